"""Who is calling: the caller's credential and its tenant (the session id:
`gateway.memory.session_sources`).

The credential is the key in the first credential header that holds a usable one:
`Authorization` (a bare key or `Bearer <key>`), `x-api-key`, `api-key`, then the
headers `tenants.credential_headers` names. Empty or whitespace-only values, a scheme
with no token, anything but visible ASCII (control bytes; non-UTF-8 bytes, which aiohttp
hands over as surrogate escapes) and an unset variable's rendering (`Bearer undefined`,
`Bearer None`) are no credential: such a request has no tenant, so it gets no memory,
unless `tenants.anonymous` names one. The tenant is a hash of the key, so the same key
is one tenant in whichever header it comes.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.config.schema import TenantRules

BUILTIN_HEADERS = ("Authorization", "x-api-key", "api-key")
_KEY = re.compile(r"[\x21-\x7e]+")
# what a client whose key variable is unset sends, and the stand-ins the local model
# servers' docs tell SDK users to pass (the SDKs refuse an empty key): shared by every
# such client, so no one's key (vLLM "EMPTY", llama.cpp "sk-no-key-required", Ollama
# "ollama", LM Studio "lm-studio", ...)
_PLACEHOLDERS = frozenset((
    "undefined", "null", "none", "nil", "empty", "dummy", "placeholder", "not-needed",
    "not_needed", "no-key", "nokey", "sk-no-key-required", "ollama", "lm-studio",
    "lmstudio", "sk-xxx", "sk-dummy", "sk-placeholder", "fake", "fake-key", "sk-fake"))


@functools.lru_cache(maxsize=4096)  # a client sends the same value on every request
def key_of(value: str) -> str | None:
    """The key in one header value, or None when it holds no usable one."""
    parts = value.split()
    if len(parts) == 2 and parts[0].lower() == "bearer":
        key = parts[1]
    elif len(parts) == 1 and parts[0].lower() != "bearer":
        key = parts[0]
    else:
        return None
    if _KEY.fullmatch(key) is None or key.lower() in _PLACEHOLDERS:
        return None
    return key


def credential(headers: Mapping[str, str], extra_headers: tuple[str, ...] = ()) -> str | None:
    """The caller's key: the first usable one of the credential headers."""
    for name in BUILTIN_HEADERS + extra_headers:
        value = headers.get(name)
        if value is not None and (key := key_of(value)) is not None:
            return key
    return None


@functools.lru_cache(maxsize=4096)
def key_sha256(key: str) -> str:
    """Hex sha256 of a key (keys are visible ASCII: encoding cannot fail)."""
    return hashlib.sha256(key.encode()).hexdigest()


@functools.lru_cache(maxsize=4096)
def _tenant_of_key(key: str) -> str:
    return "t-" + key_sha256(key)[:16]


def tenant_of(headers: Mapping[str, str], rules: TenantRules) -> str | None:
    """A stable, non-reversible tenant id from the caller's key; without a usable key
    the configured anonymous tenant, else None (no memory)."""
    key = credential(headers, rules.credential_headers)
    return rules.anonymous if key is None else _tenant_of_key(key)


def client_refusal(headers: Mapping[str, str], rules: TenantRules) -> str | None:
    """Why this caller may not use a route that gets the gateway's own key (None: it may)."""
    if rules.allow_any_client:
        return None
    if not rules.client_keys_sha256:
        return ("this route sends the gateway's own API key upstream and no client keys are "
                "allowed to use it (tenants.client_keys_sha256 or MEMGATE_CLIENT_KEYS_SHA256)")
    key = credential(headers, rules.credential_headers)
    if key is None:
        return ("this route needs your client key (Authorization: Bearer <key>, x-api-key "
                "or api-key)")
    if key_sha256(key) not in rules.client_keys_sha256:
        return "your key is not on this gateway's client allowlist"
    return None
