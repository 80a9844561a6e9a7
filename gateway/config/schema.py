"""The config's shape: the `Rules` snapshot and its sections, as frozen dataclasses.

The loader (`gateway.config.rules`) validates a file into them; each stage reads its own
section (compaction, the carry note, the memory store, the tenants), and a request asks
the snapshot the lookups kept with it (which upstream serves a path, what a model's
window is). They live here, beneath the stages, so that the config never imports a
stage and a stage imports no loader.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from gateway.config.carry import CarryPatterns

Boundary = Literal["closed", "half_open"]
# the API an upstream speaks (`any`: both); a request's own is "openai" or "anthropic"
UpstreamWire = Literal["openai", "anthropic", "any"]
SEED_KEEP = ("task_state", "resolved_refs", "confirmed_constraints", "output_file")
# what an agent's tool calls leave (only sessions with tool calls have them)
AGENT_KEEP = ("workdir", "conclusion", "files_written", "files_touched")
ALL_FIELDS = (*SEED_KEEP, *AGENT_KEEP, "refs", "tool_results", "dropped_candidates",
              "ambiguous")


@dataclass(frozen=True, slots=True)
class CompactRules:
    min_chars: int = 2000  # results shorter than this stay as they are
    keep_recent: int = 1  # the newest N tool results are never compacted
    exclude_tools: tuple[str, ...] = ()
    target_chars: int = 1200  # a lossless form up to this size is enough
    head_lines: int = 12
    tail_lines: int = 6
    error_lines: int = 12  # at most this many error/warning lines from the middle
    max_line: int = 120  # characters kept of one long line (or JSON string): head + tail
    max_items: int = 8  # elements of a JSON list / members of an object kept


@dataclass(frozen=True, slots=True)
class CarryRules:
    enabled: bool = True
    keep_fields: tuple[str, ...] = (*SEED_KEEP, *AGENT_KEEP)
    task_closed: bool = True
    no_pending_reference: bool = True
    small_talk_only: bool = True
    ref_ttl_turns: int = 3
    log_skipped: bool = True
    max_note_chars: int = 1200


@dataclass(frozen=True, slots=True)
class StoreRules:
    backend: Literal["sqlite", "postgres"] = "sqlite"
    path: str = "var/memgate.db"  # sqlite file
    dsn_env: str = "MEMGATE_STORE_DSN"  # postgres DSN comes from this env var
    write_granularity: Literal["turn", "message", "session"] = "turn"
    session_scope: Literal["current", "cross_session"] = "current"
    time_boundary: Boundary = "half_open"
    default_time_window_s: int = 7 * 86400
    # added to every record written, and the tag filter of a search that names no tags
    default_tags: tuple[str, ...] = ()
    search_top_k: int = 5
    max_chars_per_record: int = 8000
    on_overlong: Literal["truncate", "reject"] = "truncate"
    archive: Literal["off", "evicted", "all"] = "off"
    recall_enabled: bool = False
    recall_top_k: int = 3
    recall_scope: Literal["current", "cross_session"] = "current"
    # records whose ts is older than this are deleted (None, when the key is absent:
    # kept for ever, so an upgrade deletes nothing; the shipped configs say 90d)
    retention_s: int | None = None


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


# the text that opens the client context agents send in a session's first user messages
# (memory.context.prefixes): Claude Code's reminders (CLAUDE.md, the date, agent lists),
# Codex's environment context and AGENTS.md / user instructions
CONTEXT_PREFIXES = ("<system-reminder>", "<environment_context>", "<user_instructions>",
                    "# AGENTS.md instructions")


# what the retrieval tool says of itself: the same bytes on every request of every session
RETRIEVE_DESCRIPTION = (
    "Returns content memgate left out of this conversation to fit its context budget: "
    "earlier turns and the full text of shortened tool results. Call it with the handle "
    "a [memgate: ...] marker names when you need what was left out, with a query to get "
    "only the passages holding its words; a long result comes in parts (call again with "
    "the offset it gives).")
# models that take no tools: the retrieval tool is never added to their requests
NO_TOOL_MODELS = ("o1-mini*", "o1-preview*", "chatgpt-4o-latest", "*-search-preview*",
                  "*-audio-preview*", "*-realtime-preview*", "gpt-3.5-turbo-instruct*")


@dataclass(frozen=True, slots=True)
class RetrieveRules:
    """memory.retrieve: a tool memgate adds to a request it cuts and answers itself."""

    enabled: bool = False
    tool_name: str = "memgate_retrieve"
    description: str = RETRIEVE_DESCRIPTION
    max_rounds: int = 3  # extra upstream requests one client request may cost
    max_result_chars: int = 8000  # of one tool result memgate answers (the rest: offset)
    # results of the current turn at least this long are excerpted too (head and tail,
    # with a handle); None: the current turn's results stay whole
    excerpt_min_chars: int | None = None
    skip_models: tuple[str, ...] = NO_TOOL_MODELS

    def takes_tools(self, model: str | None) -> bool:
        return model is None or not any(fnmatch.fnmatchcase(model, p)
                                        for p in self.skip_models)


@dataclass(frozen=True, slots=True)
class Memory:
    enable_eviction: bool = False
    shadow: bool = True
    budget: Budget = field(default_factory=Budget)
    eviction: Eviction = field(default_factory=Eviction)
    markers: Markers = field(default_factory=Markers)
    # a user message before the history's first reply holding a text that starts with
    # one of these is the client's context: kept like the system prompt, not a turn
    context_prefixes: tuple[str, ...] = CONTEXT_PREFIXES
    carry: CarryRules = field(default_factory=lambda: CarryRules(enabled=False))
    carry_patterns: CarryPatterns | None = None
    retrieve: RetrieveRules = field(default_factory=RetrieveRules)
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
    # the API it speaks: a request known to speak another one goes elsewhere when an
    # upstream of its own is configured (Rules.upstream_for), so that its key never
    # reaches another provider; `any`: a gateway that speaks both (LiteLLM, a mock)
    wire: UpstreamWire = "any"

    def serves(self, path: str, model: str | None) -> bool:
        if not any(fnmatch.fnmatchcase(path, p) for p in self.paths):
            return False
        if self.models and model is not None:
            return any(fnmatch.fnmatchcase(model, m) for m in self.models)
        return not self.models

    def speaks(self, wire: str | None) -> bool:
        """May a request of this wire (None: not known) come here?"""
        return wire is None or self.wire == "any" or self.wire == wire


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


# the sources `session.id_from` may name besides `header:<Name>`: what each takes is in
# gateway/memory/session_sources.py and docs/configuration.md
SESSION_SOURCES = ("metadata.session_id", "metadata.user_id.session_id",
                   "client_metadata.session_id", "previous_response_id", "conversation",
                   "prompt_cache_key", "user", "fingerprint")
# the gateway's own ids first (a caller that names its session means it), then what Claude
# Code and Codex send (each names its own session), Responses' server-side threads, a
# cache key (often shared by many sessions of one prompt), the end user (all of a user's
# sessions), and the fingerprint of the conversation's opening for the rest
SESSION_ID_FROM = (
    "header:X-Session-Id", "metadata.session_id",
    "header:X-Claude-Code-Session-Id", "metadata.user_id.session_id",
    "header:session-id", "header:session_id", "header:conversation_id",
    "client_metadata.session_id", "previous_response_id", "conversation",
    "prompt_cache_key", "user", "fingerprint",
)


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
        # "/": Claude Code's start-up `HEAD /` (Bun's preconnect) carries no header
        Upstream("anthropic", "https://api.anthropic.com", paths=("/v1/messages*", "/"),
                 api_key_header="x-api-key", wire="anthropic"),
        Upstream("openai", "https://api.openai.com", wire="openai"),
    )
    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    # /metrics and /admin/* on their own listener (None: on the main one); read at start-up
    listen_admin_port: int | None = None
    listen_admin_host: str = "127.0.0.1"
    log_format: Literal["console", "json"] = "console"
    log_level: str = "info"
    max_body_bytes: int = 32 * 1024 * 1024
    # the per-process content caches together (limits.cache_mb; proxy/cache_bounds.py)
    cache_mb: int = 256
    # where a request's session id comes from, first match wins (session.id_from)
    session_id_from: tuple[str, ...] = SESSION_ID_FROM
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
                     wire: str | None = None) -> Upstream:
        """Where a request goes, always one of the configured upstreams. `wire`: the API
        the request is known to speak (`anthropic`: the Messages route, or Anthropic's
        headers; `openai`: a chat completions or Responses route; None: not known). The
        first upstream whose `paths` (and `models`) serve the request and which speaks
        its wire; else the default one if it speaks it; else the first upstream
        declaring that wire (Anthropic's /v1/models, files, `HEAD /`: never with its key
        to another provider). With no upstream of that wire configured, or the wire not
        known: by path alone, as the config lists them, else the default one."""
        key = ("upstream", path, model, wire)
        up: Upstream | None = self.memo.get(key)
        if up is None:
            up = self._route(path, model, wire)
            self.remember(key, up)
        return up

    def _route(self, path: str, model: str | None, wire: str | None) -> Upstream:
        default = self.default_upstream
        by_path = [u for u in self.upstreams if u.serves(path, model)]
        if wire is not None and any(u.wire == wire for u in self.upstreams):
            return next((u for u in by_path if u.speaks(wire)),
                        default if default.speaks(wire)
                        else next(u for u in self.upstreams if u.wire == wire))
        return by_path[0] if by_path else default

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
