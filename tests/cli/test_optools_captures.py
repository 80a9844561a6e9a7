"""The operator tools read what the gateway writes: capture files in stats, evict, replay.

The captures are real: a gateway with `capture.enabled` in front of a recording
upstream writes them; the tools run as `python -m gateway ...` subprocesses.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.cli import stats
from gateway.cli.mock_upstream import create_mock_app
from gateway.config.rules import load_rules
from gateway.decide.chat import decide
from gateway.measure.tokens import Tokenizers
from gateway.wire import WIRES
from tests.conftest import SECRET, GatewayFactory, Upstream, sample

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "rules" / "gateway.yaml")


async def cli(*args: str, env: dict[str, str] | None = None, timeout_s: float = 120
              ) -> tuple[int, str, str]:
    """`python -m gateway ARGS` without blocking the loop the test servers run on."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    env.pop("OPENAI_API_KEY", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", *args, cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    stderr = err.decode()
    assert "Traceback" not in stderr, stderr
    return proc.returncode or 0, out.decode(), stderr


async def captured(gateway: GatewayFactory, tmp_path: Path, bodies: dict[str, tuple[str, Any]]
                   ) -> tuple[dict[str, Path], str]:
    """Run each (route, body) through a gateway with capture and eviction on: name -> its
    capture file, and the gateway's config file."""
    cap = tmp_path / "captures"
    gw = await gateway(memory={"enable_eviction": True},
                       capture={"enabled": True, "dir": str(cap), "sample_rate": 1.0,
                                "max_files": 50})
    out = {}
    async with aiohttp.ClientSession() as s:
        for name, (route, body) in bodies.items():
            before = set(cap.glob("*.json")) if cap.exists() else set()
            async with s.post(f"{gw.url}{route}", data=orjson.dumps(body),
                              headers={"Authorization": f"Bearer {SECRET}",
                                       "x-api-key": SECRET}) as r:
                assert r.status == 200, await r.text()
            await gw.state.capture.drain()
            (new,) = set(cap.glob("*.json")) - before
            out[name] = new
    return out, str(gw.config)


def planned(body: dict[str, Any], api: str, config: str) -> Any:
    """What the gateway decides for `body` with eviction on (the tools must agree)."""
    rules = load_rules(Path(config), {"MEMGATE_ENABLE_EVICTION": "1"})
    raw = orjson.dumps(body)
    return decide(raw, orjson.loads(raw), rules, Tokenizers(1000), WIRES[api])


async def test_stats_and_evict_read_captures(gateway: GatewayFactory, upstream: Upstream,
                                             tmp_path: Path) -> None:
    """`memgate stats captures/` measures every capture on `before` (the client's body, the
    same numbers as for the body itself), `--side after` the forwarded one; `memgate evict
    capture.json` explains the client's body, says so, and --json forwards what the
    gateway forwarded."""
    bodies = {"chat": ("/v1/chat/completions", sample("chat_long_tools")),
              "messages": ("/v1/messages", sample("anthropic_long_tools")),
              "responses": ("/v1/responses", sample("responses_long_tools"))}
    files, config = await captured(gateway, tmp_path, bodies)
    cap = files["chat"].parent

    runs = await asyncio.gather(
        cli("stats", str(cap), "--json", "--config", config),
        cli("stats", str(cap), "--side", "after"),
        cli("evict", str(files["chat"]), "--config", config),
        cli("evict", str(files["chat"]), "--json", "--config", config,
            env={"MEMGATE_ENABLE_EVICTION": "1"}))
    assert [code for code, _, _ in runs] == [0] * 4, runs
    (_, out, _), (_, after_out, _), (_, chat_out, _), (_, js, js_err) = runs

    s = json.loads(out)
    assert s["requests"] == 3 and s["skipped"] == 0, s
    assert s["sources"] == {"payloads": 3, "mem_lines": 0, "other_log_lines": 0,
                            "captures": 3, "capture_side": "before"}
    want = {name: planned(body, name, config) for name, (_, body) in bodies.items()}
    assert s["tokens"]["total"] == sum(d.est_tokens() for d in want.values())
    assert s["policy"]["messages_dropped"] == sum(len(d.plan.dropped) for d in want.values())

    assert "3 captures, side `after`: what the gateway forwarded" in after_out, after_out
    after = stats.summary(stats.measure([str(cap)], load_rules(Path(config), {}),
                                        simulate=False, side="after"))
    assert after["messages"]["total"] == sum(len(d.plan.kept) for d in want.values())
    assert after["tokens"]["total"] < s["tokens"]["total"]

    chat = want["chat"]
    assert f"{files['chat']}: a capture (openai_chat); using `before` (what the client sent)" \
        in chat_out
    rows = [ln for ln in chat_out.splitlines() if ln[:4].strip().isdigit()]
    assert len(rows) == len(chat.messages) and sum("dropped" in r for r in rows) == len(
        chat.plan.dropped) > 0

    assert "using `before`" in js_err
    forwarded = json.loads(files["chat"].read_text())["after"]
    assert orjson.loads(js) == forwarded  # the gateway forwarded exactly this


async def test_replay_ab_replays_a_capture(gateway: GatewayFactory, upstream: Upstream,
                                           aiohttp_server: Any, tmp_path: Path) -> None:
    """`memgate replay ab captures/X.json` replays the client's conversation (`before`) and
    says so; a capture of another API is refused in one line, exit 2, no traceback."""
    files, _ = await captured(gateway, tmp_path, {
        "chat": ("/v1/chat/completions", sample("chat_long_tools")),
        "responses": ("/v1/responses", sample("responses_long_tools"))})
    mock = await aiohttp_server(create_mock_app())
    url = str(mock.make_url("")).rstrip("/")
    out_dir = tmp_path / "report"
    code, out, err = await cli("replay", "ab", str(files["chat"]), "--probes",
                               "samples/probes_long_tools.yaml", "--upstream", url,
                               "--config", CONFIG, "--out", str(out_dir))
    assert "using `before` (what the client sent)" in err
    assert "PASS early-constraint" in out and code in (0, 1), out + err
    html = (out_dir / "report.html").read_text()
    assert "a capture: `before`" in html and "B for early-constraint" in html

    (c1, _, e1), (c2, _, e2) = await asyncio.gather(
        cli("replay", "ab", str(files["responses"]), "--probes",
            "samples/probes_long_tools.yaml", "--upstream", url),
        cli("replay", "ab", str(ROOT / "samples" / "responses_long_tools.json"),
            "--probes", "samples/probes_long_tools.yaml", "--upstream", url))
    assert c1 == 2 and "a capture of openai_responses" in e1, e1
    assert c2 == 2 and "not a chat completions body" in e2, e2
