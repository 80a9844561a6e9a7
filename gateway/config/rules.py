"""Load and validate the gateway config into an immutable `Rules` snapshot.

The loader is pure apart from reading the files it is given: it either returns a
complete, frozen `Rules` or raises `RulesError(file, line, key, reason)`. Reload
builds a whole new snapshot and swaps one reference, so a bad file never takes
effect. Precedence: CLI flags > environment (`MEMGATE_*`) > file > defaults.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml

from gateway.config.carry import CarryPatterns, load_carry_patterns
from gateway.config.resources import shipped_file
from gateway.config.schema import ALL_FIELDS, CarryRules, CompactRules, StoreRules
from gateway.config.validate import check_tags, parse_window
from gateway.config.yamlfile import load_yaml
from gateway.errors import RulesError

# compact_tools shortens old tool results before the planner runs (chat.py): listed,
# it must come before length, which then drops fewer turns
STAGES = ("pinned", "recent_turns", "compact_tools", "length", "score")
DropUnit = Literal["turn", "group"]


@dataclass(frozen=True, slots=True)
class Budget:
    max_tokens: int | Literal["auto"] | None = 6000
    # backstops behind max_tokens, not the policy: at 24,000 / 60 / 20 they cut a chat at
    # ~1,800 tokens whatever max_tokens said (LoCoMo dev, 8k budget: 74.6% of the evidence
    # kept; 92.1% at these, where max_tokens decides)
    max_chars: int | None = None
    max_messages: int | None = 400
    max_turns: int | None = 200
    safety_ratio: float = 0.9
    reserve_output_tokens: int = 4096


@dataclass(frozen=True, slots=True)
class Eviction:
    order: tuple[str, ...] = ("pinned", "recent_turns", "length")
    keep_pinned: bool = True
    max_pinned: int = 8
    drop_unit: DropUnit = "turn"
    on_over_budget: Literal["forward", "reject"] = "forward"
    low_water: float = 0.6
    move_cache_marker: bool = False
    compact: CompactRules = field(default_factory=CompactRules)
    recall_share: float = 0.4  # of the budget, filled with the dropped history the request is about


@dataclass(frozen=True, slots=True)
class Markers:
    system_prefix: str = "[PIN]"
    min_score: float = 0.7
    # malformed `memgate` metadata with eviction on: ignore it (the message is pinned by
    # nothing but its text prefix; logged metadata=invalid) or refuse the request (400).
    # With eviction off or in shadow it is always ignored: the kill switch never rejects.
    on_bad_metadata: Literal["reject", "ignore"] = "ignore"


@dataclass(frozen=True, slots=True)
class Memory:
    enable_eviction: bool = False
    shadow: bool = True
    budget: Budget = field(default_factory=Budget)
    eviction: Eviction = field(default_factory=Eviction)
    markers: Markers = field(default_factory=Markers)
    carry: CarryRules = field(default_factory=lambda: CarryRules(enabled=False))
    carry_patterns: CarryPatterns | None = None
    # a body the gateway changed (evicted, note added, metadata cut) that the upstream
    # refuses as invalid is resent as the client sent it
    fallback_original: bool = True
    # after such a refusal the session's requests go unchanged this long (0: every
    # request is tried changed again)
    fallback_backoff_s: float = 600.0

    @property
    def mode(self) -> Literal["off", "shadow", "on"]:
        if self.enable_eviction:
            return "on"
        return "shadow" if self.shadow else "off"


@dataclass(frozen=True, slots=True)
class Upstream:
    name: str
    base_url: str
    paths: tuple[str, ...] = ("/*",)
    models: tuple[str, ...] = ()
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0
    api_key_env: str | None = None  # inject this env var's key instead of the client's
    api_key_header: Literal["authorization", "x-api-key", "api-key"] = "authorization"
    proxy: str | None = None  # egress HTTP proxy for this upstream

    def serves(self, path: str, model: str | None) -> bool:
        if not any(fnmatch.fnmatchcase(path, p) for p in self.paths):
            return False
        if self.models and model is not None:
            return any(fnmatch.fnmatchcase(model, m) for m in self.models)
        return not self.models


def target_url(up: Upstream, path_qs: str) -> str:
    """base_url + the client's path; a base ending in /v1 does not double it."""
    base = up.base_url
    if urlsplit(base).path.endswith("/v1") and (path_qs == "/v1" or path_qs.startswith("/v1/")
                                                  or path_qs.startswith("/v1?")):
        base = base[: -len("/v1")]
    return base + path_qs


@dataclass(frozen=True, slots=True)
class ModelInfo:
    match: str
    encoding: str
    context_window: int


@dataclass(frozen=True, slots=True)
class CaptureRules:
    enabled: bool = False
    dir: str = "var/capture"
    sample_rate: float = 0.01
    max_files: int = 1000
    around_change: int = 20


@dataclass(frozen=True, slots=True)
class ConsoleRules:
    """The operator console (console.py): off unless enabled; what it keeps is bounded
    by `max_sessions` sessions of `ring` recent requests each."""

    enabled: bool = False
    show_text: bool = False  # the carry note and recalled records as text, not only sizes
    max_sessions: int = 200
    ring: int = 20


@dataclass(frozen=True, slots=True)
class StateRules:
    backend: Literal["memory", "redis"] = "memory"
    redis_url_env: str = "MEMGATE_REDIS_URL"
    ttl_s: int = 86400
    key_prefix: str = "memgate"
    # a Redis that refuses or hangs costs at most this per command, then is skipped
    connect_timeout_s: float = 0.25
    read_timeout_s: float = 0.5
    retry_after_s: float = 5.0


@dataclass(frozen=True, slots=True)
class TenantRules:
    """Who a caller is (session.py reads these): the extra headers that carry its key,
    the tenant of callers without one (None: no memory), and which client keys may
    use a route whose upstream gets the gateway's own key."""

    credential_headers: tuple[str, ...] = ()  # after Authorization, x-api-key, api-key
    anonymous: str | None = None
    client_keys_sha256: frozenset[str] = frozenset()  # + $MEMGATE_CLIENT_KEYS_SHA256
    allow_any_client: bool = False  # an injected key serves any caller: explicit opt-out


# what makes `tracing.enabled: auto` switch tracing on: the standard variables naming an
# OTLP endpoint or an exporter (OTEL_TRACES_EXPORTER=none does not)
OTEL_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


@dataclass(frozen=True, slots=True)
class TracingRules:
    """OpenTelemetry traces and GenAI metrics (the `otel` extra, gateway/observe/otel.py)."""

    enabled: bool | Literal["auto"] = False

    def active(self, env: Mapping[str, str]) -> bool:
        """On as configured; `auto`: on when the environment names where to export.
        OTEL_SDK_DISABLED=true switches it off either way."""
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return False
        if self.enabled != "auto":
            return self.enabled
        exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        return any(env.get(v) for v in OTEL_ENDPOINT_VARS) or exporter not in ("", "none")


@dataclass(frozen=True, slots=True)
class Rules:
    memory: Memory = field(default_factory=Memory)
    upstreams: tuple[Upstream, ...] = (
        Upstream("anthropic", "https://api.anthropic.com", paths=("/v1/messages*",),
                 api_key_header="x-api-key"),
        Upstream("openai", "https://api.openai.com"),
    )
    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    # /metrics and /admin/* on their own listener (None: on the main one); read at start-up
    listen_admin_port: int | None = None
    listen_admin_host: str = "127.0.0.1"
    log_format: Literal["console", "json"] = "console"
    log_level: str = "info"
    max_body_bytes: int = 32 * 1024 * 1024
    session_header: str = "X-Session-Id"
    max_tracked_sessions: int = 10_000
    history_cache_mb: int = 256
    # request-path shortcuts turned off (MEMGATE_SHORTCUTS_OFF): same decisions, more work
    shortcuts_off: frozenset[str] = frozenset()
    token_cache_size: int = 200_000
    approx_token_factor: float = 1.15
    capture: CaptureRules = field(default_factory=CaptureRules)
    store: StoreRules = field(default_factory=StoreRules)
    state: StateRules = field(default_factory=StateRules)
    tenants: TenantRules = field(default_factory=TenantRules)
    tracing: TracingRules = field(default_factory=TracingRules)
    console: ConsoleRules = field(default_factory=ConsoleRules)
    models: tuple[ModelInfo, ...] = ()
    default_encoding: str = "cl100k_base"
    default_context_window: int = 8192
    source: str = "<defaults>"
    models_path: str | None = None
    carry_path: str | None = None
    # answers worked out once per Rules object (routes, model info, plan limits): a
    # reload builds a new Rules, so nothing here outlives the config it came from
    memo: dict[Any, Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    def remember(self, key: Any, value: Any) -> None:
        if len(self.memo) > 4096:  # request paths and model names come from clients
            self.memo.clear()
        self.memo[key] = value

    @property
    def routes_by_model(self) -> bool:
        """Does any upstream choose requests by model (so the body must be read)?"""
        return any(u.models for u in self.upstreams)

    def upstream_for(self, path: str, model: str | None = None,
                     anthropic: bool = False) -> Upstream:
        """First upstream serving this path (and model); else the default one. A request
        of Anthropic's SDK (`anthropic`: it sends anthropic-version) that would go to
        the OpenAI-compatible default goes to the upstream named `anthropic` if there
        is one: /v1/models or /v1/files of Anthropic's API, never with its key to
        another provider."""
        key = ("upstream", path, model, anthropic)
        up: Upstream | None = self.memo.get(key)
        if up is None:
            default = self.default_upstream
            up = next((u for u in self.upstreams if u.serves(path, model)), default)
            if anthropic and up is default:
                up = next((u for u in self.upstreams if u.name == "anthropic"), up)
            self.remember(key, up)
        return up

    @property
    def default_upstream(self) -> Upstream:
        """The OpenAI-compatible default: the upstream named `openai`, else the first."""
        return next((u for u in self.upstreams if u.name == "openai"), self.upstreams[0])

    def model_info(self, model: str | None) -> ModelInfo:
        found: ModelInfo | None = self.memo.get(("model", model))
        if found is None:
            found = next((i for i in self.models if model and fnmatch.fnmatchcase(model, i.match)),
                         ModelInfo("*", self.default_encoding, self.default_context_window))
            self.remember(("model", model), found)
        return found


# --------------------------------------------------------------------------- parsing

_Lines = dict[str, int]


def _line_map(root: yaml.Node) -> _Lines:
    """Dotted key path -> 1-based line of its key, for error messages."""
    lines: _Lines = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                path = f"{prefix}.{k.value}" if prefix else str(k.value)
                lines[path] = k.start_mark.line + 1
                walk(v, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                path = f"{prefix}[{i}]"
                lines[path] = item.start_mark.line + 1
                walk(item, path)

    walk(root, "")
    return lines


# Every mapping of the gateway config and the keys it allows. The parsers read their keys
# from here, so a key refused in one mapping can be answered with where it does live (a
# block pasted at the wrong level, as the seeds list their parameters).
SECTIONS: dict[str, frozenset[str]] = {
    "": frozenset({"memory", "upstreams", "listen", "logging", "limits", "session", "tokens",
                   "capture", "store", "state", "tenants", "tracing",
                   "console"}),
    "memory": frozenset({"enable_eviction", "shadow", "budget", "eviction", "markers", "carry",
                         "write", "fallback_original", "fallback_backoff_s"}),
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
                              "read_timeout_s", "api_key_env", "api_key_header", "proxy"}),
    "listen": frozenset({"host", "port", "admin_port", "admin_host"}),
    "logging": frozenset({"format", "level"}),
    "limits": frozenset({"max_body_bytes"}),
    "session": frozenset({"header", "max_tracked", "history_cache_mb"}),
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
MODEL_SECTIONS: dict[str, frozenset[str]] = {  # the models file (tokens.models_file)
    "": frozenset({"models", "default"}),
    "models[]": frozenset({"match", "encoding", "context_window"}),
    "default": frozenset({"encoding", "context_window"}),
}


def _homes(sections: Mapping[str, frozenset[str]], key: str, here: str) -> str | None:
    """Where else `key` is allowed, as the error names it; None when nowhere."""
    found = sorted(s for s, keys in sections.items() if key in keys and s != here)
    if not found:
        return None
    if found == [""]:
        return "at the top level"
    names = [f"{s.replace('[]', '[i]')}:" if s else "the top level" for s in found]
    return "under " + (names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}")


class _Reader:
    """Typed access to a parsed YAML mapping that reports file:line: key: reason."""

    def __init__(self, file: str, lines: _Lines,
                 sections: Mapping[str, frozenset[str]] = SECTIONS) -> None:
        self.file, self.lines, self.sections = file, lines, sections

    def fail(self, key: str, reason: str) -> RulesError:
        line = self.lines.get(key)
        probe = key
        while line is None and ("." in probe or "[" in probe):
            probe = probe.rsplit(".", 1)[0] if "." in probe else probe.rsplit("[", 1)[0]
            line = self.lines.get(probe)
        return RulesError(self.file, line, key, reason)

    def section(self, data: Any, key: str, schema: str | None = None) -> dict[str, Any]:
        """The mapping at `key`, holding only keys its section allows (`schema`: the
        section's name in SECTIONS when `key` is spelled otherwise; list indices as [])."""
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise self.fail(key, f"must be a mapping, got {type(data).__name__}")
        here = re.sub(r"\[\d+\]", "[]", key) if schema is None else schema
        allowed = self.sections[here]
        unknown = [k for k in data if k not in allowed]
        if unknown:
            first = unknown[0]
            where = f"{key}.{first}" if key else str(first)
            home = _homes(self.sections, str(first), here)
            if home is None:
                raise self.fail(where, f"unknown key (allowed: {', '.join(sorted(allowed))})")
            others = [(str(k), _homes(self.sections, str(k), here)) for k in unknown[1:]]
            same = [k for k, h in others if h == home]
            elsewhere = [f"{k} ({h})" for k, h in others if h is not None and h != home]
            reason = f"unknown key here; it belongs {home}"
            if same:
                reason += f" (as do {', '.join(same)})"
            if elsewhere:
                reason += f"; also misplaced here: {', '.join(elsewhere)}"
            raise self.fail(where, reason)
        return data

    def get(
        self,
        data: dict[str, Any],
        prefix: str,
        name: str,
        check: Callable[[Any], Any],
        default: Any,
    ) -> Any:
        if name not in data:
            return default
        key = f"{prefix}.{name}" if prefix else name
        try:
            return check(data[name])
        except ValueError as exc:
            raise self.fail(key, str(exc)) from None


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise ValueError(f"must be true or false, got {v!r}")


def _int(lo: int = 0, hi: int | None = None, nullable: bool = False) -> Callable[[Any], Any]:
    def check(v: Any) -> int | None:
        if v is None and nullable:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"must be an integer{' or null' if nullable else ''}, got {v!r}")
        if v < lo or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise ValueError(f"must be {rng}, got {v}")
        return v

    return check


def _float(lo: float, hi: float) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"must be a number, got {v!r}")
        if not lo <= v <= hi:
            raise ValueError(f"must be between {lo} and {hi}, got {v}")
        return float(v)

    return check


def _str(choices: tuple[str, ...] | None = None, nonempty: bool = True) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if not isinstance(v, str) or (nonempty and not v):
            raise ValueError(f"must be a non-empty string, got {v!r}")
        if choices and v not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {v!r}")
        return v

    return check


def _str_list(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        return (v,)
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise ValueError(f"must be a list of strings, got {v!r}")
    return tuple(v)


def _max_tokens(v: Any) -> int | Literal["auto"] | None:
    if v == "auto":
        return "auto"
    result: int | None = _int(1, nullable=True)(v)
    return result


def _order(v: Any) -> tuple[str, ...]:
    names = _str_list(v)
    for n in names:
        if n not in STAGES:
            raise ValueError(f"unknown stage {n!r} (stages: {', '.join(STAGES)})")
    if len(set(names)) != len(names):
        raise ValueError("a stage is listed twice")
    if "compact_tools" in names and "length" in names and (
            names.index("compact_tools") > names.index("length")):
        raise ValueError("compact_tools must come before length (it runs first)")
    return names


def _base_url(v: Any) -> str:
    s = _str()(v)
    parts = urlsplit(s)
    # said without a user:password or query (a secret may sit there)
    shown = repr(parts._replace(netloc=parts.netloc.rpartition("@")[2], query="").geturl())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"must be an http(s) URL with a host, got {shown}")
    try:  # what the client would refuse on every request, refused here once
        port = parts.port
    except ValueError:
        raise ValueError(f"port out of range 1-65535, got {shown}") from None
    host = parts.hostname or ""
    if not host or port == 0 or any(c.isspace() or c in "<>\"{}|\\^`" for c in host):
        raise ValueError(f"must name a valid host (and port 1-65535), got {shown}")
    return s.rstrip("/")


def _keep_fields(v: Any) -> tuple[str, ...]:
    names = _str_list(v)
    for n in names:
        if n not in ALL_FIELDS:
            raise ValueError(f"unknown field {n!r} (fields: {', '.join(ALL_FIELDS)})")
    return names


def _parse_carry(
    r: _Reader, data: Any, base_dir: Path, k: str
) -> tuple[CarryRules, CarryPatterns | None, str | None]:
    """memory.carry, or the same section spelled memory.write (`k`: the spelling used)."""
    c = r.section(data, k, "memory.carry")
    if not c:
        return CarryRules(enabled=False), None, None
    dw = r.section(c.get("drop_when"), f"{k}.drop_when", "memory.carry.drop_when")
    d = CarryRules()
    rules = CarryRules(
        enabled=r.get(c, k, "enabled", _bool, True),
        keep_fields=r.get(c, k, "keep_fields", _keep_fields, d.keep_fields),
        task_closed=r.get(dw, f"{k}.drop_when", "task_closed", _bool, d.task_closed),
        no_pending_reference=r.get(dw, f"{k}.drop_when", "no_pending_reference", _bool,
                                   d.no_pending_reference),
        small_talk_only=r.get(dw, f"{k}.drop_when", "small_talk_only", _bool, d.small_talk_only),
        ref_ttl_turns=r.get(c, k, "ref_ttl_turns", _int(0), d.ref_ttl_turns),
        log_skipped=r.get(c, k, "log_skipped", _bool, d.log_skipped),
        max_note_chars=r.get(c, k, "max_note_chars", _int(100), d.max_note_chars),
    )
    path = _companion(r, c, k, "rules_file", "carry.yaml", base_dir)
    return rules, _load_companion(r, f"{k}.rules_file", path, load_carry_patterns), str(path)


def _companion(r: _Reader, data: dict[str, Any], prefix: str, name: str, default: str,
               base_dir: Path) -> Path:
    """A file the config names (relative to the config's folder). Not named: the one of
    that name beside the config, else the one shipped with memgate, so a config copied
    to another folder keeps working; named but absent: refused with the key and path."""
    given: str | None = r.get(data, prefix, name, _str(), None)
    if given is not None:
        path = (base_dir / given).resolve()
        if not path.is_file():
            hint = "" if Path(given).is_absolute() else (
                f"a relative {name} is read from the config's folder; ")
            raise r.fail(f"{prefix}.{name}", f"{path} does not exist ({hint}leave the key "
                         "out for the file shipped with memgate)")
        return path
    beside = base_dir / default
    if beside.is_file():
        return beside.resolve()
    shipped = shipped_file("rules", default)
    if shipped is None:
        raise r.fail(f"{prefix}.{name}", f"no {default} beside the config ({beside}) and "
                     "none shipped with this install: set the key")
    return shipped


def _load_companion(r: _Reader, key: str, path: Path, load: Callable[[Path], Any]) -> Any:
    """load(path), its errors naming the config key that chose the file."""
    try:
        return load(path)
    except RulesError as exc:
        if exc.key in ("<file>", "<document>"):  # the file itself, not a key inside it
            raise r.fail(key, f"{path}: {exc.reason}") from None
        raise


def _parse_memory(r: _Reader, data: Any, base_dir: Path) -> tuple[Memory, str | None]:
    m = r.section(data, "memory")
    b = r.section(m.get("budget"), "memory.budget")
    d = Budget()
    budget = Budget(
        max_tokens=r.get(b, "memory.budget", "max_tokens", _max_tokens, d.max_tokens),
        max_chars=r.get(b, "memory.budget", "max_chars", _int(1, nullable=True), d.max_chars),
        max_messages=r.get(
            b, "memory.budget", "max_messages", _int(1, nullable=True), d.max_messages
        ),
        max_turns=r.get(b, "memory.budget", "max_turns", _int(1, nullable=True), d.max_turns),
        safety_ratio=r.get(b, "memory.budget", "safety_ratio", _float(0.05, 1.0), d.safety_ratio),
        reserve_output_tokens=r.get(
            b, "memory.budget", "reserve_output_tokens", _int(0), d.reserve_output_tokens
        ),
    )
    e = r.section(m.get("eviction"), "memory.eviction")
    de = Eviction()
    cs = r.section(e.get("compact"), "memory.eviction.compact")
    dc, ck = CompactRules(), "memory.eviction.compact"
    compact = CompactRules(
        min_chars=r.get(cs, ck, "min_chars", _int(1), dc.min_chars),
        keep_recent=r.get(cs, ck, "keep_recent", _int(0), dc.keep_recent),
        exclude_tools=r.get(cs, ck, "exclude_tools", _str_list, dc.exclude_tools),
        target_chars=r.get(cs, ck, "target_chars", _int(200), dc.target_chars),
        max_line=r.get(cs, ck, "max_line", _int(40), dc.max_line),
    )
    eviction = Eviction(
        order=r.get(e, "memory.eviction", "order", _order, de.order),
        keep_pinned=r.get(e, "memory.eviction", "keep_pinned", _bool, de.keep_pinned),
        max_pinned=r.get(e, "memory.eviction", "max_pinned", _int(0), de.max_pinned),
        drop_unit=r.get(e, "memory.eviction", "drop_unit", _str(("turn", "group")), de.drop_unit),
        on_over_budget=r.get(
            e, "memory.eviction", "on_over_budget", _str(("forward", "reject")), de.on_over_budget
        ),
        low_water=r.get(e, "memory.eviction", "low_water", _float(0.1, 1.0), de.low_water),
        move_cache_marker=r.get(
            e, "memory.eviction", "move_cache_marker", _bool, de.move_cache_marker
        ),
        compact=compact,
        recall_share=r.get(e, "memory.eviction", "recall_share", _float(0.0, 0.9),
                           de.recall_share),
    )
    k = r.section(m.get("markers"), "memory.markers")
    dk = Markers()
    markers = Markers(
        system_prefix=r.get(k, "memory.markers", "system_prefix", _str(), dk.system_prefix),
        min_score=r.get(k, "memory.markers", "min_score", _float(0.0, 1.0), dk.min_score),
        on_bad_metadata=r.get(k, "memory.markers", "on_bad_metadata",
                              _str(("reject", "ignore")), dk.on_bad_metadata),
    )
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
        enable_eviction=r.get(m, "memory", "enable_eviction", _bool, False),
        shadow=r.get(m, "memory", "shadow", _bool, True),
        budget=budget,
        eviction=eviction,
        markers=markers,
        carry=carry,
        carry_patterns=patterns,
        fallback_original=r.get(m, "memory", "fallback_original", _bool, True),
        fallback_backoff_s=r.get(m, "memory", "fallback_backoff_s", _float(0, 86400), 600.0),
    ), carry_path


def _window(v: Any) -> int:
    if not isinstance(v, str):
        raise ValueError(f"must look like 7d or 12h, got {v!r}")
    return parse_window(v)


def _tags(v: Any) -> tuple[str, ...]:
    return tuple(check_tags(v))


def _parse_store(r: _Reader, data: Any) -> StoreRules:
    k = "store"
    s = r.section(data, k)
    rc = r.section(s.get("recall"), "store.recall")
    d = StoreRules()
    return StoreRules(
        backend=r.get(s, k, "backend", _str(("sqlite", "postgres")), d.backend),
        path=r.get(s, k, "path", _str(), d.path),
        dsn_env=r.get(s, k, "dsn_env", _str(), d.dsn_env),
        write_granularity=r.get(s, k, "write_granularity", _str(("turn", "message", "session")),
                                d.write_granularity),
        session_scope=r.get(s, k, "session_scope", _str(("current", "cross_session")),
                            d.session_scope),
        time_boundary=r.get(s, k, "time_boundary", _str(("closed", "half_open")),
                            d.time_boundary),
        default_time_window_s=r.get(s, k, "default_time_window", _window,
                                    d.default_time_window_s),
        default_tags=r.get(s, k, "default_tags", _tags, d.default_tags),
        search_top_k=r.get(s, k, "search_top_k", _int(1, 100), d.search_top_k),
        max_chars_per_record=r.get(s, k, "max_chars_per_record", _int(1),
                                   d.max_chars_per_record),
        on_overlong=r.get(s, k, "on_overlong", _str(("truncate", "reject")), d.on_overlong),
        archive=r.get(s, k, "archive", _str(("off", "evicted", "all")), d.archive),
        recall_enabled=r.get(rc, "store.recall", "enabled", _bool, d.recall_enabled),
        recall_top_k=r.get(rc, "store.recall", "top_k", _int(1, 20), d.recall_top_k),
        recall_scope=r.get(rc, "store.recall", "scope", _str(("current", "cross_session")),
                           d.recall_scope),
        retention_s=r.get(s, k, "retention", _window_or_none, d.retention_s),
    )


def _window_or_none(v: Any) -> int | None:
    return None if v is None else _window(v)


_HEADER = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _header_names(v: Any) -> tuple[str, ...]:
    names = _str_list(v)
    for n in names:
        if not _HEADER.fullmatch(n):
            raise ValueError(f"{n!r} is not an HTTP header name")
    return names


def _tenant_name(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not _TENANT.fullmatch(v) or v.startswith("t-"):
        # t-<hex> is what keys hash to: a name must never equal a key's tenant
        raise ValueError(f"must be 1-64 of A-Z a-z 0-9 . _ - not starting with t-, got {v!r}")
    return v


def _key_hashes(v: Any) -> frozenset[str]:
    hashes = [h.strip().lower() for h in _str_list(v)]
    for i, h in enumerate(hashes):
        if not _SHA256.fullmatch(h):
            # not echoed: a wrong entry is likely the key itself
            raise ValueError(f"entry {i} is not a hex sha256 digest (64 hex digits) of a "
                             "client key; memgate hash-key prints one")
    return frozenset(hashes)


def _parse_tenants(r: _Reader, data: Any) -> TenantRules:
    k = "tenants"
    t = r.section(data, k)
    d = TenantRules()
    return TenantRules(
        credential_headers=r.get(t, k, "credential_headers", _header_names,
                                 d.credential_headers),
        anonymous=r.get(t, k, "anonymous", _tenant_name, d.anonymous),
        client_keys_sha256=r.get(t, k, "client_keys_sha256", _key_hashes, d.client_keys_sha256),
        allow_any_client=r.get(t, k, "allow_any_client", _bool, d.allow_any_client),
    )


def _tracing_enabled(v: Any) -> bool | Literal["auto"]:
    if v != "auto" and not isinstance(v, bool):
        raise ValueError(f"must be true, false or auto, got {v!r}")
    if v is True and not _otel_installed():  # auto stays off without it (said at startup)
        raise ValueError("tracing needs the otel extra (pip install -e '.[otel]' in a "
                         "checkout)")
    return v  # type: ignore[no-any-return]


def _otel_installed() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry.sdk") is not None
    except ModuleNotFoundError:  # no opentelemetry package at all
        return False


def _parse_tracing(r: _Reader, data: Any) -> TracingRules:
    t = r.section(data, "tracing")
    return TracingRules(enabled=r.get(t, "tracing", "enabled", _tracing_enabled,
                                      TracingRules().enabled))
def _parse_console(r: _Reader, data: Any) -> ConsoleRules:
    k = "console"
    c = r.section(data, k)
    d = ConsoleRules()
    return ConsoleRules(
        enabled=r.get(c, k, "enabled", _bool, d.enabled),
        show_text=r.get(c, k, "show_text", _bool, d.show_text),
        max_sessions=r.get(c, k, "max_sessions", _int(1, 10_000), d.max_sessions),
        ring=r.get(c, k, "ring", _int(1, 500), d.ring),
    )


def _parse_upstreams(r: _Reader, data: Any) -> tuple[Upstream, ...]:
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
        up = Upstream(
            name=r.get(u, key, "name", _str(), ""),
            base_url=r.get(u, key, "base_url", _base_url, ""),
            paths=r.get(u, key, "paths", _str_list, ("/*",)),
            models=r.get(u, key, "models", _str_list, ()),
            connect_timeout_s=r.get(u, key, "connect_timeout_s", _float(0.001, 3600), 10.0),
            read_timeout_s=r.get(u, key, "read_timeout_s", _float(0.001, 86400), 600.0),
            api_key_env=r.get(u, key, "api_key_env", _str(), None),
            api_key_header=r.get(
                u, key, "api_key_header", _str(("authorization", "x-api-key", "api-key")),
                "authorization"
            ),
            proxy=r.get(u, key, "proxy", _base_url, None),
        )
        if up.name in names:
            raise r.fail(f"{key}.name", f"duplicate upstream name {up.name!r}")
        names.add(up.name)
        out.append(up)
    return tuple(out)


def _parse_models(r: _Reader, data: Any) -> tuple[tuple[ModelInfo, ...], str, int]:
    t = r.section(data, "")
    infos: list[ModelInfo] = []
    items = t.get("models") or []
    if not isinstance(items, list):
        raise r.fail("models", "must be a list")
    for i, item in enumerate(items):
        key = f"models[{i}]"
        mi = r.section(item, key)
        if "match" not in mi or "encoding" not in mi:
            raise r.fail(key, "needs match and encoding")
        infos.append(
            ModelInfo(
                match=r.get(mi, key, "match", _str(), ""),
                encoding=r.get(mi, key, "encoding", _str(), ""),
                context_window=r.get(mi, key, "context_window", _int(1), 8192),
            )
        )
    dflt = r.section(t.get("default"), "default")
    return (
        tuple(infos),
        r.get(dflt, "default", "encoding", _str(), "cl100k_base"),
        r.get(dflt, "default", "context_window", _int(1), 8192),
    )


def _load_yaml(path: Path) -> tuple[Any, _Lines]:
    data, root = load_yaml(path)
    return data, _line_map(root)


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
        return _base_url(raw)
    except ValueError as exc:
        raise RulesError(f"env:{name}", None, name, str(exc)) from None


def load_rules(path: str | Path | None, env: Mapping[str, str] | None = None) -> Rules:
    """Build a complete Rules snapshot from a YAML file plus MEMGATE_* overrides."""
    env = os.environ if env is None else env
    if path is None:
        return apply_env(Rules(), env)
    p = Path(path)
    data, lines = _load_yaml(p)
    return apply_env(build_rules(data, str(p), lines, p.parent), env)


def build_rules(
    data: Any,
    file: str = "<mapping>",
    lines: _Lines | None = None,
    base_dir: Path | None = None,
) -> Rules:
    """Validate parsed config data (as from YAML) into Rules; no env overrides."""
    r = _Reader(file, lines or {})
    base_dir = base_dir or Path.cwd()
    top = r.section(data if data is not None else {}, "")
    memory, carry_path = _parse_memory(r, top.get("memory"), base_dir)
    c = r.section(top.get("capture"), "capture")
    dc = CaptureRules()
    capture = CaptureRules(
        enabled=r.get(c, "capture", "enabled", _bool, dc.enabled),
        dir=r.get(c, "capture", "dir", _str(), dc.dir),  # relative: to the working directory
        sample_rate=r.get(c, "capture", "sample_rate", _float(0.0, 1.0), dc.sample_rate),
        max_files=r.get(c, "capture", "max_files", _int(1), dc.max_files),
        around_change=r.get(c, "capture", "around_change", _int(0), dc.around_change),
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
        backend=r.get(st, "state", "backend", _str(("memory", "redis")), "memory"),
        redis_url_env=r.get(st, "state", "redis_url_env", _str(), "MEMGATE_REDIS_URL"),
        ttl_s=r.get(st, "state", "ttl_s", _int(60), 86400),
        key_prefix=r.get(st, "state", "key_prefix", _str(), "memgate"),
        connect_timeout_s=r.get(st, "state", "connect_timeout_s", _float(0.001, 60), 0.25),
        read_timeout_s=r.get(st, "state", "read_timeout_s", _float(0.001, 60), 0.5),
        retry_after_s=r.get(st, "state", "retry_after_s", _float(0.0, 3600), 5.0),
    )
    mpath = _companion(r, tokens, "tokens", "models_file", "models.yaml", base_dir)
    mdata, mlines = _load_companion(r, "tokens.models_file", mpath, _load_yaml)
    models, default_encoding, default_window = _parse_models(
        _Reader(str(mpath), mlines, MODEL_SECTIONS), mdata
    )

    rules = Rules(
        memory=memory,
        upstreams=upstreams,
        listen_host=r.get(listen, "listen", "host", _str(), "127.0.0.1"),
        listen_port=r.get(listen, "listen", "port", _int(0, 65535), 8080),
        listen_admin_port=_admin_port(r, listen),
        listen_admin_host=r.get(listen, "listen", "admin_host", _str(), "127.0.0.1"),
        log_format=r.get(logging_, "logging", "format", _str(("console", "json")), "console"),
        log_level=r.get(
            logging_, "logging", "level", _str(("debug", "info", "warning", "error")), "info"
        ),
        max_body_bytes=r.get(limits, "limits", "max_body_bytes", _int(1024), 32 * 1024 * 1024),
        session_header=r.get(session, "session", "header", _str(), "X-Session-Id"),
        max_tracked_sessions=r.get(session, "session", "max_tracked", _int(1), 10_000),
        history_cache_mb=r.get(session, "session", "history_cache_mb", _int(0), 256),
        token_cache_size=r.get(tokens, "tokens", "cache_size", _int(0), 200_000),
        approx_token_factor=r.get(tokens, "tokens", "approx_factor", _float(0.5, 3.0), 1.15),
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
    return rules


def _admin_port(r: _Reader, listen: dict[str, Any]) -> int | None:
    """listen.admin_port: a fixed port (1..65535; the admin listener is told apart from the
    main one by it) other than listen.port."""
    port: int | None = r.get(listen, "listen", "admin_port", _int(1, 65535, nullable=True), None)
    if port is not None and port == listen.get("port", 8080):
        raise r.fail("listen.admin_port", f"must differ from listen.port ({port}): the admin "
                                          "listener is a port of its own")
    return port


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
    from dataclasses import replace

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
                              | _key_hashes(keys))
        except ValueError as exc:
            raise RulesError("env:MEMGATE_CLIENT_KEYS_SHA256", None,
                             "MEMGATE_CLIENT_KEYS_SHA256", str(exc)) from None
    off = _env_shortcuts(env)
    if "prefilter" in off and memory.carry_patterns is not None:
        memory = replace(memory, carry_patterns=replace(memory.carry_patterns,
                                                        prefilter_on=False))
    return replace(rules, memory=memory, upstreams=tuple(upstreams), log_format=log_format,
                   tenants=tenants, shortcuts_off=off)


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
