"""memory.retrieve on the decide side: when the retrieval tool is added, what its handles
name, what they give back, and that `enabled: false` changes nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config.rules import build_rules
from gateway.decide.chat import decide
from gateway.decide.history import HistoryCache
from gateway.decide.retrieve import page, passages, resolve
from gateway.errors import RulesError
from gateway.measure.tokens import Tokenizers
from gateway.wire import WIRES
from gateway.wire.jsonbytes import append_edit, apply
from gateway.wire.retrieve_tool import forbids, tool_def
from tests.strategies import conversation, to_anthropic, to_responses

ROOT = Path(__file__).resolve().parents[2]
TOK = Tokenizers(4096)
TOOL = "memgate_retrieve"
HANDLE = re.compile(r'handle \\?"((?:cmp|hist)-[0-9a-f]+)\\?"')
ORDER = ["pinned", "recent_turns", "compact_tools", "length"]


def rules_with(retrieve: dict[str, Any] | None, budget: int = 400, **memory: Any) -> Any:
    m: dict[str, Any] = {"enable_eviction": True, "budget": {"max_tokens": budget},
                         "eviction": {"order": ORDER}, "carry": {"enabled": True}, **memory}
    if retrieve is not None:
        m["retrieve"] = retrieve
    return build_rules({"memory": m, "tokens": {"models_file": "models.yaml"}},
                       base_dir=ROOT / "rules")


def rows(tag: str, n: int = 120) -> str:
    return json.dumps({"rows": [{"id": i, "path": f"/srv/{tag}/f{i}.txt", "size": i * 37}
                                for i in range(n)]}, indent=1)


def agent_chat(turns: int = 6) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"task {t}: list /srv/d{t}"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{t}", "type": "function",
                      "function": {"name": "ls", "arguments": json.dumps({"dir": f"/d{t}"})}}]},
                 {"role": "tool", "tool_call_id": f"c{t}", "content": rows(f"d{t}")},
                 {"role": "assistant", "content": f"listed /srv/d{t}"}]
    msgs.append({"role": "user", "content": "what was the size of /srv/d0/f5.txt?"})
    return {"model": "gpt-4o", "messages": msgs,
            "tools": [{"type": "function", "function": {"name": "ls", "parameters": {}}}]}


def run(body: dict[str, Any], rules: Any, wire: str = "chat", key: Any = ("t", "s"),
        history: HistoryCache | None = None) -> Any:
    return decide(orjson.dumps(body), body, rules, TOK, WIRES[wire], key=key, history=history)


def tools_of(forward: bytes, wire: str) -> list[str]:
    tools = orjson.loads(forward).get("tools") or []
    return [t["function"]["name"] if wire == "chat" else t["name"] for t in tools]


def test_a_cut_agent_chat_carries_the_tool_and_every_handle_gives_its_original() -> None:
    body = agent_chat()
    d = run(body, rules_with({"enabled": True}))
    assert d.retrieve == TOOL and d.plan is not None and (d.plan.dropped or d.compacted)
    sent = orjson.loads(d.forward)
    assert [t["function"]["name"] for t in sent["tools"]] == ["ls", TOOL]
    assert sent["tools"][-1] == orjson.loads(tool_def(WIRES["chat"], rules_with(
        {"enabled": True}).memory.retrieve))
    handles = set(HANDLE.findall(d.forward.decode()))
    assert handles, "a cut names at least one handle"
    everything = "\n".join(m["content"] or "" for m in body["messages"])
    for h in handles:
        text = resolve(d, h)
        assert text is not None
        if h.startswith("cmp-"):
            assert text in everything  # a compacted result's own original
    # the value the question is about is forwarded or behind a handle
    value = '"/srv/d0/f5.txt"'
    assert value in d.forward.decode() or any(value in (resolve(d, h) or "") for h in handles)


def test_retrieve_off_is_byte_identical_to_no_section() -> None:
    body = agent_chat()
    base = run(body, rules_with(None))
    off = run(body, rules_with({"enabled": False, "excerpt_min_chars": 2000}))
    assert off.forward == base.forward and off.retrieve is None
    assert TOOL not in off.forward.decode()


@pytest.mark.parametrize("choice", ["none", "required",
                                    {"type": "function", "function": {"name": "ls"}}])
def test_a_choice_other_than_auto_gets_no_tool_and_no_handle(choice: Any) -> None:
    body = {**agent_chat(), "tool_choice": choice}
    d = run(body, rules_with({"enabled": True}))
    assert d.plan is not None and (d.plan.dropped or d.compacted)
    assert d.retrieve is None and d.retrieve_off == "tool_choice"
    assert TOOL not in d.forward.decode() and not HANDLE.search(d.forward.decode())


def test_a_client_tool_of_the_same_name_and_a_toolless_model_forbid_it() -> None:
    body = agent_chat()
    body["tools"].append({"type": "function", "function": {"name": TOOL, "parameters": {}}})
    d = run(body, rules_with({"enabled": True}))
    assert d.retrieve is None and d.retrieve_off == "name_taken"
    assert tools_of(d.forward, "chat").count(TOOL) == 1  # the client's own, untouched
    d = run({**agent_chat(), "model": "o1-mini"}, rules_with({"enabled": True}))
    assert d.retrieve_off == "model_without_tools" and TOOL not in d.forward.decode()


def test_handles_differ_between_sessions_and_tenants() -> None:
    body, rules = agent_chat(), rules_with({"enabled": True})
    a, b, c = run(body, rules, key=("t", "s1")), run(body, rules, key=("t", "s2")), run(
        body, rules, key=("u", "s1"))
    ha, hb, hc = (set(HANDLE.findall(x.forward.decode())) for x in (a, b, c))
    assert ha and not ha & hb and not ha & hc
    assert all(resolve(b, h) is None for h in ha)


def test_the_tool_stays_on_a_session_once_it_came() -> None:
    rules, cache = rules_with({"enabled": True}, budget=20_000), HistoryCache(64 << 20, 100)
    short = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    d = run(short, rules, history=cache)
    assert d.retrieve is None  # nothing cut: no tool
    long = agent_chat(turns=10)
    small = rules_with({"enabled": True}, budget=400)
    d1 = run(long, small, history=cache)
    assert d1.retrieve == TOOL
    grown = {**long, "messages": [*long["messages"], {"role": "assistant", "content": "185"},
                                  {"role": "user", "content": "thanks"}]}
    d2 = run(grown, small, history=cache)
    assert d2.retrieve == TOOL


def test_big_results_are_excerpted_on_every_request_in_the_same_bytes() -> None:
    """excerpt_min_chars: a big result is excerpted from the first request on, cut or
    not, read or not, and reads the same on the session's later requests (the cached
    prefix holds); without it, a history that fits goes whole."""
    body = agent_chat(turns=1)
    body["messages"][-1:] = [
        {"role": "user", "content": "list /srv/big"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "cb", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "cb", "content": rows("big", 400)}]
    whole = run(body, rules_with({"enabled": True}, budget=50_000))
    assert rows("big", 400) in orjson.loads(whole.forward)["messages"][-1]["content"]
    assert whole.retrieve == TOOL  # an agent's request carries the tool from the first
    rules, cache = (rules_with({"enabled": True, "excerpt_min_chars": 5000}, budget=50_000),
                    HistoryCache(64 << 20, 100))
    first = run(body, rules, history=cache)
    assert first.plan is not None and not first.plan.dropped
    last = orjson.loads(first.forward)["messages"][-1]["content"]
    assert len(last) < 5000 and first.retrieve == TOOL
    (h,) = HANDLE.findall(last)
    assert resolve(first, h) == rows("big", 400)
    later = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "ok"},
                                  {"role": "user", "content": "and the next one?"}]}
    second = run(later, rules, history=cache)
    assert orjson.loads(second.forward)["messages"][len(body["messages"]) - 1]["content"] == last


def test_page_goes_on_by_offset_and_says_where() -> None:
    text = "".join(chr(97 + i % 26) for i in range(2500))
    first = page(text, 0, 1000, TOOL)
    assert first.startswith(text[:1000]) and "offset=1000" in first and "1,500 more" in first
    assert page(text, 2000, 1000, TOOL) == text[2000:]
    assert page(text, 99_999, 1000, TOOL) == ""


@pytest.mark.parametrize("raw", [
    b'{"model":"m","messages":[{"role":"user","content":"x"}]}',
    b'{"model":"m","tools":[],"messages":[{"role":"user","content":"x"}]}',
    b'{ "model" : "m" , "messages" : [ {"role":"user","content":"]"} ] , "tools" : [ {"a":1} ] }',
    b'{"tools":[{"a":[1,2]}],"messages":[{"role":"user","content":"x"}]}',
])
def test_append_edit_appends_to_tools_wherever_they_are(raw: bytes) -> None:
    payload = orjson.loads(raw)
    for spans in (None, [(raw.index(b'{"role"'), raw.index(b"}", raw.index(b'{"role"')) + 1)]):
        out = orjson.loads(apply(raw, [append_edit(raw, payload, "tools", b'{"t":1}', spans)]))
        assert out["tools"] == [*(payload.get("tools") or []), {"t": 1}]
        assert out["messages"] == payload["messages"]


def test_bad_retrieve_config_is_refused_with_its_key() -> None:
    for bad in ({"tool_name": "has space"}, {"max_rounds": 0}, {"excerpt_min_chars": 10},
                {"surprise": 1}):
        with pytest.raises(RulesError, match="memory.retrieve"):
            rules_with({"enabled": True, **bad})


def _with_big_results(msgs: list[dict[str, Any]], big: list[int]) -> list[dict[str, Any]]:
    out, k = [], 0
    for m in msgs:
        if m["role"] == "tool":
            if big[k % len(big)]:
                m = {**m, "content": rows(f"r{k}", 60 + 10 * (k % 3))}
            k += 1
        out.append(m)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=conversation(max_turns=8), big=st.lists(st.integers(0, 1), min_size=1, max_size=4),
       wire=st.sampled_from(["chat", "messages", "responses"]),
       choice=st.sampled_from([None, "auto", "none", "required"]),
       budget=st.sampled_from([60, 300, 1500]),
       current=st.sampled_from([None, 2000]))
def test_a_marker_never_names_a_tool_the_request_lacks(
        msgs: list[dict[str, Any]], big: list[int], wire: str, choice: str | None,
        budget: int, current: int | None) -> None:
    """Whatever the history, wire and tool_choice: the forwarded body names the retrieval
    tool only if it carries it (once); every handle it names resolves from this request;
    a request that may not carry it names no handle."""
    msgs = _with_big_results(msgs, big)
    chat = {"model": "gpt-4o", "messages": msgs,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    body = chat if wire == "chat" else (to_anthropic(msgs) if wire == "messages"
                                        else to_responses(msgs))
    if wire != "chat":
        body["tools"] = [{"name": "f", "input_schema": {"type": "object"}} if wire == "messages"
                         else {"type": "function", "name": "f", "parameters": {}}]
    if choice is not None:
        body["tool_choice"] = ({"type": {"none": "none", "required": "any"}.get(choice, choice)}
                               if wire == "messages" else choice)
    rules = rules_with({"enabled": True, "excerpt_min_chars": current}, budget=budget)
    d = run(body, rules, wire)
    text = d.forward.decode()
    named = TOOL in text
    carried = tools_of(d.forward, wire).count(TOOL)
    assert carried == (1 if d.retrieve else 0)
    if named:
        assert carried == 1, "a marker names a tool the forwarded request lacks"
    for h in HANDLE.findall(text):
        assert resolve(d, h) is not None
    if choice not in (None, "auto"):
        assert not named and d.retrieve is None
    off = run(body, rules_with({"enabled": False, "excerpt_min_chars": current}, budget=budget),
              wire)
    assert TOOL not in off.forward.decode()


def test_forbids_reads_each_wires_tool_choice() -> None:
    r = rules_with({"enabled": True}).memory.retrieve
    a = WIRES["messages"]
    assert forbids(a, {"tool_choice": {"type": "auto"}}, r, "claude-x") is None
    assert forbids(a, {"tool_choice": {"type": "any"}}, r, "claude-x") == "tool_choice"
    assert forbids(a, {"tools": [{"name": TOOL}]}, r, "claude-x") == "name_taken"
    resp = WIRES["responses"]
    assert forbids(resp, {"tool_choice": "auto", "store": False}, r, "gpt-4o") is None
    # a response the provider keeps may be chained onto by id: never one ending in our call
    assert forbids(resp, {"tool_choice": "auto"}, r, "gpt-4o") == "stored_response"
    assert forbids(resp, {"store": True}, r, "gpt-4o") == "stored_response"
    assert forbids(resp, {"tool_choice": {"type": "allowed_tools"}, "store": False}, r,
                   "gpt-4o") == "tool_choice"
    assert forbids(WIRES["chat"], {"n": 2}, r, "gpt-4o") == "n_choices"


def test_a_query_gives_the_passages_that_hold_its_words() -> None:
    text = "".join(f"row {i}: path /srv/f{i}.txt size {i * 37}\n" for i in range(400))
    got = passages(text, "F17.TXT")
    assert "/srv/f17.txt size 629" in got and "/srv/f300.txt" not in got
    assert got.startswith("[memgate: ") and "characters skipped" in got
    both = passages(text, "f17.txt f390.txt")
    assert "size 629" in both and "size 14430" in both and len(both) < 2000
    assert "no passage holds" in passages(text, "zebra")
    assert passages("abc", "abc") == "abc"


@settings(max_examples=200, deadline=None)
@given(before=st.booleans(), indent=st.sampled_from([None, 1]),
       decoy=st.sampled_from(["none", "key", "value", "both"]), empty=st.booleans(),
       after=st.lists(st.sampled_from(["stream", "user", "metadata"]), unique=True),
       spans=st.booleans())
def test_append_edit_finds_the_top_level_list_among_decoys(
        before: bool, indent: int | None, decoy: str, empty: bool, after: list[str],
        spans: bool) -> None:
    """Whatever the key order, the spelling and the lookalikes inside the history (a
    nested "tools" key, a "tools" string): the top-level list gets the value, nothing
    else changes."""
    content: Any = "hi"
    if decoy in ("key", "both"):
        content = [{"type": "text", "text": "x", "tools": [{"a": 1}]}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": content}]
    if decoy in ("value", "both"):
        msgs.append({"role": "assistant", "content": "tools"})
    tools: list[Any] = [] if empty else [{"type": "function", "function": {"name": "f"}}]
    body: dict[str, Any] = {"model": "m"}
    if before:
        body["tools"] = tools
    body["messages"] = msgs
    if not before:
        body["tools"] = tools
    extra = {"stream": True, "user": "u", "metadata": {"tools": "x"}}
    body.update({k: extra[k] for k in after})
    raw = (json.dumps(body, indent=indent) if indent else orjson.dumps(body).decode()).encode()
    found: list[tuple[int, int]] | None = None
    if spans:
        at = raw.index(b'"messages"')
        from gateway.wire.jsonbytes import elements, ws
        found = elements(raw, ws(raw, raw.index(b"[", at)))
    out = orjson.loads(apply(raw, [append_edit(raw, body, "tools", b'{"t":1}', found)]))
    assert out == {**body, "tools": [*tools, {"t": 1}]}


def test_tools_null_gets_the_tool_in_its_place() -> None:
    """`"tools": null` (an unset field some SDKs send) is the tool's list, not a reason
    to give up the cut."""
    body = {**agent_chat(), "tools": None}
    d = run(body, rules_with({"enabled": True}))
    assert d.skip_reason is None and d.plan is not None and d.plan.dropped
    sent = orjson.loads(d.forward)
    assert [t["function"]["name"] for t in sent["tools"]] == [TOOL]
    assert len(sent["messages"]) < len(body["messages"])


def test_passages_find_words_after_text_that_folds_longer() -> None:
    """Matches are found in the text itself: characters whose case-folded form is longer
    (ß, İ) before a match do not shift it."""
    for pad in ("ß" * 400, "İ" * 700):
        got = passages(pad + "x" * 10 + "NEEDLE here", "needle")
        assert "NEEDLE here" in got


def test_the_next_round_keeps_a_responses_input_string_as_its_message() -> None:
    """Round 2 of a Responses request whose `input` is a string: that string is the first
    item (not its characters), then the model's turn and memgate's answer."""
    from gateway.wire.retrieve_tool import next_body
    sent = {"model": "gpt-4o", "input": "what is in /srv?", "store": False}
    turn = [{"type": "function_call", "call_id": "c1", "name": TOOL, "arguments": "{}"}]
    out = orjson.loads(next_body(WIRES["responses"], sent, turn, [("c1", "the text")], True))
    assert out["input"] == [{"role": "user", "content": "what is in /srv?"}, *turn,
                            {"type": "function_call_output", "call_id": "c1",
                             "output": "the text"}]
    assert out["tool_choice"] == "none"
