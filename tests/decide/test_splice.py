"""A resent body parsed from where the session's previous body left off gives exactly
what parsing it whole gives — or nothing (the whole parse then runs): for every JSON
formatting a client may use, growing and edited histories, duplicate and escaped keys,
and arbitrary bytes after the reused prefix."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.decide import splice
from gateway.decide.chat import decide
from gateway.wire.anthropic_messages import ANTHROPIC_MESSAGES
from gateway.wire.jsonbytes import members, ws
from gateway.wire.openai_chat import OPENAI_CHAT
from tests.decide.test_history_cache import TOK, make_rules

FORMATS = {
    "orjson": orjson.dumps,
    "json": lambda o: json.dumps(o).encode(),  # ", " and ": ", \uXXXX escapes
    "indent": lambda o: json.dumps(o, indent=2, ensure_ascii=False).encode(),
    "compact": lambda o: json.dumps(o, ensure_ascii=False, separators=(",", ":")).encode(),
}
TEXT = st.lists(st.sampled_from(list('ab "\\/{}[],:é中\n') + ['"messages"', "\\u006d", "\u2028"]),
                max_size=12).map("".join)
VALUE = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | TEXT,
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(["a", "messages", "role"]), inner,
                                       max_size=3), max_leaves=6)
ITEM = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": TEXT},
                             optional={"extra": VALUE})


@st.composite
def body(draw: st.DrawFn) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(["model", "tools", "stream", "max_tokens", "x"]),
                         unique=True, max_size=4))
    at = draw(st.integers(0, len(keys)))
    out: dict[str, Any] = {}
    for k in keys[:at]:
        out[k] = draw(VALUE)
    out["messages"] = draw(st.lists(ITEM, min_size=2, max_size=6))
    for k in keys[at:]:
        out[k] = draw(VALUE)
    return out


def parse_whole(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "invalid"


def check(raw: bytes, rec: splice.Splice, prev: dict[str, Any]) -> bool:
    """splice.loads gives the whole parse (same keys in the same order) or None."""
    got = splice.loads(raw, rec, prev)
    if got is None:
        return False
    whole = parse_whole(raw)
    assert got == whole
    assert list(got) == list(whole)
    return True


@pytest.mark.slow
@given(p=body(), fmt=st.sampled_from(sorted(FORMATS)), more=st.lists(ITEM, max_size=3),
       edit=st.integers(0, 5), data=st.data())
@settings(max_examples=300)
def test_splice_is_the_whole_parse_or_nothing(p: dict[str, Any], fmt: str, more: list[Any],
                                              edit: int, data: st.DataObject) -> None:
    dump = FORMATS[fmt]
    raw = dump(p)
    prev = orjson.loads(raw)
    rec = splice.make(raw, "messages", prev, None)
    assert rec is not None  # every shape drawn here has a last item to splice at
    assert rec.count == len(p["messages"]) - 1 and raw.startswith(rec.prefix)
    nxt = {**p, "messages": [*p["messages"], *more]}
    if edit == 1:  # the last item edited (as the benchmark's counter does)
        nxt["messages"][-1] = {**nxt["messages"][-1], "content": "changed"}
    new = dump(nxt)
    if edit == 2:  # arbitrary bytes after the reused prefix
        cut = data.draw(st.integers(len(rec.prefix), len(new)))
        new = new[:cut] + data.draw(st.binary(max_size=12)) + new[cut:]
    elif edit == 3:  # a key repeated after the list, or the list's key itself
        dup = data.draw(st.sampled_from([
            b'"messages":[]', b'"messages":[{"role":"user","content":"x"}]',
            b'"\\u006dessages":[{"role":"user","content":"y"}]', b'"model":1',
            b'"\\u006dodel":2']))
        new = new[: new.rindex(b"}")] + b"," + dup + b"}"
    elif edit == 4:  # a trailing comma where the last item was
        new = rec.prefix + b"]}"
    spliced = check(new, rec, prev)
    rest = new[len(rec.prefix):]
    if edit == 0 and more and b'"messages"' not in rest and b"\\u00" not in rest:
        assert spliced  # a plainly grown body is spliced (unless it looks like a key again)
        got = splice.loads(new, rec, prev)
        assert got is not None and got["messages"][: rec.count] == prev["messages"][: rec.count]
        # the next record, scanning only the new items, is the one a full scan finds
        inc = splice.make(new, "messages", got, rec)
        assert inc == splice.make(new, "messages", orjson.loads(new), None)


# spaced as a client may write it: found by the scan, not orjson's spelling of its last item
PLANTED = b'"messages": [{"role": "user", "content": "planted"}, {"role": "user", "content": "2"}]'


@pytest.mark.slow
@given(p=body(), fmt=st.sampled_from(sorted(FORMATS)), more=st.lists(ITEM, max_size=3),
       dup=st.sampled_from([PLANTED, b'"model":"evil-model"', b'"max_tokens":1', b'"x":null']))
@example(p={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "a"}] * 2},
         fmt="json", more=[], dup=b'"model":"evil-model"')
@example(p={"messages": [{"role": "user", "content": "a"}] * 3}, fmt="indent",
         more=[{"role": "user", "content": "b"}], dup=PLANTED)
@settings(max_examples=300)
def test_a_record_of_a_body_repeating_a_key_splices_no_other_parse(
    p: dict[str, Any], fmt: str, more: list[Any], dup: bytes
) -> None:
    """A record made from a body that repeats a key after its list (orjson keeps the
    last value, a scan finds the first list) never hands its values to a body that
    starts with the same bytes: another caller's body starting like this one is
    parsed as its own (or not spliced)."""
    dump = FORMATS[fmt]
    raw = dump(p)
    raw = raw[: raw.rindex(b"}")] + b"," + dup + b"}"
    prev = orjson.loads(raw)
    rec = splice.make(raw, "messages", prev, None)
    if rec is None:
        return
    check(raw, rec, prev)  # its own body: as it parses, or not spliced
    check(dump({**p, "messages": [*p["messages"], *more]}), rec, prev)


def test_records_serve_only_their_own_tenant() -> None:
    """A session's record splices only bodies of the same tenant: never another
    caller's, never a caller without a key."""
    from gateway.decide.history import HistoryCache

    rules = make_rules({"enable_eviction": True})
    cache = HistoryCache(1 << 26, 10)
    msgs = [{"role": "user", "content": "x" * 20_000}, {"role": "assistant", "content": "a"}]
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
    d = decide(raw, orjson.loads(raw), rules, TOK, OPENAI_CHAT, history=cache, key=("A", "s"))
    cache.remember(("A", "s"), raw, d.payload, d.messages, None)
    grown = orjson.dumps({"model": "gpt-4o-mini",
                          "messages": [*msgs, {"role": "user", "content": "b"}]})
    assert cache.loads(grown, OPENAI_CHAT, "A")[1] is not None  # its own tenant: spliced
    for other in ("B", None):
        payload, src = cache.loads(grown, OPENAI_CHAT, other)
        assert src is None and payload == orjson.loads(grown)
        assert cache.unmarked_from(grown, OPENAI_CHAT, other) == 0


@pytest.mark.slow
@given(p=body(), fmt=st.sampled_from(sorted(FORMATS)),
       grows=st.lists(st.lists(ITEM, min_size=1, max_size=3), min_size=1, max_size=3),
       seed=st.sampled_from(["first", "spliced"]))
@settings(max_examples=300)
def test_spans_kept_along_a_session_are_the_bodys_own(
        p: dict[str, Any], fmt: str, grows: list[list[Any]], seed: str) -> None:
    """The item spans a record keeps, extended request by request with the new items'
    only, are where each body's items are (jsonbytes.elements over the whole body, the
    list orjson reads), and a body cut from them is the body cut from a full scan: for
    every formatting, keys around the list, nested and escaped values. The first record
    finds them by scanning its body, or (seed=spliced) from one made without spans."""
    dump = FORMATS[fmt]
    raw = dump(p)
    prev = orjson.loads(raw)
    rec = splice.make(raw, "messages", prev, None, scan=False, spans=seed == "first")
    assert rec is not None
    msgs = list(p["messages"])
    for more in grows:
        msgs += more
        new = dump({**p, "messages": msgs})
        got = splice.loads(new, rec, prev)
        if got is None:  # a new item looks like a key: the whole parse, no record used
            return
        full = [m for m in members(new, ws(new, 0), got, listed="messages")
                if m.name == "messages"][-1].items
        assert full is not None and len(full) == len(msgs)
        if rec.spans is not None:
            assert list(rec.spans) == full[: rec.count]
            spans = splice.spans_of(new, rec, got["messages"])
            assert spans == full
            kept = sorted({*range(0, len(msgs), 2), len(msgs) - 1})
            assert (OPENAI_CHAT.build_body(new, got, kept, spans=spans)
                    == OPENAI_CHAT.build_body(new, got, kept))
        else:
            assert splice.spans_of(new, rec, got["messages"]) is None
        rec = splice.make(new, "messages", got, rec, scan=False, spans=True)
        assert rec is not None and rec.spans is not None
        prev = got


MARKED = st.lists(st.sampled_from(["memgate", "mem", "gate", "\\u00", "\\u006d", "é", "x "]),
                  max_size=4).map("".join)


@pytest.mark.slow
@given(p=body(), fmt=st.sampled_from(sorted(FORMATS)), more=st.lists(MARKED, max_size=3),
       noise=st.binary(max_size=10), at=st.none() | st.integers(0, 1 << 20),
       scans=st.tuples(st.booleans(), st.booleans()))
@example(p={"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
         fmt="orjson", more=["x", "memgate", "y"], noise=b"", at=None,
         scans=(True, True))  # the key in a new item that the next record's prefix covers
@example(p={"messages": [{"role": "user", "content": "memgate"},
                         {"role": "user", "content": "b"}]},
         fmt="orjson", more=["x", "y"], noise=b"", at=None,
         scans=(False, True))  # the key in a prefix that was not searched when recorded
def test_marker_search_from_a_record_is_the_whole_search(
        p: dict[str, Any], fmt: str, more: list[str], noise: bytes, at: int | None,
        scans: tuple[bool, bool]) -> None:
    """With eviction off, a body holding the gateway's metadata key or a \\u00XX escape
    takes the normal path; a resent history is not searched again. Searching from where
    a record says gives what searching the whole body gives, for records made from the
    whole body and from a spliced one, searched when made or not (eviction on does not
    need it), whatever follows the prefix."""
    dump = FORMATS[fmt]
    raw = dump(p)
    prev = orjson.loads(raw)
    rec = splice.make(raw, "messages", prev, None, scans[0])
    assert rec is not None
    assert rec.unmarked == (splice.unmarked(rec.prefix) if scans[0] else None)
    nxt = {**p, "messages": [*p["messages"], *({"role": "user", "content": t} for t in more)]}
    new = dump(nxt)
    if at is not None:  # arbitrary bytes anywhere after the reused prefix
        cut = len(rec.prefix) + at % (len(new) - len(rec.prefix) + 1)
        new = new[:cut] + noise + new[cut:]
    start = splice.unmarked_from(new, rec)
    assert splice.unmarked(new, start) == splice.unmarked(new)
    got = splice.loads(new, rec, prev)
    if got is not None:  # the next record, from the new items only
        inc = splice.make(new, "messages", got, rec, scans[1])
        if inc is not None:
            assert inc.unmarked == (splice.unmarked(inc.prefix) if scans[1] else None)
            later = new[: len(inc.prefix)] + dump({"messages": [{"content": t} for t in more]})
            assert (splice.unmarked(later, splice.unmarked_from(later, inc))
                    == splice.unmarked(later))


@pytest.mark.slow
@given(p=body(), fmt=st.sampled_from(sorted(FORMATS)))
def test_located_offset_is_the_last_items_start(p: dict[str, Any], fmt: str) -> None:
    """The scanner (any formatting) finds the same offset as the orjson fast way."""
    raw = FORMATS[fmt](p)
    n = len(p["messages"]) - 1
    found = splice.locate(raw, "messages", n)
    assert found is not None
    off, before = found
    names = list(p)
    at = names.index("messages")
    assert orjson.loads(b'{"messages":[' + raw[off:]) == {
        "messages": [p["messages"][-1]], **{k: p[k] for k in names[at + 1:]}}
    assert list(before) == names[:at]


def test_not_an_object_or_no_list_gives_no_record() -> None:
    for raw in (b'[{"messages":[1,2]}]', b'{"messages":"hi"}', b'{"messages":[1]}',
                b'{"a":1,"a":2,"messages":[1,2]}'):
        payload = orjson.loads(raw)
        if isinstance(payload, dict) and isinstance(payload.get("messages"), list):
            rec = splice.make(raw, "messages", payload, None)
            if rec is not None:  # the duplicate "a": only the fast way takes it; still exact
                assert check(raw[: len(rec.prefix)] + b'3,4]}', rec, payload)
        assert splice.locate(raw, "messages", 1) is None


async def test_growing_session_over_http_is_spliced_and_forwards_the_same(
    gateway: Any, upstream: Any
) -> None:
    """Big bodies of a growing session (Python's json formatting, an Anthropic one too):
    from the second request on the body is spliced (and cut where its record's spans
    say), and what the upstream receives is byte for byte what deciding the whole body
    without any cache forwards."""
    from tests.proxy.test_proxy import post_raw

    gw = await gateway(memory={"enable_eviction": True, "shadow": False,
                               "budget": {"max_tokens": 3000, "max_chars": None}})
    rules = make_rules({"enable_eviction": True, "shadow": False,
                        "budget": {"max_tokens": 3000, "max_chars": None}})
    for wire, path, extra in ((OPENAI_CHAT, "/v1/chat/completions", {"model": "gpt-4o-mini"}),
                              (ANTHROPIC_MESSAGES, "/v1/messages",
                               {"model": "claude-3-5-haiku", "max_tokens": 64,
                                "system": "be brief"})):
        msgs: list[dict[str, Any]] = []
        before = gw.state.history.spliced
        for t in range(6):
            ask = f"turn {t}: read /data/f{t}.csv " + "订单 " * 1500
            msgs += [{"role": "user", "content": ask},
                     {"role": "assistant", "content": f"done {t} " + "ok " * 300}]
            raw = json.dumps({**extra, "messages": [*msgs, {"role": "user", "content": "next?"}]}
                             ).encode()
            status, _, _ = await post_raw(gw, raw, path=path,
                                          headers={"X-Session-Id": f"grow-{wire.name}"})
            assert status == 200
            want = decide(raw, orjson.loads(raw), rules, TOK, wire).forward
            assert upstream.received[-1]["raw"] == want
            await gw.wait_mem(len(upstream.received))
        assert gw.state.history.spliced - before == 5  # every request after the first
    async with aiohttp.ClientSession() as s, s.get(f"{gw.url}/metrics") as r:
        text = await r.text()
    assert "memgate_history_cache_spliced_total 10.0" in text
    cache = gw.state.history
    entries = list(cache._entries.values())
    assert cache.bytes == sum(e.size for e in entries)  # the records' bytes are counted
    assert all(e.reuse is not None and e.reuse.payload["messages"] is e.items for e in entries)
    # eviction on: each record knows where its messages are, so the cuts above (the
    # bytes checked against a whole decide) were made from its spans
    assert all(e.reuse is not None and e.reuse.rec.spans is not None
               and len(e.reuse.rec.spans) == e.reuse.rec.count for e in entries)


def test_small_body_drops_the_inherited_record() -> None:
    """A session whose body shrinks below the threshold keeps no older parse alive."""
    from gateway.decide.history import HistoryCache

    rules = make_rules({"enable_eviction": True})
    cache = HistoryCache(1 << 26, 10)
    for msgs in ([{"role": "user", "content": "x" * 20_000}, {"role": "user", "content": "a"}],
                 [{"role": "user", "content": "short"}]):
        raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
        payload, src = cache.loads(raw, OPENAI_CHAT, "t")
        d = decide(raw, payload, rules, TOK, OPENAI_CHAT, history=cache, key=("t", "s"))
        cache.remember(("t", "s"), raw, d.payload, d.messages, src)
        (entry,) = cache._entries.values()
        assert (entry.reuse is not None) == (len(raw) >= 16 << 10)
        assert cache.bytes == entry.size


async def test_overlapping_requests_of_a_session_still_leave_a_record(
    gateway: Any, upstream: Any
) -> None:
    """Under load a newer request of the session is in flight whenever one finishes: the
    finished request's record must still serve the session's next body (it used to be
    dropped because the entry was no longer its own, so no body was ever spliced)."""
    from tests.proxy.test_proxy import post_raw

    gw = await gateway(memory={"enable_eviction": True, "shadow": False,
                               "budget": {"max_tokens": 3000, "max_chars": None}})
    msgs = [{"role": "user", "content": f"turn {t}: read /data/f{t}.csv " + "订单 " * 1500}
            for t in range(3)]

    def body(tag: str) -> bytes:
        return json.dumps({"model": "gpt-4o-mini",
                           "messages": [*msgs, {"role": "user", "content": tag}]}).encode()

    async def until(n: int) -> None:
        for _ in range(500):
            if len(upstream.received) >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"upstream got {len(upstream.received)} requests, not {n}")

    upstream.holds = {b"first": asyncio.Event(), b"second": asyncio.Event()}
    hdrs = {"X-Session-Id": "overlap"}
    first = asyncio.create_task(post_raw(gw, body("first"), headers=hdrs))
    second = None
    try:
        await until(1)  # parsed and forwarded, answer held
        second = asyncio.create_task(post_raw(gw, body("second"), headers=hdrs))
        await until(2)  # the session's entry is the second request's now
        upstream.holds[b"first"].set()
        assert (await first)[0] == 200
        await gw.wait_mem(1)
        before = gw.state.history.spliced
        status, _, _ = await post_raw(gw, body("third"), headers=hdrs)  # second still held
        assert status == 200
        assert gw.state.history.spliced == before + 1
        want = decide(body("third"), orjson.loads(body("third")),
                      make_rules({"enable_eviction": True, "shadow": False,
                                  "budget": {"max_tokens": 3000, "max_chars": None}}),
                      TOK, OPENAI_CHAT).forward
        assert upstream.received[-1]["raw"] == want
    finally:
        for released in upstream.holds.values():
            released.set()
    assert second is not None and (await second)[0] == 200
    await gw.wait_mem(3)
    cache = gw.state.history
    assert cache.bytes == sum(e.size for e in cache._entries.values())
