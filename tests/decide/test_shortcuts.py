"""MEMGATE_SHORTCUTS_OFF: each request-path shortcut only ever saves work. A growing
session sent through real HTTP gets the same [mem] decisions and the upstream the same
bytes with a shortcut switched off as with every shortcut on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.config.env_overrides import SHORTCUTS, apply_env
from gateway.config.rules import build_rules
from gateway.errors import RulesError
from tests.conftest import GatewayFactory, Upstream

ROOT = Path(__file__).resolve().parents[2]
# what differs between runs without being a decision: timings, ids
TIMING = {"overhead_ms", "upstream_ms", "req", "ts"}
WORDS = ("the deploy of /srv/api/config.yaml failed; please check service billing-api "
         "and write the report to out/report.md before we merge ").split()


def turn(k: int, size: int) -> list[dict[str, Any]]:
    """One turn: a user message naming a file, a tool call and a long result, an answer."""
    text = " ".join(WORDS[(k + i) % len(WORDS)] for i in range(size))
    return [
        {"role": "user", "content": f"step {k}: look at /src/mod{k}/main.py — {text}"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{k}", "type": "function",
             "function": {"name": "read_file", "arguments": f'{{"path": "/src/mod{k}.py"}}'}}]},
        {"role": "tool", "tool_call_id": f"call_{k}", "content": text * 2},
        {"role": "assistant", "content": f"done with step {k}; that file is fine"},
    ]


def bodies() -> list[bytes]:
    """A session that starts cold and big (over the counting thread's 64 K characters,
    over the splice parser's 16 KB), then grows by a turn per request, compact as the
    SDKs write it; once spelled with a \\u00XX escape (the deferred path's marker)."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are careful."}]
    for k in range(60):
        msgs += turn(k, 60)
    out = []
    for k in range(60, 66):
        ask = {"role": "user", "content": f"what about step {k}? open it and fix it"}
        out.append(orjson.dumps({"model": "gpt-4o-mini", "messages": [*msgs, ask]}))
        msgs += turn(k, 60)
    out.append(out[-1].replace(b"fix it", b"fix \\u0069t"))  # same text, escaped
    return out


async def run(gateway: GatewayFactory, upstream: Upstream, mode: dict[str, Any],
              off: str) -> tuple[list[dict[str, str]], list[bytes], tuple[int, int]]:
    """The [mem] decisions, the forwarded bodies of the session with `off` off and the
    history cache's (hits, spliced)."""
    carry = {"enabled": True, "rules_file": str(ROOT / "rules" / "carry.yaml")}
    gw = await gateway({**mode, "carry": carry}, env={"MEMGATE_SHORTCUTS_OFF": off})
    assert gw.state.rules.shortcuts_off == (frozenset(SHORTCUTS) if off == "all"
                                            else frozenset(filter(None, [off])))
    first = len(upstream.received)
    sent = bodies()
    async with aiohttp.ClientSession() as s:
        for raw in sent:
            async with s.post(f"{gw.url}/v1/chat/completions", data=raw, headers={
                    "Authorization": "Bearer sk-test-key", "X-Session-Id": "grow",
                    "Content-Type": "application/json"}) as r:
                assert r.status == 200, await r.text()
                await r.read()
    events = await gw.wait_mem(len(sent))
    cache = gw.state.history
    await gw.server.close()
    assert "sk-test-key" not in gw.log.getvalue()
    decisions = [{k: v for k, v in e.items() if k not in TIMING} for e in events]
    return decisions, [rec["raw"] for rec in upstream.received[first:]], (cache.hits,
                                                                          cache.spliced)


EVICTING = {"enable_eviction": True, "shadow": False,
            "budget": {"max_tokens": 9000, "max_chars": None, "max_messages": None,
                       "max_turns": None}}
SHADOW = {"enable_eviction": False, "shadow": True,
          "budget": {"max_tokens": 9000, "max_chars": None, "max_messages": None,
                     "max_turns": None}}


@pytest.mark.parametrize("off", [*SHORTCUTS, "all"])
async def test_switched_off_decides_the_same(gateway: GatewayFactory, upstream: Upstream,
                                             off: str) -> None:
    for mode in (EVICTING, SHADOW):
        on_dec, on_fwd, (hits, spliced) = await run(gateway, upstream, mode, "")
        off_dec, off_fwd, (off_hits, off_spliced) = await run(gateway, upstream, mode, off)
        assert off_dec == on_dec
        assert off_fwd == on_fwd
        assert hits and spliced  # with everything on the shortcuts are taken
        if off in ("history", "all"):
            assert off_hits == off_spliced == 0
        if off == "splice":
            assert off_hits and not off_spliced
        if mode is EVICTING:  # the session was cut and carried: the switches had work
            assert any(int(e["dropped"]) for e in on_dec) and any("note" in e for e in on_dec)
            assert on_fwd[0] != bodies()[0]
        else:  # shadow: the client's bytes, every one
            assert on_fwd == bodies()
            assert any(int(e.get("would_drop", 0)) for e in on_dec)


def test_unknown_shortcut_is_a_bad_config() -> None:
    rules = build_rules({"tokens": {"models_file": "models.yaml"}}, base_dir=ROOT / "rules")
    with pytest.raises(RulesError, match="unknown shortcut"):
        apply_env(rules, {"MEMGATE_SHORTCUTS_OFF": "history,histroy"})
    assert apply_env(rules, {"MEMGATE_SHORTCUTS_OFF": " splice , thread"}).shortcuts_off == {
        "splice", "thread"}
    assert apply_env(rules, {}).shortcuts_off == frozenset()
