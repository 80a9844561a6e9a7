"""`overhead_ms` is the gateway's time: it starts once the request body has arrived."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator

import aiohttp
import orjson

from tests.conftest import SECRET, GatewayFactory, Upstream, sample

CHUNKS = 6
GAP_S = 0.15  # 0.75 s of upload in all


async def slow_upload(body: bytes) -> AsyncIterator[bytes]:
    """The body in CHUNKS pieces with a pause before each but the first (chunked upload)."""
    step = -(-len(body) // CHUNKS)
    for i in range(0, len(body), step):
        if i:
            await asyncio.sleep(GAP_S)
        yield body[i:i + step]


async def test_slow_upload_is_not_gateway_overhead(gateway: GatewayFactory,
                                                   upstream: Upstream) -> None:
    """A client trickling its body over 0.75 s (chunked, pauses between chunks) gets the
    upstream's answer, the upstream gets the client's bytes, and the [mem] line's
    overhead_ms stays far below the upload time: the upload is the client's time."""
    gw = await gateway(memory={"enable_eviction": True})
    body = orjson.dumps(sample("chat_long_tools"))
    # what `memgate serve` does once started (gc.collect, then freeze): the young
    # generations are emptied. Late in the suite they held ~400k objects of earlier
    # tests (hypothesis' choice trees), and one collection of them during this request
    # took 0.6-0.9 s, counted as the gateway's overhead
    gc.collect()
    async with aiohttp.ClientSession() as s, s.post(
            f"{gw.url}/v1/chat/completions", data=slow_upload(body),
            headers={"Authorization": f"Bearer {SECRET}",
                     "Content-Type": "application/json"}) as r:
        assert r.status == 200
        await r.read()
    sent = orjson.loads(body)["messages"]
    assert upstream.last_body()["messages"][-1] == sent[-1]  # the whole body arrived
    (mem,) = await gw.wait_mem(1)
    assert mem["status"] == "200" and mem["mode"] == "on"
    upload_ms = (CHUNKS - 1) * GAP_S * 1000
    # the gateway's own work on this body is a few ms; the bound is a third of the upload
    assert float(mem["overhead_ms"]) < upload_ms / 3, mem
