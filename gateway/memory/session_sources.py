"""Which session a request belongs to: the sources of its id in the configured order
(`session.id_from`), and the fingerprint of a conversation's opening for a request that
names none.

A source is `header:<Name>` (that header's value) or one of the body's: the gateway's
own `metadata.session_id`; the session part of Anthropic's `metadata.user_id` (Claude Code
sends `user_<hash>_account_<uuid>_session_<uuid>`, or a JSON string with a `session_id`
field: only that part is taken, never the user's or the account's); Codex's
`client_metadata.session_id`; Responses' `previous_response_id` (the session of the
request whose answer it continues: the caller looks the response id up, see
`candidates`) and `conversation` (a string id or an object with `id`);
`prompt_cache_key`; `user`; and `fingerprint`, always last. The first source that names
an id wins; the id is cleaned (characters outside `A-Za-z0-9._:@/-` become `_`, at most
MAX_ID of them). The tenant never comes from here: session state is keyed by (tenant,
session), so an id a client sends never reaches another tenant's state.

The fingerprint hashes what the model reads at the start of the conversation, not the
JSON a client wrapped it in: the tenant, the system text (Anthropic `system`, Responses
`instructions`, the system and developer messages before the first prompt), the tool
names, and the opening user messages up to the first real prompt — the client context
they carry (texts starting with one of `memory.context.prefixes`: Claude Code's
`<system-reminder>` blocks, Codex's `<environment_context>`, AGENTS.md and
`<user_instructions>` items) and the first text that is not context. So it is the same
on every request of a session, wherever per-request markers such as `cache_control`
move, and differs between sessions whose system prompt, tools, client context (a working
directory) or first prompt differ. A part that is not text (an image, a file) counts as
its JSON without `cache_control`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import orjson

from gateway.config.schema import CONTEXT_PREFIXES
from gateway.measure.conversation import has_prefix

_SAFE = re.compile(r"[^A-Za-z0-9._:@/-]")
MAX_ID = 128
# the source whose value is a response id to look up, not a session id
CHAINED = "previous_response_id"
FINGERPRINT = "fingerprint"
# Claude Code's metadata.user_id before it became JSON: the session is the last part
_CLAUDE_SESSION = re.compile(r"(?:^|_)session_([^_]+)$")


def clean(value: str) -> str:
    """An id as the gateway keeps and logs it."""
    return _SAFE.sub("_", value)[:MAX_ID]


def _field(payload: Mapping[str, Any], *path: str) -> str | None:
    """The non-empty string at `path` in the body, else None."""
    value: Any = payload
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value if isinstance(value, str) and value.strip() else None


def claude_session(payload: Mapping[str, Any]) -> str | None:
    """The session part of Anthropic's `metadata.user_id` (Claude Code's), else None."""
    uid = _field(payload, "metadata", "user_id")
    if uid is None:
        return None
    if uid.lstrip().startswith("{"):
        try:
            parsed = orjson.loads(uid)
        except orjson.JSONDecodeError:
            return None
        sid = parsed.get("session_id") if isinstance(parsed, dict) else None
        return sid if isinstance(sid, str) and sid.strip() else None
    m = _CLAUDE_SESSION.search(uid)
    return m.group(1) if m else None


def _conversation(payload: Mapping[str, Any]) -> str | None:
    return _field(payload, "conversation") or _field(payload, "conversation", "id")


_BODY: dict[str, Callable[[Mapping[str, Any]], str | None]] = {
    "metadata.session_id": lambda p: _field(p, "metadata", "session_id"),
    "metadata.user_id.session_id": claude_session,
    "client_metadata.session_id": lambda p: _field(p, "client_metadata", "session_id"),
    CHAINED: lambda p: _field(p, "previous_response_id"),
    "conversation": _conversation,
    "prompt_cache_key": lambda p: _field(p, "prompt_cache_key"),
    "user": lambda p: _field(p, "user"),
}


def candidates(
    sources: tuple[str, ...],
    headers: Mapping[str, str],
    payload: Mapping[str, Any],
    items: list[Any] | None,
    tenant: str | None,
    prefixes: tuple[str, ...] = CONTEXT_PREFIXES,
) -> Iterator[tuple[str, str]]:
    """(source, cleaned id) for each source that names one, in `sources`' order, ending
    with the fingerprint (computed only when reached). For `previous_response_id` the
    value is the response id the request continues, not a session: the caller looks up
    the session that answer belonged to and goes on to the next candidate when it is
    unknown."""
    for source in sources:
        if source == FINGERPRINT:
            yield source, fingerprint(tenant, payload, items, prefixes)
            return
        if source.startswith("header:"):
            value = headers.get(source[len("header:"):])
            value = value if value is not None and value.strip() else None
        else:
            value = _BODY[source](payload)
        if value is not None:
            yield source, clean(value.strip())


def first_named(
    sources: tuple[str, ...], headers: Mapping[str, str], payload: Mapping[str, Any],
    items: list[Any] | None, tenant: str | None,
    prefixes: tuple[str, ...] = CONTEXT_PREFIXES,
) -> tuple[str, str]:
    """(session id, source) without session state (offline commands): a response id
    cannot be looked up there, so `previous_response_id` is passed over."""
    for source, value in candidates(sources, headers, payload, items, tenant, prefixes):
        if source != CHAINED:
            return value, source
    raise AssertionError("the loader makes fingerprint the last source")


def _texts(content: Any) -> list[str]:
    """What the model reads of a message's content: its text parts, and any other part
    (an image, a file) as its JSON without per-request cache markers."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return []
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, dict):
            text = part.get("text")
            out.append(text if isinstance(text, str) else _media(part))
    return out


def _media(part: dict[str, Any]) -> str:
    try:
        return orjson.dumps({k: v for k, v in part.items() if k != "cache_control"},
                            option=orjson.OPT_SORT_KEYS).decode()
    except orjson.JSONEncodeError:  # nested deeper than orjson writes: its kind at least
        return str(part.get("type"))


def _tool_names(tools: Any) -> list[str]:
    """The tools' names (a built-in tool without one: its type), sorted."""
    names = set()
    for tool in tools if isinstance(tools, list) else ():
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function")
        name = tool.get("name")
        if not isinstance(name, str) and isinstance(fn, dict):
            name = fn.get("name")
        if not isinstance(name, str):
            name = tool.get("type")
        if isinstance(name, str):
            names.add(name)
    return sorted(names)


def opening(items: list[Any] | None, prefixes: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(system texts, opening texts): the system and developer messages before the first
    real prompt, and the user messages' texts up to and including it (their client
    context, then the first text that is not context)."""
    system: list[str] = []
    opened: list[str] = []
    for item in items or ():
        if not isinstance(item, dict):
            continue
        role = item.get("role")
        if role in ("system", "developer"):
            system += _texts(item.get("content"))
        elif role == "user":
            texts = _texts(item.get("content"))
            context = [has_prefix(t, prefixes) for t in texts]
            real = [t for t, c in zip(texts, context, strict=True) if not c]
            opened += [t for t, c in zip(texts, context, strict=True) if c] + real
            if real:
                break
    return system, opened


def fingerprint(
    tenant: str | None, payload: Mapping[str, Any], items: list[Any] | None,
    prefixes: tuple[str, ...] = CONTEXT_PREFIXES,
) -> str:
    """`fp-` and 16 hex digits of the conversation's opening (see the module docstring)."""
    system, opened = opening(items, prefixes)
    top = [*_texts(payload.get("system")), *_texts(payload.get("instructions"))]
    h = hashlib.sha256()
    # each group is its length, then each string its length and bytes: no two different
    # openings hash the same bytes
    for group in ([tenant or ""], top + system, _tool_names(payload.get("tools")), opened):
        h.update(len(group).to_bytes(8, "big"))
        for text in group:
            data = text.encode("utf-8", "surrogatepass")
            h.update(len(data).to_bytes(8, "big") + data)
    return "fp-" + h.hexdigest()[:16]
