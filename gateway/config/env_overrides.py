"""The MEMGATE_* environment variables that override a loaded config (env > file).

`apply_env` takes a complete `Rules` and returns the one the environment makes of it:
the kill switch (MEMGATE_ENABLE_EVICTION, MEMGATE_SHADOW), the upstream URLs, the log
format, extra allowed client keys, and the request-path shortcuts turned off
(MEMGATE_SHORTCUTS_OFF). An invalid value raises RulesError naming the variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from gateway.config.schema import Rules
from gateway.config.validate import check_base_url, check_key_hashes
from gateway.errors import RulesError


def _env_bool(env: Mapping[str, str], name: str) -> bool | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise RulesError(f"env:{name}", None, name, f"must be 0 or 1, got {raw!r}")


def _env_url(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    if not raw:
        return None
    try:
        return check_base_url(raw)
    except ValueError as exc:
        raise RulesError(f"env:{name}", None, name, str(exc)) from None


# What MEMGATE_SHORTCUTS_OFF may name: work the request path saves without changing a
# decision (the README's Performance section measures what each buys)
SHORTCUTS = ("history", "splice", "spans", "prefilter", "deferred", "thread", "planpass",
             "plancache", "recallscan", "toolscan", "exactfit")


def _env_shortcuts(env: Mapping[str, str]) -> frozenset[str]:
    """MEMGATE_SHORTCUTS_OFF: comma-separated names of SHORTCUTS ("all": every one)."""
    names = {n.strip() for n in env.get("MEMGATE_SHORTCUTS_OFF", "").split(",") if n.strip()}
    if "all" in names:
        return frozenset(SHORTCUTS)
    unknown = sorted(names - set(SHORTCUTS))
    if unknown:
        raise RulesError("env:MEMGATE_SHORTCUTS_OFF", None, "MEMGATE_SHORTCUTS_OFF",
                         f"unknown shortcut(s) {', '.join(unknown)}; known: all, "
                         + ", ".join(SHORTCUTS))
    return frozenset(names)


def apply_env(rules: Rules, env: Mapping[str, str]) -> Rules:
    """Environment overrides (env > file); invalid values raise RulesError."""
    enable = _env_bool(env, "MEMGATE_ENABLE_EVICTION")
    shadow = _env_bool(env, "MEMGATE_SHADOW")
    memory = rules.memory
    if enable is not None:
        memory = replace(memory, enable_eviction=enable)
    if shadow is not None:
        memory = replace(memory, shadow=shadow)
    upstreams = list(rules.upstreams)
    url = _env_url(env, "MEMGATE_UPSTREAM")
    if url is not None:
        i = upstreams.index(rules.default_upstream)
        upstreams[i] = replace(upstreams[i], base_url=url)
    url = _env_url(env, "MEMGATE_ANTHROPIC_UPSTREAM")
    if url is not None:
        named = [i for i, u in enumerate(upstreams) if u.name == "anthropic"]
        if not named:
            raise RulesError("env:MEMGATE_ANTHROPIC_UPSTREAM", None, "MEMGATE_ANTHROPIC_UPSTREAM",
                             "the config has no upstream named 'anthropic' to override")
        upstreams[named[0]] = replace(upstreams[named[0]], base_url=url)
    fmt = env.get("MEMGATE_LOG_FORMAT")
    log_format = rules.log_format
    if fmt:
        if fmt not in ("console", "json"):
            raise RulesError("env:MEMGATE_LOG_FORMAT", None, "MEMGATE_LOG_FORMAT",
                             f"must be console or json, got {fmt!r}")
        log_format = fmt  # type: ignore[assignment]
    tenants = rules.tenants
    keys = env.get("MEMGATE_CLIENT_KEYS_SHA256", "").replace(",", " ").split()
    if keys:
        try:
            tenants = replace(tenants, client_keys_sha256=tenants.client_keys_sha256
                              | check_key_hashes(keys))
        except ValueError as exc:
            raise RulesError("env:MEMGATE_CLIENT_KEYS_SHA256", None,
                             "MEMGATE_CLIENT_KEYS_SHA256", str(exc)) from None
    off = _env_shortcuts(env)
    if "prefilter" in off and memory.carry_patterns is not None:
        memory = replace(memory, carry_patterns=replace(memory.carry_patterns,
                                                        prefilter_on=False))
    return replace(rules, memory=memory, upstreams=tuple(upstreams), log_format=log_format,
                   tenants=tenants, shortcuts_off=off)
