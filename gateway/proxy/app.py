"""create_app(): routes and resources; nothing happens at import time."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.config.reload import Reloader
from gateway.config.rules import unguarded_injection
from gateway.config.schema import Rules
from gateway.decide.history import HistoryCache
from gateway.errors import RulesError
from gateway.measure.tokens import Tokenizers
from gateway.memory.api import MemoryService
from gateway.memory.api import routes as memory_routes
from gateway.memory.backends import Backend
from gateway.memory.state import MemoryState, RedisState
from gateway.observe import logging as mglog
from gateway.proxy import admin_routes, chat_route, listeners
from gateway.proxy.appstate import STATE, GatewayState, RefusedSessions
from gateway.proxy.cache_bounds import bound_caches
from gateway.proxy.error_answers import contained_paths
from gateway.proxy.intake import read_body
from gateway.proxy.passthrough import passthrough
from gateway.wire import PATHS


def _preload_tokenizers(state: GatewayState, rules: Rules) -> None:
    """Load every configured encoding now and say which one serves which models."""
    names = {rules.default_encoding} | {m.encoding for m in rules.models}
    resolved = state.tokenizers.preload(sorted(names))
    serving: dict[str, list[str]] = {}
    for m in rules.models:
        serving.setdefault(m.encoding, []).append(m.match)
    serving.setdefault(rules.default_encoding, []).append("(default)")
    for wanted, models in sorted(serving.items()):
        actual = resolved[wanted]
        state.log.info("tokenizer", wanted=wanted, encoding=actual,
                       fallback=actual != wanted, models=",".join(models))


def _warn_injection(state: GatewayState, rules: Rules) -> None:
    for detail in unguarded_injection(rules):
        state.log.warning("injected_key_unguarded", detail=detail)


def _switch_tracing(state: GatewayState, rules: Rules, env: Mapping[str, str]) -> None:
    """Tracing on or off as `rules` say, at startup and on each reload. The SDK is set up
    the first time it is on; while it is off nothing of OpenTelemetry is imported."""
    on = rules.tracing.active(env)
    if on and state.tracing is None:
        try:
            from gateway.observe import otel  # the optional extra
        except ImportError as exc:  # tracing: auto without it (true is refused at load)
            state.log.warning("tracing_unavailable", error=str(exc)[:200],
                              detail="pip install -e '.[otel]' in a checkout")
            return
        try:
            state.tracing = otel.from_env(env, lambda: state.log)
        except Exception as exc:  # noqa: BLE001 - tracing never stops the gateway
            state.log.error("tracing_unavailable", error=type(exc).__name__,
                            detail=str(exc)[:200])
            return
    tracing = state.tracing
    if tracing is None or on == (state.tracer is not None):
        return
    if on:
        state.observers.append(tracing.observe)
    else:
        state.observers.remove(tracing.observe)
    state.tracer = tracing if on else None
    state.log.info("tracing", enabled=on)


def _session_state(
    rules: Rules, env: Mapping[str, str], log: Callable[[], Any]
) -> MemoryState | RedisState:
    st = rules.state
    if st.backend == "redis":
        url = env.get(st.redis_url_env, "")
        if not url:
            raise RulesError("env", None, st.redis_url_env,
                             "state.backend is redis but the Redis URL is not set")
        return RedisState(url, st.ttl_s, st.key_prefix, Backend("redis", log, st.retry_after_s),
                          st.connect_timeout_s, st.read_timeout_s)
    return MemoryState(rules.max_tracked_sessions)


def create_app(
    rules: Rules,
    config_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    watch_interval_s: float = 0.5,
) -> web.Application:
    """Build the gateway application for `rules` (reloaded from `config_path` if given)."""
    from gateway.proxy import console

    log = mglog.get_logger()

    def on_swap(old: Rules, new: Rules) -> None:
        if (old.log_format, old.log_level) != (new.log_format, new.log_level):
            mglog.configure(new.log_format, new.log_level)
            state.log = reloader.log = mglog.get_logger()
        if (old.models, old.default_encoding) != (new.models, new.default_encoding):
            _preload_tokenizers(state, new)
        state.capture.config_changed(new.capture)
        bound_caches(state, new)  # limits.cache_mb, session.history_cache_mb, max_tracked
        state.refused.max_entries = new.max_tracked_sessions
        if (old.upstreams, old.tenants) != (new.upstreams, new.tenants):
            _warn_injection(state, new)
        _switch_tracing(state, new, env or {})
        if old.console != new.console:
            console.sync(state, new)

    reloader = Reloader(config_path, env or {}, rules, on_swap, log, watch_interval_s,
                        on_result=lambda result: state.metrics.reloads.labels(result).inc())
    state = GatewayState(
        reloader=reloader,
        tokenizers=Tokenizers(rules.token_cache_size),
        sessions=_session_state(rules, env or {}, lambda: state.log),
        store_health=Backend("store", lambda: state.log),
        archive_health=Backend("archive", lambda: state.log),
        history=HistoryCache(rules.history_cache_mb << 20, rules.max_tracked_sessions),
        refused=RefusedSessions(rules.max_tracked_sessions),
        log=log,
    )
    state.memory = MemoryService(env or {}, log)
    bound_caches(state, rules)
    console.sync(state, rules)
    state.metrics.watch_history(state.history)
    state.metrics.watch_backends([state.store_health, state.archive_health, *(
        [state.sessions.health] if isinstance(state.sessions, RedisState) else [])])

    # the body limit is enforced per request from the live rules (it can be reloaded);
    # bodies arrive as the client sent them: passthrough relays them so, and read_body
    # decodes a compressed one within that limit (aiohttp would inflate it unbounded)
    app = web.Application(client_max_size=1 << 40, handler_args={"auto_decompress": False},
                          middlewares=[contained_paths,
                                       *listeners.split_middlewares(rules)])
    app[STATE] = state
    app[listeners.ADMIN_LISTEN] = listeners.admin_listen(rules)

    async def resources(app: web.Application) -> AsyncIterator[None]:
        _preload_tokenizers(state, state.rules)
        _warn_injection(state, state.rules)
        if state.rules.store.archive != "off" and state.rules.store.retention_s is None:
            state.log.warning("store_retention_off", archive=state.rules.store.archive,
                              hint="archived records are kept for ever: set store.retention "
                                   "(e.g. 90d) to bound the store")
        _switch_tracing(state, state.rules, env or {})
        for up in state.rules.upstreams:
            state.pool.session(up)
        watcher = asyncio.create_task(reloader.run()) if config_path else None
        writer = asyncio.create_task(state.capture.run())
        memory = state.memory
        assert memory is not None
        archiver = asyncio.create_task(memory.run_writer(state.rules.store, state.archive_health))
        purger = asyncio.create_task(memory.run_purger(lambda: state.rules.store,
                                                       state.archive_health))
        # one of several workers: its scrape-time values reach the other workers' scrapes
        publisher = (asyncio.create_task(state.metrics.publish_every())
                     if state.metrics.shared_dir else None)
        loop = asyncio.get_running_loop()
        hup = False
        try:
            loop.add_signal_handler(signal.SIGHUP, reloader.hup)
            hup = True
        except (RuntimeError, NotImplementedError, ValueError):
            pass  # not the main thread (tests) or no signals on this platform
        try:
            yield
        finally:
            if hup:
                loop.remove_signal_handler(signal.SIGHUP)
            if state.background:  # accounting of requests whose clients already left
                await asyncio.gather(*state.background, return_exceptions=True)
            state.counting.shutdown(wait=False)
            await state.capture.drain()  # nothing captured is lost on a clean shutdown
            await memory.close()  # archived turns flushed before the store closes
            for task in (watcher, writer, archiver, purger, publisher):
                if task is not None:
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
            await state.pool.close()
            await state.sessions.close()
            state.metrics.publish()  # a drained worker's last figures stay in the totals
            if state.tracing is not None:  # the spans of the requests above exported
                await state.tracing.shutdown()

    app.cleanup_ctx.append(resources)
    app.router.add_get("/healthz", admin_routes.healthz)
    app.router.add_get("/readyz", admin_routes.readyz)
    app.router.add_get("/metrics", admin_routes.metrics)
    app.router.add_get("/admin/sessions/{session}/memory",
                       admin_routes.admin_session_memory)
    app.router.add_routes(console.routes())
    app.router.add_routes(memory_routes(lambda r: r.app[STATE].memory,
                                        lambda r: r.app[STATE].rules, read_body))
    for path, wire in PATHS.items():
        app.router.add_post(path, chat_route.intercept(wire))
    # every path is relayed, a (decoded) newline in it too: aiohttp's own 404 is plain text
    app.router.add_route("*", "/{tail:[\\s\\S]*}", passthrough)
    return app
