"""The effective config as a config file: what `memgate check-config` prints.

Every key is spelled as the loader reads it (rules.SECTIONS), every value as the file
would give it, and the files the config reads (model map, carry patterns) by their
resolved paths: the output, saved and loaded again, is the same Rules. That makes it
something to start from (copy it, edit one key) rather than a dump to read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.config.schema import Memory, Rules, StoreRules, Upstream

_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))


def window(seconds: int) -> str:
    """Seconds as store.default_time_window spells them (7d, 12h ...), largest exact unit
    up to days (7d reads better than 1w)."""
    unit, size = next((u, n) for u, n in _UNITS if seconds % n == 0)
    return f"{seconds // size}{unit}"


def effective_config(rules: Rules) -> dict[str, Any]:
    """`rules` as config-file data, loadable by rules.build_rules to the same Rules."""
    t = rules.tenants
    return {
        "memory": _memory(rules.memory, rules.carry_path),
        "upstreams": [_upstream(u) for u in rules.upstreams],
        "listen": {"host": rules.listen_host, "port": rules.listen_port,
                   "admin_port": rules.listen_admin_port, "admin_host": rules.listen_admin_host},
        "logging": {"format": rules.log_format, "level": rules.log_level},
        "limits": {"max_body_bytes": rules.max_body_bytes, "cache_mb": rules.cache_mb},
        "session": {"id_from": list(rules.session_id_from),
                    "max_tracked": rules.max_tracked_sessions,
                    "history_cache_mb": rules.history_cache_mb},
        "tokens": {"cache_size": rules.token_cache_size, "models_file": rules.models_path,
                   "approx_factor": rules.approx_token_factor},
        "capture": _fields(rules.capture, "enabled", "dir", "sample_rate", "max_files",
                           "around_change"),
        "store": _store(rules.store),
        "state": _fields(rules.state, "backend", "redis_url_env", "ttl_s", "key_prefix",
                         "connect_timeout_s", "read_timeout_s", "retry_after_s"),
        "tenants": {"credential_headers": list(t.credential_headers), "anonymous": t.anonymous,
                    "client_keys_sha256": sorted(t.client_keys_sha256),
                    "allow_any_client": t.allow_any_client},
        "tracing": {"enabled": rules.tracing.enabled},
        "console": _fields(rules.console, "enabled", "show_text", "max_sessions", "ring"),
    }


def _fields(obj: Any, *names: str) -> dict[str, Any]:
    """Attributes named as their config keys; tuples as lists (YAML has no tuples)."""
    return {n: list(v) if isinstance(v := getattr(obj, n), tuple) else v for n in names}


def _memory(m: Memory, carry_path: str | None) -> dict[str, Any]:
    e = m.eviction
    out: dict[str, Any] = {
        "enable_eviction": m.enable_eviction,
        "shadow": m.shadow,
        "fallback_original": m.fallback_original,
        "fallback_backoff_s": m.fallback_backoff_s,
        "budget": _fields(m.budget, "max_tokens", "max_chars", "max_messages", "max_turns",
                          "safety_ratio", "reserve_output_tokens"),
        "eviction": {
            **_fields(e, "order", "keep_pinned", "max_pinned", "drop_unit", "on_over_budget",
                      "low_water", "move_cache_marker", "recall_share"),
            "compact": _fields(e.compact, "min_chars", "keep_recent", "exclude_tools",
                               "target_chars", "max_line"),
        },
        "markers": _fields(m.markers, "system_prefix", "min_score", "on_bad_metadata"),
        "context": {"prefixes": list(m.context_prefixes)},
        "retrieve": {
            "enabled": m.retrieve.enabled, "tool_name": m.retrieve.tool_name,
            "description": m.retrieve.description, "max_rounds": m.retrieve.max_rounds,
            "max_result_chars": m.retrieve.max_result_chars,
            "excerpt_min_chars": m.retrieve.excerpt_min_chars,
            "skip_models": list(m.retrieve.skip_models),
        },
    }
    if carry_path is not None:  # no carry section: none printed (carry stays off)
        c = m.carry
        out["carry"] = {
            **_fields(c, "enabled", "keep_fields"),
            "drop_when": _fields(c, "task_closed", "no_pending_reference", "small_talk_only"),
            **_fields(c, "ref_ttl_turns", "log_skipped", "max_note_chars"),
            "rules_file": carry_path,
        }
    return out


def _upstream(u: Upstream) -> dict[str, Any]:
    out = _fields(u, "name", "base_url", "paths", "models", "wire", "connect_timeout_s",
                  "read_timeout_s", "api_key_header")
    if u.api_key_env is not None:
        out["api_key_env"] = u.api_key_env
    if u.proxy is not None:
        out["proxy"] = u.proxy
    return out


def _store(s: StoreRules) -> dict[str, Any]:
    return {
        **_fields(s, "backend", "path", "dsn_env", "write_granularity", "session_scope",
                  "time_boundary"),
        "default_time_window": window(s.default_time_window_s),
        **_fields(s, "default_tags", "search_top_k", "max_chars_per_record", "on_overlong",
                  "archive"),
        "recall": {"enabled": s.recall_enabled, "top_k": s.recall_top_k,
                   "scope": s.recall_scope},
        "retention": None if s.retention_s is None else window(s.retention_s),
    }
