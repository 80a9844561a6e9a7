"""`memgate demo`: the whole job offline, on the embedded default.

Starts a deterministic mock upstream and the gateway on free loopback ports,
replays every sample payload through it in shadow mode, flips
`enable_eviction: true` by editing the (temporary) config file - the hot
reload picks it up, no restart - replays again, and prints a before/after table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from aiohttp import web

from gateway.cli.eventloop import run_async
from gateway.cli.mock_upstream import RECORD, create_mock_app
from gateway.config.resources import default_config, shipped_dir
from gateway.config.rules import load_rules
from gateway.decide.chat import decide
from gateway.errors import CommandError
from gateway.observe import logging as mglog
from gateway.proxy.app import create_app
from gateway.proxy.appstate import STATE
from gateway.wire import path_of, sniff


def _samples_dir(explicit: str | None) -> Path:
    if explicit:
        if not Path(explicit).is_dir():
            raise CommandError(f"--samples {explicit}: not a directory", 2)
        return Path(explicit)
    found = Path("samples") if Path("samples").is_dir() else shipped_dir("samples")
    if found is None:
        raise CommandError("no samples/ directory here and none shipped with this install "
                           "(use --samples DIR)", 2)
    return found


def _write_config(src: Path | None, dst: Path, enable: bool) -> None:
    # first: a file the gateway would refuse is its one-line error, exit 2
    resolved = load_rules(src, {}) if src is not None else None
    data: dict[str, Any] = yaml.safe_load(src.read_text(encoding="utf-8")) if src else {}
    data = data or {}
    memory = data.setdefault("memory", {})
    memory["enable_eviction"] = enable
    memory["shadow"] = True
    if resolved is not None:  # the copy lives elsewhere: the files the original resolved to
        data["tokens"] = {**(data.get("tokens") or {}), "models_file": resolved.models_path}
        carry = memory.get("carry")
        if isinstance(carry, dict) and resolved.carry_path is not None:
            carry["rules_file"] = resolved.carry_path
    tmp = dst.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")
    os.replace(tmp, dst)  # atomic rename, as config management tools do


async def _start(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, int(runner.addresses[0][1])


async def _replay(gw: str, samples: list[Path], phase: str) -> None:
    async with aiohttp.ClientSession() as http:
        for path in samples:
            body = path.read_bytes()
            api_path = path_of(sniff(None, path.name))
            async with http.post(
                f"{gw}{api_path}",
                data=body,
                headers={"Content-Type": "application/json", "X-Session-Id": path.stem,
                         "Authorization": "Bearer sk-demo-not-a-real-key"},
            ) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise SystemExit(f"demo: {path.name} ({phase}) -> HTTP {resp.status}: {text}")


async def _demo(args: argparse.Namespace) -> int:
    samples = sorted(_samples_dir(args.samples).glob("*.json"))
    if not samples:
        raise CommandError("the samples directory has no *.json payloads", 2)
    mem: list[dict[str, Any]] = []
    mglog.configure("console", "info", stream=sys.stdout, sink=mem)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MEMGATE_ENABLE_EVICTION", "MEMGATE_SHADOW", "MEMGATE_UPSTREAM",
                        "MEMGATE_ANTHROPIC_UPSTREAM")}
    with tempfile.TemporaryDirectory(prefix="memgate-demo-") as tmp:
        cfg = Path(tmp) / "gateway.yaml"
        src = default_config(args.config, env)
        _write_config(src, cfg, enable=False)
        mock = create_mock_app()
        mock_runner, mock_port = await _start(mock)
        env["MEMGATE_UPSTREAM"] = f"http://127.0.0.1:{mock_port}"
        env["MEMGATE_ANTHROPIC_UPSTREAM"] = f"http://127.0.0.1:{mock_port}"
        gw_app = create_app(load_rules(cfg, env), cfg, env, watch_interval_s=0.2)
        gw_runner, gw_port = await _start(gw_app)
        gw = f"http://127.0.0.1:{gw_port}"
        try:
            print(f"\n== mock upstream :{mock_port}, gateway :{gw_port}; "
                  f"config {cfg} (a temporary copy of {src}), "
                  f"model map {gw_app[STATE].rules.models_path}")
            print("\n== phase A: enable_eviction: false (shadow: measure and log what would go)")
            await _replay(gw, samples, "shadow")
            print("\n== flipping enable_eviction: true in the config file (hot reload, no restart)")
            _write_config(src, cfg, enable=True)
            state = gw_app[STATE]
            for _ in range(50):
                if state.rules.memory.mode == "on":
                    break
                await asyncio.sleep(0.1)
            else:
                raise SystemExit("demo: the config change was not picked up within 5 s")
            print("\n== phase B: enable_eviction: true")
            await _replay(gw, samples, "on")
            _print_table(samples, mem, mock[RECORD], state)
        finally:
            await gw_runner.cleanup()
            await mock_runner.cleanup()
    return 0


def _print_table(samples: list[Path], mem: list[dict[str, Any]], records: list[dict[str, Any]],
                 state: Any) -> None:
    n = len(samples)
    by_session_a = {e["session"]: e for e in mem[:n]}
    by_session_b = {e["session"]: e for e in mem[n:]}
    got_b = {r["session"]: r for r in records[n:]}
    print("\n== before / after (what the upstream received)")
    head = (f"{'sample':<21} {'msgs':>5} {'tokens':>7} {'chars':>7} | {'shadow would_drop':>17} |"
            f" {'fwd msgs':>8} {'fwd tokens':>10} {'fwd chars':>9} {'pinned':>6} {'evict':>12}")
    print(head)
    print("-" * len(head))
    off = replace(state.rules, memory=replace(state.rules.memory, enable_eviction=False,
                                              shadow=False))
    for path in samples:
        a, b = by_session_a[path.stem], by_session_b[path.stem]
        body = got_b[path.stem]["body"]
        fwd = decide(orjson.dumps(body), body, off, state.tokenizers, sniff(body, path.name))
        fwd_tokens, fwd_chars = fwd.est_tokens(), fwd.hist_chars()
        print(
            f"{path.stem:<21} {a['hist_msgs']:>5} {a['est_tokens']:>7} {a['hist_chars']:>7} |"
            f" {a.get('would_drop', 0):>17} | {len(fwd.messages):>8} {fwd_tokens:>10}"
            f" {fwd_chars:>9} {b['pinned']:>6} {b['evict']:>12}"
        )
    print("\nThe same history, measured once with eviction off (A) and once on (B); "
          "budget: " + orjson.dumps(
              {k: getattr(state.rules.memory.budget, k)
               for k in ("max_tokens", "max_chars", "max_messages", "max_turns")}).decode())


def run(args: argparse.Namespace) -> int:
    return run_async(lambda: _demo(args))
