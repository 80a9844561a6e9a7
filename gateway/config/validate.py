"""Checks of single config values, shared by the loader and the stages that take the same
values from a client (a memory record's tags, a time window)."""

from __future__ import annotations

import re
from typing import Any

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
