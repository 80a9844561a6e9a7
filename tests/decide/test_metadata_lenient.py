"""The kill switch never rejects: malformed `memgate` metadata is cut out and logged with
eviction off or in shadow; with eviction on it is ignored or refused, as configured."""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config.rules import build_rules
from gateway.decide.chat import decide
from gateway.errors import BadRequest
from gateway.measure.tokens import Tokenizers
from tests.conftest import ROOT, SECRET, Gateway, GatewayFactory, Upstream

BAD = b', "memgate": {"score": "high"}'
GOOD = b', "memgate": {"pin": true}'
REASON = "messages[1].memgate.score: must be a number between 0 and 1"
# the client's spelling: spaces, an escape, a big integer (kept byte for byte)
MSGS = [
    b'{"role": "system", "content": "be brief"}',
    b'{"role": "user", "content": "old question caf\\u00e9"' + BAD + b"}",
    b'{"role": "assistant", "content": "old answer"}',
    b'{"role": "user", "content": "keep this"' + GOOD + b"}",
    b'{"role": "assistant", "content": "ok"}',
    b'{"role": "user", "content": "new question"}',
]
RAW = (b'{"model": "gpt-4o-mini", "seed": 12345678901234567890, "messages": ['
       + b", ".join(MSGS) + b"]}")
STRIPPED = RAW.replace(BAD, b"").replace(GOOD, b"")
TIGHT = {"budget": {"max_tokens": None, "max_chars": None, "max_messages": 4,
                    "max_turns": None},
         "eviction": {"recall_share": 0}}  # the kept history is the plain cut
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')


def mem_line(gw: Gateway) -> dict[str, str]:
    """The last [mem] line's fields, quoted values read back as JSON strings."""
    line = gw.mem_lines()[-1]
    return {k: json.loads(v) if v.startswith('"') else v for k, v in _FIELD.findall(line)}


async def post(gw: Gateway, body: bytes) -> tuple[int, bytes]:
    hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {SECRET}"}
    async with aiohttp.ClientSession() as s, s.post(
            f"{gw.url}/v1/chat/completions", data=body, headers=hdrs) as r:
        return r.status, await r.read()


@pytest.mark.parametrize("shadow", [False, True])
async def test_eviction_off_forwards_with_the_metadata_cut_out(
    gateway: GatewayFactory, upstream: Upstream, shadow: bool
) -> None:
    """Off and shadow: no 400; every memgate block is cut from the client's bytes (the
    rest byte-identical) and [mem] says metadata=invalid with the reason."""
    gw = await gateway(memory={"enable_eviction": False, "shadow": shadow, **TIGHT,
                               "markers": {"on_bad_metadata": "reject"}})
    status, _ = await post(gw, RAW)
    assert status == 200
    assert upstream.received[-1]["raw"] == STRIPPED
    await gw.wait_mem(1)
    ev = mem_line(gw)
    assert ev["metadata"] == "invalid" and ev["metadata_reason"] == REASON
    assert ev["mode"] == ("shadow" if shadow else "off")
    if shadow:  # still planned: the valid pin holds, the bad one does not
        assert ev["would_drop"] == "2" and ev["pinned"] == "1"


async def test_eviction_on_reject_refuses_naming_the_field(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """On + on_bad_metadata: reject -> a 400 in the client's API format, nothing sent."""
    gw = await gateway(memory={"enable_eviction": True, **TIGHT,
                               "markers": {"on_bad_metadata": "reject"}})
    status, body = await post(gw, RAW)
    assert status == 400
    assert orjson.loads(body)["error"]["message"] == REASON
    assert upstream.received == []


async def test_eviction_on_ignore_treats_the_message_as_unpinned(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """On + ignore (the default): the message with bad metadata is not pinned (dropped
    here), the valid pin still holds, no memgate block is forwarded."""
    gw = await gateway(memory={"enable_eviction": True, **TIGHT})
    status, _ = await post(gw, RAW)
    assert status == 200
    sent = upstream.received[-1]["raw"]
    assert b"memgate" not in sent
    assert [m["content"] for m in orjson.loads(sent)["messages"]] == [
        "be brief", "keep this", "ok", "new question"]
    assert MSGS[3].replace(GOOD, b"") in sent  # kept items keep the client's bytes
    await gw.wait_mem(1)
    ev = mem_line(gw)
    assert ev["metadata"] == "invalid" and ev["metadata_reason"] == REASON
    assert ev["dropped"] == "2" and ev["pinned"] == "1"


async def test_reason_is_bounded_and_valid_requests_say_nothing(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """A client-chosen key in the reason is cut short; a body with valid metadata has
    no metadata field."""
    gw = await gateway()
    long_key = b"k" * 5000
    status, _ = await post(gw, RAW.replace(b'"score": "high"', b'"' + long_key + b'": 1'))
    assert status == 200
    await gw.wait_mem(1)
    reason = mem_line(gw)["metadata_reason"]
    assert reason.startswith("messages[1].memgate: unknown key 'kkk") and len(reason) <= 200
    await post(gw, RAW.replace(BAD, b""))
    await gw.wait_mem(2)
    assert "metadata" not in mem_line(gw)


def _rules(mode: str) -> Any:
    memory = {"enable_eviction": mode == "on", "shadow": mode == "shadow",
              "budget": {"max_tokens": None, "max_chars": None, "max_messages": 3,
                         "max_turns": None},
              "markers": {"on_bad_metadata": "reject"}}
    return build_rules({"memory": memory, "tokens": {"models_file": "rules/models.yaml"}},
                       base_dir=ROOT)


RULES = {m: _rules(m) for m in ("off", "shadow", "on")}
TOK = Tokenizers(10_000)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["pin", "score", "ttl", "x"]), inner, max_size=3),
    max_leaves=6,
)


@given(metas=st.lists(st.none() | JSON, min_size=1, max_size=6),
       mode=st.sampled_from(["off", "shadow"]))
def test_kill_switch_never_rejects_any_metadata(metas: list[Any], mode: str) -> None:
    """Off or shadow (even with on_bad_metadata: reject): whatever the memgate blocks
    hold, the request is forwarded -- every block cut out, every other item as sent."""
    msgs: list[dict[str, Any]] = []
    for i, meta in enumerate(metas):
        m: dict[str, Any] = {"role": "user" if i % 2 == 0 else "assistant",
                             "content": f"m{i}"}
        if meta is not None:
            m["memgate"] = meta
        msgs.append(m)
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
    d = decide(raw, orjson.loads(raw), RULES[mode], TOK)
    sent = orjson.loads(d.forward)["messages"]
    assert sent == [{k: v for k, v in m.items() if k != "memgate"} for m in msgs]
    if any("memgate" in m for m in msgs):
        assert d.forward != raw
    # eviction on with reject refuses exactly those, with the reason the log gave
    try:
        decide(raw, orjson.loads(raw), RULES["on"], TOK)
        refused = None
    except BadRequest as exc:
        refused = str(exc)
    assert refused == d.bad_metadata


async def test_anthropic_shadow_forwards_with_the_metadata_cut_out(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """The Anthropic Messages route in shadow: same, the reason names its messages list."""
    gw = await gateway()
    raw = (b'{"model": "claude-3-5-haiku-20241022", "max_tokens": 64, "system": "be brief",'
           b' "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}],'
           b' "memgate": {"ttl": -1}}]}')
    hdrs = {"Content-Type": "application/json", "x-api-key": SECRET,
            "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as s, s.post(
            f"{gw.url}/v1/messages", data=raw, headers=hdrs) as r:
        assert r.status == 200
    assert upstream.received[-1]["raw"] == raw.replace(b', "memgate": {"ttl": -1}', b"")
    await gw.wait_mem(1)
    ev = mem_line(gw)
    assert ev["metadata"] == "invalid"
    assert ev["metadata_reason"] == (
        "messages[0].memgate.ttl: must be a non-negative integer (turns)")
