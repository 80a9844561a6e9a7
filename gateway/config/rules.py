"""Load and validate the gateway config into an immutable `Rules` snapshot.

The loader is pure apart from reading the files it is given: it either returns a
complete, frozen `Rules` or raises `RulesError(file, line, key, reason)`. Reload
builds a whole new snapshot and swaps one reference, so a bad file never takes
effect. Precedence: CLI flags > environment (`MEMGATE_*`) > file > defaults.
This module holds the table of the file's sections and keys and composes a `Rules`
from them; the shape is `gateway.config.schema`, the checks of single values
`gateway.config.validate`, the environment's overrides `gateway.config.env_overrides`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.config.carry import CarryPatterns, load_carry_patterns
from gateway.config.companions import companion_path, load_companion, load_model_map
from gateway.config.env_overrides import apply_env
from gateway.config.reader import Lines, Reader, read_yaml
from gateway.config.schema import (
    CONTEXT_PREFIXES,
    SESSION_ID_FROM,
    Budget,
    CaptureRules,
    CarryRules,
    CompactRules,
    ConsoleRules,
    Eviction,
    Markers,
    Memory,
    RetrieveRules,
    Rules,
    StateRules,
    StoreRules,
    TenantRules,
    TracingRules,
    Upstream,
)
from gateway.config.validate import (
    check_base_url,
    check_bool,
    check_float,
    check_header_names,
    check_int,
    check_keep_fields,
    check_key_hashes,
    check_max_tokens,
    check_order,
    check_prefixes,
    check_session_sources,
    check_str,
    check_str_list,
    check_tag_tuple,
    check_tenant_name,
    check_tool_name,
    check_tracing_enabled,
    check_window,
    check_window_or_none,
)
from gateway.errors import RulesError

# Every mapping of the gateway config and the keys it allows. The parsers read their keys
# from here, so a key refused in one mapping can be answered with where it does live (a
# block pasted at the wrong level, as the seeds list their parameters).
SECTIONS: dict[str, frozenset[str]] = {
    "": frozenset({"memory", "upstreams", "listen", "logging", "limits", "session", "tokens",
                   "capture", "store", "state", "tenants", "tracing",
                   "console"}),
    "memory": frozenset({"enable_eviction", "shadow", "budget", "eviction", "markers", "carry",
                         "write", "fallback_original", "fallback_backoff_s", "context",
                         "retrieve"}),
    "memory.context": frozenset({"prefixes"}),
    "memory.retrieve": frozenset({"enabled", "tool_name", "description", "max_rounds",
                                  "max_result_chars", "excerpt_min_chars", "skip_models"}),
    "memory.budget": frozenset({"max_tokens", "max_chars", "max_messages", "max_turns",
                                "safety_ratio", "reserve_output_tokens"}),
    "memory.eviction": frozenset({"order", "keep_pinned", "max_pinned", "drop_unit",
                                  "on_over_budget", "low_water", "move_cache_marker",
                                  "compact", "recall_share"}),
    "memory.eviction.compact": frozenset({"min_chars", "keep_recent", "exclude_tools",
                                          "target_chars", "max_line"}),
    "memory.markers": frozenset({"system_prefix", "min_score", "on_bad_metadata"}),
    "memory.carry": frozenset({"enabled", "keep_fields", "drop_when", "ref_ttl_turns",
                               "log_skipped", "rules_file", "max_note_chars"}),
    "memory.carry.drop_when": frozenset({"task_closed", "no_pending_reference",
                                         "small_talk_only"}),
    "upstreams[]": frozenset({"name", "base_url", "paths", "models", "connect_timeout_s",
                              "read_timeout_s", "api_key_env", "api_key_header", "proxy",
                              "wire"}),
    "listen": frozenset({"host", "port", "admin_port", "admin_host"}),
    "logging": frozenset({"format", "level"}),
    "limits": frozenset({"max_body_bytes", "cache_mb"}),
    "session": frozenset({"id_from", "header", "max_tracked", "history_cache_mb"}),
    "tokens": frozenset({"cache_size", "models_file", "approx_factor"}),
    "capture": frozenset({"enabled", "dir", "sample_rate", "max_files", "around_change"}),
    "store": frozenset({"backend", "path", "dsn_env", "write_granularity", "session_scope",
                        "time_boundary", "default_time_window", "default_tags", "search_top_k",
                        "max_chars_per_record", "on_overlong", "archive", "recall",
                        "retention"}),
    "store.recall": frozenset({"enabled", "top_k", "scope"}),
    "state": frozenset({"backend", "redis_url_env", "ttl_s", "key_prefix", "connect_timeout_s",
                        "read_timeout_s", "retry_after_s"}),
    "tenants": frozenset({"credential_headers", "anonymous", "client_keys_sha256",
                          "allow_any_client"}),
    "tracing": frozenset({"enabled"}),
    "console": frozenset({"enabled", "show_text", "max_sessions", "ring"}),
}


def _parse_carry(
    r: Reader, data: Any, base_dir: Path, k: str
) -> tuple[CarryRules, CarryPatterns | None, str | None]:
    """memory.carry, or the same section spelled memory.write (`k`: the spelling used)."""
    c = r.section(data, k, "memory.carry")
    if not c:
        return CarryRules(enabled=False), None, None
    dw = r.section(c.get("drop_when"), f"{k}.drop_when", "memory.carry.drop_when")
    d = CarryRules()
    rules = CarryRules(
        enabled=r.get(c, k, "enabled", check_bool, True),
        keep_fields=r.get(c, k, "keep_fields", check_keep_fields, d.keep_fields),
        task_closed=r.get(dw, f"{k}.drop_when", "task_closed", check_bool, d.task_closed),
        no_pending_reference=r.get(dw, f"{k}.drop_when", "no_pending_reference", check_bool,
                                   d.no_pending_reference),
        small_talk_only=r.get(dw, f"{k}.drop_when", "small_talk_only", check_bool,
                              d.small_talk_only),
        ref_ttl_turns=r.get(c, k, "ref_ttl_turns", check_int(0), d.ref_ttl_turns),
        log_skipped=r.get(c, k, "log_skipped", check_bool, d.log_skipped),
        max_note_chars=r.get(c, k, "max_note_chars", check_int(100), d.max_note_chars),
    )
    path = companion_path(r, c, k, "rules_file", "carry.yaml", base_dir)
    return rules, load_companion(r, f"{k}.rules_file", path, load_carry_patterns), str(path)


def _parse_retrieve(r: Reader, data: Any) -> RetrieveRules:
    k, d = "memory.retrieve", RetrieveRules()
    s = r.section(data, k)
    return RetrieveRules(
        enabled=r.get(s, k, "enabled", check_bool, d.enabled),
        tool_name=r.get(s, k, "tool_name", check_tool_name, d.tool_name),
        description=r.get(s, k, "description", check_str(), d.description),
        max_rounds=r.get(s, k, "max_rounds", check_int(1, 10), d.max_rounds),
        max_result_chars=r.get(s, k, "max_result_chars", check_int(500, 200_000),
                               d.max_result_chars),
        excerpt_min_chars=r.get(s, k, "excerpt_min_chars", check_int(2000, nullable=True),
                                d.excerpt_min_chars),
        skip_models=r.get(s, k, "skip_models", check_str_list, d.skip_models),
    )


def _parse_memory(r: Reader, data: Any, base_dir: Path) -> tuple[Memory, str | None]:
    m = r.section(data, "memory")
    b = r.section(m.get("budget"), "memory.budget")
    d = Budget()
    budget = Budget(
        max_tokens=r.get(b, "memory.budget", "max_tokens", check_max_tokens, d.max_tokens),
        max_chars=r.get(b, "memory.budget", "max_chars", check_int(1, nullable=True), d.max_chars),
        max_messages=r.get(
            b, "memory.budget", "max_messages", check_int(1, nullable=True), d.max_messages
        ),
        max_turns=r.get(b, "memory.budget", "max_turns", check_int(1, nullable=True), d.max_turns),
        safety_ratio=r.get(b, "memory.budget", "safety_ratio", check_float(0.05, 1.0),
                           d.safety_ratio),
        reserve_output_tokens=r.get(
            b, "memory.budget", "reserve_output_tokens", check_int(0), d.reserve_output_tokens
        ),
    )
    e = r.section(m.get("eviction"), "memory.eviction")
    de = Eviction()
    cs = r.section(e.get("compact"), "memory.eviction.compact")
    dc, ck = CompactRules(), "memory.eviction.compact"
    compact = CompactRules(
        min_chars=r.get(cs, ck, "min_chars", check_int(1), dc.min_chars),
        keep_recent=r.get(cs, ck, "keep_recent", check_int(0), dc.keep_recent),
        exclude_tools=r.get(cs, ck, "exclude_tools", check_str_list, dc.exclude_tools),
        target_chars=r.get(cs, ck, "target_chars", check_int(200), dc.target_chars),
        max_line=r.get(cs, ck, "max_line", check_int(40), dc.max_line),
    )
    eviction = Eviction(
        order=r.get(e, "memory.eviction", "order", check_order, de.order),
        keep_pinned=r.get(e, "memory.eviction", "keep_pinned", check_bool, de.keep_pinned),
        max_pinned=r.get(e, "memory.eviction", "max_pinned", check_int(0), de.max_pinned),
        drop_unit=r.get(e, "memory.eviction", "drop_unit", check_str(("turn", "group")),
                        de.drop_unit),
        on_over_budget=r.get(
            e, "memory.eviction", "on_over_budget", check_str(("forward", "reject")),
            de.on_over_budget
        ),
        low_water=r.get(e, "memory.eviction", "low_water", check_float(0.1, 1.0), de.low_water),
        move_cache_marker=r.get(
            e, "memory.eviction", "move_cache_marker", check_bool, de.move_cache_marker
        ),
        compact=compact,
        recall_share=r.get(e, "memory.eviction", "recall_share", check_float(0.0, 0.9),
                           de.recall_share),
    )
    k = r.section(m.get("markers"), "memory.markers")
    dk = Markers()
    markers = Markers(
        system_prefix=r.get(k, "memory.markers", "system_prefix", check_str(), dk.system_prefix),
        min_score=r.get(k, "memory.markers", "min_score", check_float(0.0, 1.0), dk.min_score),
        on_bad_metadata=r.get(k, "memory.markers", "on_bad_metadata",
                              check_str(("reject", "ignore")), dk.on_bad_metadata),
    )
    c = r.section(m.get("context"), "memory.context")
    context_prefixes = r.get(c, "memory.context", "prefixes", check_prefixes, CONTEXT_PREFIXES)
    retrieve = _parse_retrieve(r, m.get("retrieve"))
    # memory.write is the seed's name (000) for memory.carry: one section, two spellings
    carry_key = "memory.carry"
    if "write" in m:
        if "carry" in m:
            line = r.lines.get("memory.carry")
            raise r.fail("memory.write", "memory.write is an alias of memory.carry, and "
                         f"memory.carry{f' (line {line})' if line else ''} is given too: "
                         "keep one of them")
        carry_key = "memory.write"
    carry, patterns, carry_path = _parse_carry(r, m.get(carry_key[7:]), base_dir, carry_key)
    return Memory(
        enable_eviction=r.get(m, "memory", "enable_eviction", check_bool, False),
        shadow=r.get(m, "memory", "shadow", check_bool, True),
        budget=budget,
        eviction=eviction,
        markers=markers,
        context_prefixes=context_prefixes,
        carry=carry,
        carry_patterns=patterns,
        retrieve=retrieve,
        fallback_original=r.get(m, "memory", "fallback_original", check_bool, True),
        fallback_backoff_s=r.get(m, "memory", "fallback_backoff_s", check_float(0, 86400), 600.0),
    ), carry_path


def _parse_store(r: Reader, data: Any) -> StoreRules:
    k = "store"
    s = r.section(data, k)
    rc = r.section(s.get("recall"), "store.recall")
    d = StoreRules()
    return StoreRules(
        backend=r.get(s, k, "backend", check_str(("sqlite", "postgres")), d.backend),
        path=r.get(s, k, "path", check_str(), d.path),
        dsn_env=r.get(s, k, "dsn_env", check_str(), d.dsn_env),
        write_granularity=r.get(s, k, "write_granularity",
                                check_str(("turn", "message", "session")), d.write_granularity),
        session_scope=r.get(s, k, "session_scope", check_str(("current", "cross_session")),
                            d.session_scope),
        time_boundary=r.get(s, k, "time_boundary", check_str(("closed", "half_open")),
                            d.time_boundary),
        default_time_window_s=r.get(s, k, "default_time_window", check_window,
                                    d.default_time_window_s),
        default_tags=r.get(s, k, "default_tags", check_tag_tuple, d.default_tags),
        search_top_k=r.get(s, k, "search_top_k", check_int(1, 100), d.search_top_k),
        max_chars_per_record=r.get(s, k, "max_chars_per_record", check_int(1),
                                   d.max_chars_per_record),
        on_overlong=r.get(s, k, "on_overlong", check_str(("truncate", "reject")), d.on_overlong),
        archive=r.get(s, k, "archive", check_str(("off", "evicted", "all")), d.archive),
        recall_enabled=r.get(rc, "store.recall", "enabled", check_bool, d.recall_enabled),
        recall_top_k=r.get(rc, "store.recall", "top_k", check_int(1, 20), d.recall_top_k),
        recall_scope=r.get(rc, "store.recall", "scope", check_str(("current", "cross_session")),
                           d.recall_scope),
        retention_s=r.get(s, k, "retention", check_window_or_none, d.retention_s),
    )


def _parse_tenants(r: Reader, data: Any) -> TenantRules:
    k = "tenants"
    t = r.section(data, k)
    d = TenantRules()
    return TenantRules(
        credential_headers=r.get(t, k, "credential_headers", check_header_names,
                                 d.credential_headers),
        anonymous=r.get(t, k, "anonymous", check_tenant_name, d.anonymous),
        client_keys_sha256=r.get(t, k, "client_keys_sha256", check_key_hashes,
                                 d.client_keys_sha256),
        allow_any_client=r.get(t, k, "allow_any_client", check_bool, d.allow_any_client),
    )


def _parse_tracing(r: Reader, data: Any) -> TracingRules:
    t = r.section(data, "tracing")
    return TracingRules(enabled=r.get(t, "tracing", "enabled", check_tracing_enabled,
                                      TracingRules().enabled))


def _parse_console(r: Reader, data: Any) -> ConsoleRules:
    k = "console"
    c = r.section(data, k)
    d = ConsoleRules()
    return ConsoleRules(
        enabled=r.get(c, k, "enabled", check_bool, d.enabled),
        show_text=r.get(c, k, "show_text", check_bool, d.show_text),
        max_sessions=r.get(c, k, "max_sessions", check_int(1, 10_000), d.max_sessions),
        ring=r.get(c, k, "ring", check_int(1, 500), d.ring),
    )


def _parse_upstreams(r: Reader, data: Any) -> tuple[Upstream, ...]:
    if data is None:
        return Rules().upstreams
    if not isinstance(data, list) or not data:
        raise r.fail("upstreams", "must be a non-empty list of upstreams")
    out: list[Upstream] = []
    names: set[str] = set()
    for i, item in enumerate(data):
        key = f"upstreams[{i}]"
        u = r.section(item, key)
        for required in ("name", "base_url"):
            if required not in u:
                raise r.fail(key, f"missing required key {required!r}")
        name = r.get(u, key, "name", check_str(), "")
        up = Upstream(
            name=name,
            base_url=r.get(u, key, "base_url", check_base_url, ""),
            paths=r.get(u, key, "paths", check_str_list, ("/*",)),
            models=r.get(u, key, "models", check_str_list, ()),
            connect_timeout_s=r.get(u, key, "connect_timeout_s", check_float(0.001, 3600), 10.0),
            read_timeout_s=r.get(u, key, "read_timeout_s", check_float(0.001, 86400), 600.0),
            api_key_env=r.get(u, key, "api_key_env", check_str(), None),
            api_key_header=r.get(
                u, key, "api_key_header", check_str(("authorization", "x-api-key", "api-key")),
                "authorization"
            ),
            proxy=r.get(u, key, "proxy", check_base_url, None),
            # unset: the API the two upstreams the gateway names speak, else both
            wire=r.get(u, key, "wire", check_str(("openai", "anthropic", "any")),
                       name if name in ("openai", "anthropic") else "any"),
        )
        if up.name in names:
            raise r.fail(f"{key}.name", f"duplicate upstream name {up.name!r}")
        names.add(up.name)
        out.append(up)
    return tuple(out)


def load_rules(path: str | Path | None, env: Mapping[str, str] | None = None) -> Rules:
    """Build a complete Rules snapshot from a YAML file plus MEMGATE_* overrides."""
    env = os.environ if env is None else env
    if path is None:
        return apply_env(Rules(), env)
    p = Path(path)
    data, lines = read_yaml(p)
    return apply_env(build_rules(data, str(p), lines, p.parent), env)


def build_rules(
    data: Any,
    file: str = "<mapping>",
    lines: Lines | None = None,
    base_dir: Path | None = None,
) -> Rules:
    """Validate parsed config data (as from YAML) into Rules; no env overrides."""
    r = Reader(file, lines or {}, SECTIONS)
    base_dir = base_dir or Path.cwd()
    top = r.section(data if data is not None else {}, "")
    memory, carry_path = _parse_memory(r, top.get("memory"), base_dir)
    c = r.section(top.get("capture"), "capture")
    dc = CaptureRules()
    capture = CaptureRules(
        enabled=r.get(c, "capture", "enabled", check_bool, dc.enabled),
        dir=r.get(c, "capture", "dir", check_str(), dc.dir),  # relative: to the working directory
        sample_rate=r.get(c, "capture", "sample_rate", check_float(0.0, 1.0), dc.sample_rate),
        max_files=r.get(c, "capture", "max_files", check_int(1), dc.max_files),
        around_change=r.get(c, "capture", "around_change", check_int(0), dc.around_change),
    )
    upstreams = _parse_upstreams(r, top.get("upstreams"))
    listen = r.section(top.get("listen"), "listen")
    logging_ = r.section(top.get("logging"), "logging")
    limits = r.section(top.get("limits"), "limits")
    session = r.section(top.get("session"), "session")
    tokens = r.section(top.get("tokens"), "tokens")

    store = _parse_store(r, top.get("store"))
    st = r.section(top.get("state"), "state")
    state = StateRules(
        backend=r.get(st, "state", "backend", check_str(("memory", "redis")), "memory"),
        redis_url_env=r.get(st, "state", "redis_url_env", check_str(), "MEMGATE_REDIS_URL"),
        ttl_s=r.get(st, "state", "ttl_s", check_int(60), 86400),
        key_prefix=r.get(st, "state", "key_prefix", check_str(), "memgate"),
        connect_timeout_s=r.get(st, "state", "connect_timeout_s", check_float(0.001, 60), 0.25),
        read_timeout_s=r.get(st, "state", "read_timeout_s", check_float(0.001, 60), 0.5),
        retry_after_s=r.get(st, "state", "retry_after_s", check_float(0.0, 3600), 5.0),
    )
    mpath, models, default_encoding, default_window = load_model_map(r, tokens, base_dir)

    rules = Rules(
        memory=memory,
        upstreams=upstreams,
        listen_host=r.get(listen, "listen", "host", check_str(), "127.0.0.1"),
        listen_port=r.get(listen, "listen", "port", check_int(0, 65535), 8080),
        listen_admin_port=_admin_port(r, listen),
        listen_admin_host=r.get(listen, "listen", "admin_host", check_str(), "127.0.0.1"),
        log_format=r.get(logging_, "logging", "format", check_str(("console", "json")), "console"),
        log_level=r.get(
            logging_, "logging", "level", check_str(("debug", "info", "warning", "error")), "info"
        ),
        max_body_bytes=r.get(limits, "limits", "max_body_bytes", check_int(1024), 32 * 1024 * 1024),
        cache_mb=r.get(limits, "limits", "cache_mb", check_int(16), 256),
        session_id_from=_session_id_from(r, session),
        max_tracked_sessions=r.get(session, "session", "max_tracked", check_int(1), 10_000),
        history_cache_mb=r.get(session, "session", "history_cache_mb", check_int(0), 256),
        token_cache_size=r.get(tokens, "tokens", "cache_size", check_int(0), 200_000),
        approx_token_factor=r.get(tokens, "tokens", "approx_factor", check_float(0.5, 3.0), 1.15),
        capture=capture,
        store=store,
        state=state,
        tenants=_parse_tenants(r, top.get("tenants")),
        tracing=_parse_tracing(r, top.get("tracing")),
        console=_parse_console(r, top.get("console")),
        models=models,
        default_encoding=default_encoding,
        default_context_window=default_window,
        source=file,
        models_path=str(mpath),
        carry_path=carry_path,
    )
    _refuse_credential_sources(r, rules, session)
    return rules


def _session_id_from(r: Reader, session: dict[str, Any]) -> tuple[str, ...]:
    """session.id_from; `session.header`, the older spelling, names the header of its
    first source (the default order otherwise). Both at once is refused: which one
    meant the order?"""
    if "header" not in session:
        sources: tuple[str, ...] = r.get(session, "session", "id_from", check_session_sources,
                                         SESSION_ID_FROM)
        return sources
    if "id_from" in session:
        raise r.fail("session.header", "session.id_from is given too: list the header there "
                                       "(header:<Name>, where it belongs in the order) and "
                                       "remove session.header, its older spelling")
    name = r.get(session, "session", "header", check_header_names, ())
    if len(name) != 1:
        raise r.fail("session.header", f"must be one HTTP header name, got {session['header']!r}")
    try:  # the same checks as id_from's (a header carrying the key, a duplicate)
        return check_session_sources([f"header:{name[0]}", *SESSION_ID_FROM[1:]])
    except ValueError as exc:
        raise r.fail("session.header", str(exc)) from None


def _refuse_credential_sources(r: Reader, rules: Rules, session: dict[str, Any]) -> None:
    """No session source may read a header tenants.credential_headers names: it carries
    the caller's key, and a session id is written on every [mem] line."""
    keys = {h.lower() for h in rules.tenants.credential_headers}
    for i, source in enumerate(rules.session_id_from):
        kind, _, header = source.partition(":")
        if kind == "header" and header.lower() in keys:
            key = "session.header" if "header" in session else "session.id_from"
            raise r.fail(key, f"entry {i} ({source!r}) reads a header tenants.credential_headers "
                              "names: it carries the caller's key, and a session id is written "
                              "on every [mem] line")


def _admin_port(r: Reader, listen: dict[str, Any]) -> int | None:
    """listen.admin_port: a fixed port (1..65535; the admin listener is told apart from the
    main one by it) other than listen.port."""
    port: int | None = r.get(listen, "listen", "admin_port", check_int(1, 65535, nullable=True),
                             None)
    if port is not None and port == listen.get("port", 8080):
        raise r.fail("listen.admin_port", f"must differ from listen.port ({port}): the admin "
                                          "listener is a port of its own")
    return port


def unguarded_injection(rules: Rules) -> list[str]:
    """Startup/reload warnings: upstreams that get the gateway's own key, and what
    happens to callers of their routes."""
    out = []
    for up in rules.upstreams:
        if up.api_key_env is None:
            continue
        if rules.tenants.allow_any_client:
            out.append(f"upstream {up.name!r} gets ${up.api_key_env} (when set) and "
                       "tenants.allow_any_client is on: anyone who reaches the port spends it")
        elif not rules.tenants.client_keys_sha256:
            out.append(f"upstream {up.name!r} gets ${up.api_key_env} (when set) but no client "
                       "keys are allowed (tenants.client_keys_sha256 / "
                       "MEMGATE_CLIENT_KEYS_SHA256): its routes answer 401")
    return out


def missing_env(rules: Rules, env: Mapping[str, str]) -> RulesError | None:
    """A backend the config chooses whose connection string the environment lacks:
    serve and check-config refuse it up front instead of failing at the first use."""
    if rules.state.backend == "redis" and not env.get(rules.state.redis_url_env):
        return RulesError(rules.source, None, "state.backend",
                          f"redis needs ${rules.state.redis_url_env} (a redis:// URL; "
                          "state.redis_url_env names the variable), which is not set")
    if rules.store.backend == "postgres" and not env.get(rules.store.dsn_env):
        return RulesError(rules.source, None, "store.backend",
                          f"postgres needs ${rules.store.dsn_env} (a postgresql:// DSN; "
                          "store.dsn_env names the variable), which is not set")
    return None
