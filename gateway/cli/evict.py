"""`memgate evict PAYLOAD`: explain what the gateway would drop from a request body or a
capture file (a table of messages, kept or dropped and by which stage), or with --json
print the exact body it would forward. Recall runs as the server runs it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from gateway.cli.eventloop import run_async
from gateway.cli.exit_codes import EXIT_FAILED, EXIT_USAGE
from gateway.config.resources import default_config
from gateway.config.rules import load_rules
from gateway.config.schema import Rules
from gateway.errors import CommandError, GatewayError
from gateway.observe.capture import SIDES


def add_subcommand(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`memgate evict` and its flags."""
    e = sub.add_parser("evict", help="explain what the gateway would drop from a payload")
    e.add_argument("payload", help="request body or capture file (JSON, or - for stdin)")
    e.add_argument("--config", default=None, help="the policy to explain (default as for serve)")
    e.add_argument("--json", action="store_true", help="print the exact body it would forward")
    e.add_argument("--api", choices=["chat", "messages", "responses"], default=None,
                   help="the payload's API (default: a capture's api, else the file name "
                        "prefix, else its shape)")
    e.add_argument("--side", choices=SIDES, default="before",
                   help="a capture file: explain what the client sent (before, the default) "
                        "or what the gateway forwarded (after)")
    e.set_defaults(func=cmd_evict)


def cmd_evict(args: argparse.Namespace) -> int:
    from gateway.decide.chat import decide
    from gateway.measure.conversation import is_active
    from gateway.measure.tokens import Tokenizers
    from gateway.observe.capture import describe_side, is_capture, unwrap, wire_named
    from gateway.wire import WIRES, sniff

    env = dict(os.environ)
    rules = load_rules(default_config(args.config, env), env)
    raw = sys.stdin.buffer.read() if args.payload == "-" else Path(args.payload).read_bytes()
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise CommandError(f"{args.payload}: not JSON: {exc}", EXIT_USAGE) from None
    tokenizers = Tokenizers(rules.token_cache_size)
    captured = None
    if is_capture(payload):
        raw, payload, api = unwrap(raw, payload, args.side)
        captured = wire_named(api)
        print(describe_side(args.payload, args.side, api),
              file=sys.stderr if args.json else sys.stdout)
    wire = (WIRES[args.api] if args.api else captured
            or sniff(payload, Path(args.payload).name))
    try:
        d = decide(raw, payload, rules, tokenizers, wire)
    except GatewayError as exc:
        raise CommandError(f"the gateway would answer {exc.status}: {exc.message}",
                           EXIT_FAILED) from None
    if rules.store.recall_enabled and d.mode == "on" and d.plan is not None:
        d = run_async(lambda: _recall_offline(d, rules, env, payload, tokenizers, wire))
    if args.json:
        sys.stdout.buffer.write(d.forward + b"\n")
        return 0
    if d.skip_reason is not None or d.plan is None or d.conv is None:  # a plan has a conv
        why = d.skip_reason or "mode=off (nothing planned)"
        print(f"not planned: {why}; the gateway forwards the body unchanged")
        return 0
    p = d.plan
    dropped = dict(p.dropped)
    kept_by = dict(zip(p.kept, p.kept_by, strict=True))
    pinned = {
        i
        for g in d.conv.groups
        for i, pin in g.pins
        if is_active(pin, g.turn, d.conv.n_turns, rules.memory.markers.min_score)
    }
    print(f"api: {wire.name}")
    print(f"{'idx':>4}  {'role':<22} {'tokens':>7} {'chars':>7}  pin  {'':7} stage")
    for i, m in enumerate(d.messages):
        status = "dropped" if i in dropped else "kept"
        stage = dropped.get(i) or kept_by.get(i, "")
        role = str(m.get("role") or m.get("type"))
        print(
            f"{i:>4}  {role:<22} {d.message_tokens(i):>7} {d.conv.chars[i]:>7}"
            f"  {'yes' if i in pinned else '   '}  {status:<7} {stage}"
        )
    total = d.est_tokens()
    kept_tokens = d.kept_tokens()
    print(
        f"\nmessages {len(d.messages)} -> {len(p.kept)} (dropped {len(p.dropped)}), "
        f"est_tokens {total} -> {kept_tokens}, budget_tokens {d.budget_tokens}, "
        f"pinned {p.pinned}, evict={p.evict}"
        + (", over_budget=true" if p.over_budget else "")
        + (f", pinned_overflow={p.pinned_overflow}" if p.pinned_overflow else "")
        + (f", recalled={len(p.recalled)}" if p.recalled else "")
    )
    if d.note is not None and d.snapshot is not None:
        print(f"carry-over note ({d.snapshot.count} fields) inserted before the current turn:")
        print("  " + d.note.replace("\n", "\n  "))
    if d.mode != "on":
        print(f"mode={d.mode}: the gateway forwards the original body; "
              "MEMGATE_ENABLE_EVICTION=1 shows the evicted one")
    return 0


async def _recall_offline(d: Any, rules: Rules, env: Mapping[str, str], payload: Any,
                          tokenizers: Any, wire: Any) -> Any:
    """The same recall the server does (store + the turns being dropped)."""
    from gateway.decide.chat import decide
    from gateway.memory.recall import recall
    from gateway.memory.session import tenant_of
    from gateway.memory.session_sources import first_named
    from gateway.memory.store import make_store

    tenant = tenant_of({"Authorization": f"Bearer {env.get('OPENAI_API_KEY', '')}"},
                       rules.tenants)
    body = payload if isinstance(payload, dict) else {}
    session = first_named(rules.session_id_from, {}, body, wire.items(body), tenant,
                          rules.memory.context_prefixes)[0]
    if tenant is None:  # no key: only the turns being dropped, as the server would
        recalled = await recall(None, rules.store, "", session, d)
    else:
        store = make_store(rules.store, env)
        await store.open()
        try:
            recalled = await recall(store, rules.store, tenant, session, d)
        finally:
            await store.close()
    return decide(d.raw, payload, rules, tokenizers, wire, recalled=recalled) if recalled else d
