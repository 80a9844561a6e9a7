"""Responses state: server-side history (previous_response_id, conversation) and
calls sent as `item_reference` items, through the real openai SDK and the planner."""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.decide.chat import decide
from gateway.wire.openai_responses import OPENAI_RESPONSES
from tests.conftest import SECRET, GatewayFactory, Upstream
from tests.strategies import conversation, memory_rules, to_responses
from tests.wire.test_wire_properties import TOK, make_rules, strip

EVICT = {"enable_eviction": True,
         "budget": {"max_tokens": 6000, "max_chars": 2000, "max_messages": None,
                    "max_turns": None}}


def referenced_history(turns: int = 12) -> list[dict[str, Any]]:
    """A client-managed history whose earlier calls are sent by reference (store: true):
    the reasoning and function_call items as `item_reference`, the outputs in full."""
    items: list[dict[str, Any]] = [{"role": "developer", "content": "Use metric units."}]
    for t in range(turns):
        items += [
            {"role": "user", "content": f"step {t}: " + "measure the room " * 20},
            {"type": "item_reference", "id": f"rs_{t}"},
            {"type": "item_reference", "id": f"fc_{t}"},
            {"type": "function_call_output", "call_id": f"call_{t}", "output": "4.2 m " * 30},
            {"type": "message", "role": "assistant", "content": f"Room {t} is 4.2 m wide."},
        ]
    items.append({"role": "user", "content": "Which room was widest?"})
    return items


async def test_stateful_tool_loop_is_server_state(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """previous_response_id + a function_call_output whose call the server holds: skipped
    as server_state (not unpaired_tool_result), with its budget, forwarded as sent."""
    gw = await gateway(memory=EVICT)
    items = [{"type": "function_call_output", "call_id": "call_srv", "output": "21 degrees"}]
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET, max_retries=0) as c:
        await c.responses.create(model="gpt-4o-mini", previous_response_id="resp_prev",
                                 input=items)  # type: ignore[arg-type]
    ev = (await gw.wait_mem(1))[-1]
    assert (ev["evict"], ev["reason"], ev["budget_tokens"]) == ("skipped", "server_state",
                                                                 "6000")
    assert int(ev["est_tokens"]) > 0 and ev["hist_msgs"] == "1"
    assert upstream.last_body()["input"] == items


async def test_conversation_param_is_server_state(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """A `conversation` holds the history server-side too: a long input with orphan
    results is measured and forwarded whole, never evicted."""
    gw = await gateway(memory=EVICT)
    items = referenced_history()[1:]  # no developer message: the conversation has it
    items.insert(3, {"type": "function_call_output", "call_id": "call_in_conv", "output": "x"})
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET, max_retries=0) as c:
        await c.responses.create(model="gpt-4o-mini", conversation="conv_123",
                                 input=items)  # type: ignore[arg-type]
    ev = (await gw.wait_mem(1))[-1]
    assert (ev["evict"], ev["reason"], ev["dropped"]) == ("skipped", "server_state", "0")
    assert ev["budget_tokens"] == "6000" and int(ev["hist_chars"]) > 2000
    assert upstream.last_body()["input"] == items


async def test_server_state_strips_gateway_metadata(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Server-side state still gets its items parsed: gateway metadata never goes upstream."""
    gw = await gateway(memory=EVICT)
    items: list[dict[str, Any]] = [
        {"type": "function_call_output", "call_id": "call_srv", "output": "ok"},
        {"role": "user", "content": "thanks", "memgate": {"pin": True}},
    ]
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET, max_retries=0) as c:
        await c.responses.create(model="gpt-4o-mini", previous_response_id="resp_prev",
                                 input=items)  # type: ignore[arg-type]
    ev = (await gw.wait_mem(1))[-1]
    assert ev["reason"] == "server_state"
    assert upstream.last_body()["input"] == [items[0], {"role": "user", "content": "thanks"}]


async def test_item_reference_pairs_evict_as_one(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """A call sent as item_reference stands in for the call: reference and output are
    kept or dropped together and the rest of the history evicts normally."""
    # the stepped cut alone: kept items in the client's order (the fill would move the
    # history it recalls after the stable part)
    gw = await gateway(memory={**EVICT, "eviction": {"recall_share": 0}})
    items = referenced_history()
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET, max_retries=0) as c:
        await c.responses.create(model="gpt-4o-mini", input=items)  # type: ignore[arg-type]
    ev = (await gw.wait_mem(1))[-1]
    assert "reason" not in ev and int(ev["dropped"]) > 0, ev
    got = upstream.last_body()["input"]
    assert got[0] == items[0] and got[-1] == items[-1]
    it = iter(items)  # an ordered subsequence, each kept item as sent
    assert all(any(g == x for x in it) for g in got)
    refs = {i["id"][3:] for i in got if i.get("type") == "item_reference"}
    outs = {i["call_id"][5:] for i in got if i.get("type") == "function_call_output"}
    assert refs == outs and outs  # each turn's references and its output together
    assert len(upstream.last_body()["input"]) < len(items)


def test_orphan_result_without_state_is_still_unpaired() -> None:
    """No server state and no reference before it: a result without its call is not
    plannable (forwarded as is), and the line still says what the budget was."""
    body = {"model": "gpt-4o-mini", "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call_output", "call_id": "call_x", "output": "?"}]}
    raw = orjson.dumps(body)
    d = decide(raw, body, make_rules(EVICT), TOK, OPENAI_RESPONSES)
    assert d.skip_reason == "unpaired_tool_result" and d.forward is raw
    assert d.budget_tokens == 6000


def test_server_state_decided_before_pairing() -> None:
    """The server_state reason wins over the pairing check (which would raise), and the
    history is still parsed and measured."""
    body = {"model": "gpt-4o-mini", "previous_response_id": "resp_1", "input": [
        {"type": "function_call_output", "call_id": "call_srv", "output": "x" * 300},
        {"role": "user", "content": "next?"}]}
    raw = orjson.dumps(body)
    d = decide(raw, body, make_rules(EVICT), TOK, OPENAI_RESPONSES)
    assert (d.skip_reason, d.budget_tokens, d.plan) == ("server_state", 6000, None)
    assert d.conv is not None and d.hist_chars() == 305 and d.forward is raw


def by_reference(body: dict[str, Any], refer: list[bool]) -> dict[str, Any]:
    """`body` with some tool groups' reasoning and calls sent as item_reference items
    (id = "fc_" + call_id, so the test knows what the gateway cannot: which call)."""
    out: list[dict[str, Any]] = []
    k = -1
    for it in body["input"]:
        if it["type"] == "reasoning":
            k += 1
            if refer[k % len(refer)]:
                out.append({"type": "item_reference", "id": it["id"]})
                continue
        elif it["type"] == "function_call" and refer[k % len(refer)]:
            ref: dict[str, Any] = {"type": "item_reference", "id": "fc_" + it["call_id"]}
            if "memgate" in it:
                ref["memgate"] = it["memgate"]
            out.append(ref)
            continue
        out.append(it)
    return {**body, "input": out}


@pytest.mark.slow
@given(msgs=conversation(), memory=memory_rules(), refer=st.lists(st.booleans(), min_size=1,
                                                                   max_size=4))
@settings()
def test_references_never_separated_from_results(
    msgs: list[dict[str, Any]], memory: dict[str, Any], refer: list[bool]
) -> None:
    """With calls sent by reference: kept items are the client's, the current turn is
    kept, and every kept result has its call or the references standing for it."""
    body = by_reference(to_responses(msgs), refer)
    raw = orjson.dumps(body)
    d = decide(raw, orjson.loads(raw), make_rules(memory), TOK, OPENAI_RESPONSES)
    assert d.plan is not None, d.skip_reason
    src = body["input"]
    out = orjson.loads(d.forward)["input"]
    assert out == [strip(src[i]) for i in d.forwarded()]  # recalled after the stable part
    last_user = max(i for i, it in enumerate(src) if it.get("role") == "user")
    assert set(range(last_user, len(src))) <= set(d.plan.kept)
    outputs = {it["call_id"] for it in out if it["type"] == "function_call_output"}
    called = {it["call_id"] for it in out if it["type"] == "function_call"}
    referenced = {it["id"][3:] for it in out if it["type"] == "item_reference"
                  and it["id"].startswith("fc_")}
    assert outputs == called | referenced
    kept = set(d.plan.kept)
    for i in kept:  # a referenced reasoning item stays with what it precedes
        if src[i]["type"] in ("reasoning", "item_reference") and src[i]["id"].startswith("rs_"):
            assert i + 1 in kept
