"""The two agent CLIs our users run most, Claude Code and Codex, through memgate against a
local mock model, offline: two tasks in one session each (TASK1, then TASK2 continuing it
with `claude -p --continue` / `codex exec resume --last`), six tool rounds per task run by
the clients' own tools.

How "byte for byte" is checked: a recording TCP tap sits on each side of memgate, so what
the client sent and what reached the mock are both taken off the wire by code that is
neither memgate's nor aiohttp's (memgate's capture would be memgate reporting on itself,
redacts credential fields and keeps no headers; a second run of the client straight
against the mock cannot be compared byte for byte: session ids, timestamps and paths
change between runs). Bodies are compared after HTTP framing (chunked or not is not the
client's content), headers end to end (hop-by-hop ones and Host excepted).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import (
    TASK1,
    TASK1_DONE,
    TASK2_DONE,
    Launch,
    Session,
    WireRequest,
    foreign_in_trace,
    mem_fields,
    run_client,
    run_crowd,
    run_session,
    strace_usable,
)
from tests.e2e.mock_model import RETRIEVE_TOOL
from tests.e2e.report import byte_differences, format_report, is_chat, pair, report

pytestmark = pytest.mark.slow

CLIENT_NAMES = ["claude", "codex"]
API = {"claude": "anthropic_messages", "codex": "openai_responses"}


def explain(s: Session) -> str:
    parts = [format_report(s)]
    for i, run in enumerate(s.runs, start=1):
        parts.append(f"--- run {i}: {' '.join(run.argv[:3])} ... exit={run.returncode} "
                     f"timed_out={run.timed_out}\nstdout: {run.stdout[-1500:]}\n"
                     f"stderr: {run.stderr[-3000:]}")
    parts.append("--- memgate log (tail):\n" + "\n".join(s.memgate_log[-25:]))
    return "\n".join(parts)


def assert_completed(s: Session) -> None:
    """Both tasks ran to their final answer: exit 0 and the final text on stdout."""
    why = explain(s)
    assert len(s.runs) == 2, why
    for run in s.runs:
        assert run.returncode == 0 and not run.timed_out, why
    assert TASK1_DONE in s.runs[0].stdout, why
    assert TASK2_DONE in s.runs[1].stdout, why
    assert (s.project / "out" / "task2.txt").read_text(encoding="utf-8") == "TASK2 done\n"
    assert (s.project / "out" / "task1.txt").read_text(encoding="utf-8") == (
        "TASK1 wrote this line\nTASK2 appended this line\n")
    assert s.memgate_exit == 0, why  # memgate stopped by SIGTERM, cleanly


def assert_offline(s: Session) -> None:
    """The clients reached no address but loopback (connect/sendto/sendmsg of the whole
    process tree under strace, DNS queries included)."""
    traced = [r for r in s.runs if r.trace is not None]
    if not traced:  # MEMGATE_E2E_STRACE=0, or no strace / no ptrace here
        print("strace unavailable: the no-network check did not run")
    for run in traced:
        assert run.foreign_addresses() == [], (run.argv[:3], run.foreign_addresses())


def assert_provider_accepted(s: Session) -> None:
    """Every body memgate forwarded is one the provider accepts: the mock (which checks
    what the real APIs check) refused none, and memgate never fell back to the client's
    original body (a fallback would hide a broken cut behind the client's own bytes)."""
    assert s.model is not None
    refused = [(r.seq, r.refusal) for r in s.model.refused()]
    assert refused == [], (refused, explain(s))
    fallbacks = [ln for ln in s.mem_lines if "fallback=" in ln]
    assert fallbacks == [], (fallbacks, explain(s))


def assert_every_step_played(s: Session) -> None:
    """The mock was asked for every step of both tasks (6 tool rounds + the answer each)."""
    assert s.model is not None
    steps = {(r.task, r.round) for r in s.model.received if r.role == "agent"}
    assert steps >= {(t, n) for t in ("1", "2") for n in range(7)}, explain(s)


@pytest.mark.parametrize("client", CLIENT_NAMES)
async def test_shadow_mode_forwards_the_clients_bytes(
    client: str, agent_clients: dict[str, Path], tmp_path: Path
) -> None:
    """Eviction off (the shipped config as is): both tasks complete, every request reached
    the mock byte for byte with the client's headers, one [mem] line per chat request."""
    s = await run_session(client, agent_clients[client], tmp_path, eviction=False)
    print(format_report(s))
    assert_completed(s)
    assert_every_step_played(s)
    # TASK2 went out with TASK1's history: the client continued the same session
    assert "task1_answer_in_history=yes" in s.runs[1].stdout, explain(s)

    assert byte_differences(s) == [], explain(s)
    assert len(s.sent) == len(s.forwarded) and s.sent, explain(s)
    chat = [r for r in s.sent if is_chat(r)]
    assert len(chat) >= 14
    # what reached the mock (byte_differences: the same values the client sent)
    at_mock = [r for r in s.forwarded if is_chat(r)]
    if client == "claude":
        assert {r.target for r in at_mock} == {"/v1/messages?beta=true"}
        assert all(r.header("anthropic-beta") and r.header("anthropic-version")
                   and r.header("x-api-key") and r.header("X-Claude-Code-Session-Id")
                   for r in at_mock)
    else:
        assert {r.target for r in at_mock} == {"/v1/responses"}
        assert all(r.header("authorization") and r.header("session-id")
                   and r.header("originator") for r in at_mock)
    assert all((r.json() or {}).get("stream") is True for r in at_mock)  # streams relayed

    events = [mem_fields(ln) for ln in s.mem_lines]
    assert len(events) == len(chat), explain(s)
    for ev in events:
        assert ev["mode"] == "shadow" and ev["dropped"] == "0" and ev["status"] == "200", ev
        assert ev["api"] == API[client] and ev["session"], ev
    assert_provider_accepted(s)
    assert_offline(s)


def assert_agent_kept_its_task(s: Session, whole: bool) -> list[dict[str, object]]:
    """Every forwarded request carries the client context of the session's opening
    message (Claude Code's reminders, Codex's AGENTS.md and environment context); with
    `whole`, every request of the second task also carries the first task's request and
    its answer; one memgate session, the client's own id."""
    rows = [r for r in report(s) if r["role"] == "agent"]
    why = explain(s)
    assert rows, why
    for r in rows:
        have, _, want = str(r["context"]).partition("/")
        assert r["context"] != "-" and have == want, (r, why)
        assert r["instructions"] is True, (r, why)
    if whole:
        second = [r for r in rows if str(r["step"]).startswith("T2")]
        assert second, why
        assert all(r["task1_text"] is True and r["task1_answer"] is True for r in second), why
    sessions = {r["session"] for r in rows}
    assert len(sessions) == 1 and None not in sessions, (sessions, why)
    client_ids = {v for r in rows for k, v in dict(r["ids"]).items()  # type: ignore[call-overload]
                  if k.endswith("session_id") or k in ("h:x-claude-code-session-id",
                                                       "h:session-id")}
    assert sessions <= client_ids, (sessions, client_ids)
    return rows


@pytest.mark.parametrize("client", CLIENT_NAMES)
async def test_eviction_on_the_agent_keeps_its_task(
    client: str, agent_clients: dict[str, Path], tmp_path: Path
) -> None:
    """Eviction on with the shipped config (rules/gateway.yaml, enable_eviction: true):
    both tasks complete, every request the provider accepts; the second task's model sees
    the first task's request and answer, every request the opening client context, and
    the session is the client's own."""
    s = await run_session(client, agent_clients[client], tmp_path, eviction=True)
    print(format_report(s))
    assert_completed(s)
    assert_every_step_played(s)
    events = [mem_fields(ln) for ln in s.mem_lines]
    chat = [r for r in s.sent if is_chat(r)]
    assert len(events) == len(chat), explain(s)
    assert all(ev["mode"] == "on" and ev["status"] == "200" for ev in events), explain(s)
    assert_provider_accepted(s)
    assert_agent_kept_its_task(s, whole=True)
    assert_offline(s)


@pytest.mark.parametrize("client", CLIENT_NAMES)
async def test_a_tight_budget_cuts_history_not_the_agents_context(
    client: str, agent_clients: dict[str, Path], tmp_path: Path
) -> None:
    """Eviction on, a history budget of 300 tokens (the tool loops of the first task go):
    both tasks still complete, history is dropped, and every request still carries the
    opening client context and the client's session."""
    s = await run_session(client, agent_clients[client], tmp_path, eviction=True,
                          max_tokens=300)
    print(format_report(s))
    assert_completed(s)
    assert_every_step_played(s)
    rows = assert_agent_kept_its_task(s, whole=False)
    assert any(int(str(r["dropped"] or 0)) > 0 for r in rows), explain(s)
    events = [mem_fields(ln) for ln in s.mem_lines]
    assert all(ev["status"] == "200" for ev in events), explain(s)
    assert_provider_accepted(s)


def _items(req: WireRequest) -> list[dict[str, Any]]:
    body = req.json()
    items = body.get("messages", body.get("input")) if isinstance(body, dict) else None
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def _parts(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Items and their content blocks (Anthropic's tool_use / tool_result are blocks)."""
    for item in items:
        yield item
        content = item.get("content")
        yield from (b for b in content if isinstance(b, dict)) if isinstance(content,
                                                                            list) else ()


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(_text(c) for c in content)
    if isinstance(content, dict):
        return _text(content.get("text", ""))
    return content if isinstance(content, str) else ""


def tool_outputs(items: list[dict[str, Any]]) -> list[str]:
    """The tool results' texts (tool_result blocks, Responses *_output items)."""
    return [_text(p.get("content") if p.get("type") == "tool_result" else p.get("output"))
            for p in _parts(items)
            if p.get("type") == "tool_result" or str(p.get("type")).endswith("_output")]


def call_ids(items: list[dict[str, Any]]) -> list[str]:
    """The ids of the tool calls (tool_use blocks, Responses *_call items)."""
    return [str(p.get("id") if p.get("type") == "tool_use" else p.get("call_id"))
            for p in _parts(items)
            if p.get("type") == "tool_use" or str(p.get("type")).endswith("_call")]


def result_ids(items: list[dict[str, Any]]) -> list[str]:
    """The call ids the tool results answer."""
    return [str(p.get("tool_use_id") if p.get("type") == "tool_result" else p.get("call_id"))
            for p in _parts(items)
            if p.get("type") == "tool_result" or str(p.get("type")).endswith("_output")]


@pytest.mark.parametrize("client", CLIENT_NAMES)
async def test_the_model_retrieves_what_the_cut_left_out(
    client: str, agent_clients: dict[str, Path], tmp_path: Path
) -> None:
    """Eviction on, the 300-token budget, memory.retrieve on, and a model that uses the
    tool: at the first request of a task that names a handle it calls memgate_retrieve,
    gets back what the cut left out, and goes on. Both tasks complete as with eviction on,
    the provider accepts every body, [mem] shows the rounds and no error, and the client
    never sees the retrieval: its next request holds only its own call and result."""
    t0 = time.perf_counter()
    s = await run_session(client, agent_clients[client], tmp_path, eviction=True,
                          max_tokens=300, retrieve=True)
    seconds = time.perf_counter() - t0
    print(format_report(s))
    why = explain(s)
    assert_completed(s)
    assert_every_step_played(s)
    events = [mem_fields(ln) for ln in s.mem_lines]
    chat = [r for r in s.sent if is_chat(r)]
    assert len(events) == len(chat), why
    assert all(ev["mode"] == "on" and ev["status"] == "200" for ev in events), why
    assert_provider_accepted(s)
    assert_agent_kept_its_task(s, whole=False)
    assert [ev for ev in events if "retrieve_error" in ev] == [], why
    rounds = [int(ev.get("retrieve_rounds", "0")) for ev in events]
    assert max(rounds) >= 1, why
    assert all(ev.get("retrieve") == "tool" for ev in events if "retrieve_rounds" in ev), why

    assert s.model is not None
    received, retrievals = s.model.received, s.model.retrievals
    assert retrievals, why
    forwarded = [r for r in s.forwarded if is_chat(r)]
    asked_for = {id(f): c for c, f in pair(chat, forwarded) if f is not None}
    for r in retrievals:
        # memgate answered the call, and the model went on with the step it was at
        assert r.result is not None and r.result_seq is not None, (r, why)
        went_on = received[r.result_seq]
        assert (went_on.role, went_on.task, went_on.round) == (
            "agent", r.task, received[r.seq].round), (r, why)
        assert not r.result.startswith("[memgate:"), (r.result, why)  # e.g. nothing is kept
        # what the handle names, as the client sent it: the compacted result whole, or
        # every tool result of the request that memgate did not forward
        fwd = next(f for f in forwarded if f.body == received[r.seq].raw)
        asked = asked_for[id(fwd)]
        if r.handle.startswith("cmp-"):
            assert r.result in tool_outputs(_items(asked)), (r, why)
        else:
            kept = tool_outputs(_items(fwd))
            left_out = [o for o in tool_outputs(_items(asked)) if o.strip() and o not in kept]
            assert left_out, (r, why)
            assert [o for o in left_out if o.strip() not in r.result] == [], (r.result, why)
        # the client's next request: its own call (the step memgate's round 2 answered)
        # and its result appended, nothing of the retrieval
        nxt = chat[chat.index(asked) + 1]
        new = _items(nxt)[len(_items(asked)):]
        assert call_ids(new) == result_ids(new) == [went_on.call_id], (new, why)
    for req in s.sent:
        assert RETRIEVE_TOOL.encode() not in req.body, why
        assert not any(r.call_id.encode() in req.body for r in retrievals), why
    print(f"{client}: {len(chat)} client requests, {len(forwarded)} at the mock, "
          f"{sum(rounds)} retrieval rounds ({len([n for n in rounds if n])} requests), "
          f"retrieve_ms {sum(float(ev.get('retrieve_ms', 0)) for ev in events):.1f}, "
          f"runs {' + '.join(f'{run.seconds:.1f}s' for run in s.runs)}, "
          f"session {seconds:.1f}s")


# the header each client names its session by (the shadow test checks every request has it)
SESSION_HEADER = {"claude": "X-Claude-Code-Session-Id", "codex": "session-id"}


async def test_four_concurrent_sessions_are_four_memgate_sessions(
    agent_clients: dict[str, Path], tmp_path: Path
) -> None:
    """Through ONE memgate, eviction on with the shipped config, at the same time: two
    Claude Code sessions with the same prompt in two project directories, and two Codex
    sessions with different prompts in one directory (first task each). They are four
    memgate sessions, each the id its client sent, and each session's [mem] lines carry
    its own id only (per session, the lines with its id are exactly as many, with the same
    history sizes, as the chat requests it sent)."""
    claude, codex = agent_clients["claude"], agent_clients["codex"]
    crowd = await run_crowd([
        Launch("claude", claude, "claude-a/project", TASK1),
        Launch("claude", claude, "claude-b/project", TASK1),
        Launch("codex", codex, "codex/project", TASK1),
        Launch("codex", codex, "codex/project", f"{TASK1}, then say which files you read"),
    ], tmp_path, eviction=True)
    why = "\n\n".join(explain(s) for s in crowd.sessions)
    for s in crowd.sessions:
        assert len(s.runs) == 1 and s.runs[0].returncode == 0 and not s.runs[0].timed_out, why
        assert TASK1_DONE in s.runs[0].stdout, why
        assert_provider_accepted(s)
    assert crowd.memgate_exit == 0, why
    events = [mem_fields(ln) for ln in crowd.mem_lines]
    chat = [(s, r) for s in crowd.sessions for r in s.sent if is_chat(r)]
    assert len(events) == len(chat), why
    assert all(ev["mode"] == "on" and ev["status"] == "200" for ev in events), why

    ids = []
    for s in crowd.sessions:
        mine = [r for r in s.sent if is_chat(r)]
        sent_ids = {r.header(SESSION_HEADER[s.client]) for r in mine}
        assert len(sent_ids) == 1 and None not in sent_ids, (s.client, sent_ids, why)
        sid = sent_ids.pop()
        assert sid is not None
        ids.append(sid)
        lines = [ev for ev in events if ev["session"] == sid]
        hist = []
        for r in mine:
            body = r.json() if isinstance(r.json(), dict) else {}
            items = body.get("messages", body.get("input"))
            hist.append(len(items) if isinstance(items, list) else 1)
        assert sorted(int(ev["hist_msgs"]) for ev in lines) == sorted(hist), (sid, why)
        assert all(ev["api"] == API[s.client] for ev in lines), (sid, why)
    assert len(set(ids)) == 4, (ids, why)
    assert {ev["session"] for ev in events} == set(ids), why


# what Codex 0.171.0 did before `features.plugins = false` (curated plugin sync)
CODEX_PLUGIN_SYNC_TRACE = (
    '2030  sendto(40, "\\331+\\1\\0\\0\\1\\0\\0\\0\\0\\0\\0\\3api\\6github\\3com\\0\\0\\1\\0\\1", '
    '32, MSG_NOSIGNAL, {sa_family=AF_INET, sin_port=htons(53), '
    'sin_addr=inet_addr("10.255.255.53")}, 16) = 32\n'
    '2171  connect(7, {sa_family=AF_INET, sin_port=htons(443), '
    'sin_addr=inet_addr("140.82.112.6")}, 16) = -1 ENETUNREACH\n'
    '2172  connect(9, {sa_family=AF_INET, sin_port=htons(8080), '
    'sin_addr=inet_addr("127.0.0.1")}, 16) = 0\n'
    '2005  connect(7, {sa_family=AF_UNIX, sun_path="/var/run/nscd/socket"}, 110) = -1\n')


def test_network_check_reads_strace_lines() -> None:
    """The no-network check finds DNS queries (with the name) and non-loopback
    connects, and lets loopback and unix sockets pass."""
    assert foreign_in_trace(CODEX_PLUGIN_SYNC_TRACE) == {
        "dns@10.255.255.53 api.github.com", "140.82.112.6"}


async def test_network_check_follows_child_processes(tmp_path: Path) -> None:
    """Under the same strace as the clients, a grandchild's connect() is seen (a UDP
    connect to TEST-NET-1: no packet leaves the machine)."""
    if not strace_usable():
        pytest.skip("strace unavailable")
    code = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "try: s.connect(('192.0.2.1', 9))\nexcept OSError: pass")
    run = await run_client(["sh", "-c", f'"{sys.executable}" -c "$0"', code],
                           {"PATH": os.environ.get("PATH", "")}, tmp_path,
                           tmp_path / "probe.strace", timeout_s=60)
    assert run.returncode == 0, run.stderr
    assert run.foreign_addresses() == ["192.0.2.1"]
