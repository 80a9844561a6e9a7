"""One chat request from bytes to decision: parse, plan, build the forwarded body.

Shared by the server handler and `memgate evict`, so the CLI explains exactly
what the gateway would forward. No I/O and no logging here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .conversation import Conversation, Unplannable, content_chars
from .errors import BadRequest, OverBudget
from .policy import Limits, Plan, PlanRules, plan
from .rules import Rules
from .tokens import TokenCounter, Tokenizers
from .wire import openai_chat


@dataclass(slots=True)
class Decision:
    raw: bytes
    payload: Any
    mode: str
    model: str | None
    counter: TokenCounter
    forward: bytes
    conv: Conversation | None = None
    plan: Plan | None = None
    skip_reason: str | None = None
    budget_tokens: int | None = None
    _msg_tokens: dict[int, int] = field(default_factory=dict)

    @property
    def messages(self) -> list[Any]:
        msgs = self.payload.get("messages") if isinstance(self.payload, dict) else None
        return msgs if isinstance(msgs, list) else []

    def message_tokens(self, i: int) -> int:
        n = self._msg_tokens.get(i)
        if n is None:
            n = openai_chat.message_tokens(self.messages[i], self.counter)
            self._msg_tokens[i] = n
        return n

    def overhead_tokens(self) -> int:
        return openai_chat.overhead_tokens(self.payload, self.counter)

    def hist_chars(self) -> int:
        if self.conv is not None:
            return self.conv.total_chars
        return sum(
            content_chars(m.get("content")) for m in self.messages
            if isinstance(m, dict)
        )

    def est_tokens(self) -> int:
        """Exact estimate for the whole history (cached per message content)."""
        msgs = self.messages
        if not msgs or not all(isinstance(m, dict) for m in msgs):
            return 0
        return self.overhead_tokens() + sum(self.message_tokens(i) for i in range(len(msgs)))

    @property
    def changed(self) -> bool:
        return self.forward is not self.raw


def budget_tokens(rules: Rules, payload: dict[str, Any], model: str | None) -> int | None:
    b = rules.memory.budget
    if b.max_tokens != "auto":
        return b.max_tokens
    window = rules.model_info(model).context_window
    reserve = payload.get("max_completion_tokens") or payload.get("max_tokens")
    if not isinstance(reserve, int) or isinstance(reserve, bool) or reserve < 0:
        reserve = b.reserve_output_tokens
    return max(1, int((window - reserve) * b.safety_ratio))


def plan_rules(rules: Rules, max_tokens: int | None) -> PlanRules:
    m = rules.memory
    return PlanRules(
        limits=Limits(
            max_tokens=max_tokens,
            max_chars=m.budget.max_chars,
            max_messages=m.budget.max_messages,
            max_turns=m.budget.max_turns,
        ),
        order=m.eviction.order,
        keep_pinned=m.eviction.keep_pinned,
        max_pinned=m.eviction.max_pinned,
        drop_unit=m.eviction.drop_unit,
        min_score=m.markers.min_score,
        low_water=m.eviction.low_water,
    )


def decide(raw: bytes, payload: Any, rules: Rules, tokenizers: Tokenizers) -> Decision:
    """Plan one chat-completions request; raises BadRequest / OverBudget for the client."""
    model = payload.get("model") if isinstance(payload, dict) else None
    model = model if isinstance(model, str) else None
    counter = tokenizers.get(rules.model_info(model).encoding)
    mode = rules.memory.mode
    d = Decision(raw=raw, payload=payload, mode=mode, model=model, counter=counter, forward=raw)
    if payload is None:
        d.skip_reason = "invalid_json"
        return d
    if not isinstance(payload, dict):
        d.skip_reason = "not_an_object"
        return d
    messages = payload.get("messages")
    if not isinstance(messages, list):
        d.skip_reason = "no_messages"
        return d
    markers = rules.memory.markers
    try:
        d.conv = openai_chat.parse(messages, markers.system_prefix, markers.min_score)
    except Unplannable as exc:
        d.skip_reason = exc.reason
        return d
    except ValueError as exc:  # BadMetadata
        raise BadRequest(str(exc)) from None
    d.budget_tokens = budget_tokens(rules, payload, model)
    if mode != "off":
        d.plan = plan(
            d.conv,
            plan_rules(rules, d.budget_tokens),
            d.message_tokens,
            overhead_tokens=d.overhead_tokens() if d.budget_tokens is not None else 0,
            tokens_upper_bound=len(raw) + d.conv.media_parts * 85,
            weight_of=lambda i: openai_chat.message_weight(messages[i]),
        )
        if (
            mode == "on"
            and d.plan.over_budget
            and rules.memory.eviction.on_over_budget == "reject"
        ):
            raise OverBudget(
                "the system prompt, pinned messages and the current turn alone exceed the "
                f"gateway's history budget (max_tokens={d.budget_tokens}, "
                f"max_chars={rules.memory.budget.max_chars}, "
                f"max_messages={rules.memory.budget.max_messages}); shorten the current turn"
            )
    if mode == "on" and d.plan is not None and d.plan.dropped:
        d.forward = openai_chat.build_body(payload, list(d.plan.kept))
    elif d.conv.has_metadata:
        # gateway metadata is ours: upstreams never see it, whatever the mode
        d.forward = openai_chat.build_body(payload, list(range(len(messages))))
    return d
