"""GET /metrics: Prometheus text with bounded labels, counting what the [mem] lines say."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson

from .conftest import SECRET, GatewayFactory, Upstream, sample


def value(text: str, name: str) -> float:
    """The value of one exact metric line `name value` (name includes its labels)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    raise AssertionError(f"{name} not in metrics")


async def test_metrics_count_requests_drops_and_reloads(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Requests by route/mode/status, dropped messages, pins, reloads; no session ids."""
    gw = await gateway(memory={"enable_eviction": True})
    body = orjson.dumps(sample("chat_long_tools"))
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(f"{gw.url}/v1/chat/completions", data=body,
                              headers={"Authorization": f"Bearer {SECRET}",
                                       "X-Session-Id": "secret-session-name"}) as r:
                assert r.status == 200
        gw.config.write_text(gw.config.read_text().replace("max_turns: 20", "max_turns: bad"))
        deadline = time.monotonic() + 2
        while gw.state.reloader.failed == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        async with s.get(f"{gw.url}/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
    ev = gw.mem_events()[-1]
    assert value(text, 'memgate_requests_total{mode="on",route="openai_chat",status="200"}') == 2
    assert value(text, 'memgate_dropped_messages_sum{route="openai_chat"}') == 2 * int(ev["dropped"])
    assert value(text, "memgate_pinned_kept_total") == 2 * int(ev["pinned"])
    assert value(text, 'memgate_history_tokens_before_sum{route="openai_chat"}') == 2 * int(
        ev["est_tokens"])
    assert value(text, 'memgate_config_reloads_total{result="failed"}') == 1
    # the second request was the same session's history again: parsed only where it grew
    assert value(text, "memgate_history_cache_hits_total") == 1
    assert value(text, "memgate_history_cache_misses_total") == 1
    assert value(text, "memgate_history_cache_entries") == 1
    assert 0 < value(text, "memgate_history_cache_bytes") <= 256 << 20
    assert "secret-session-name" not in text and SECRET not in text
