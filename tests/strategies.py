"""Hypothesis generators of chat histories with tool calls, pins, scores and ttls."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

WORDS = ["path", "/data/orders", "report.csv", "订单", "汇总", "budget", "ok", "tool", "结果",
         "the", "cancelled", "error", "上周", "it", "that file", "the former", "write to"]


@st.composite
def text(draw: st.DrawFn, max_words: int = 25) -> str:
    n = draw(st.integers(0, max_words))
    return " ".join(draw(st.sampled_from(WORDS)) for _ in range(n))


@st.composite
def meta(draw: st.DrawFn) -> dict[str, Any] | None:
    kind = draw(st.sampled_from(["none", "none", "none", "pin", "score", "ttl"]))
    if kind == "none":
        return None
    if kind == "pin":
        return {"pin": True}
    if kind == "score":
        return {"score": draw(st.sampled_from([0.1, 0.5, 0.7, 0.95]))}
    return {"pin": True, "ttl": draw(st.integers(0, 4))}


# the client context agents open a session with (memory.context.prefixes' defaults)
CONTEXT = ["<system-reminder>CLAUDE.md: run the tests</system-reminder>",
           "<environment_context><cwd>/repo</cwd></environment_context>"]


@st.composite
def message(draw: st.DrawFn, role: str, **extra: Any) -> dict[str, Any]:
    body = draw(text())
    if draw(st.integers(0, 9)) == 0:
        body = "[PIN] " + body
    elif role == "user" and draw(st.integers(0, 14)) == 0:  # later: ordinary history
        body = draw(st.sampled_from(CONTEXT)) + " " + body
    m: dict[str, Any] = {"role": role, "content": body, **extra}
    md = draw(meta())
    if md is not None:
        m["memgate"] = md
    return m


@st.composite
def tool_group(draw: st.DrawFn, turn: int, k: int) -> list[dict[str, Any]]:
    n = draw(st.integers(1, 3))
    ids = [f"call_{turn}_{k}_{j}" for j in range(n)]
    call = draw(message("assistant"))
    call["content"] = None
    call["tool_calls"] = [
        {"id": i, "type": "function", "function": {"name": "f", "arguments": draw(text(5))}}
        for i in ids
    ]
    results = [draw(message("tool", tool_call_id=i)) for i in draw(st.permutations(ids))]
    return [call, *results]


@st.composite
def conversation(draw: st.DrawFn, max_turns: int = 12) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(0, 2))):
        msgs.append({"role": draw(st.sampled_from(["system", "developer"])),
                     "content": draw(text(10))})
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):  # the client's opening context
        msgs.append({"role": "user", "content": draw(st.sampled_from(CONTEXT)) + draw(text(6))})
    n_turns = draw(st.integers(1, max_turns))
    for t in range(1, n_turns + 1):
        msgs.append(draw(message("user")))
        for k in range(draw(st.integers(0, 3))):
            if draw(st.booleans()):
                msgs.extend(draw(tool_group(t, k)))
            else:
                msgs.append(draw(message("assistant")))
        if draw(st.integers(0, 15)) == 0:
            msgs.append({"role": "system", "content": "mid-conversation note"})
    return msgs


@st.composite
def memory_rules(draw: st.DrawFn) -> dict[str, Any]:
    """A `memory:` config section with a random but valid policy."""
    stages = draw(st.sampled_from([
        ["pinned", "recent_turns", "length"],
        ["pinned", "recent_turns", "length"],
        ["pinned", "length"],
        ["recent_turns", "pinned", "length"],
        ["pinned", "score", "recent_turns", "length"],
        ["pinned", "recent_turns", "length", "score"],
    ]))
    return {
        "enable_eviction": True,
        "budget": {
            "max_tokens": draw(st.one_of(st.none(), st.integers(20, 3000))),
            "max_chars": draw(st.one_of(st.none(), st.integers(10, 6000))),
            "max_messages": draw(st.one_of(st.none(), st.integers(1, 60))),
            "max_turns": draw(st.one_of(st.none(), st.integers(1, 12))),
        },
        "eviction": {
            "order": stages,
            "keep_pinned": draw(st.booleans()),
            "max_pinned": draw(st.integers(0, 6)),
            "drop_unit": draw(st.sampled_from(["turn", "group"])),
            "low_water": draw(st.sampled_from([0.3, 0.6, 1.0])),
            "recall_share": draw(st.sampled_from([0.0, 0.5, 0.9])),
        },
    }


def to_anthropic(msgs: list[dict[str, Any]]) -> dict[str, Any]:
    """The same conversation as an Anthropic Messages body."""
    system = [m["content"] for m in msgs if m["role"] in ("system", "developer")]
    out: list[dict[str, Any]] = []
    for m in msgs:
        role = m["role"]
        extra = {"memgate": m["memgate"]} if "memgate" in m else {}
        if role in ("system", "developer"):
            continue
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"],
                     "content": m["content"]}
            if out and out[-1]["role"] == "user" and any(
                    b.get("type") == "tool_result" for b in out[-1]["content"]):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block], **extra})
            continue
        if role == "assistant" and m.get("tool_calls"):
            blocks: list[dict[str, Any]] = [{"type": "thinking", "thinking": "hmm",
                                             "signature": "sig"}]
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": {"q": c["function"]["arguments"]}} for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": blocks, **extra})
            continue
        text: dict[str, Any] = {"type": "text", "text": m["content"]}
        if len(out) % 3 == 1:  # some prompt-cache breakpoints (the same ones as it grows)
            text["cache_control"] = {"type": "ephemeral"}
        out.append({"role": role, "content": [text], **extra})
    return {"model": "claude-3-5-haiku-20241022", "max_tokens": 256,
            "system": "\n".join(system), "messages": out}


def to_responses(msgs: list[dict[str, Any]]) -> dict[str, Any]:
    """The same conversation as an OpenAI Responses body (reasoning before calls)."""
    items: list[dict[str, Any]] = []
    for m in msgs:
        role = m["role"]
        extra = {"memgate": m["memgate"]} if "memgate" in m else {}
        if role == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"], **extra})
        elif role == "assistant" and m.get("tool_calls"):
            items.append({"type": "reasoning", "id": f"rs_{len(items)}", "summary": []})
            for c in m["tool_calls"]:
                items.append({"type": "function_call", "call_id": c["id"],
                              "name": c["function"]["name"],
                              "arguments": c["function"]["arguments"], **extra})
        else:
            items.append({"type": "message", "role": role, "content": m["content"], **extra})
    return {"model": "gpt-4o-mini", "instructions": "Be brief.", "input": items}
