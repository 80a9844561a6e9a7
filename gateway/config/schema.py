"""Settings sections that the stages read, as frozen dataclasses the loader builds.

Each stage reads its own section (compaction, the carry note, the memory store); the
loader (`gateway.config.rules`) validates a file into them. They live here, beneath the
stages, so that the config never imports a stage and a stage imports no loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Boundary = Literal["closed", "half_open"]
SEED_KEEP = ("task_state", "resolved_refs", "confirmed_constraints", "output_file")
ALL_FIELDS = (*SEED_KEEP, "refs", "tool_results", "dropped_candidates", "ambiguous")


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
    keep_fields: tuple[str, ...] = SEED_KEEP
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
