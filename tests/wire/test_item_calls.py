"""Each wire hands the carry-over its items' tool calls: name and the head of the arguments."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import example, given
from hypothesis import strategies as st

from gateway.policy.carry import ToolCall
from gateway.policy.carry.calls import CALL_CHARS
from gateway.wire.anthropic_messages import ANTHROPIC_MESSAGES
from gateway.wire.base import json_head, json_text
from gateway.wire.openai_chat import OPENAI_CHAT
from gateway.wire.openai_responses import OPENAI_RESPONSES


def _args(call: ToolCall) -> Any:
    return orjson.loads(call.arguments)


def test_anthropic_tool_use_blocks_are_calls() -> None:
    """Claude Code's assistant message: text, then tool_use blocks with an `input` object;
    a user message (tool results) makes none."""
    item = {"role": "assistant", "content": [
        {"type": "text", "text": "Reading it."},
        {"type": "tool_use", "id": "toolu_1", "name": "Read",
         "input": {"file_path": "/repo/src/app.py", "limit": 80}},
        {"type": "tool_use", "id": "toolu_2", "name": "Bash",
         "input": {"command": "cat src/x.py", "description": "Show x"}}]}
    calls = ANTHROPIC_MESSAGES.item_calls(item)
    assert [c.name for c in calls] == ["Read", "Bash"]
    assert _args(calls[0]) == {"file_path": "/repo/src/app.py", "limit": 80}
    assert ANTHROPIC_MESSAGES.item_calls({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}) == []
    assert ANTHROPIC_MESSAGES.item_calls({"role": "assistant", "content": "plain"}) == []


def test_chat_tool_calls_and_custom_calls() -> None:
    """OpenAI chat: `function.arguments` is JSON text already (given as it is); a custom
    tool's free-form `input` is given as a JSON string; a legacy `function_call` too."""
    item = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "shell", "arguments": '{"command":["bash","-lc","ls"]}'}},
        {"id": "c2", "type": "custom",
         "custom": {"name": "apply_patch", "input": "*** Begin Patch\n*** End Patch"}}],
        "function_call": {"name": "legacy", "arguments": "{}"}}
    calls = OPENAI_CHAT.item_calls(item)
    assert calls == [ToolCall("shell", '{"command":["bash","-lc","ls"]}'),
                     ToolCall("apply_patch", '"*** Begin Patch\\n*** End Patch"'),
                     ToolCall("legacy", "{}")]
    assert OPENAI_CHAT.item_calls({"role": "tool", "tool_call_id": "c1", "content": "x"}) == []


def test_responses_call_items() -> None:
    """Codex's items: a function_call's `arguments`, a custom_tool_call's `input`, a
    local_shell_call's `action` object; outputs and messages make none."""
    fc = {"type": "function_call", "call_id": "c1", "name": "shell",
          "arguments": '{"command":["bash","-lc","cat README.md"],"workdir":"/repo"}'}
    custom = {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch",
              "input": "*** Begin Patch\n*** Add File: a.py\n+x\n*** End Patch"}
    local = {"type": "local_shell_call", "call_id": "c3", "status": "completed",
             "action": {"type": "exec", "command": ["ls"], "working_directory": "/w"}}
    assert OPENAI_RESPONSES.item_calls(fc) == [ToolCall("shell", fc["arguments"])]
    assert _args(OPENAI_RESPONSES.item_calls(custom)[0]) == custom["input"]
    (shell,) = OPENAI_RESPONSES.item_calls(local)
    assert shell.name == "local_shell" and _args(shell)["working_directory"] == "/w"
    assert OPENAI_RESPONSES.item_calls(
        {"type": "function_call_output", "call_id": "c1", "output": "x"}) == []
    assert OPENAI_RESPONSES.item_calls({"role": "assistant", "content": "hi"}) == []


def test_a_huge_input_is_handed_over_as_a_bounded_head() -> None:
    """A 1 MB Write: the wire writes out CALL_CHARS characters of its arguments, the
    path first among them; a chat call's 1 MB arguments string is cut the same."""
    item = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Write",
            "input": {"file_path": "/w/big.txt", "content": "x" * 1_000_000}}]}
    (call,) = ANTHROPIC_MESSAGES.item_calls(item)
    assert len(call.arguments) == CALL_CHARS
    assert call.arguments.startswith('{"file_path":"/w/big.txt","content":"xxx')
    args = orjson.dumps({"file_path": "/w/big.txt", "content": "y" * 1_000_000}).decode()
    (chat,) = OPENAI_CHAT.item_calls({"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "Write", "arguments": args}}]})
    assert chat.arguments == args[:CALL_CHARS]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from('ab"\\\n\t\u2028é中\x00/'), max_size=12),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(alphabet='ab"\\é', max_size=4), inner, max_size=4),
    max_leaves=20)


@given(value=_JSON, limit=st.integers(0, 80))
@example(value={"a": "é\"\\" * 5}, limit=9).via("a cut inside an escape")
def test_json_head_is_the_prefix_of_the_whole_text(value: Any, limit: int) -> None:
    """json_head(v, n) == json_text(v)[:n], whatever is cut: strings with escapes,
    nested containers, numbers. (Checked against a planted bug: a string written out
    as `v[:room - 2]`, which cut escaped strings short.)"""
    assert json_head(value, limit) == json_text(value)[:limit]
