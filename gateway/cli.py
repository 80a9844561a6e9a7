"""`memgate` command line: serve | demo | check-config | evict."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import orjson
import yaml

from . import logging as mglog
from .errors import GatewayError, RulesError
from .rules import Rules, describe, load_rules

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def default_config(explicit: str | None, env: Mapping[str, str]) -> Path | None:
    """--config > MEMGATE_CONFIG > ./rules/gateway.yaml > the install's rules/gateway.yaml."""
    if explicit:
        return Path(explicit)
    if env.get("MEMGATE_CONFIG"):
        return Path(env["MEMGATE_CONFIG"])
    for candidate in (Path("rules/gateway.yaml"), PROJECT_ROOT / "rules" / "gateway.yaml"):
        if candidate.is_file():
            return candidate
    return None


def _load_or_exit(config: Path | None, env: Mapping[str, str]) -> Rules:
    try:
        return load_rules(config, env)
    except RulesError as exc:
        print(f"memgate: invalid config: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def run_async(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run on uvloop when it is installed, else asyncio's default loop."""
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main())
    except ImportError:
        return asyncio.run(main())


# --------------------------------------------------------------------------- serve


async def listen(runner: Any, host: str, port: int, reuse_port: bool = False) -> Any:
    """Start one listening site of `runner` (every listener of a worker shares its port
    with the other workers: reuse_port)."""
    from aiohttp import web

    site = web.TCPSite(runner, host, port, backlog=1024, reuse_port=reuse_port or None)
    await site.start()
    return site


async def serve_forever(app: Any, host: str, port: int, log: Any, drain_s: float = 30.0,
                        worker: int | None = None) -> int:
    from .httpserver import GatewayRunner

    runner = GatewayRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=drain_s)
    await runner.setup()
    await listen(runner, host, port, reuse_port=worker is not None)
    # request-sized object trees are short-lived: keep start-up objects out of every GC pass
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if worker is not None:
        from .workers import watch_parent

        orphaned = watch_parent(stop)
    log.info("listening", host=host, port=port, pid=os.getpid())
    await stop.wait()
    if worker is not None:
        orphaned.cancel()
    log.info("shutting_down", drain_s=drain_s)
    await runner.cleanup()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .app import create_app

    env = dict(os.environ)
    if args.upstream:
        env["MEMGATE_UPSTREAM"] = args.upstream
    if args.anthropic_upstream:
        env["MEMGATE_ANTHROPIC_UPSTREAM"] = args.anthropic_upstream
    config = default_config(args.config, env)
    rules = _load_or_exit(config, env)
    if args.worker is not None:
        mglog.set_process_fields(worker=args.worker)
    mglog.configure(rules.log_format, rules.log_level)
    log = mglog.get_logger()
    log.info("config_loaded", file=rules.source, mode=rules.memory.mode,
             upstreams=",".join(f"{u.name}={u.base_url}" for u in rules.upstreams))
    host = args.host or rules.listen_host
    port = args.port if args.port is not None else rules.listen_port
    workers = _workers_or_exit(args.workers or env.get("MEMGATE_WORKERS") or "1")
    if workers > 1 and args.worker is None:
        code = _supervise(args, config, env, host, port, workers, log)
        if code is not None:
            return code
    app = create_app(rules, config, env)
    gc.set_threshold(50_000, 20, 20)
    return run_async(lambda: serve_forever(app, host, port, log, args.drain_s, args.worker))


def _workers_or_exit(text: str) -> int:
    from .workers import parse_workers

    try:
        return parse_workers(text)
    except ValueError as exc:
        print(f"memgate serve: --workers / MEMGATE_WORKERS: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _supervise(args: argparse.Namespace, config: Path | None, env: Mapping[str, str],
               host: str, port: int, workers: int, log: Any) -> int | None:
    """Run `workers` copies of this command as workers (None: the OS cannot share a port,
    serve in this process)."""
    from . import workers as mp

    try:
        reserved = mp.reserve_port(host, port)
    except OSError as exc:
        print(f"memgate serve: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 2
    if reserved is None:
        log.warning("workers_unsupported", wanted=workers, serving=1,
                    reason="no SO_REUSEPORT on this OS: one process serves")
        return None
    command = [sys.executable, "-m", "gateway", "serve", "--host", host,
               "--drain-s", str(args.drain_s)]
    for flag, value in (("--config", config and config.resolve()), ("--upstream", args.upstream),
                        ("--anthropic-upstream", args.anthropic_upstream)):
        if value:
            command += [flag, str(value)]

    def loads() -> bool:  # a worker is restarted with the config only while it loads
        try:
            load_rules(config, env)
            return True
        except Exception:  # noqa: BLE001 - an unreadable file too, as the reloader sees it
            return False

    return mp.supervise(reserved, lambda i: [*command, "--worker", str(i)], workers, log,
                        args.drain_s, loads)


# --------------------------------------------------------------------------- check-config


def cmd_check_config(args: argparse.Namespace) -> int:
    try:
        rules = load_rules(Path(args.file), os.environ)
    except RulesError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(yaml.safe_dump(describe(rules), sort_keys=False, allow_unicode=True), end="")
    print(f"# {args.file}: ok (mode={rules.memory.mode})", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- evict


def cmd_evict(args: argparse.Namespace) -> int:
    from .chat import decide
    from .conversation import is_active
    from .tokens import Tokenizers
    from .wire import WIRES, sniff

    env = dict(os.environ)
    rules = _load_or_exit(default_config(args.config, env), env)
    raw = sys.stdin.buffer.read() if args.payload == "-" else Path(args.payload).read_bytes()
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        print(f"memgate evict: {args.payload}: not JSON: {exc}", file=sys.stderr)
        return 2
    tokenizers = Tokenizers(rules.token_cache_size)
    wire = WIRES[args.api] if args.api else sniff(payload, Path(args.payload).name)
    try:
        d = decide(raw, payload, rules, tokenizers, wire)
    except GatewayError as exc:
        print(f"memgate evict: the gateway would answer {exc.status}: {exc.message}",
              file=sys.stderr)
        return 1
    if rules.store.recall_enabled and d.mode == "on" and d.plan is not None:
        d = run_async(lambda: _recall_offline(d, rules, env, payload, tokenizers, wire))
    if args.json:
        sys.stdout.buffer.write(d.forward + b"\n")
        return 0
    if d.skip_reason is not None or d.plan is None:
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
    } if d.conv else set()
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
    from .chat import decide
    from .recall import recall
    from .session import session_id, tenant_of
    from .store import make_store

    tenant = tenant_of({"Authorization": f"Bearer {env.get('OPENAI_API_KEY', '')}"},
                       rules.tenants)
    session = session_id({}, rules.session_header, payload, tenant, "", "")
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


# --------------------------------------------------------------------------- stats


def cmd_stats(args: argparse.Namespace) -> int:
    from . import stats

    env = dict(os.environ)
    rules = _load_or_exit(default_config(args.config, env), env)
    report = stats.measure(args.paths, rules, simulate=args.config is not None,
                           progress=sys.stderr if sys.stderr.isatty() else None)
    summary = stats.summary(report)
    if args.json:
        summary["skipped_detail"] = report.skipped[:100]
        sys.stdout.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(stats.render_table(summary))
        for why in report.skipped[:10]:
            print(f"skipped: {why}", file=sys.stderr)
    if args.plot:
        error = stats.plot(report, args.plot, report.budget_tokens)
        if error:
            print(f"memgate stats: {error}", file=sys.stderr)
            return 2
    return 0 if report.samples else 1


# --------------------------------------------------------------------------- replay


def cmd_replay_ab(args: argparse.Namespace) -> int:
    from . import replay

    env = dict(os.environ)
    rules = _load_or_exit(default_config(args.config, env), env)
    try:
        return replay.main(args, rules)
    except (OSError, ValueError, RuntimeError, aiohttp_errors()) as exc:
        print(f"memgate replay ab: {exc}", file=sys.stderr)
        return 2


def cmd_replay_expect(args: argparse.Namespace) -> int:
    from .carry import expect

    env = dict(os.environ)
    rules = _load_or_exit(default_config(args.config, env), env)
    patterns = rules.memory.carry_patterns
    if patterns is None:
        print("memgate replay expect: the config has no memory.carry section", file=sys.stderr)
        return 2
    try:
        session = expect.load_session(Path(args.session))
        expectations = expect.load_expectations(Path(args.expect))
    except (OSError, ValueError) as exc:
        print(f"memgate replay expect: {exc}", file=sys.stderr)
        return 2
    lines = expect.run(session, expectations, patterns, rules.memory.carry)
    print("\n".join(lines))
    failed = any(" FAIL" in ln for ln in lines)
    if args.self_check:
        for name, bad in expect.corruptions(expectations):
            bad_lines = expect.run(session, bad, patterns, rules.memory.carry)
            caught = any(" FAIL" in ln for ln in bad_lines)
            print(f"self-check {name}: {'caught' if caught else 'NOT CAUGHT'}")
            failed = failed or not caught
    return 1 if failed or not lines else 0


def aiohttp_errors() -> type[Exception]:
    import aiohttp

    return aiohttp.ClientError


# --------------------------------------------------------------------------- memory


def cmd_memory(args: argparse.Namespace) -> int:
    """memgate memory write|search|get: the store the gateway uses, from the shell."""
    from .session import tenant_of
    from .store import StoreError, build_filter, build_record, make_store

    env = dict(os.environ)
    rules = _load_or_exit(default_config(args.config, env), env)
    key = args.api_key or env.get("OPENAI_API_KEY", "")
    tenant = tenant_of({"Authorization": f"Bearer {key}"}, rules.tenants)
    if tenant is None:
        print("memgate memory: whose records? give --api-key or $OPENAI_API_KEY "
              "(or map keyless callers with tenants.anonymous)", file=sys.stderr)
        return 2

    async def run() -> int:
        store = make_store(rules.store, env)
        await store.open()
        try:
            if args.memory_command == "write":
                body = orjson.loads(sys.stdin.buffer.read() if args.json == "-" else args.json)
                rec = build_record(body, tenant, rules.store)
                await store.write([rec], exists_ok=False)  # an id held already: exit 2
                out: Any = {"memory_id": rec.memory_id, "truncated": rec.truncated}
            elif args.memory_command == "search":
                body = {"filter": orjson.loads(args.filter) if args.filter else {},
                        "query": args.query or "", "top_k": args.top_k or rules.store.search_top_k}
                if args.cross_session:
                    body["scope"] = "cross_session"
                results = await store.search(build_filter(body, tenant, rules.store))
                out = [r.public(score) for r, score in results]
            else:
                rec = await store.get(tenant, args.memory_id)
                if rec is None:
                    print(f"memgate memory get: no memory {args.memory_id!r} for this key",
                          file=sys.stderr)
                    return 1
                out = rec.public()
        finally:
            await store.close()
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
        return 0

    try:
        return run_async(run)
    except (StoreError, orjson.JSONDecodeError) as exc:
        print(f"memgate memory: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------- main


def cmd_hash_key(args: argparse.Namespace) -> int:
    """Read from stdin (a key on the command line would stay in the shell history)."""
    from .session import credential, key_sha256

    text = sys.stdin.readline().strip()
    key = credential({"Authorization": text})
    if key is None:
        print("memgate hash-key: no usable key on stdin (visible ASCII, optionally "
              "'Bearer <key>')", file=sys.stderr)
        return 2
    print(key_sha256(key))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="memgate", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the gateway")
    s.add_argument("--config", help="YAML config (default: MEMGATE_CONFIG or rules/gateway.yaml)")
    s.add_argument("--host", default=None)
    s.add_argument("--port", type=int, default=None)
    s.add_argument("--upstream", help="OpenAI-compatible upstream base URL (= MEMGATE_UPSTREAM)")
    s.add_argument("--drain-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests and streams may finish (30)")
    s.add_argument("--anthropic-upstream",
                   help="Anthropic upstream base URL (= MEMGATE_ANTHROPIC_UPSTREAM)")
    s.add_argument("--workers", default=None,
                   help="processes accepting on the port: a number or 'auto' (the CPUs this "
                        "process may use); default MEMGATE_WORKERS or 1")
    s.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # set by the parent
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser("demo", help="gateway + mock upstream + samples, offline")
    d.add_argument("--samples", default=None, help="directory of sample payloads")
    d.add_argument("--config", default=None, help="config to start from (copied, then flipped)")
    d.set_defaults(func=lambda a: __import__("gateway.demo", fromlist=["run"]).run(a))

    c = sub.add_parser("check-config", help="validate a config and print the effective one")
    c.add_argument("file")
    c.set_defaults(func=cmd_check_config)

    e = sub.add_parser("evict", help="explain what the gateway would drop from a payload")
    e.add_argument("payload", help="chat request body (JSON file, or - for stdin)")
    e.add_argument("--config", default=None)
    e.add_argument("--json", action="store_true", help="print the exact body it would forward")
    e.add_argument("--api", choices=["chat", "messages", "responses"], default=None,
                   help="the payload's API (default: from the file name prefix, else its shape)")
    e.set_defaults(func=cmd_evict)
    st = sub.add_parser("stats", help="measure saved payloads / [mem] logs (and a policy)")
    st.add_argument("paths", nargs="+", help="JSON/JSONL files, log files, directories, or -")
    st.add_argument("--config", default=None, help="also simulate this config's policy")
    st.add_argument("--json", action="store_true")
    st.add_argument("--plot", default=None, help="write a tokens histogram PNG (matplotlib)")
    st.set_defaults(func=cmd_stats)
    mem = sub.add_parser("memory", help="write / search / get memory records")
    mem.add_argument("--config", default=None)
    mem.add_argument("--api-key", default=None, help="whose records (default $OPENAI_API_KEY)")
    msub = mem.add_subparsers(dest="memory_command", required=True)
    mw = msub.add_parser("write", help="write one record (JSON as for POST /v1/memories)")
    mw.add_argument("json", help="the record as JSON, or - for stdin")
    ms = msub.add_parser("search", help="search (as POST /v1/memories/search)")
    ms.add_argument("--filter", default=None, help='JSON, e.g. {"session_id": "s1"}')
    ms.add_argument("--query", default=None)
    ms.add_argument("--top-k", type=int, default=None)
    ms.add_argument("--cross-session", action="store_true")
    mg = msub.add_parser("get", help="one record by memory_id")
    mg.add_argument("memory_id")
    mem.set_defaults(func=cmd_memory)

    hk = sub.add_parser("hash-key", help="sha256 of a client key read from stdin, for "
                                         "tenants.client_keys_sha256")
    hk.set_defaults(func=cmd_hash_key)

    rp = sub.add_parser("replay", help="replay conversations: ab")
    rsub = rp.add_subparsers(dest="replay_command", required=True)
    ab = rsub.add_parser("ab", help="A (no eviction) vs B (a policy) on one long conversation")
    ab.add_argument("conversation", help="chat payload JSON (the long history)")
    ab.add_argument("--probes", required=True, help="YAML list of probe questions")
    ab.add_argument("--upstream", required=True, help="OpenAI-compatible base URL to ask")
    ab.add_argument("--config", default=None, help="the policy for B (default rules)")
    ab.add_argument("--repeat", type=int, default=1, help="runs per probe (stability)")
    ab.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""),
                    help="key for the upstream (default $OPENAI_API_KEY)")
    ab.add_argument("--out", default="replay-report", help="directory for report.md/.html")
    ab.add_argument("--as-configured", action="store_true",
                    help="B forwards as the config stands (kill switch included): checks a rollback")
    ab.set_defaults(func=cmd_replay_ab)
    ex = rsub.add_parser("expect", help="per-turn replay of a session against expectations")
    ex.add_argument("session", help="JSONL: {turn, role, text} per line")
    ex.add_argument("expect", help="YAML: turn -> {must_contain: {key: value}, must_not_contain}")
    ex.add_argument("--config", default=None)
    ex.add_argument("--self-check", action="store_true",
                    help="also corrupt each expectation and require the run to fail")
    ex.set_defaults(func=cmd_replay_expect)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result
