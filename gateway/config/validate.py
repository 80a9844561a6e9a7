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

from gateway.config.schema import ALL_FIELDS, SESSION_SOURCES, STAGES

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


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_tool_name(v: Any) -> str:
    """A tool name every wire takes (OpenAI's and Anthropic's rule: ^[a-zA-Z0-9_-]{1,64}$)."""
    if not isinstance(v, str) or not _TOOL_NAME.fullmatch(v):
        raise ValueError(f"must be 1-64 letters, digits, _ or -, got {v!r}")
    return v


MAX_PREFIXES = 32
MAX_PREFIX_CHARS = 256


def check_prefixes(v: Any) -> tuple[str, ...]:
    """Distinct non-empty text prefixes, a bounded few (each is tried on the opening user
    messages of every request)."""
    if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
        raise ValueError(f"must be a list of non-empty strings, got {v!r}")
    if len(v) > MAX_PREFIXES:
        raise ValueError(f"at most {MAX_PREFIXES} prefixes, got {len(v)}")
    for x in v:
        if len(x) > MAX_PREFIX_CHARS:
            raise ValueError(f"a prefix is at most {MAX_PREFIX_CHARS} characters")
    return tuple(dict.fromkeys(x.strip() for x in v))


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


# headers that carry a caller's secret: a session id is written on every [mem] line
_SECRET_HEADERS = frozenset(("authorization", "proxy-authorization", "x-api-key", "api-key",
                             "cookie"))


def check_session_sources(v: Any) -> tuple[str, ...]:
    """session.id_from: distinct sources, each `header:<Name>` or a named one, ending with
    `fingerprint` (the id of a request no other source names); no header that carries a
    secret."""
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"must be a list of sources ending with fingerprint, got {v!r}")
    seen: set[str] = set()
    for i, name in enumerate(v):
        kind, colon, header = name.partition(":")
        if colon and (kind != "header" or not _HEADER.fullmatch(header)):
            raise ValueError(f"entry {i} ({name!r}): a header source is header:<Name>, "
                             "with an HTTP header name")
        if colon and header.lower() in _SECRET_HEADERS:
            raise ValueError(f"entry {i} ({name!r}): that header carries the caller's key or "
                             "cookie, and a session id is written on every [mem] line")
        if not colon and name not in SESSION_SOURCES:
            raise ValueError(f"entry {i}: unknown source {name!r}; the sources are "
                             f"header:<Name>, {', '.join(SESSION_SOURCES)}")
        same = name.lower() if colon else name  # header names are case-insensitive
        if same in seen:
            raise ValueError(f"entry {i}: {name!r} is listed twice")
        seen.add(same)
    if "fingerprint" not in seen:
        raise ValueError("must end with fingerprint: a request no other source names gets "
                         "the fingerprint of its conversation's opening")
    if v[-1] != "fingerprint":
        raise ValueError(f"fingerprint must be the last entry: {v[-1]!r} after it is never "
                         "read (every request has a fingerprint)")
    return tuple(v)


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
