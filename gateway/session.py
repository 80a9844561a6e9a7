"""Who is calling: the tenant (from credentials) and the session id."""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from typing import Any

_SAFE = re.compile(r"[^A-Za-z0-9._:@/-]")
MAX_ID = 128


def credential(headers: Mapping[str, str]) -> str:
    auth = headers.get("Authorization") or headers.get("x-api-key") or ""
    return auth.removeprefix("Bearer ").strip()


@functools.lru_cache(maxsize=4096)
def _tenant_of_key(key: str) -> str:
    return "t-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def tenant_of(headers: Mapping[str, str]) -> str:
    """A stable, non-reversible tenant id from the caller's API key."""
    key = credential(headers)
    return _tenant_of_key(key) if key else "anon"


def _clean(value: str) -> str:
    return _SAFE.sub("_", value)[:MAX_ID]


def session_id(
    headers: Mapping[str, str],
    header_name: str,
    payload: Mapping[str, Any],
    tenant: str,
    system_text: str,
    first_user_text: str,
) -> str:
    """Header > body metadata.session_id > body user > fingerprint of the conversation start."""
    h = headers.get(header_name)
    if h:
        return _clean(h)
    meta = payload.get("metadata")
    if isinstance(meta, dict):
        sid = meta.get("session_id")
        if isinstance(sid, str) and sid:
            return _clean(sid)
    user = payload.get("user")
    if isinstance(user, str) and user:
        return _clean(user)
    digest = hashlib.sha256(
        "\0".join((tenant, system_text, first_user_text)).encode("utf-8", "surrogatepass")
    ).hexdigest()
    return "fp-" + digest[:16]
