"""Cache-stable cuts through the gateway: cut=/prefix_tokens, est_tokens reuse, restarts."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.decide.chat import decide
from gateway.measure.tokens import Tokenizers
from gateway.memory.state import SessionRecord, compare_cut, runs
from gateway.proxy.appstate import STATE
from tests.conftest import SECRET, GatewayFactory, Upstream, sample

BUDGET = {"max_tokens": None, "max_chars": 6000, "max_messages": None, "max_turns": None}


def growing_requests() -> list[dict[str, Any]]:
    body = sample("chat_long_tools")
    msgs = body["messages"]
    return [{**body, "messages": msgs[: i + 1]} for i, m in enumerate(msgs) if m["role"] == "user"]


async def send(url: str, body: dict[str, Any], session: str = "s-grow") -> None:
    async with aiohttp.ClientSession() as s, s.post(
        f"{url}/v1/chat/completions", data=orjson.dumps(body),
        headers={"Authorization": f"Bearer {SECRET}", "X-Session-Id": session,
                 "Content-Type": "application/json"},
    ) as r:
        assert r.status == 200
        await r.read()


@pytest.mark.parametrize("share", [0.0, 0.5])
async def test_cut_kept_and_moved_follow_the_forwarded_prefix(
    gateway: GatewayFactory, upstream: Upstream, share: float
) -> None:
    """Along a growing session, cut=kept exactly when the previous forwarded messages (but
    the history the fill recalled for its question) are a prefix of this one's, and
    prefix_tokens is then the tokens of all of them."""
    gw = await gateway(memory={"enable_eviction": True, "budget": BUDGET,
                               "eviction": {"recall_share": share}})
    reqs = growing_requests()
    for body in reqs:
        await send(gw.url, body)
    events = gw.mem_events()
    bodies = [orjson.loads(r["raw"])["messages"] for r in upstream.received]
    assert len(events) == len(bodies) == len(reqs)
    statuses = [e["cut"] for e in events]
    # the stable part has the budget's (1 - share), its cut points the same step as
    # without the fill: after a move its tail is that much shorter
    assert statuses.count("kept") > (1 - share) * statuses.count("moved") > 0
    rules, tok = gw.app[STATE].rules, Tokenizers(10_000)
    stable = []  # what was forwarded but the recalled history, as the gateway decided it
    for body in reqs:
        d = decide(orjson.dumps(body), body, rules, tok)
        assert d.plan is not None
        assert [body["messages"][i] for i in d.forwarded()] == bodies[len(stable)]
        back = set(d.plan.recalled)
        stable.append([body["messages"][i] for i in d.forwarded() if i not in back])
    assert (stable != bodies) == (share > 0)
    for prev, cur, ev in zip(stable, bodies[1:], events[1:], strict=False):
        if ev["cut"] == "kept":
            assert cur[: len(prev)] == prev
            assert int(ev["prefix_tokens"]) > 0
        elif ev["cut"] == "moved":
            assert cur[: len(prev)] != prev


async def test_token_budget_cut_moves_once_per_step_of_growth(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """With a token budget, a growing session's cut moves (cut=moved after the first cut) at
    most once per (1 - low_water) x max_tokens tokens the history grows by (est_tokens),
    plus one for the turn that crosses a step: its cut points sit by token counts."""
    budget = {"max_tokens": 2000, "max_chars": None, "max_messages": None, "max_turns": None}
    gw = await gateway(memory={"enable_eviction": True, "budget": budget,
                               "eviction": {"recall_share": 0.0, "low_water": 0.6}})
    for body in growing_requests():
        await send(gw.url, body)
    events = gw.mem_events()
    first = next(k for k, ev in enumerate(events) if ev["cut"] != "none")
    later = events[first + 1:]
    moves = sum(ev["cut"] == "moved" for ev in later)
    growth = int(events[-1]["est_tokens"]) - int(events[first]["est_tokens"])
    assert 0 < moves <= growth / (0.4 * 2000) + 1
    assert all(ev["cut"] in ("kept", "moved") for ev in later)
    assert not any(ev.get("over_budget") for ev in events)


async def test_next_request_sent_while_the_answer_is_held_sees_the_cut(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """A session's bookkeeping is done while the upstream answers: a request sent while the
    previous one's answer is still on its way is compared with that request's cut (an agent
    firing its next call early; it used to see no record and say cut=moved)."""
    gw = await gateway(memory={"enable_eviction": True, "budget": BUDGET})
    reqs = growing_requests()
    for body in reqs:
        await send(gw.url, body, session="probe")
    probe = gw.mem_events()
    k = next(i for i in range(1, len(probe) - 1)
             if probe[i]["cut"] != "none" and probe[i + 1]["cut"] == "kept")
    upstream.holds = {b"held-answer": asyncio.Event()}
    first = asyncio.create_task(send(gw.url, {**reqs[k], "user": "held-answer"}, "early"))
    try:
        for _ in range(500):
            if b"held-answer" in upstream.received[-1]["raw"]:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the first request never reached the upstream")
        await send(gw.url, reqs[k + 1], session="early")
        events = await gw.wait_mem(len(probe) + 1)
        assert events[-1]["session"] == "early"
        assert events[-1]["cut"] == "kept"
        assert events[-1]["prefix_tokens"] == probe[k + 1]["prefix_tokens"]
    finally:
        upstream.holds[b"held-answer"].set()
    await first


async def test_est_tokens_reused_from_the_session_equals_a_full_count(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """est_tokens computed incrementally per session equals counting the whole history."""
    gw = await gateway(memory={"enable_eviction": True, "budget": BUDGET})
    reqs = growing_requests()
    for body in reqs:
        await send(gw.url, body)
    tok = Tokenizers(10_000)
    for body, ev in zip(reqs, gw.mem_events(), strict=True):
        raw = orjson.dumps(body)
        assert int(ev["est_tokens"]) == decide(raw, body, gw.state.rules, tok).est_tokens()


async def test_restart_forwards_the_same_cut(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """A gateway that lost its state (restart, another replica) forwards the same body."""
    gw = await gateway(memory={"enable_eviction": True, "budget": BUDGET})
    reqs = growing_requests()
    for body in reqs[:-1]:
        await send(gw.url, body)
    await send(gw.url, reqs[-1])
    warm = upstream.received[-1]["raw"]
    fresh = await gateway(memory={"enable_eviction": True, "budget": BUDGET})
    await send(fresh.url, reqs[-1])
    assert upstream.received[-1]["raw"] == warm


async def test_sessions_are_kept_apart_by_tenant(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """The same session id under another API key is another session (no shared state)."""
    gw = await gateway(memory={"enable_eviction": True, "budget": BUDGET})
    reqs = growing_requests()
    await send(gw.url, reqs[-2])
    async with aiohttp.ClientSession() as s, s.post(
        f"{gw.url}/v1/chat/completions", data=orjson.dumps(reqs[-1]),
        headers={"Authorization": "Bearer sk-other-tenant", "X-Session-Id": "s-grow",
                 "Content-Type": "application/json"},
    ) as r:
        await r.read()
    assert gw.mem_events()[-1]["cut"] == "moved"  # nothing known for this tenant's session
    assert len(gw.state.sessions.records) == 2


async def test_est_tokens_reused_when_the_last_message_is_replaced(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """A retry with an edited last message reuses the known prefix and still counts right."""
    gw = await gateway(memory={"enable_eviction": True, "budget": BUDGET})
    body = growing_requests()[-1]
    edited = {**body, "messages": [*body["messages"][:-1],
                                   {"role": "user", "content": "A different question, 不同的问题"}]}
    await send(gw.url, body)
    await send(gw.url, edited)
    tok = Tokenizers(10_000)
    first, second = gw.mem_events()
    assert int(first["est_tokens"]) == decide(orjson.dumps(body), body, gw.state.rules,
                                              tok).est_tokens()
    assert int(second["est_tokens"]) == decide(orjson.dumps(edited), edited, gw.state.rules,
                                               tok).est_tokens()


async def test_an_edited_last_message_compares_the_prefix_before_it(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """A regenerate or an edited question (the last message replaced) that forwards the
    same prefix before it says cut=kept with that prefix's tokens (it said cut=moved,
    prefix_tokens=0: only a history that grew was compared)."""
    gw = await gateway(memory={"enable_eviction": True, "budget": BUDGET,
                               "eviction": {"recall_share": 0.0}})
    body = growing_requests()[-1]
    last = body["messages"][-1]
    text = last["content"]
    edited = {**body, "messages": [*body["messages"][:-1],  # the same size, one letter else
                                   {**last, "content": text[:-1] + ("?" if text[-1] != "?"
                                                                    else "!")}]}
    await send(gw.url, body, session="s-edit")
    await send(gw.url, edited, session="s-edit")
    first, second = gw.mem_events()
    assert first["cut"] == "moved" and int(first["dropped"]) > 0
    sent = [orjson.loads(r["raw"])["messages"] for r in upstream.received]
    assert sent[0][:-1] == sent[1][:-1] and sent[0][-1] != sent[1][-1]
    d = decide(orjson.dumps(edited), edited, gw.state.rules, Tokenizers(10_000))
    kept = d.forwarded()
    assert second["cut"] == "kept"
    assert int(second["prefix_tokens"]) == sum(d.message_tokens(i) for i in kept[:-1]) > 0


async def test_the_same_body_again_is_cut_kept_though_the_fill_recalled(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """A body sent again unchanged (a retry) forwards the same bytes: cut=kept with the
    stable part's tokens, also when the fill recalled history for its question (the
    recalled items were compared as if they were stable: cut=moved, prefix_tokens=6)."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for i in range(6):
        msgs += [{"role": "user", "content": f"topic{i} " + "alpha beta gamma " * 30},
                 {"role": "assistant", "content": f"reply{i} " + "delta " * 60}]
    msgs.append({"role": "user", "content": "tell me about topic2 alpha"})
    body = {"model": "gpt-4o-mini", "messages": msgs}
    gw = await gateway(memory={"enable_eviction": True, "budget": {
        "max_tokens": 400, "max_chars": None, "max_messages": None, "max_turns": None}})
    for _ in range(3):
        await send(gw.url, body, session="s-retry")
    sent = [r["raw"] for r in upstream.received]
    assert sent[0] == sent[1] == sent[2]
    events = gw.mem_events()
    assert all(int(e["recalled"]) > 0 for e in events)  # the fill did bring history back
    assert [e["cut"] for e in events] == ["moved", "kept", "kept"]
    assert int(events[1]["prefix_tokens"]) == int(events[2]["prefix_tokens"]) > 100


async def test_a_shadow_session_record_is_small_whatever_its_length(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """In shadow mode every message is forwarded: the session's record holds that as
    one run, not one index per message (200,000 tiny messages were 10 MB per session,
    10,000 sessions per key)."""
    gw = await gateway(memory={"enable_eviction": False, "shadow": True})
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "k"}
            for i in range(20_001)]
    await send(gw.url, {"model": "gpt-4o-mini", "messages": msgs}, session="s-long")
    (rec,) = gw.state.sessions.records._records.values()
    assert rec.kept == (0, 20_001) and rec.n_messages == 20_001


@given(prev=st.lists(st.integers(0, 60), max_size=40), kept=st.lists(st.integers(0, 60),
                                                                      max_size=40))
def test_runs_hold_the_indices_and_compare_as_they_would(prev: list[int],
                                                         kept: list[int]) -> None:
    """A record's indices as runs expand to the same indices, and the number of this
    request's items the previous one started with is what the plain lists say."""
    rs = runs(prev)
    assert [i for a, b in zip(rs[::2], rs[1::2]) for i in range(a, b)] == prev
    assert runs(range(len(prev))) == ((0, len(prev)) if prev else ())
    rec = SessionRecord(kept=rs, n_messages=61, last=b"", cut=True, msg_tokens=0)
    same = next((k for k, (a, b) in enumerate(zip(prev, kept)) if a != b),
                min(len(prev), len(kept)))
    status = "kept" if same == len(prev) else "moved"
    assert compare_cut(rec, 61, kept, True) == (status, same)


@given(prev=st.lists(st.integers(0, 60), max_size=40, unique=True).map(sorted),
       kept=st.lists(st.integers(0, 60), max_size=40, unique=True).map(sorted),
       known=st.integers(0, 61), was_cut=st.booleans())
def test_only_the_known_messages_are_compared(prev: list[int], kept: list[int],
                                              known: int, was_cut: bool) -> None:
    """When only this request's first `known` messages are the previous request's (its
    last message replaced: known_prefix), the forwarded indices under `known` are what
    is compared; none known, nothing is the same; a cut after an uncut request moved."""
    rec = SessionRecord(kept=runs(prev), n_messages=61, last=b"", cut=was_cut,
                        msg_tokens=0)
    before = [i for i in prev if i < known]
    same = next((k for k, (a, b) in enumerate(zip(before, kept)) if a != b),
                min(len(before), len(kept)))
    status = "kept" if was_cut and known and same == len(before) else "moved"
    assert compare_cut(rec, known, kept, True) == (status, same)
    assert compare_cut(rec, known, kept, False) == ("none", same)
