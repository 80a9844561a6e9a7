"""`memgate` command line (the subcommands are listed in build_parser's description).

Exit codes, for every subcommand: 0 ok; 1 the command ran and failed (a port in use,
an upstream that failed, nothing to measure); 2 a usage or config error (a wrong flag,
a missing file, an invalid config, an environment variable the config needs).
A user error is one line on stderr naming what and where, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import os
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
import yaml

from gateway import __version__
from gateway.cli.eventloop import run_async
from gateway.config.effective import effective_config
from gateway.config.resources import default_config
from gateway.config.rules import Rules, load_rules, missing_env
from gateway.errors import CommandError, GatewayError, RulesError
from gateway.observe import logging as mglog
from gateway.observe.capture import SIDES

EXIT_FAILED, EXIT_USAGE = 1, 2  # and 0: ok


def port_number(text: str) -> int:
    """argparse type for --port: 1-65535, or 0 for any free port (logged as bound)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"{port} is not a TCP port (1-65535, or 0 for any free port)")
    return port


def listen_error(host: str, port: int, exc: OSError) -> CommandError:
    """What a failed bind means, in one line (in use, not this machine's, no such host)."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EADDRINUSE:
        reason = "the address is already in use (another memgate or server on that port?)"
    elif isinstance(exc, socket.gaierror):
        reason = f"the host does not resolve ({reason})"
    elif exc.errno == errno.EADDRNOTAVAIL:
        reason = "the address is not one of this machine's"
    elif exc.errno == errno.EACCES:
        reason = "permission denied (ports below 1024 need privileges)"
    return CommandError(f"cannot listen on {host}:{port}: {reason}", EXIT_FAILED)


def bound_port(site: Any, asked: int) -> int:
    """The port a started TCPSite listens on (the one the OS chose when asked for 0)."""
    server = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None) or ()
    return int(sockets[0].getsockname()[1]) if sockets else asked


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
    from gateway.proxy.httpserver import GatewayRunner
    from gateway.proxy.listeners import ADMIN_LISTEN, start_admin_site

    runner = GatewayRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=drain_s)
    await runner.setup()
    try:
        site = await listen(runner, host, port, reuse_port=worker is not None)
    except OSError as exc:
        await runner.cleanup()
        raise listen_error(host, port, exc) from None
    port = bound_port(site, port)
    admin = app.get(ADMIN_LISTEN)  # listen.admin_port: /metrics and /admin/* move there
    try:
        await start_admin_site(runner, site, admin)
    except OSError as exc:
        await runner.cleanup()
        raise listen_error(admin[0], admin[1], exc) from None
    # request-sized object trees are short-lived: keep start-up objects out of every GC pass
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if worker is not None:
        from gateway.proxy.workers import watch_parent

        orphaned = watch_parent(stop, worker)
    log.info("listening", host=host, port=port, pid=os.getpid(),
             **({"admin_host": admin[0], "admin_port": admin[1]} if admin else {}))
    await stop.wait()
    log.info("shutting_down", drain_s=drain_s)
    await runner.cleanup()
    if worker is not None:  # it beat through the drain: a draining worker is not hung
        orphaned.cancel()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """memgate demo (imported here: `serve` does not load the mock upstream and samples)."""
    from gateway.cli import demo

    return demo.run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway.proxy.app import create_app

    env = dict(os.environ)
    if args.upstream:
        env["MEMGATE_UPSTREAM"] = args.upstream
    if args.anthropic_upstream:
        env["MEMGATE_ANTHROPIC_UPSTREAM"] = args.anthropic_upstream
    config = default_config(args.config, env)
    rules = load_rules(config, env)
    problem = missing_env(rules, env)
    if problem is not None:
        raise problem
    if args.worker is not None:
        mglog.set_process_fields(worker=args.worker)
    mglog.configure(rules.log_format, rules.log_level)
    log = mglog.get_logger()
    from gateway.cli.replay import shown_url  # no user:password or query (a secret may sit there)

    log.info("config_loaded", file=rules.source, mode=rules.memory.mode,
             models_file=rules.models_path, carry_file=rules.carry_path,
             upstreams=",".join(f"{u.name}={shown_url(u.base_url)}" for u in rules.upstreams))
    host = args.host or rules.listen_host
    port = args.port if args.port is not None else rules.listen_port
    if port == rules.listen_admin_port:
        raise CommandError(f"--port {port} is listen.admin_port too: give each its own port",
                           EXIT_USAGE)
    workers = _workers_count(args.workers or env.get("MEMGATE_WORKERS") or "1")
    if args.worker is not None:  # its console says whose requests it shows
        from gateway.proxy import console

        console.set_worker(args.worker, workers)
    if workers > 1 and args.worker is None:
        code = _supervise(args, config, env, host, port, workers, log)
        if code is not None:
            return code
    app = create_app(rules, config, env)
    gc.set_threshold(50_000, 20, 20)
    return run_async(lambda: serve_forever(app, host, port, log, args.drain_s, args.worker))


def _workers_count(text: str) -> int:
    from gateway.proxy.workers import parse_workers

    try:
        return parse_workers(text)
    except ValueError as exc:
        raise CommandError(f"--workers / MEMGATE_WORKERS: {exc}", EXIT_USAGE) from None


def _supervise(args: argparse.Namespace, config: Path | None, env: Mapping[str, str],
               host: str, port: int, workers: int, log: Any) -> int | None:
    """Run `workers` copies of this command as workers (None: the OS cannot share a port,
    serve in this process)."""
    from gateway.proxy import workers as mp

    hang_s = _hang_s(env)
    try:
        reserved = mp.reserve_port(host, port)
    except OSError as exc:  # the same one line and exit code as a single process's bind
        raise listen_error(host, port, exc) from None
    if reserved is None:
        log.warning("workers_unsupported", wanted=workers, serving=1,
                    reason="no SO_REUSEPORT on this OS: one process serves")
        return None
    command = [sys.executable, "-m", "gateway", "serve", "--host", host,
               "--drain-s", str(args.drain_s), "--workers", str(workers)]
    # the path as given (made absolute), never its symlinks resolved: a Kubernetes
    # ConfigMap's `..data` link flips to a new folder and deletes the old one
    for flag, value in (("--config", config and config.absolute()), ("--upstream", args.upstream),
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
                        args.drain_s, loads, hang_s)


def _hang_s(env: Mapping[str, str]) -> float:
    """MEMGATE_WORKER_HANG_S: how long a worker's event loop may not turn before the
    parent kills and restarts it (default 30)."""
    text = env.get("MEMGATE_WORKER_HANG_S", "30")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 1 <= value <= 3600:
        raise CommandError(f"MEMGATE_WORKER_HANG_S: a number of seconds from 1 to 3600, "
                           f"not {text!r}", EXIT_USAGE)
    return value


# --------------------------------------------------------------------------- check-config


def cmd_check_config(args: argparse.Namespace) -> int:
    """Prints the effective config as a config file: saved, it loads to the same rules."""
    try:
        rules = load_rules(Path(args.file), os.environ)
        problem = missing_env(rules, os.environ)
        if problem is not None:
            raise problem
    except RulesError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    print(f"# effective config of {args.file} (environment overrides applied)")
    print(yaml.safe_dump(effective_config(rules), sort_keys=False, allow_unicode=True), end="")
    print(f"# {args.file}: ok (mode={rules.memory.mode})", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- evict


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
    from gateway.memory.session import session_id, tenant_of
    from gateway.memory.store import make_store

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
    from gateway.cli import stats

    env = dict(os.environ)
    rules = load_rules(default_config(args.config, env), env)
    report = stats.measure(args.paths, rules, simulate=args.config is not None,
                           progress=sys.stderr if sys.stderr.isatty() else None,
                           side=args.side)
    summary = stats.summary(report)
    if args.json:
        summary["skipped_detail"] = report.skipped[:100]
        sys.stdout.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(stats.render_table(summary))
        for why in report.skipped[:10]:
            print(f"skipped: {why}", file=sys.stderr)
    if args.plot:
        source = " ".join(args.paths) + f"  ({stats.describe_sources(summary['sources'])})"
        error = stats.plot(report, args.plot, report.budget_tokens, source, log=args.log)
        if error:  # nothing measured is the command failing; no matplotlib, a usage error
            raise CommandError(error, EXIT_FAILED if not report.samples else EXIT_USAGE)
    return 0 if report.samples else 1


# --------------------------------------------------------------------------- replay


def cmd_replay_ab(args: argparse.Namespace) -> int:
    from gateway.cli import replay

    env = dict(os.environ)
    rules = load_rules(default_config(args.config, env), env)
    try:
        return replay.main(args, rules)
    except (aiohttp_errors(), TimeoutError) as exc:  # before OSError: some are OSErrors too
        why = str(exc) or "no answer in time"
        raise CommandError(f"upstream {replay.shown_url(args.upstream)}: {why}",
                           EXIT_FAILED) from None
    except RuntimeError as exc:  # the upstream answered an error
        raise CommandError(str(exc), EXIT_FAILED) from None
    except ValueError as exc:  # the conversation, the probes or a flag
        raise CommandError(str(exc), EXIT_USAGE) from None


def cmd_replay_expect(args: argparse.Namespace) -> int:
    from gateway.cli import expect

    env = dict(os.environ)
    rules = load_rules(default_config(args.config, env), env)
    patterns = rules.memory.carry_patterns
    if patterns is None:
        raise CommandError(f"{rules.source or 'the config'} has no memory.carry section",
                           EXIT_USAGE)
    try:  # a missing or unreadable file: main names it (exit 2)
        session = expect.load_session(Path(args.session))
        expectations = expect.load_expectations(Path(args.expect))
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
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


MEMORY_EPILOG = """\
record fields (POST /v1/memories takes the same JSON):
  every kind     session_id (required), agent_id, tags, memory_id (generated when absent)
  turn           ts (required, ISO 8601 with a timezone) and user_text / assistant_text,
                 or one message as role (user|assistant|system|tool) + text; turn_id
  message        ts, text (required), role, message_id, turn_id
  session        start_ts, end_ts, summary (required), raw_messages_ref
  memory_type    turn | message | session (default: store.write_granularity)

examples:
  memgate memory write '{"memory_type": "turn", "session_id": "s1", "agent_id": "a1",
      "ts": "2026-11-29T10:00:00Z", "role": "user", "text": "budget is 100k"}'
  memgate memory search --session-id s1 --agent-id a1 --query budget
  memgate memory search --url http://127.0.0.1:8080 --cross-session --query budget
  memgate memory delete 5b1f0c...   # one record of this key's tenant

Without --url the store of the config is opened directly; with --url the gateway's HTTP
memory API is asked. Search results are the same either way: every record field plus
score, the share (0..1) of the query's distinct terms the record contains (1 = all of
them; no query: 0), best first, ties in BM25 order (SQLite) / ts_rank (PostgreSQL).
The tenant is the hash of --api-key / $OPENAI_API_KEY: another key's records are never
seen, changed or deleted."""


def _search_body(args: argparse.Namespace, default_top_k: int) -> dict[str, Any]:
    """The POST /v1/memories/search body the search flags describe."""
    try:
        flt: dict[str, Any] = orjson.loads(args.filter) if args.filter else {}
    except orjson.JSONDecodeError as exc:
        raise CommandError(f"--filter: not JSON: {exc}", EXIT_USAGE) from None
    if not isinstance(flt, dict):
        raise CommandError("--filter: must be a JSON object", EXIT_USAGE)
    for key in ("agent_id", "session_id", "time_from", "time_to", "memory_type"):
        if getattr(args, key, None) is not None:
            flt[key] = getattr(args, key)
    if args.tag:
        flt["tags"] = args.tag
    body: dict[str, Any] = {"filter": flt, "query": args.query or "",
                            "top_k": args.top_k or default_top_k}
    if args.cross_session:
        body["scope"] = "cross_session"
    return body


def _memory_body(args: argparse.Namespace) -> Any:
    if args.memory_command == "write":
        try:
            return orjson.loads(sys.stdin.buffer.read() if args.json == "-" else args.json)
        except orjson.JSONDecodeError as exc:
            raise CommandError(f"the record is not JSON: {exc}", EXIT_USAGE) from None
    return None


async def _memory_http(args: argparse.Namespace, key: str, default_top_k: int) -> Any:
    """The output of one call to a running gateway's memory API (an error answer raises
    CommandError)."""
    import aiohttp
    from yarl import URL

    base = args.url.rstrip("/") + "/v1/memories"
    cmd = args.memory_command
    if cmd == "write":
        method, url, body = "POST", base, _memory_body(args)
    elif cmd == "search":
        method, url, body = "POST", base + "/search", _search_body(args, default_top_k)
    else:
        method, url, body = ("GET" if cmd == "get" else "DELETE",
                             str(URL(base) / args.memory_id), None)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if body is not None:
        headers["Content-Type"] = "application/json"
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http, http.request(
            method, url, headers=headers, data=None if body is None else orjson.dumps(body),
    ) as r:
        raw = await r.read()
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            data = {"error": {"message": raw[:200].decode("utf-8", "replace")}}
        if r.status >= 400:
            msg = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
            # no such memory or a gateway that cannot serve: the command failed (1); a
            # request it refuses (a record, a filter, a key): the user's to fix (2)
            failed = r.status == 404 or r.status >= 500
            raise CommandError(f"the gateway answered {r.status}: {msg}",
                               EXIT_FAILED if failed else EXIT_USAGE)
    return data["results"] if cmd == "search" else data


def cmd_memory(args: argparse.Namespace) -> int:
    """memgate memory write|search|get|delete: the store the gateway uses, from the shell
    (or, with --url, a running gateway's HTTP memory API)."""
    from gateway.memory.session import tenant_of
    from gateway.memory.store import StoreError, build_filter, build_record, make_store

    for common in ("config", "api_key", "url"):  # given before or after the subcommand
        setattr(args, common, getattr(args, common, None))
    env = dict(os.environ)
    rules = load_rules(default_config(args.config, env), env)
    key = args.api_key or env.get("OPENAI_API_KEY", "")
    tenant = tenant_of({"Authorization": f"Bearer {key}"}, rules.tenants)
    if tenant is None and not args.url:
        raise CommandError("whose records? give --api-key or $OPENAI_API_KEY "
                           "(or map keyless callers with tenants.anonymous)", EXIT_USAGE)

    async def run() -> int:
        out: Any
        if args.url:
            out = await _memory_http(args, key, rules.store.search_top_k)
            print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
            return 0
        assert tenant is not None
        store = make_store(rules.store, env)
        await store.open()
        try:
            cmd = args.memory_command
            if cmd == "write":
                rec = build_record(_memory_body(args), tenant, rules.store)
                await store.write([rec], exists_ok=False)  # an id held already: exit 2
                out = {"memory_id": rec.memory_id, "truncated": rec.truncated}
            elif cmd == "search":
                body = _search_body(args, rules.store.search_top_k)
                results = await store.search(build_filter(body, tenant, rules.store))
                out = [r.public(score) for r, score in results]
            elif cmd == "delete":
                if not await store.delete(tenant, args.memory_id):
                    raise CommandError(f"no memory {args.memory_id!r} for this key",
                                       EXIT_FAILED)
                out = {"deleted": True}
            else:
                got = await store.get(tenant, args.memory_id)
                if got is None:
                    raise CommandError(f"no memory {args.memory_id!r} for this key",
                                       EXIT_FAILED)
                out = got.public()
        finally:
            await store.close()
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
        return 0

    try:
        return run_async(run)
    except StoreError as exc:  # a store that cannot serve failed the command; else the input
        raise CommandError(exc.message, EXIT_FAILED if exc.status >= 500 else EXIT_USAGE,
                           ) from None
    except ValueError as exc:  # an invalid --url
        raise CommandError(str(exc), EXIT_USAGE) from None
    except (OSError, aiohttp_errors()) as exc:
        if not args.url:
            raise  # a file of the config's store: main names it
        raise CommandError(f"cannot reach {args.url}: {exc}", EXIT_FAILED) from None


def _memory_parser(sub: Any) -> None:
    """`memory` and its subcommands; the common flags work before and after the subcommand
    (a flag given after it wins)."""
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    common.add_argument("--config", help="YAML config whose store to open (no --url)")
    common.add_argument("--api-key", help="whose records (default $OPENAI_API_KEY)")
    common.add_argument("--url", help="a running gateway's base URL: use its HTTP memory API "
                                      "instead of opening the store")
    fmt = argparse.RawDescriptionHelpFormatter
    mem = sub.add_parser("memory", help="write / search / get / delete memory records",
                         parents=[common], epilog=MEMORY_EPILOG, formatter_class=fmt)
    # no set_defaults for the common flags: it would change the actions the subcommands
    # share, and a default set after the subcommand would undo a flag given before it
    mem.set_defaults(func=cmd_memory)
    msub = mem.add_subparsers(dest="memory_command", required=True)

    def add(name: str, text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = msub.add_parser(
            name, help=text, description=text, parents=[common], epilog=MEMORY_EPILOG,
            formatter_class=fmt)
        return parser

    mw = add("write", "write one record (JSON as for POST /v1/memories)")
    mw.add_argument("json", help="the record as JSON, or - for stdin (fields: see below)")
    ms = add("search", "search (as POST /v1/memories/search)")
    ms.add_argument("--filter", default=None, help='JSON, e.g. {"session_id": "s1"}; the '
                                                   "flags below are merged into it")
    ms.add_argument("--session-id", dest="session_id", default=None,
                    help="required unless --cross-session")
    ms.add_argument("--agent-id", dest="agent_id", default=None,
                    help="only records of this agent")
    ms.add_argument("--time-from", dest="time_from", default=None,
                    help="ISO 8601 with a timezone, e.g. 2026-11-29T00:00:00Z")
    ms.add_argument("--time-to", dest="time_to", default=None,
                    help="up to this time (ISO 8601; store.time_boundary says if included)")
    ms.add_argument("--tag", action="append", default=None,
                    help="a record must carry one of the --tag values (repeatable)")
    ms.add_argument("--memory-type", dest="memory_type", default=None,
                    choices=["turn", "message", "session"], help="only records of this kind")
    ms.add_argument("--query", default=None, help="full-text query (ranks the results)")
    ms.add_argument("--top-k", type=int, default=None, help="1..100 (store.search_top_k)")
    ms.add_argument("--cross-session", action="store_true",
                    help="search every session of this key's tenant")
    mg = add("get", "one record by memory_id")
    mg.add_argument("memory_id", help="the id write printed")
    md = add("delete", "delete one record by memory_id (this key's tenant only)")
    md.add_argument("memory_id", help="the id write printed (only your own records)")


# --------------------------------------------------------------------------- main


def cmd_hash_key(args: argparse.Namespace) -> int:
    """Read from stdin (a key on the command line would stay in the shell history)."""
    from gateway.memory.session import credential, key_sha256

    text = sys.stdin.readline().strip()
    key = credential({"Authorization": text})
    if key is None:
        raise CommandError("no usable key on stdin (visible ASCII, optionally "
                           "'Bearer <key>')", EXIT_USAGE)
    print(key_sha256(key))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="memgate", usage="memgate [-h] [--version] COMMAND [ARGS ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit codes: 0 ok, 1 the command failed (port in use, upstream error, nothing "
               "measured), 2 usage or config error (wrong flag, missing file, invalid config)")
    ap.add_argument("--version", action="version", version=f"memgate {__version__}")
    # listed once, in the description (with their help), not again as a positional
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND", prog="memgate",
                            help=argparse.SUPPRESS)

    s = sub.add_parser("serve", help="run the gateway")
    s.add_argument("--config", help="YAML config (default: MEMGATE_CONFIG, ./rules/gateway.yaml, "
                                    "else the one shipped with memgate)")
    s.add_argument("--host", default=None, help="address to listen on (default: listen.host, "
                                                "127.0.0.1)")
    s.add_argument("--port", type=port_number, default=None,
                   help="TCP port 1-65535, 0 = any free port (default: listen.port, 8080)")
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
    d.set_defaults(func=cmd_demo)

    c = sub.add_parser("check-config", help="validate a config and print the effective one")
    c.add_argument("file", help="the YAML config to check (its effective form, printed on "
                                "stdout, is itself a valid config)")
    c.set_defaults(func=cmd_check_config)

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
    st = sub.add_parser("stats", help="measure saved payloads / [mem] logs (and a policy)")
    st.add_argument("paths", nargs="+", help="payload / capture JSON files, JSONL, [mem] log "
                    "files (docker/kubectl prefixes welcome), directories, or -")
    st.add_argument("--config", default=None, help="also simulate this config's policy")
    st.add_argument("--json", action="store_true", help="print the summary as JSON")
    st.add_argument("--plot", default=None, metavar="PNG",
                    help="write a tokens histogram PNG: p50/p90/p99, the budget (matplotlib)")
    st.add_argument("--log", action="store_true", help="--plot with a log-scaled tokens axis")
    st.add_argument("--side", choices=SIDES, default="before",
                    help="capture files: measure what the client sent (before, the default) "
                         "or what the gateway forwarded (after)")
    st.set_defaults(func=cmd_stats)
    _memory_parser(sub)

    hk = sub.add_parser("hash-key", help="sha256 of a client key read from stdin, for "
                                         "tenants.client_keys_sha256")
    hk.set_defaults(func=cmd_hash_key)

    rp = sub.add_parser("replay", help="replay conversations: ab (A/B), expect (per turn)")
    rsub = rp.add_subparsers(dest="replay_command", required=True)
    ab = rsub.add_parser("ab", help="A (no eviction) vs B (a policy) on one long conversation")
    ab.add_argument("conversation", help="chat payload JSON (the long history), or a capture "
                                         "file (its --side)")
    ab.add_argument("--probes", required=True, help="YAML list of probe questions")
    ab.add_argument("--upstream", required=True, help="OpenAI-compatible base URL to ask")
    ab.add_argument("--config", default=None, help="the policy for B (default rules)")
    ab.add_argument("--repeat", type=int, default=1, help="runs per probe (stability)")
    ab.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""),
                    help="key for the upstream (default $OPENAI_API_KEY)")
    ab.add_argument("--out", default="replay-report", help="directory for report.md/.html")
    ab.add_argument("--as-configured", action="store_true",
                    help="B forwards as the config stands (kill switch included): "
                         "checks a rollback")
    ab.add_argument("--concurrency", type=int, default=4,
                    help="upstream calls in flight at once (4); each call is a progress line")
    ab.add_argument("--side", choices=SIDES, default="before",
                    help="a capture file: replay what the client sent (before, the default) or "
                         "what the gateway forwarded (after)")
    ab.set_defaults(func=cmd_replay_ab)
    ex = rsub.add_parser("expect", help="per-turn replay of a session against expectations")
    ex.add_argument("session", help="JSONL: {turn, role, text} per line")
    ex.add_argument("expect", help="YAML: turn -> {must_contain: {key: value}, must_not_contain}")
    ex.add_argument("--config", default=None, help="config whose memory.carry rules replay")
    ex.add_argument("--self-check", action="store_true",
                    help="also corrupt each expectation and require the run to fail")
    ex.set_defaults(func=cmd_replay_expect)
    ap.description = ("memgate: a memory-aware reverse proxy for LLM APIs.\n\ncommands:\n"
                      + "\n".join(f"  {name:<13} {a.help}" for name, a in
                                  zip(sub.choices, sub._choices_actions, strict=True)))
    _own_usage(ap)
    return ap


def _own_usage(parser: argparse.ArgumentParser) -> None:
    """Each (sub)command remembers its parser, so a wrong flag shows that command's usage."""
    parser.set_defaults(_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _own_usage(child)


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra:
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        result: int = args.func(args)
    except CommandError as exc:
        return _fail(args, str(exc), exc.code)
    except RulesError as exc:
        return _fail(args, f"invalid config: {exc}", EXIT_USAGE)
    except OSError as exc:  # a file the user named: missing, a directory, unreadable
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(args, f"{where}{exc.strerror or exc}", EXIT_USAGE if where else EXIT_FAILED)
    except KeyboardInterrupt:
        return 130
    return result


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    sub = " ".join(str(v) for k in ("command", "memory_command", "replay_command")
                   if (v := getattr(args, k, None)))
    print(f"memgate {sub}: {message}", file=sys.stderr)
    return code
