"""Sample capture: before/after pairs with the [mem] record, rotation, no secrets."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import orjson

from tests.conftest import SECRET, GatewayFactory, Upstream, sample


async def test_capture_pairs_rotation_and_around_change(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path
) -> None:
    """sample_rate 1 writes before/after with [mem]; max_files bounds the directory; a config
    change captures the next around_change requests even at sample_rate 0; no credentials."""
    cap = tmp_path / "cap"
    gw = await gateway(memory={"enable_eviction": True},
                       capture={"enabled": True, "dir": str(cap), "sample_rate": 1.0,
                                "max_files": 3, "around_change": 2})
    body = sample("chat_long_tools")
    async with aiohttp.ClientSession() as s:
        for _ in range(5):
            async with s.post(f"{gw.url}/v1/chat/completions", data=orjson.dumps(body),
                              headers={"Authorization": f"Bearer {SECRET}"}) as r:
                assert r.status == 200
        await gw.state.capture.drain()
        files = sorted(cap.glob("*.json"))
        assert len(files) == 3 and gw.state.capture.written == 5
        rec = json.loads(files[-1].read_text())
        assert rec["before"] == body
        assert len(rec["after"]["messages"]) == int(rec["mem"]["kept"]) < len(body["messages"])
        assert rec["mem"]["dropped"] > 0 and rec["api"] == "openai_chat"
        assert all(SECRET not in f.read_text() for f in files)

        text = gw.config.read_text().replace("sample_rate: 1.0", "sample_rate: 0.0")
        gw.config.write_text(text)
        deadline = time.monotonic() + 2
        while gw.state.rules.capture.sample_rate != 0.0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for _ in range(4):
            async with s.post(f"{gw.url}/v1/chat/completions", data=orjson.dumps(body)) as r:
                assert r.status == 200
        await gw.state.capture.drain()
    assert gw.state.capture.written == 5 + 2  # exactly around_change after the change
