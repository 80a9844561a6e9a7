"""The [mem] line's measured figures describe the request as the client sent it.

`hist_msgs`, `hist_chars` and `est_tokens` are the same whatever is planned for a body:
with compact_tools in the order or not, the budget fill on or off (recall_share), the
carry note on or off, records recalled from the store or not, in shadow or with eviction
on, decided once or again through the session's history cache; and they equal a direct
measurement of the client's body (the jq definition of docs/mem-line.md, the wire's own
token counts of its items). What was forwarded has its own fields: `sent_chars` is the
same measure of the forwarded body.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from gateway.config.rules import build_rules
from gateway.config.schema import Rules
from gateway.decide.chat import decide
from gateway.decide.decision import Decision
from gateway.decide.history import HistoryCache
from gateway.errors import GatewayError
from gateway.measure.tokens import Tokenizers
from gateway.proxy.mem_line import mem_fields
from gateway.wire.anthropic_messages import ANTHROPIC_MESSAGES
from gateway.wire.base import Wire
from gateway.wire.openai_chat import OPENAI_CHAT
from gateway.wire.openai_responses import OPENAI_RESPONSES
from tests.conftest import GatewayFactory, Upstream
from tests.strategies import WORDS, conversation, memory_rules, to_anthropic, to_responses

ROOT = Path(__file__).resolve().parents[2]
TOK = Tokenizers(50_000)
WIRES: dict[str, tuple[Wire, Any]] = {
    "chat": (OPENAI_CHAT, lambda msgs: {"model": "gpt-4o-mini", "messages": msgs}),
    "anthropic": (ANTHROPIC_MESSAGES, to_anthropic),
    "responses": (OPENAI_RESPONSES, to_responses),
}
MEASURED = ("hist_msgs", "hist_chars", "est_tokens")


# ------------------------------------------------------------------ a direct measurement


def jq_chars(value: Any) -> int:
    """`tostring | length`, a null counting 0 (docs/mem-line.md), with the standard
    library's JSON writer: not the gateway's code."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value)
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def items_of(wire: Wire, body: dict[str, Any]) -> list[Any]:
    if wire is OPENAI_RESPONSES:
        v = body["input"]
        return [{"role": "user", "content": v}] if isinstance(v, str) else list(v)
    return list(body["messages"])


def item_chars(wire: Wire, item: dict[str, Any]) -> int:
    """What of an item hist_chars counts: its content; Responses calls their arguments
    (custom tools: input), call outputs their output, other items nothing."""
    if wire is not OPENAI_RESPONSES:
        return jq_chars(item.get("content"))
    kind = item.get("type", "message")
    if kind == "message":
        return jq_chars(item.get("content"))
    if kind.endswith("_call"):
        return jq_chars(item.get("arguments", item.get("input")))
    if kind.endswith("_call_output"):
        return jq_chars(item.get("output"))
    return 0


def direct(wire: Wire, body: dict[str, Any], rules: Rules) -> dict[str, int]:
    """The client's body measured without deciding it: the wire's token counts of its
    items and of what sits outside them (system, tools)."""
    items = items_of(wire, body)
    counter = TOK.get(rules.model_info(body.get("model")).encoding)
    if wire.approx_tokens:
        counter = counter.scaled(rules.approx_token_factor)
    return {
        "hist_msgs": len(items),
        "hist_chars": sum(item_chars(wire, m) for m in items),
        "est_tokens": wire.overhead_tokens(body, counter)
        + sum(wire.item_tokens(m, counter) for m in items),
    }


# ------------------------------------------------------------------ histories and rules


def big_result(seed: int, lines: int) -> str:
    """A tool result compact_tools shortens: a long listing (over the 2000-character
    min_chars)."""
    words = [WORDS[(seed + k) % len(WORDS)] for k in range(5)]
    return "\n".join(f"{k:04d} {' '.join(words)} status=ok size={k * 37 % 1000}"
                     for k in range(lines))


@st.composite
def agent_history(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A generated chat history (tests/strategies.py) whose tool results are big and
    old enough for compact_tools to shorten some."""
    msgs = draw(conversation(max_turns=8))
    for k, m in enumerate(msgs):
        if m["role"] == "tool" and draw(st.integers(0, 2)):
            m["content"] = big_result(k, draw(st.integers(45, 160)))
    return msgs


@st.composite
def stages(draw: st.DrawFn) -> dict[str, Any]:
    """A memory section with each planning stage drawn on or off."""
    memory = draw(memory_rules())
    order = list(memory["eviction"]["order"])
    if draw(st.integers(0, 2)):  # compact_tools in the order, anywhere before length
        order.insert(draw(st.integers(0, order.index("length"))), "compact_tools")
    memory["eviction"]["order"] = order
    memory["eviction"]["recall_share"] = draw(st.sampled_from([0.0, 0.4]))
    memory["eviction"]["compact"] = {"min_chars": 2000, "keep_recent": draw(st.integers(0, 2))}
    memory.update(enable_eviction=draw(st.sampled_from(["on", "shadow"])) == "on", shadow=True)
    memory["carry"] = {"enabled": draw(st.booleans()), "rules_file": "carry.yaml",
                       "log_skipped": False}
    return memory


def make_rules(memory: dict[str, Any]) -> Rules:
    return build_rules({"memory": memory, "tokens": {"models_file": "models.yaml"}},
                       base_dir=ROOT / "rules")


def decided(raw: bytes, rules: Rules, wire: Wire, recalled: list[str] | None,
            cache: HistoryCache | None) -> Decision | None:
    try:
        return decide(raw, orjson.loads(raw), rules, TOK, wire, recalled=recalled,
                      history=cache, key=("tenant", "s1") if cache is not None else None)
    except GatewayError:  # on_over_budget: reject: nothing is measured for the client
        return None


def forwarded_chars(wire: Wire, forward: bytes) -> int:
    return sum(item_chars(wire, m) for m in items_of(wire, orjson.loads(forward)))


@pytest.mark.slow
@given(wire_name=st.sampled_from(sorted(WIRES)), msgs=agent_history(), memory=stages(),
       recalled=st.sampled_from([None, ["earlier: the report went to /data/out.csv"]]),
       again=st.booleans())
def test_no_planning_stage_changes_the_measured_figures(
    wire_name: str, msgs: list[dict[str, Any]], memory: dict[str, Any],
    recalled: list[str] | None, again: bool,
) -> None:
    wire, to_body = WIRES[wire_name]
    body = to_body(msgs)
    raw = orjson.dumps(body)
    rules = make_rules(memory)
    cache = HistoryCache(1 << 26, 64) if again else None
    if cache is not None:  # the session's second request of the same body: cached parse,
        decided(raw, rules, wire, recalled, cache)  # counts and compaction
    d = decided(raw, rules, wire, recalled, cache)
    if d is None:
        return
    fields = mem_fields(d, include_indices=False)
    want = direct(wire, body, rules)
    assert {k: fields[k] for k in MEASURED} == want
    # and with nothing planned at all (eviction off, not even shadow)
    off = decided(raw, make_rules({**memory, "enable_eviction": False, "shadow": False}),
                  wire, None, None)
    assert off is not None and {k: mem_fields(off, False)[k] for k in MEASURED} == want
    event(f"compacted={bool(d.compacted)} mode={d.mode} note={d.note is not None}")
    if "sent_chars" in fields and not d.cache_marker_moved:
        assert fields["sent_chars"] == forwarded_chars(wire, d.forward)


# ------------------------------------------------------------------ through HTTP

SHADOW_COMPACT = {
    "enable_eviction": False, "shadow": True,
    "budget": {"max_tokens": 1000, "max_chars": None, "max_messages": None, "max_turns": None},
    "eviction": {"order": ["pinned", "recent_turns", "compact_tools", "length"],
                 "recall_share": 0.0, "compact": {"min_chars": 2000, "keep_recent": 1}},
}


def agent_session() -> list[dict[str, Any]]:
    """An agent's history: an old listing of 5,500 characters, answered, then later work."""
    def call(cid: str, args: str) -> dict[str, Any]:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "shell", "arguments": args}}]}

    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "List the data directory and summarise it."},
        call("c1", '{"cmd": "ls -l /data"}'),
        {"role": "tool", "tool_call_id": "c1", "content": big_result(3, 120)},
        {"role": "assistant", "content": "The directory holds 120 order files."},
        {"role": "user", "content": "Now count the cancelled orders in report.csv."},
        call("c2", '{"cmd": "grep -c cancelled /data/report.csv"}'),
        {"role": "tool", "tool_call_id": "c2", "content": "17"},
        {"role": "assistant", "content": "17 orders were cancelled."},
        {"role": "user", "content": "Write that to /data/summary.txt."},
    ]


ROUTES = {"chat": "/v1/chat/completions", "anthropic": "/v1/messages",
          "responses": "/v1/responses"}


async def test_hist_chars_is_what_the_client_sent_with_compaction_planned(
    gateway: GatewayFactory, upstream: Upstream,
) -> None:
    """Shadow mode, compact_tools in the order, a big old tool result the plan would
    compact: each wire's [mem] line logs the history as sent (and says what would be
    compacted), and the upstream gets the client's bytes. With eviction on the same
    body logs the same figures, and what went in sent_chars."""
    for on in (False, True):
        gw = await gateway(memory={**SHADOW_COMPACT, "enable_eviction": on})
        async with aiohttp.ClientSession() as http:
            for name, (wire, to_body) in WIRES.items():
                body = to_body(agent_session())
                raw = orjson.dumps(body)
                headers = {"Content-Type": "application/json",
                           "Authorization": "Bearer sk-test-measured-0123456789",
                           "X-Session-Id": f"measured-{name}-{on}"}
                n = len(gw.mem_lines())
                async with http.post(gw.url + ROUTES[name], data=raw, headers=headers) as r:
                    assert r.status == 200, await r.text()
                ev = (await gw.wait_mem(n + 1))[-1]
                want = direct(wire, body, gw.state.rules)
                assert int(ev["hist_chars"]) == want["hist_chars"] > 5000, (name, ev)
                assert int(ev["hist_msgs"]) == want["hist_msgs"]
                assert int(ev["est_tokens"]) == want["est_tokens"]
                assert int(ev["compacted"]) == 1, (name, ev)  # compaction was planned
                if on:
                    sent = forwarded_chars(wire, upstream.received[-1]["raw"])
                    assert int(ev["sent_chars"]) == sent < want["hist_chars"]
                else:
                    assert ev["mode"] == "shadow" and "sent_chars" not in ev
                    assert upstream.received[-1]["raw"] == raw
