"""The client context agents open a session with is kept like the system prompt.

Claude Code puts `<system-reminder>` blocks (CLAUDE.md, the date, agent lists) before the
first prompt in the session's first user message; Codex sends AGENTS.md instructions and
`<environment_context>` as user items before its first prompt. A user message before the
history's first reply whose text opens with a `memory.context.prefixes` prefix is fixed
(always forwarded, not a turn); the same text later in a session is ordinary history."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson

from gateway.config.rules import build_rules
from gateway.config.schema import CONTEXT_PREFIXES, StoreRules
from gateway.decide.chat import decide
from gateway.decide.history import HistoryCache
from gateway.measure.tokens import Tokenizers
from gateway.memory.recall import archive_records
from gateway.wire import anthropic_messages, openai_chat, openai_responses
from gateway.wire.anthropic_messages import ANTHROPIC_MESSAGES
from tests.conftest import GatewayFactory, Upstream
from tests.proxy.test_proxy import post_raw

REMINDER = ("<system-reminder>\nAs you answer the user's questions, you can use the "
            "following context:\n# claudeMd\nRun `make test` before you commit.\n"
            "</system-reminder>\n")
AGENTS_MD = ("# AGENTS.md instructions for /repo\n\n<INSTRUCTIONS>\nUse ruff.\n"
             "</INSTRUCTIONS>")
ENV_CONTEXT = ("<environment_context>\n  <cwd>/repo</cwd>\n  <shell>bash</shell>\n"
               "</environment_context>")


def claude_session(tasks: int, rounds: int = 2) -> list[dict[str, Any]]:
    """A Claude Code session as `claude -p` then `--continue` send it: reminders and the
    first prompt in one message, a Bash/Read tool loop per task, a closing answer."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": [
        {"type": "text", "text": REMINDER},
        {"type": "text", "text": "<system-reminder>Today's date is 2026-12-06.</system-reminder>"},
        {"type": "text", "text": "TASK1: list the files and read README.md",
         "cache_control": {"type": "ephemeral"}}]}]
    for t in range(1, tasks + 1):
        if t > 1:
            msgs.append({"role": "user", "content": f"TASK{t}: append a line to notes.md"})
        for r in range(rounds):
            uid = f"toolu_{t}_{r}"
            msgs.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": uid, "name": "Bash",
                 "input": {"command": f"cat src/file_{t}_{r}.py", "description": "read"}}]})
            msgs.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": uid, "content": f"print({t}{r})\n" * 40}]})
        if t < tasks:
            msgs.append({"role": "assistant", "content": [
                {"type": "text", "text": f"TASK{t}-DONE: the README says to run make test."}]})
    return msgs


def codex_items(prompts: int) -> list[dict[str, Any]]:
    """A Codex exec session's `input`: the developer prompt, the AGENTS.md and environment
    context user item, then each prompt with an exec_command call and its output."""
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": AGENTS_MD},
            {"type": "input_text", "text": ENV_CONTEXT}]}]
    for k in range(1, prompts + 1):
        items.append({"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": f"TASK{k}: run ls"}]})
        items.append({"type": "function_call", "call_id": f"call_{k}", "name": "exec_command",
                      "arguments": json.dumps({"cmd": "ls", "workdir": "/repo"})})
        items.append({"type": "function_call_output", "call_id": f"call_{k}",
                      "output": "README.md\nsrc\n"})
        if k < prompts:
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": f"TASK{k}-DONE"}]})
    return items


def test_claude_codes_opening_message_is_fixed_and_not_a_turn() -> None:
    """The reminders' message (the first prompt in it) is fixed; the first task's tool
    loop is history before any turn; the second task is turn 1, the current one."""
    conv = anthropic_messages.parse(claude_session(2), "[PIN]", 0.7, CONTEXT_PREFIXES)
    assert conv.fixed == [0]
    assert conv.n_turns == 1 and conv.groups[-1].turn == 1
    assert {g.turn for g in conv.groups[:-3]} == {0}
    without = anthropic_messages.parse(claude_session(2), "[PIN]", 0.7)
    assert without.fixed == [] and without.n_turns == 2


def test_codexs_context_item_is_fixed_and_its_first_prompt_is_turn_one() -> None:
    """The developer message and the AGENTS.md / environment context item are fixed; the
    first prompt opens turn 1 (it used to log turn=2)."""
    conv = openai_responses.parse(codex_items(2), "[PIN]", 0.7, context=CONTEXT_PREFIXES)
    assert conv.fixed == [0, 1] and conv.n_turns == 2
    assert openai_responses.parse(codex_items(2), "[PIN]", 0.7).n_turns == 3


def test_the_same_text_after_the_first_reply_is_ordinary_history() -> None:
    """Only the opening counts: a reminder in a user message after a reply opens a turn
    (a session's later prompts are never taken for context)."""
    msgs = [{"role": "system", "content": "sys"},
            {"role": "user", "content": ENV_CONTEXT},
            {"role": "user", "content": "first prompt"},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": REMINDER + "second prompt"}]
    conv = openai_chat.parse(msgs, "[PIN]", 0.7, CONTEXT_PREFIXES)
    assert conv.fixed == [0, 1] and conv.n_turns == 2
    assert conv.groups[-1].indices == [4] and conv.groups[-1].is_user


def test_a_session_parsed_piecewise_keeps_its_opening_context() -> None:
    """The history cache parses a growing session from its last turn start: with the
    opening still running at that point (all fixed before it), the piece is read with the
    prefixes too, and every request's parse equals the whole parse."""
    cache = HistoryCache(1 << 24, 16)
    rules = object()  # the entry's identity key only
    items = claude_session(1, rounds=0)
    for n in range(1, 4):
        items = claude_session(n)
        view = cache.parse(("t", "s"), ANTHROPIC_MESSAGES, items, rules, 1000, "[PIN]", 0.7,
                           CONTEXT_PREFIXES)
        whole = anthropic_messages.parse(items, "[PIN]", 0.7, CONTEXT_PREFIXES)
        assert (view.conv.fixed, view.conv.n_turns, [g.indices for g in view.conv.groups]) == (
            whole.fixed, whole.n_turns, [g.indices for g in whole.groups])
    first = [{"role": "user", "content": ENV_CONTEXT}, {"role": "user", "content": "go"}]
    view = cache.parse(("t", "c"), ANTHROPIC_MESSAGES, first, rules, 100, "[PIN]", 0.7,
                       CONTEXT_PREFIXES)
    assert view.conv.fixed == [0] and view.conv.n_turns == 1


async def test_every_forwarded_request_carries_the_opening_context(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Eviction on, a budget the second task's history is over: the forwarded request
    still starts with the reminders' message (the first task's prompt in it), cut from
    the client's bytes; the [mem] line counts the tasks as turns."""
    gw = await gateway(memory={"enable_eviction": True,
                               "budget": {"max_tokens": 300, "max_chars": None,
                                          "max_messages": None, "max_turns": None},
                               "eviction": {"recall_share": 0.0}})
    msgs = claude_session(3, rounds=3)
    body = {"model": "claude-sonnet-4-5", "max_tokens": 1024, "system": "You are Claude Code.",
            "messages": msgs}
    raw = orjson.dumps(body)
    await post_raw(gw, raw, "/v1/messages?beta=true",
                   headers={"anthropic-version": "2023-06-01"})
    sent = orjson.loads(upstream.received[-1]["raw"])["messages"]
    assert sent[0] == msgs[0] and sent[-1] == msgs[-1]
    ev = (await gw.wait_mem(1))[-1]
    assert int(ev["dropped"]) > 0 and ev["turn"] == "2", ev
    assert "fixed_tokens" in ev and ev.get("over_budget") != "true", ev


def test_claude_codes_first_task_is_archived_when_dropped() -> None:
    """The first task's loop and answer have no user message of their own (its prompt is in
    the fixed opening message): dropped, they are still archived as a turn, with the
    opening message as its request, so the store can bring the answer back."""
    rules = build_rules({"memory": {"enable_eviction": True,
                                    "budget": {"max_tokens": 50, "max_chars": None,
                                               "max_messages": None, "max_turns": None},
                                    "eviction": {"recall_share": 0.0}},
                         "tokens": {"models_file": "rules/models.yaml"}},
                        base_dir=Path(__file__).resolve().parents[2])
    body = {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": claude_session(3)}
    raw = orjson.dumps(body)
    d = decide(raw, orjson.loads(raw), rules, Tokenizers(10_000), ANTHROPIC_MESSAGES)
    assert d.plan is not None and d.plan.dropped
    records, _ = archive_records(d, "t", "s", "a", StoreRules(archive="evicted"))
    texts = [r.text for r in records]
    assert any("TASK1: list the files" in x and "TASK1-DONE" in x for x in texts), texts
    assert any("TASK2-DONE" in x for x in texts), texts
