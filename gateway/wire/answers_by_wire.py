"""Each wire's answers while memgate answers its retrieval tool, by the wire's `name`."""

from __future__ import annotations

from gateway.wire.answers import Answers
from gateway.wire.answers_anthropic import MESSAGES_ANSWERS
from gateway.wire.answers_chat import CHAT_ANSWERS
from gateway.wire.answers_responses import RESPONSES_ANSWERS

ANSWERS: dict[str, Answers] = {
    "openai_chat": CHAT_ANSWERS,
    "anthropic_messages": MESSAGES_ANSWERS,
    "openai_responses": RESPONSES_ANSWERS,
}
