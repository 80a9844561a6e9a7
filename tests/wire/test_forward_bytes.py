"""Kept messages are forwarded byte for byte: the rewritten body is cut from the client's."""

from __future__ import annotations

import http.server
import io
import json
import threading
import time
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.measure.conversation import META_KEY
from gateway.proxy import chat_route
from gateway.wire import WIRES
from gateway.wire.anthropic_messages import EPHEMERAL, UNMARKABLE
from tests.conftest import CHAT_REPLY, GatewayFactory, Upstream
from tests.proxy.test_proxy import post_raw

BIG = 123456789012345678901234567893  # past 64 bits: orjson reads it as a float
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages",
         "responses": "/v1/responses"}
EVICTING = {"enable_eviction": True, "budget": {"max_messages": 6},
            "eviction": {"recall_share": 0}}  # kept in the client's order: no fill


def history(api: str, turns: int = 8) -> dict[str, Any]:
    """A body of `api` with `turns` turns; every message holds a 30-digit integer and
    non-ASCII text (written escaped by json.dumps)."""
    items: list[dict[str, Any]] = []
    for t in range(turns):
        ask = f"turn {t}: caf\u00e9 cr\u00e8me, order {BIG + t}?"
        if api == "messages":
            items.append({"role": "user", "content": [{"type": "text", "text": ask}]})
            items.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": f"toolu_{t}", "name": "lookup",
                 "input": {"order_id": BIG + t, "note": "d\u00e9j\u00e0"}}]})
            items.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{t}", "content": "pr\u00eat"}]})
            items.append({"role": "assistant", "content": [{"type": "text", "text": "ok \u00e9"}]})
        elif api == "responses":
            items.append({"type": "message", "role": "user", "content": ask, "seq": BIG + t})
            items.append({"type": "function_call", "call_id": f"c{t}", "name": "lookup",
                          "arguments": json.dumps({"order_id": BIG + t})})
            items.append({"type": "function_call_output", "call_id": f"c{t}",
                          "output": "pr\u00eat", "seq": BIG})
            items.append({"type": "message", "role": "assistant", "content": "ok \u00e9"})
        else:
            items.append({"role": "user", "content": ask, "seq": BIG + t})
            items.append({"role": "assistant", "content": "ok \u00e9", "seq": -BIG - t})
    items.append({"role": "user", "content": f"and now? \u00e9 {BIG}", "seq": BIG})
    key = "input" if api == "responses" else "messages"
    return {"model": "claude-3-5-haiku-20241022" if api == "messages" else "gpt-4o-mini",
            "max_tokens": 100, key: items, "metadata": {"trace": BIG}}


@pytest.mark.parametrize("api", sorted(PATHS))
async def test_big_ints_and_escapes_reach_upstream_unchanged(
    gateway: GatewayFactory, upstream: Upstream, api: str
) -> None:
    """Eviction on, 30-digit integers and \\u00e9 escapes in kept messages: the upstream
    receives each kept message's exact bytes and the top-level fields untouched."""
    gw = await gateway(memory=EVICTING)
    body = history(api)
    key = "input" if api == "responses" else "messages"
    raw = json.dumps(body).encode()  # ", " / ": " separators, ASCII with \u escapes
    status, _, _ = await post_raw(gw, raw, PATHS[api])
    assert status == 200
    fwd = upstream.received[-1]["raw"]
    ev = (await gw.wait_mem(1))[-1]
    assert ev["evict"] != "none" and int(ev["dropped"]) > 0, ev
    sent = json.loads(fwd)[key]  # the stdlib keeps big integers exact
    assert 0 < len(sent) < len(body[key]) and sent[-1] == body[key][-1]
    pos = 0
    for item in sent:
        own = json.dumps(item).encode()
        assert own in raw and own in fwd  # the client's bytes of that item, verbatim
        pos = body[key].index(item, pos) + 1  # in the client's order
    assert b'"metadata": {"trace": %d}' % BIG in fwd
    assert fwd.startswith(raw[: raw.index(b"[")])  # what precedes the list is untouched


def nested(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


def deepened(api: str, depth: int, where: str) -> tuple[bytes, bytes]:
    """A history body with a value nested `depth` deep in the last message (`item`: a
    field of its own, `content`: inside a content part) or in the first user message's
    content (`first`); (the body, that message's bytes)."""
    body = history(api)
    key = "input" if api == "responses" else "messages"
    at = 0 if where == "first" else -1
    msg = body[key][at]
    if where != "item":
        text = msg["content"] if isinstance(msg["content"], str) else msg["content"][0]["text"]
        part = "input_text" if api == "responses" else "text"
        msg["content"] = [{"type": part, "text": text, "deep": "HERE"}]
    else:
        msg["deep"] = "HERE"
    raw = json.dumps(body).encode()
    own = json.dumps(msg).encode()
    deep = own.replace(b'"HERE"', nested(depth))
    return raw.replace(own, deep), deep


@pytest.mark.parametrize(("depth", "mode"), [(300, "on"), (1000, "on"), (300, "shadow")])
@pytest.mark.parametrize("where", ["item", "content", "first"])
@pytest.mark.parametrize("api", sorted(PATHS))
async def test_deep_nesting_in_a_rewritten_body_is_no_500(
    gateway: GatewayFactory, upstream: Upstream, api: str, where: str, depth: int, mode: str
) -> None:
    """A message nested deeper than orjson writes (255..1024 levels) in a body that
    eviction rewrites (or, in shadow, would): its bytes forwarded as sent (evicted
    around, or the whole body relayed with evict=skipped), with a [mem] line, never a
    bare 500."""
    gw = await gateway(memory=EVICTING if mode == "on" else {"budget": {"max_messages": 6}})
    raw, deep = deepened(api, depth, where)
    status, answer, _ = await post_raw(gw, raw, PATHS[api])
    assert status == 200, answer
    fwd = upstream.received[-1]["raw"]
    ev = (await gw.wait_mem(1))[-1]
    if ev["evict"] == "skipped" or mode == "shadow":
        assert fwd == raw and ev.get("reason", "nested_too_deep") == "nested_too_deep"
    else:
        assert int(ev["dropped"]) > 0 and len(fwd) < len(raw)
        assert deep in fwd or where == "first"


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_message_whose_role_is_an_object_is_no_500(
    gateway: GatewayFactory, upstream: Upstream, api: str
) -> None:
    """A message whose role is an object is relayed as sent (the planner cannot read it:
    evict=skipped), not a 500."""
    gw = await gateway(memory=EVICTING)
    body = history(api)
    body["input" if api == "responses" else "messages"][4]["role"] = {"name": "user"}
    raw = json.dumps(body).encode()
    status, _, _ = await post_raw(gw, raw, PATHS[api])
    assert status == 200
    assert upstream.received[-1]["raw"] == raw
    ev = (await gw.wait_mem(1))[-1]
    assert ev["evict"] == "skipped"
    assert ev["reason"] == {"chat": "missing_role", "responses": "unknown_role"}[api]


# --- any body, any plan: spelled JSON whose bytes the generator knows --------------------

WS = st.sampled_from(["", "", " ", "\n  ", "\t", "\r\n", " \n\t "])
_SHORT = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "/": "\\/"}
CHARS = st.sampled_from(list("ab /\"\\\n\t\x01é你") + ["\U0001f600", "\u2028"])
KEYS = st.sampled_from(["role", "content", "type", "text", META_KEY, "cache_control", "x",
                        "\u00e9"])
ITEM_KEYS = st.sampled_from(["role", "content", "type", "text", "cache_control", "x"])
NUMBERS = st.one_of(st.integers(-(10**40), 10**40).map(str),
                    st.sampled_from(["0", "-0", "1.50", "1E2", "2.5e-3", "-1.0E+2"]))


@st.composite
def spelled_str(draw: st.DrawFn, text: str | None = None) -> str:
    """A JSON string of `text` (drawn when None), each character written raw, as a \\u
    escape (a surrogate pair past the BMP) or as a short escape, at random."""
    text = draw(st.lists(CHARS, max_size=6).map("".join)) if text is None else text
    out = ['"']
    hows = draw(st.lists(st.integers(0, 2), min_size=len(text), max_size=len(text)))
    for ch, how in zip(text, hows):
        if ord(ch) < 0x20 or how == 1 or (ch in '"\\' and how == 0):
            if ord(ch) > 0xFFFF:
                hi, lo = divmod(ord(ch) - 0x10000, 0x400)
                out.append(f"\\u{0xD800 + hi:04x}\\u{0xDC00 + lo:04X}")
            else:
                out.append(_SHORT.get(ch, f"\\u{ord(ch):04x}") if how != 1 else
                           f"\\u{ord(ch):04x}")
        elif how == 2 and ch in _SHORT:
            out.append(_SHORT[ch])
        else:
            out.append(ch)
    return "".join(out) + '"'


def spelled_obj(draw: st.DrawFn, members: list[tuple[str, str]]) -> str:
    """`{...}` from (spelled key, spelled value) pairs, odd whitespace everywhere."""
    if not members:
        return "{" + draw(WS) + "}"
    parts = [draw(WS) + k + draw(WS) + ":" + draw(WS) + v + draw(WS) for k, v in members]
    return "{" + ",".join(parts) + "}"


def spelled_arr(draw: st.DrawFn, values: list[str]) -> str:
    if not values:
        return "[" + draw(WS) + "]"
    return "[" + ",".join(draw(WS) + v + draw(WS) for v in values) + "]"


@st.composite
def spelled_value(draw: st.DrawFn, depth: int = 2) -> str:
    kind = draw(st.sampled_from(["num", "str", "lit"] + (["obj", "arr"] * 2 if depth else [])))
    if kind == "num":
        return draw(NUMBERS)
    if kind == "str":
        return draw(spelled_str())
    if kind == "lit":
        return draw(st.sampled_from(["true", "false", "null"]))
    n = draw(st.integers(0, 3))
    if kind == "arr":
        return spelled_arr(draw, [draw(spelled_value(depth - 1)) for _ in range(n)])
    return spelled_obj(draw, [(draw(KEYS.flatmap(spelled_str)), draw(spelled_value(depth - 1)))
                              for _ in range(n)])


@st.composite
def spelled_item(draw: st.DrawFn) -> str:
    """Mostly an object (sometimes with one gateway metadata member, duplicate keys, an
    Anthropic content of text or blocks), now and then another value."""
    if draw(st.integers(0, 9)) == 0:
        return str(draw(spelled_value(1)))
    members = [(draw(ITEM_KEYS.flatmap(spelled_str)), draw(spelled_value(2)))
               for _ in range(draw(st.integers(0, 3)))]  # duplicates; nested ones hold memgate
    content = draw(st.sampled_from(["none", "str", "blocks"]))
    if content == "str":
        members.append((draw(spelled_str("content")), draw(spelled_str())))
    elif content == "blocks":
        blocks = []
        for _ in range(draw(st.integers(0, 3))):
            kind = draw(st.sampled_from(["text", "thinking", "image"]))
            fields = [(draw(spelled_str("type")), draw(spelled_str(kind)))]
            fields += [(draw(KEYS.flatmap(spelled_str)), draw(spelled_value(1)))
                       for _ in range(draw(st.integers(0, 2)))]
            blocks.append(spelled_obj(draw, draw(st.permutations(fields))))
        members.append((draw(spelled_str("content")), spelled_arr(draw, blocks)))
    if draw(st.booleans()):
        members.append((draw(spelled_str(META_KEY)), draw(spelled_value(1))))
    return spelled_obj(draw, draw(st.permutations(members)))


@st.composite
def body_and_plan(draw: st.DrawFn) -> tuple[str, bytes, bytes, list[bytes], bytes, Any]:
    """(api, body, the bytes before its items, each item's bytes, the bytes after them,
    a plan: kept, marker_at, note, note_before)."""
    api = draw(st.sampled_from(sorted(WIRES)))
    key = WIRES[api].items_key
    items = [draw(spelled_item()).encode() for _ in range(draw(st.integers(0, 6)))]
    others = [(draw(KEYS.flatmap(spelled_str)), draw(spelled_value(2)))
              for _ in range(draw(st.integers(0, 3)))]
    at = draw(st.integers(0, len(others)))
    if draw(st.booleans()):  # a list under the items key that the later one overrides
        others.insert(0, (draw(spelled_str(key)), spelled_arr(draw, [draw(spelled_item())])))
        at += 1
    head = ("{" + "".join(draw(WS) + k + draw(WS) + ":" + draw(WS) + v + draw(WS) + ","
                          for k, v in others[:at])
            + draw(WS) + draw(spelled_str(key)) + draw(WS) + ":" + draw(WS) + "[").encode()
    seps = [draw(WS).encode() for _ in range(len(items) + 1)]
    listed = b"".join(seps[i] + it + (b"," if i < len(items) - 1 else b"")
                      for i, it in enumerate(items)) + seps[-1]
    tail = ("]" + draw(WS) + "".join("," + draw(WS) + k + draw(WS) + ":" + draw(WS) + v
                                     + draw(WS) for k, v in others[at:]) + "}").encode()
    kept = sorted(draw(st.sets(st.sampled_from(range(len(items))))) if items else set())
    note = draw(st.sampled_from([None, "carried: caf\u00e9 \"x\""]))
    note_before = draw(st.sampled_from(kept)) if kept and note else None
    marker_at = draw(st.sampled_from([None, *kept])) if api == "messages" else None
    return api, head + listed + tail, head, items, tail, (kept, marker_at, note, note_before)


def old_way(wire: Any, payload: dict[str, Any], kept: list[int], marker_at: int | None,
            note: str | None, note_before: int | None) -> dict[str, Any]:
    """What the forwarded payload was when build_body re-serialised (the oracle)."""
    items = payload[wire.items_key]
    out = []
    for i in kept:
        if note is not None and i == note_before:
            out.append(wire.note_item(note))
        m = items[i]
        if isinstance(m, dict) and META_KEY in m:
            m = {k: v for k, v in m.items() if k != META_KEY}
        if i == marker_at and isinstance(m, dict):
            c = m.get("content")
            if isinstance(c, str):
                m = {**m, "content": [{"type": "text", "text": c, "cache_control": EPHEMERAL}]}
            elif isinstance(c, list):
                for j in range(len(c) - 1, -1, -1):
                    if isinstance(c[j], dict) and c[j].get("type") not in UNMARKABLE:
                        c = [*c[:j], {**c[j], "cache_control": EPHEMERAL}, *c[j + 1:]]
                        m = {**m, "content": c}
                        break
        out.append(m)
    return {**payload, wire.items_key: out}


def pairs(b: bytes) -> Any:
    """A parse that keeps key order, duplicate keys and how numbers are spelled."""
    return json.loads(b, object_pairs_hook=list, parse_int=lambda s: ("n", s),
                      parse_float=lambda s: ("n", s))


def split_list(b: bytes) -> list[bytes]:
    """The bytes of each element of the list `b`, found by the stdlib's parser."""
    text, dec, out = b.decode(), json.JSONDecoder(), []
    i = 1
    while True:
        while text[i] in " \t\n\r,":
            i += 1
        if text[i] == "]":
            return out
        _, end = dec.raw_decode(text, i)
        out.append(text[i:end].encode())
        i = end


@pytest.mark.slow
@given(case=body_and_plan())
def test_kept_items_are_forwarded_byte_for_byte(case: Any) -> None:
    """For any body and any plan, each kept item is forwarded with the client's bytes
    (an item with gateway metadata: only that member cut), everything outside the list
    untouched, the note where the plan puts it, and the result is what the old
    re-serialisation meant (compared where orjson reads the body)."""
    api, raw, head, items, tail, (kept, marker_at, note, note_before) = case
    wire = WIRES[api]
    payload = orjson.loads(raw)
    fwd = wire.build_body(raw, payload, kept, marker_at, note, note_before)
    assert fwd is not None
    assert fwd.startswith(head) and fwd.endswith(tail)
    got = split_list(fwd[len(head) - 1 : len(fwd) - len(tail) + 1])
    if note_before is not None:
        at = kept.index(note_before)
        assert orjson.loads(got.pop(at)) == wire.note_item(note)
    assert len(got) == len(kept)
    for i, sent in zip(kept, got):
        own = items[i]
        if i == marker_at:
            continue  # only this item is rewritten: checked through the oracle below
        value = orjson.loads(own)
        if isinstance(value, dict) and META_KEY in value:
            # one contiguous cut, and what it took is the metadata member alone: the rest
            # parses the same, in the same order, with the same number spellings
            p = next((k for k, (a, b) in enumerate(zip(own, sent)) if a != b), len(sent))
            assert own[:p] + own[p + len(own) - len(sent):] == sent
            assert pairs(sent) == [kv for kv in pairs(own) if kv[0] != META_KEY]
        else:
            assert sent == own
    assert orjson.loads(fwd) == old_way(wire, payload, kept, marker_at, note, note_before)


# --- the edges, by example ----------------------------------------------------------------

async def test_metadata_is_cut_and_nothing_else(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Eviction off: both spellings of a repeated memgate key are cut out of their message,
    and every other byte of the body reaches the upstream as sent."""
    gw = await gateway()
    raw = (b'{"model": "gpt-4o-mini",\n "messages": [ {"role": "system", "content": "Be brief"},'
           b'\n  {"role": "user", "memgate": {"pin": true}, "content": "caf\\u00e9 %d",'
           b' "memg\\u0061te": {"pin": true, "ttl": 3}} ]}' % BIG)
    status, _, _ = await post_raw(gw, raw)
    assert status == 200
    assert upstream.received[-1]["raw"] == (
        b'{"model": "gpt-4o-mini",\n "messages": [ {"role": "system", "content": "Be brief"},'
        b'\n  {"role": "user", "content": "caf\\u00e9 %d"} ]}' % BIG)


def test_cache_marker_is_put_into_the_block_bytes() -> None:
    """The moved cache breakpoint: a block gets the key inserted (one the client marked
    keeps its own), a string content becomes one text block around the client's string
    bytes; the other bytes of that message are the client's."""
    wire = WIRES["messages"]
    items = [
        b'{"role": "user", "content": "caf\\u00e9"}',
        (b'{"role": "assistant", "content": [ {"type": "text", "text": "a"} ,'
         b' {"type": "thinking", "thinking": "t", "signature": "s"} ]}'),
        (b'{"role": "user", "content": [{"type": "text", "text": "b", "cache_control":'
         b' {"type": "ephemeral", "ttl": "1h"}}]}'),
        b'{"role": "user", "content": [{}]}',
        b'{"content": "now", "role": "user"}',
    ]
    raw = b'{"messages": [' + b", ".join(items) + b"]}"
    payload = orjson.loads(raw)
    marked = {
        0: b'{"role": "user", "content": [{"type":"text","text":"caf\\u00e9",'
           b'"cache_control":{"type":"ephemeral"}}]}',
        1: b'{"role": "assistant", "content": [ {"type": "text", "text": "a",'
           b'"cache_control":{"type":"ephemeral"}} , {"type": "thinking", "thinking": "t",'
           b' "signature": "s"} ]}',
        2: items[2],
        3: b'{"role": "user", "content": [{"cache_control":{"type":"ephemeral"}}]}',
    }
    for at, want in marked.items():
        fwd = wire.build_body(raw, payload, [at, 4], marker_at=at)
        assert fwd == b'{"messages": [' + want + b", " + items[4] + b"]}"
    fwd = wire.build_body(raw, payload, [1, 4], marker_at=1, marker_ttl="1h")
    assert fwd == (b'{"messages": [' + marked[1].replace(
        b'{"type":"ephemeral"}', b'{"type":"ephemeral","ttl":"1h"}') + b", " + items[4] + b"]}")


def test_responses_string_input_gets_the_note_around_its_bytes() -> None:
    """A Responses `input` string is one user message: with a note the list is made
    around the client's string bytes; the other fields stay as sent."""
    wire = WIRES["responses"]
    raw = b'{"input" : "caf\\u00e9?", "n": %d}' % BIG
    fwd = wire.build_body(raw, orjson.loads(raw), [0], note="from before", note_before=0)
    assert fwd == (b'{"input" : [' + orjson.dumps(wire.note_item("from before"))
                   + b',{"role":"user","content":"caf\\u00e9?"}], "n": %d}' % BIG)


def test_a_body_that_cannot_be_cut_goes_unchanged() -> None:
    """When the bytes do not read as the parse says (they always do for valid JSON), the
    request is forwarded unchanged and logged skipped, nothing dropped or carried."""
    from gateway.config.rules import build_rules
    from gateway.decide.chat import decide
    from gateway.measure.tokens import Tokenizers

    rules = build_rules({"memory": {"enable_eviction": True, "budget": {"max_messages": 2}}})
    payload = history("chat", turns=3)
    raw = json.dumps({"messages": payload["messages"][:-1]}).encode()  # one item short
    d = decide(raw, orjson.loads(json.dumps(payload)), rules, Tokenizers(100))
    assert d.forward is raw and d.skip_reason == "unscannable"
    assert d.plan is None and d.note is None


# --- when and how the bytes leave ---------------------------------------------------------

class _Arrivals(http.server.BaseHTTPRequestHandler):
    """An upstream on a thread of its own (the gateway's loop cannot delay it) that
    answers after 0.1 s, as a model takes its time: notes when each whole body arrived
    and when the answer went."""

    arrived: list[tuple[float, bytes]] = []
    answered: list[float] = []

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        self.arrived.append((time.perf_counter(), raw))
        time.sleep(0.1)
        self.answered.append(time.perf_counter())
        reply = orjson.dumps(CHAT_REPLY)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        pass


async def test_the_body_leaves_before_the_measuring(
    gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The [mem] measuring that runs while the upstream answers starts once the cut body
    is with the transport: a measuring that holds the loop for 0.4 s does not hold the
    request (aiohttp writes a body in a task of its own, which a task started before it
    would precede), and it does run before the answer comes."""
    real = chat_route.measure
    started: list[float] = []

    async def slow(*args: Any, **kwargs: Any) -> Any:
        started.append(time.perf_counter())
        time.sleep(0.4)  # CPU on the loop, as a big history's counting is
        return await real(*args, **kwargs)

    monkeypatch.setattr(chat_route, "measure", slow)
    _Arrivals.arrived, _Arrivals.answered = [], []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Arrivals)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        gw = await gateway(EVICTING, upstream_url=f"http://127.0.0.1:{server.server_port}")
        raw = json.dumps(history("chat")).encode()
        async with aiohttp.ClientSession() as s:
            t0 = time.perf_counter()
            async with s.post(f"{gw.url}/v1/chat/completions", data=raw,
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200
                await r.read()
        (mem,) = await gw.wait_mem(1)
    finally:
        server.shutdown()
        server.server_close()
    assert int(mem["dropped"]) > 0  # a cut body: the measuring ran beside the relay
    ((at, sent),) = _Arrivals.arrived
    assert sent != raw
    assert at - t0 < 0.3, f"the body arrived {at - t0:.3f} s after the request"
    assert started and started[0] < _Arrivals.answered[0]  # beside the upstream's work


@pytest.mark.parametrize("memory", [{"enable_eviction": False}, EVICTING])
async def test_a_body_over_a_megabyte_goes_whole(
    gateway: GatewayFactory, upstream: Upstream, memory: dict[str, Any]
) -> None:
    """A body past 1 MB (written after its headers, not joined to them) reaches the
    upstream whole: unchanged with eviction off, the kept items' bytes with it on."""
    gw = await gateway(memory)
    payload = history("chat", turns=4)
    payload["messages"][0]["content"] = "caf\u00e9 " * 300_000  # 1.8 MB, the first turn
    raw = json.dumps(payload).encode()
    async with aiohttp.ClientSession() as s, s.post(  # from a file: aiohttp warns on bytes
            f"{gw.url}/v1/chat/completions", data=io.BytesIO(raw),
            headers={"Content-Type": "application/json"}) as r:
        assert r.status == 200
    got = upstream.received[-1]["raw"]
    if memory["enable_eviction"]:
        assert len(got) < len(raw)
        assert orjson.loads(got)["messages"][-1] == orjson.loads(raw)["messages"][-1]
    else:
        assert got == raw
