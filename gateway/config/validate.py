"""Checks of single config values, shared by the loader and the stages that take the same
values from a client (a memory record's tags, a time window).

A check takes the value as parsed (from YAML or the environment) and returns it typed,
or raises ValueError saying what is wrong without the key: the caller knows the key and
where it was written (`gateway.config.reader`). `check_int`, `check_float` and
`check_str` take their bounds or choices and return the check, as in
`check_int(1, 65535)`.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from typing import Any, Literal
from urllib.parse import urlsplit

from gateway.config.schema import ALL_FIELDS, STAGES

MAX_ID_CHARS = 256  # ids and tags are index keys (a PostgreSQL b-tree entry is <= ~2.7 KB)
MAX_TAGS = 100


def check_tags(v: Any) -> list[str]:
    """A list of distinct non-empty tags (ValueError says what is wrong, without the key)."""
    if not isinstance(v, list) or not all(isinstance(t, str) and t for t in v):
        raise ValueError("must be a list of non-empty strings")
    if len(v) > MAX_TAGS:
        raise ValueError(f"at most {MAX_TAGS} tags, got {len(v)}")
    for t in v:
        if len(t) > MAX_ID_CHARS or "\0" in t:
            raise ValueError(f"a tag is at most {MAX_ID_CHARS} characters, without NUL")
    return list(dict.fromkeys(v))


def parse_window(v: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([smhdw])", v.strip())
    if not m:
        raise ValueError(f"must look like 30m, 12h, 7d or 2w, got {v!r}")
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[m.group(2)]


def check_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise ValueError(f"must be true or false, got {v!r}")


def check_int(lo: int = 0, hi: int | None = None, nullable: bool = False) -> Callable[[Any], Any]:
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


def check_float(lo: float, hi: float) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"must be a number, got {v!r}")
        if not lo <= v <= hi:
            raise ValueError(f"must be between {lo} and {hi}, got {v}")
        return float(v)

    return check


def check_str(choices: tuple[str, ...] | None = None,
              nonempty: bool = True) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if not isinstance(v, str) or (nonempty and not v):
            raise ValueError(f"must be a non-empty string, got {v!r}")
        if choices and v not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {v!r}")
        return v

    return check


def check_str_list(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        return (v,)
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise ValueError(f"must be a list of strings, got {v!r}")
    return tuple(v)


def check_max_tokens(v: Any) -> int | Literal["auto"] | None:
    if v == "auto":
        return "auto"
    result: int | None = check_int(1, nullable=True)(v)
    return result


def check_order(v: Any) -> tuple[str, ...]:
    names = check_str_list(v)
    for n in names:
        if n not in STAGES:
            raise ValueError(f"unknown stage {n!r} (stages: {', '.join(STAGES)})")
    if len(set(names)) != len(names):
        raise ValueError("a stage is listed twice")
    if "compact_tools" in names and "length" in names and (
            names.index("compact_tools") > names.index("length")):
        raise ValueError("compact_tools must come before length (it runs first)")
    return names


def check_base_url(v: Any) -> str:
    s = check_str()(v)
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


def check_keep_fields(v: Any) -> tuple[str, ...]:
    names = check_str_list(v)
    for n in names:
        if n not in ALL_FIELDS:
            raise ValueError(f"unknown field {n!r} (fields: {', '.join(ALL_FIELDS)})")
    return names


def check_window(v: Any) -> int:
    if not isinstance(v, str):
        raise ValueError(f"must look like 7d or 12h, got {v!r}")
    return parse_window(v)


def check_tag_tuple(v: Any) -> tuple[str, ...]:
    return tuple(check_tags(v))


def check_window_or_none(v: Any) -> int | None:
    return None if v is None else check_window(v)


_HEADER = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_header_names(v: Any) -> tuple[str, ...]:
    names = check_str_list(v)
    for n in names:
        if not _HEADER.fullmatch(n):
            raise ValueError(f"{n!r} is not an HTTP header name")
    return names


def check_tenant_name(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not _TENANT.fullmatch(v) or v.startswith("t-"):
        # t-<hex> is what keys hash to: a name must never equal a key's tenant
        raise ValueError(f"must be 1-64 of A-Z a-z 0-9 . _ - not starting with t-, got {v!r}")
    return v


def check_key_hashes(v: Any) -> frozenset[str]:
    hashes = [h.strip().lower() for h in check_str_list(v)]
    for i, h in enumerate(hashes):
        if not _SHA256.fullmatch(h):
            # not echoed: a wrong entry is likely the key itself
            raise ValueError(f"entry {i} is not a hex sha256 digest (64 hex digits) of a "
                             "client key; memgate hash-key prints one")
    return frozenset(hashes)


def check_tracing_enabled(v: Any) -> bool | Literal["auto"]:
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
