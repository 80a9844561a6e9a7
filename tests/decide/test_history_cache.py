"""The per-session history cache only ever saves work: a session's requests decided
with the cache give exactly what they give without it (parse, plan, forwarded body,
carry-over snapshot, token counts), for growing, edited and switching histories."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.rules import build_rules
from gateway.config.schema import Rules
from gateway.decide.chat import decide
from gateway.decide.decision import Decision
from gateway.decide.history import HistoryCache, join, last_turn_start
from gateway.errors import GatewayError
from gateway.measure.conversation import Conversation, Unplannable
from gateway.measure.tokens import Tokenizers
from gateway.wire.anthropic_messages import ANTHROPIC_MESSAGES
from gateway.wire.base import Wire
from gateway.wire.openai_chat import OPENAI_CHAT
from gateway.wire.openai_responses import OPENAI_RESPONSES
from tests.strategies import conversation, memory_rules, to_anthropic, to_responses

ROOT = Path(__file__).resolve().parents[2]
TOK = Tokenizers(50_000)
WIRES: dict[str, tuple[Wire, Any]] = {
    "chat": (OPENAI_CHAT, lambda msgs: {"model": "gpt-4o-mini", "messages": msgs}),
    "anthropic": (ANTHROPIC_MESSAGES, to_anthropic),
    "responses": (OPENAI_RESPONSES, to_responses),
}


def make_rules(memory: dict[str, Any]) -> Rules:
    # as shipped: stale refs not logged, so a session's checkpoint folds are pruned
    memory = {**memory, "carry": {"rules_file": "carry.yaml", "log_skipped": False}}
    return build_rules({"memory": memory, "tokens": {"models_file": "models.yaml"}},
                       base_dir=ROOT / "rules")


def outcome(d: Decision) -> tuple[Any, ...]:
    snap = d.snapshot.fields if d.snapshot is not None else None
    return (d.conv, d.plan, d.forward, snap, d.note, d.skip_reason, d.est_tokens())


def decided(raw: bytes, rules: Rules, wire: Wire, cache: HistoryCache | None) -> Any:
    try:
        return outcome(decide(raw, orjson.loads(raw), rules, TOK, wire, history=cache,
                              key=("tenant", "s1")))
    except GatewayError as err:
        return ("error", type(err).__name__, str(err))


@st.composite
def session(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    """A wire and the bodies of one session's requests: growing prefixes of one
    conversation, sometimes an edited history or a different conversation."""
    name = draw(st.sampled_from(sorted(WIRES)))
    _, to_body = WIRES[name]
    body = to_body(draw(conversation()))
    key = "input" if name == "responses" else "messages"
    items = body[key]
    cuts = sorted(draw(st.lists(st.integers(1, len(items)), min_size=1, max_size=6)))
    bodies = []
    for k in cuts:
        part = [dict(m) for m in items[:k]]
        change = draw(st.integers(0, 9))
        if change == 0 and part:  # an edited old message
            j = draw(st.integers(0, len(part) - 1))
            part[j] = {**part[j], "memgate": {"pin": True}}
        elif change == 1:  # a different conversation in the same session
            part = [{"role": "user", "content": "something else entirely"}, *part[-1:]]
        bodies.append(orjson.dumps({**body, key: part}))
    return name, bodies


@pytest.mark.slow
@given(s=session(), memory=memory_rules())
@settings()
def test_cache_changes_nothing(s: tuple[str, list[bytes]], memory: dict[str, Any]) -> None:
    name, bodies = s
    wire, _ = WIRES[name]
    rules = make_rules(memory)
    cache = HistoryCache(1 << 24, 100)
    for raw in bodies:
        assert decided(raw, rules, wire, cache) == decided(raw, rules, wire, None)


@pytest.mark.slow
@given(s=session(), memory=memory_rules(), data=st.data())
@settings()
def test_overlapping_requests_count_the_same(s: tuple[str, list[bytes]],
                                             memory: dict[str, Any], data: st.DataObject) -> None:
    """Concurrent requests of a session: each is decided before the ones before it have
    counted what their plans skipped (that happens in their [mem] lines, after the
    response). Whatever the order the counting then runs in, every request's count is
    the count of its own body, as without the cache."""
    name, bodies = s
    wire, _ = WIRES[name]
    rules = make_rules(memory)
    cache = HistoryCache(1 << 24, 100)
    pending: list[tuple[Decision, bytes]] = []
    for raw in bodies:
        try:
            pending.append((decide(raw, orjson.loads(raw), rules, TOK, wire, history=cache,
                                   key=("tenant", "s1")), raw))
        except GatewayError:
            continue
        while pending and data.draw(st.booleans()):  # some finish before the next starts
            d, body = pending.pop(data.draw(st.integers(0, len(pending) - 1)))
            assert d.est_tokens() == decide(body, orjson.loads(body), rules, TOK, wire
                                            ).est_tokens()
    for d, body in pending:
        assert d.est_tokens() == decide(body, orjson.loads(body), rules, TOK, wire).est_tokens()


@pytest.mark.slow
@given(msgs=conversation(), name=st.sampled_from(sorted(WIRES)), data=st.data())
@settings()
def test_parse_splits_at_turn_starts(msgs: list[dict[str, Any]], name: str,
                                     data: st.DataObject) -> None:
    """parse(items) == join(parse(items[:r]), parse(items[r:])) at every turn start r."""
    wire, to_body = WIRES[name]
    body = to_body(msgs)
    items = body["input" if name == "responses" else "messages"]
    starts = [i for i in range(len(items)) if wire.starts_turn(items[i])]
    assert starts and last_turn_start(wire, items) == starts[-1]
    r = data.draw(st.sampled_from(starts))
    try:
        whole = wire.parse(items, "[PIN]", 0.7)
    except (Unplannable, ValueError) as exc:
        whole = type(exc).__name__
    try:
        pieces = join(wire.parse(items[:r], "[PIN]", 0.7), wire.parse(items[r:], "[PIN]", 0.7), r)
    except (Unplannable, ValueError) as exc:
        pieces = type(exc).__name__
    assert pieces == whole
    if isinstance(whole, Conversation) and isinstance(pieces, Conversation):
        assert pieces.pinned_groups == whole.pinned_groups  # not part of ==: a cache


def test_growing_session_is_parsed_once() -> None:
    """Each request of a growing session is a hit; the cache keeps to its byte bound."""
    rules = make_rules({"enable_eviction": True, "budget": {"max_tokens": 200}})
    cache = HistoryCache(1 << 20, 10)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for t in range(30):
        msgs += [{"role": "user", "content": f"question {t} about /src/app_{t}.py"},
                 {"role": "assistant", "content": f"answer {t}"}]
        raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
        d = decide(raw, orjson.loads(raw), rules, TOK, OPENAI_CHAT, history=cache,
                   key=("t", "grow"))
        assert d.view is not None and d.plan is not None
        if t:
            assert d.view.known == len(msgs) - 2  # everything the previous request had
    assert cache.hits == 29 and cache.misses == 1
    one = 3 * len(raw) + 384 * len(msgs)  # an entry's estimated memory
    small = HistoryCache(one + 10, 10)
    for k in range(3):
        decide(raw, orjson.loads(raw), rules, TOK, OPENAI_CHAT, history=small, key=("t", str(k)))
    assert len(small) == 1 and small.bytes <= small.max_bytes


@pytest.mark.parametrize(("cache_mb", "evict"), [(256, True), (0, True), (0, False)])
async def test_big_cold_history_counted_off_loop_exactly(
    gateway: Any, upstream: Any, cache_mb: int, evict: bool
) -> None:
    """A history past the off-loop threshold gets the same est_tokens in its [mem]
    line as counting it directly, with the history cache on (the next, grown request
    reuses the counts) and off."""
    from tests.proxy.test_proxy import post_raw

    gw = await gateway(memory={"enable_eviction": evict, "shadow": False},
                       session={"history_cache_mb": cache_mb})
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for t in range(60):
        msgs += [{"role": "user", "content": f"turn {t}: " + "订单 gateway budget " * 120},
                 {"role": "assistant", "content": f"answer {t} " + "ok " * 50}]
    rules = make_rules({"enable_eviction": True})
    for step in range(2):
        raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
        status, _, _ = await post_raw(gw, raw, headers={"X-Session-Id": "big"})
        assert status == 200
        direct = decide(raw, orjson.loads(raw), rules, TOK, OPENAI_CHAT)
        assert sum(direct.conv.chars) > 65_536  # the off-loop path
        ev = (await gw.wait_mem(step + 1))[-1]
        assert int(ev["est_tokens"]) == direct.est_tokens()
        assert int(ev["hist_msgs"]) == len(msgs)
        msgs += [{"role": "user", "content": "and next?"}]
    # the second request: only what was appended parsed (with the cache on)
    assert gw.state.history.hits == (1 if cache_mb else 0)


async def test_burst_of_big_cold_histories_counted_on_one_thread(gateway: Any, upstream: Any
                                                                ) -> None:
    """Big cold histories arriving together are counted one after another on the
    gateway's one counting thread (not one worker thread each, all competing with the
    event loop), and each [mem] line still has its history's exact count."""
    import threading

    from tests.proxy.test_proxy import post_raw

    # without the fill: its candidates are counted while it decides (on the loop), and
    # in histories this short that is every message, leaving nothing to count off it;
    # and the sliding window: a stepped cut places its checkpoints by the tokens of the
    # whole history before the current turn, counted while it decides
    memory = {"enable_eviction": True, "eviction": {"recall_share": 0, "low_water": 1.0}}
    gw = await gateway(memory={**memory, "shadow": False})
    rules = make_rules(memory)
    bodies = []
    for k in range(4):
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
        for t in range(40):
            msgs += [{"role": "user", "content": f"s{k} turn {t}: " + "订单 budget " * (150 + k)},
                     {"role": "assistant", "content": f"answer {t} " + "ok " * 40}]
        bodies.append(orjson.dumps({"model": "gpt-4o-mini", "messages": msgs}))
    before = {t.ident for t in threading.enumerate()}
    results = await asyncio.gather(*(post_raw(gw, raw, headers={"X-Session-Id": f"b{k}"})
                                     for k, raw in enumerate(bodies)))
    assert [status for status, _, _ in results] == [200] * 4
    lines = await gw.wait_mem(4)
    want = {}
    for k, raw in enumerate(bodies):
        direct = decide(raw, orjson.loads(raw), rules, TOK, OPENAI_CHAT)
        assert sum(direct.conv.chars) > 65_536  # each one takes the off-loop path
        want[f"b{k}"] = direct.est_tokens()
    got = {ev["session"]: int(ev["est_tokens"]) for ev in lines}
    assert got == want
    # (the store's own writes may start a default-executor thread: not counted here)
    counting = [t for t in threading.enumerate()
                if t.ident not in before and t.name.startswith("memgate-count")]
    assert len(counting) == 1


@pytest.mark.parametrize("low_water", [0.3, 0.6])
def test_growing_session_resumes_checkpoints_exactly(low_water: float) -> None:
    """A long growing session whose stepped cut moves several times: each request decides
    with the cache (checkpoints resumed from the session's memo) exactly as without it."""
    rules = make_rules({"enable_eviction": True, "shadow": False,
                        "budget": {"max_tokens": 900, "max_chars": None, "max_turns": None},
                        "eviction": {"low_water": low_water}})
    cache = HistoryCache(1 << 24, 10)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    cuts = set()
    for t in range(60):
        msgs += [{"role": "user", "content": f"question {t} " + "word " * (5 + 7 * (t % 5))},
                 {"role": "assistant", "content": f"answer {t} " + "ok " * (3 + t % 4)}]
        raw = orjson.dumps({"model": "gpt-4o-mini", "messages": [
            *msgs, {"role": "user", "content": "next?"}]})
        cached = decided(raw, rules, OPENAI_CHAT, cache)
        assert cached == decided(raw, rules, OPENAI_CHAT, None)
        cuts.add(cached[1].kept[1])  # the first kept message after the system prompt
    assert len(cuts) >= 4  # the cut moved: checkpoints beyond the first were used


@pytest.mark.slow
@given(s=session(), memory=memory_rules(), which=st.sampled_from(["evicted", "all"]))
@settings()
def test_archiving_from_where_the_session_left_off_archives_the_same_turns(
        s: tuple[str, list[bytes]], memory: dict[str, Any], which: str) -> None:
    """A request archives only the turns from its entry's mark on (the ones before were
    archived by the session's earlier requests); after every request the session has
    archived exactly the turns that looking at every turn every time would have."""
    import dataclasses

    from gateway.memory.recall import archive_records

    name, bodies = s
    wire, _ = WIRES[name]
    rules = make_rules({**memory, "enable_eviction": True})
    store = dataclasses.replace(rules.store, archive=which)
    cache = HistoryCache(1 << 24, 100)
    every, marked = set(), set()
    for raw in bodies:
        try:
            d = decide(raw, orjson.loads(raw), rules, TOK, wire, history=cache,
                       key=("tenant", "s1"))
        except GatewayError:
            continue
        if d.plan is None:
            continue
        every |= {r.memory_id for r in archive_records(d, "t", "s1", "a", store)[0]}
        entry = d.view.entry if d.view is not None else None
        since = entry.archived_upto if entry is not None else 0
        records, upto = archive_records(d, "t", "s1", "a", store, since)
        marked |= {r.memory_id for r in records}
        if entry is not None:
            entry.archived_upto = upto
        assert marked == every


def test_an_edited_old_turn_is_archived_again() -> None:
    """The mark only covers turns whose first message the client resent unchanged: after
    an edited old user message the session's history is looked at from the start again
    (and the edited turn is a new record); an unchanged resend archives nothing."""
    import dataclasses

    from gateway.memory.recall import archive_records

    rules = make_rules({"enable_eviction": True})
    store = dataclasses.replace(rules.store, archive="all")
    cache = HistoryCache(1 << 24, 100)
    msgs: list[dict[str, Any]] = []
    for t in range(6):
        msgs += [{"role": "user", "content": f"question {t}"},
                 {"role": "assistant", "content": f"answer {t}"}]
    archived = []
    edited = [msgs[0], msgs[1], {"role": "user", "content": "question 1, edited"}, *msgs[3:]]
    for body in (msgs + [{"role": "user", "content": "q"}],
                 msgs + [{"role": "user", "content": "q2"}],
                 edited + [{"role": "user", "content": "q"}]):
        raw = orjson.dumps({"model": "gpt-4o-mini", "messages": body})
        d = decide(raw, orjson.loads(raw), rules, TOK, OPENAI_CHAT, history=cache,
                   key=("tenant", "s1"))
        assert d.view is not None and d.view.entry is not None
        records, d.view.entry.archived_upto = archive_records(
            d, "t", "s1", "a", store, d.view.entry.archived_upto)
        archived.append(sorted(r.fields["user_text"] for r in records))
    assert archived[0] == [f"question {t}" for t in range(6)]
    assert archived[1] == []  # the same turns again: all archived already
    assert "question 1, edited" in archived[2]
