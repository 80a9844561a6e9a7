"""`memgate serve`: run the gateway on a port, as one process or as the parent of
--workers processes that share it (the parent supervises; each worker serves).

Binding errors become one line naming the address and why (in use, not this machine's,
no such host, a privileged port)."""

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

from gateway.cli.eventloop import run_async
from gateway.cli.exit_codes import EXIT_FAILED, EXIT_USAGE
from gateway.config.resources import default_config
from gateway.config.rules import load_rules, missing_env
from gateway.errors import CommandError
from gateway.observe import logging as mglog


def add_subcommand(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`memgate serve` and its flags."""
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
