"""Which session a request belongs to: the configured sources on what real clients send
(Claude Code, Codex CLI, the SDKs), and the fingerprint of a conversation's opening as
properties over growing sessions in the three wires."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from gateway.config.schema import CONTEXT_PREFIXES, SESSION_ID_FROM
from gateway.memory.session_sources import (
    CHAINED,
    candidates,
    claude_session,
    clean,
    fingerprint,
    first_named,
)

TENANT = "t-0123456789abcdef"
CLAUDE_SID = "ca873c7d-c2ba-494f-9903-6d950670982d"
CODEX_SID = "01a24995-6395-7d50-b2cb-981c96b27360"
DEVICE = "84d4fb45c7f21df3ebfb2d0a1e4d2ae8da840b420491e6ad4e75f1b62a0c560d"
ACCOUNT = "6b1f0c2e-8d8a-4c55-9a51-0e0f3c9b7d21"
# Claude Code 2.1.197, as it reached a local upstream (keys trimmed to what matters)
CLAUDE_HEADERS = {"X-Claude-Code-Session-Id": CLAUDE_SID, "anthropic-version": "2023-06-01",
                  "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
                  "User-Agent": "claude-cli/2.1.197 (external, sdk-cli)",
                  "x-api-key": "sk-ant-test"}
CLAUDE_USER_ID = ('{"device_id":"' + DEVICE + '","account_uuid":"","session_id":"'
                  + CLAUDE_SID + '"}')
# what Claude Code sent before its metadata.user_id became JSON
CLAUDE_OLD_USER_ID = f"user_{DEVICE}_account_{ACCOUNT}_session_{CLAUDE_SID}"
# Codex CLI 0.171.0 (exec and exec resume send the same)
CODEX_HEADERS = {"session-id": CODEX_SID, "thread-id": CODEX_SID,
                 "x-client-request-id": CODEX_SID, "x-codex-window-id": f"{CODEX_SID}:0",
                 "originator": "codex_exec", "Authorization": "Bearer sk-test",
                 "User-Agent": "codex_exec/0.171.0 (Debian 12.0.0; x86_64) dumb"}
CODEX_METADATA = {"thread_id": CODEX_SID, "session_id": CODEX_SID,
                  "x-codex-window-id": f"{CODEX_SID}:0",
                  "x-codex-installation-id": "9b556540-bd71-438f-9e6e-184b92ce6f73",
                  "turn_id": "01a24995-63f8-7a53-8094-4a528df3c03a"}
CLAUDE_BODY: dict[str, Any] = {
    "model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True,
    "metadata": {"user_id": CLAUDE_USER_ID},
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197"},
               {"type": "text", "text": "You are Claude Code.",
                "cache_control": {"type": "ephemeral"}}],
    "tools": [{"name": "Bash", "input_schema": {"type": "object"}},
              {"name": "Read", "input_schema": {"type": "object"}}],
    "messages": [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nAvailable agent types ...</system-reminder>"},
        {"type": "text", "text": "TASK1: look around the project",
         "cache_control": {"type": "ephemeral"}}]}],
}
CODEX_BODY: dict[str, Any] = {
    "model": "gpt-5-codex", "stream": True, "store": False,
    "prompt_cache_key": CODEX_SID, "client_metadata": CODEX_METADATA,
    "tools": [{"type": "function", "name": "exec_command"}, {"type": "web_search"}],
    "input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "You are a coding agent (Codex CLI)."}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "# AGENTS.md instructions for /srv/proj\n..."},
            {"type": "input_text", "text": "<environment_context>\n  <cwd>/srv/proj</cwd>"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "TASK1: write out/task1.txt"}]}],
}


def resolve(headers: dict[str, str], body: dict[str, Any],
            sources: tuple[str, ...] = SESSION_ID_FROM) -> tuple[str, str]:
    items = body.get("messages", body.get("input"))
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    return first_named(sources, CIMultiDict(headers), body, items, TENANT)


def without(body: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in keys}


@pytest.mark.parametrize(("headers", "body", "want"), [
    # Claude Code: its header, else the session in metadata.user_id (JSON or the older string)
    (CLAUDE_HEADERS, CLAUDE_BODY, (CLAUDE_SID, "header:X-Claude-Code-Session-Id")),
    ({"x-api-key": "k"}, CLAUDE_BODY, (CLAUDE_SID, "metadata.user_id.session_id")),
    ({}, {**CLAUDE_BODY, "metadata": {"user_id": CLAUDE_OLD_USER_ID}},
     (CLAUDE_SID, "metadata.user_id.session_id")),
    ({}, {**CLAUDE_BODY, "metadata": {"user_id": f"user_{DEVICE}_account__session_{CLAUDE_SID}"}},
     (CLAUDE_SID, "metadata.user_id.session_id")),
    # Codex: its session-id header, else its body's client_metadata, else its cache key
    (CODEX_HEADERS, CODEX_BODY, (CODEX_SID, "header:session-id")),
    ({"conversation_id": "c-old", "session_id": "c-old"}, without(CODEX_BODY, "client_metadata"),
     ("c-old", "header:session_id")),
    ({"conversation_id": "c-old"}, without(CODEX_BODY, "client_metadata", "prompt_cache_key"),
     ("c-old", "header:conversation_id")),
    ({}, CODEX_BODY, (CODEX_SID, "client_metadata.session_id")),
    ({}, without(CODEX_BODY, "client_metadata"), (CODEX_SID, "prompt_cache_key")),
    # the gateway's own ids come first, whichever client sends them
    ({**CLAUDE_HEADERS, "X-Session-Id": "s-42"}, CLAUDE_BODY, ("s-42", "header:X-Session-Id")),
    ({"x-session-id": "s-42"}, CODEX_BODY, ("s-42", "header:X-Session-Id")),
    (CODEX_HEADERS, {**CODEX_BODY, "metadata": {"session_id": "mine"}},
     ("mine", "metadata.session_id")),
    # Responses: a conversation (string or object), the cache key, then the end user
    ({}, {"input": "hi", "conversation": "conv_1", "prompt_cache_key": "k"},
     ("conv_1", "conversation")),
    ({}, {"input": "hi", "conversation": {"id": "conv_2"}}, ("conv_2", "conversation")),
    ({}, {"input": "hi", "prompt_cache_key": "k", "user": "u"}, ("k", "prompt_cache_key")),
    ({}, {"messages": [{"role": "user", "content": "hi"}], "user": "u-7"}, ("u-7", "user")),
    # cleaned as the gateway keeps ids: unsafe characters replaced, 128 at most
    ({"X-Session-Id": "a b\u00e9/c:d"}, {}, ("a_b_/c:d", "header:X-Session-Id")),
    ({"X-Session-Id": "x" * 300}, {}, ("x" * 128, "header:X-Session-Id")),
])
def test_each_client_gets_the_id_it_sends(
    headers: dict[str, str], body: dict[str, Any], want: tuple[str, str]
) -> None:
    """The first configured source that names an id wins, on the shapes real clients send."""
    assert resolve(headers, body) == want


@pytest.mark.parametrize("user_id", [
    "user-1234",                                   # an app's own end-user id
    f"user_{DEVICE}_account_{ACCOUNT}",            # no session part
    '{"device_id":"' + DEVICE + '","account_uuid":"' + ACCOUNT + '"}',
    '{"session_id": 7}', '{"session_id": ""}', "{not json", "[1, 2]", "   ",
])
def test_metadata_user_id_without_a_session_names_none(user_id: str) -> None:
    """Only the session part of Anthropic's user_id is ever an id: a user, device or
    account never is, and a malformed one is passed over to the fingerprint."""
    body = {**CLAUDE_BODY, "metadata": {"user_id": user_id}}
    assert claude_session(body) is None
    sid, source = resolve({}, body)
    assert source == "fingerprint" and sid.startswith("fp-")
    assert DEVICE not in sid and ACCOUNT not in sid


@pytest.mark.parametrize("body", [
    {"metadata": {"session_id": 5}, "user": ["u"], "conversation": {"id": 7},
     "prompt_cache_key": None, "client_metadata": "x", "previous_response_id": 3},
    {"metadata": "s", "conversation": "", "user": " ", "prompt_cache_key": "\t"},
])
def test_values_of_the_wrong_type_or_empty_name_nothing(body: dict[str, Any]) -> None:
    """A body field of the wrong type, or blank, is no id (the fingerprint follows)."""
    assert resolve({"X-Session-Id": "  "}, {**body, "input": "q"})[1] == "fingerprint"


def test_a_previous_response_id_is_a_candidate_to_look_up_not_an_id() -> None:
    """`previous_response_id` yields the response id for the caller to look up; offline
    (no state) it is passed over, never taken as the session."""
    body = {"input": "and then?", "previous_response_id": "resp_abc", "user": "u"}
    got = list(candidates(SESSION_ID_FROM, CIMultiDict(), body, None, TENANT))
    assert got[0] == (CHAINED, "resp_abc")
    assert got[1] == ("user", "u") and got[-1][0] == "fingerprint"
    assert resolve({}, body) == ("u", "user")


def test_the_order_is_the_configured_one() -> None:
    """A different order takes a different source; a custom header is just a line."""
    sources = ("header:X-Team-Session", "prompt_cache_key", "header:session-id", "fingerprint")
    assert resolve({**CODEX_HEADERS, "X-Team-Session": "t1"}, CODEX_BODY, sources) == (
        "t1", "header:X-Team-Session")
    assert resolve(CODEX_HEADERS, CODEX_BODY, sources) == (CODEX_SID, "prompt_cache_key")
    assert resolve(CLAUDE_HEADERS, CLAUDE_BODY, ("fingerprint",))[1] == "fingerprint"


def test_candidates_come_in_the_configured_order() -> None:
    """Every source that names an id, in order, the fingerprint last: Claude Code's
    header and its metadata name the same session."""
    got = list(candidates(SESSION_ID_FROM, CIMultiDict(CLAUDE_HEADERS), CLAUDE_BODY,
                          CLAUDE_BODY["messages"], TENANT))
    assert got[:2] == [("header:X-Claude-Code-Session-Id", CLAUDE_SID),
                       ("metadata.user_id.session_id", CLAUDE_SID)]
    assert [source for source, _ in got[2:]] == ["fingerprint"]


def test_claude_codes_first_request_and_the_next_share_a_fingerprint() -> None:
    """The bug of issue 41: Claude Code's cache_control marker moves off the first message
    on the second request; the fingerprint hashes the text, so it does not move."""
    first = without(CLAUDE_BODY, "metadata")
    opening = first["messages"][0]
    plain = [{k: v for k, v in b.items() if k != "cache_control"} for b in opening["content"]]
    second = {**first, "messages": [
        {"role": "user", "content": plain},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."}]},
        {"role": "user", "content": [{"type": "text", "text": "go on",
                                      "cache_control": {"type": "ephemeral"}}]}]}
    assert resolve({}, first) == resolve({}, second)


def test_codex_sessions_with_one_context_and_different_prompts_differ() -> None:
    """The other bug: two Codex sessions in one directory open with the same context
    items; their first real prompts tell them apart, and so do two directories."""
    other = {**CODEX_BODY, "input": [*CODEX_BODY["input"][:2], {
        "type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "TASK9: something else"}]}]}
    body = without(CODEX_BODY, "client_metadata", "prompt_cache_key")
    other = without(other, "client_metadata", "prompt_cache_key")
    assert resolve({}, body)[0] != resolve({}, other)[0]
    moved = [dict(it) for it in body["input"]]
    moved[1] = {**moved[1], "content": [moved[1]["content"][0], {
        "type": "input_text", "text": "<environment_context>\n  <cwd>/srv/other</cwd>"}]}
    assert resolve({}, body)[0] != resolve({}, {**body, "input": moved})[0]


def test_the_context_prefixes_are_a_parameter() -> None:
    """The prefixes passed decide what is context: a client whose context message is
    unknown to them has it taken for its first prompt, so two of its sessions that differ
    only after it share a fingerprint; named, the prompt after it tells them apart."""
    def body(question: str) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": "<repo-map>a.py</repo-map>"},
                             {"role": "user", "content": question}]}

    one, two = body("Q1"), body("Q2")
    assert fingerprint(TENANT, one, one["messages"]) == fingerprint(TENANT, two, two["messages"])
    prefixes = (*CONTEXT_PREFIXES, "<repo-map>")
    assert fingerprint(TENANT, one, one["messages"], prefixes) != fingerprint(
        TENANT, two, two["messages"], prefixes)


def test_ids_are_cleaned_and_tenants_and_media_are_in_the_fingerprint() -> None:
    """clean() keeps the safe characters; the fingerprint differs by tenant and by an
    attached image (its JSON without the cache marker), not by the marker."""
    assert clean("s-1.a_b:c@d/e") == "s-1.a_b:c@d/e" and clean("a\nb c") == "a_b_c"
    image = {"type": "image", "source": {"type": "base64", "data": "AAAA"}}
    msgs = [{"role": "user", "content": [image, {"type": "text", "text": "what is it?"}]}]
    marked = [{"role": "user", "content": [{**image, "cache_control": {"type": "ephemeral"}},
                                           {"type": "text", "text": "what is it?"}]}]
    other = [{"role": "user", "content": [{**image, "source": {"type": "base64", "data": "BB"}},
                                          {"type": "text", "text": "what is it?"}]}]
    fp = fingerprint(TENANT, {}, msgs)
    assert fp == fingerprint(TENANT, {}, marked)
    assert fp != fingerprint(TENANT, {}, other)
    assert fp != fingerprint("t-fedcba9876543210", {}, msgs)


# --- properties -------------------------------------------------------------------------

WORDS = ["fix", "the", "build", "订单", "report.csv", "/srv/app", "tests", "why", "ok", "err"]
words = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join)
names = st.sampled_from(["Bash", "Read", "Edit", "exec_command", "apply_patch", "web_search",
                         "Grep", "Write"])
WIRES = ("anthropic", "chat", "responses")


@st.composite
def sessions(draw: st.DrawFn) -> dict[str, Any]:
    """One client session: its opening (system, tools, client context, first prompt), the
    turns it grows by, and the id the client sends on every request (or none)."""
    prefix = st.sampled_from(CONTEXT_PREFIXES)
    return {
        "wire": draw(st.sampled_from(WIRES)),
        "system": draw(words),
        "tools": draw(st.lists(names, max_size=4, unique=True)),
        "context": [draw(prefix) + "\n" + draw(words)
                    for _ in range(draw(st.integers(0, 3)))],
        "prompt": draw(words),
        "turns": draw(st.lists(st.tuples(words, words), max_size=6)),
        "client": draw(st.sampled_from(["none", "x-session", "claude", "claude-body",
                                        "codex", "codex-body", "user"])),
    }


def _block(wire: str, text: str, marked: bool) -> dict[str, Any]:
    kind = "input_text" if wire == "responses" else "text"
    block: dict[str, Any] = {"type": kind, "text": text}
    if marked:
        block["cache_control"] = {"type": "ephemeral"}
    return block


def render(s: dict[str, Any], upto: int, marker: int, extras: dict[str, Any]
           ) -> tuple[dict[str, str], dict[str, Any], list[Any]]:
    """The session's request after `upto` turns, with the cache marker on block `marker`
    (of all text blocks, counted in order) and per-request fields `extras`."""
    wire = s["wire"]
    count = [0]

    def block(text: str) -> dict[str, Any]:
        count[0] += 1
        return _block(wire, text, count[0] - 1 == marker)

    later = "<system-reminder>\nthe date changed</system-reminder>"  # later turns' context
    opening = [block(c) for c in s["context"]] + [block(s["prompt"])]
    if wire == "responses":  # Codex: its context and its prompt as items of their own
        users = ([{"type": "message", "role": "user", "content": opening[:-1]}]
                 if s["context"] else []) + [{"type": "message", "role": "user",
                                                "content": opening[-1:]}]
    else:
        users = [{"role": "user", "content": opening}]
    items: list[Any] = []
    body: dict[str, Any] = dict(extras)
    sys_block = block(s["system"])
    if wire == "anthropic":
        body["system"] = [sys_block]
        body["tools"] = [{"name": n, "input_schema": {"type": "object"}} for n in s["tools"]]
    elif wire == "chat":
        items.append({"role": "system", "content": [sys_block]})
        body["tools"] = [{"type": "function", "function": {"name": n}} for n in s["tools"]]
    else:
        items.append({"type": "message", "role": "developer", "content": [sys_block]})
        body["tools"] = [{"type": "function", "name": n} for n in s["tools"]]
    items += users
    for answer, question in s["turns"][:upto]:
        role_answer = {"role": "assistant", "content": [
            {"type": "output_text" if wire == "responses" else "text", "text": answer}]}
        items += [role_answer, {"role": "user", "content": [block(later), block(question)]}]
    body["messages" if wire != "responses" else "input"] = items
    headers: dict[str, str] = {}
    client = s["client"]
    if client == "x-session":
        headers["X-Session-Id"] = "s-" + s["prompt"].replace(" ", "-")
    elif client == "claude":
        headers["X-Claude-Code-Session-Id"] = CLAUDE_SID
        body["metadata"] = {"user_id": CLAUDE_USER_ID}
    elif client == "claude-body":
        body["metadata"] = {"user_id": CLAUDE_OLD_USER_ID}
    elif client == "codex":
        headers.update(CODEX_HEADERS)
        body["prompt_cache_key"] = CODEX_SID
    elif client == "codex-body":
        body["client_metadata"] = CODEX_METADATA
    elif client == "user":
        body["user"] = "end-user-1"
    return headers, body, items


extras = st.fixed_dictionaries({}, optional={
    "stream": st.booleans(), "temperature": st.sampled_from([0, 0.2, 1]),
    "max_tokens": st.integers(1, 64000), "model": st.sampled_from(["m1", "m2"])})


@given(s=sessions(), data=st.data())
def test_every_request_of_a_session_gets_the_same_id(s: dict[str, Any], data: Any) -> None:
    """Whatever the session sends its id by (or none: the fingerprint), each request of
    a growing body resolves to the id of its first request, wherever the cache marker
    and the per-request fields move."""
    ids = set()
    for upto in range(len(s["turns"]) + 1):
        marker = data.draw(st.integers(-1, 12), label="marker")
        headers, body, items = render(s, upto, marker, data.draw(extras, label="extras"))
        ids.add(first_named(SESSION_ID_FROM, CIMultiDict(headers), body, items, TENANT))
    assert len(ids) == 1, ids


MUTATIONS = ("system", "tools", "prompt", "context")


@given(s=sessions(), what=st.sampled_from(MUTATIONS), data=st.data())
def test_sessions_with_another_opening_never_share_a_fingerprint(
    s: dict[str, Any], what: str, data: Any
) -> None:
    """Two sessions whose system prompt, tool names, client context or first real
    prompt differ get different fingerprints, at any point of either and wherever
    their markers are."""
    other = dict(s)
    if what == "system":
        other["system"] = s["system"] + " also"
    elif what == "tools":
        other["tools"] = [*s["tools"], "NewTool"]
    elif what == "prompt":
        other["prompt"] = s["prompt"] + " please"
    else:
        other["context"] = [*s["context"], "<environment_context>\n<cwd>/elsewhere</cwd>"]
    seen = []
    for session in (s, other):
        upto = data.draw(st.integers(0, len(session["turns"])))
        marker = data.draw(st.integers(-1, 12))
        _, body, items = render(session, upto, marker, data.draw(extras))
        seen.append(fingerprint(TENANT, body, items))
    assert seen[0] != seen[1]
