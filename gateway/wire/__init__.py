"""Wire formats: each turns its API's history into a neutral `Conversation`
and a `Plan` back into a body of the same API."""

from __future__ import annotations

from typing import Any

from gateway.wire.anthropic_messages import ANTHROPIC_MESSAGES
from gateway.wire.base import Wire
from gateway.wire.openai_chat import OPENAI_CHAT
from gateway.wire.openai_responses import OPENAI_RESPONSES

WIRES: dict[str, Wire] = {
    "chat": OPENAI_CHAT,
    "messages": ANTHROPIC_MESSAGES,
    "responses": OPENAI_RESPONSES,
}
# route -> wire; the first route of a wire is its canonical path (path_of). Azure OpenAI:
# the deployment routes (AzureOpenAI client, ?api-version=...; the deployment name is
# the model when the body has none), /openai/responses and the v1 API under /openai/v1
PATHS: dict[str, Wire] = {
    "/v1/chat/completions": OPENAI_CHAT,
    "/v1/messages": ANTHROPIC_MESSAGES,
    "/v1/responses": OPENAI_RESPONSES,
    "/openai/deployments/{deployment}/chat/completions": OPENAI_CHAT,
    "/openai/v1/chat/completions": OPENAI_CHAT,
    "/openai/responses": OPENAI_RESPONSES,
    "/openai/v1/responses": OPENAI_RESPONSES,
}
_ANTHROPIC_BLOCKS = frozenset(("tool_use", "tool_result", "thinking", "redacted_thinking"))


def sniff(body: Any, name: str = "") -> Wire:
    """Which API a saved payload speaks: by file-name prefix, else by its shape."""
    for prefix, wire in (("anthropic", ANTHROPIC_MESSAGES), ("responses", OPENAI_RESPONSES),
                         ("chat", OPENAI_CHAT)):
        if name.startswith(prefix):
            return wire
    if not isinstance(body, dict):
        return OPENAI_CHAT
    if "input" in body and "messages" not in body:
        return OPENAI_RESPONSES
    if "system" in body:
        return ANTHROPIC_MESSAGES
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") in _ANTHROPIC_BLOCKS for b in content
        ):
            return ANTHROPIC_MESSAGES
    return OPENAI_CHAT


def path_of(wire: Wire) -> str:
    return next(p for p, w in PATHS.items() if w is wire)


__all__ = ["PATHS", "WIRES", "Wire", "path_of", "sniff"]
