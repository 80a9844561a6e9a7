"""limits.cache_mb bounds the per-process content caches together (issue #39): their
shares never sum past it, a start and a reload apply them, and requests are answered
the same under a small bound."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import aiohttp
import orjson
from hypothesis import given
from hypothesis import strategies as st

from gateway.config.schema import Rules
from gateway.policy import compact, fill
from gateway.policy.carry import calls, snapshot
from gateway.proxy.cache_bounds import CacheBounds, cache_bounds
from tests.conftest import SECRET, Gateway, GatewayFactory, Upstream


@given(cache_mb=st.integers(16, 1 << 16), history_mb=st.integers(0, 1 << 16))
def test_shares_never_sum_past_the_setting(cache_mb: int, history_mb: int) -> None:
    b = cache_bounds(replace(Rules(), cache_mb=cache_mb, history_cache_mb=history_mb))
    assert b.total() <= cache_mb << 20
    assert b.history <= history_mb << 20
    assert min(b.tokens, b.extract, b.words, b.facts, b.compacted) >= 1 << 20


def held_bounds(gw: Gateway) -> CacheBounds:
    """The bounds the caches of this process hold now."""
    counters = set(gw.state.tokenizers._by_name.values())
    return CacheBounds(history=gw.state.history.max_bytes,
                       tokens=sum(c.cache_bytes for c in counters),
                       extract=snapshot.EXTRACTED.max_bytes, words=fill.COUNTED.max_bytes,
                       facts=calls.FACTS.max_bytes, compacted=2 * compact._MEMO_LIMIT)


async def chat(gw: Gateway, k: int) -> int:
    body = orjson.dumps({"model": "gpt-4o-mini", "messages": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": f"question {k} " * 50}]})
    async with aiohttp.ClientSession() as s, s.post(
            gw.url + "/v1/chat/completions", data=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {SECRET}",
                     "X-Session-Id": f"s{k}"}) as r:
        await r.read()
        return r.status


async def test_start_and_reload_apply_the_setting(gateway: GatewayFactory,
                                                  upstream: Upstream) -> None:
    gw = await gateway(memory={"enable_eviction": True}, limits={"cache_mb": 16})
    assert held_bounds(gw) == cache_bounds(gw.state.rules)
    assert held_bounds(gw).total() <= 16 << 20
    assert [await chat(gw, k) for k in range(5)] == [200] * 5
    assert gw.state.tokenizers.get("cl100k_base").stats.bytes <= 2 << 20
    gw.config.write_text(gw.config.read_text().replace("cache_mb: 16", "cache_mb: 64"))
    deadline = time.monotonic() + 2.0
    while gw.state.rules.cache_mb != 64 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert held_bounds(gw) == cache_bounds(gw.state.rules)
    assert held_bounds(gw).total() == 64 << 20
    assert await chat(gw, 9) == 200
    assert len(upstream.received) == 6


async def test_a_setting_below_the_floor_is_refused(gateway: GatewayFactory) -> None:
    from gateway.errors import RulesError

    try:
        await gateway(limits={"cache_mb": 8})
    except RulesError as e:
        assert "limits.cache_mb" in str(e)
    else:
        raise AssertionError("cache_mb: 8 was accepted")
