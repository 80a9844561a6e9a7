"""The mock model refuses what the real APIs refuse: checked on bodies a broken cut would
forward (a tool result whose call was dropped), per wire, directly and over HTTP."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.e2e.mock_model import MockModel, anthropic_problems, responses_problems


def anthropic_body() -> dict[str, Any]:
    """A valid Claude-Code-shaped conversation: task, two tool rounds, the answer."""
    return {"model": "m", "max_tokens": 64, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "TASK1: go"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "ok"},
            {"type": "text", "text": "go on"}]},
    ]}


def responses_body() -> dict[str, Any]:
    """A valid Codex-shaped input: task, a function call and a custom tool call, answered."""
    return {"model": "m", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "exec_command",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch",
         "input": "x"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "ok"},
        {"type": "function_call", "call_id": "call_3", "name": "exec_command",
         "arguments": "{}"},
    ]}


def test_valid_bodies_pass() -> None:
    assert anthropic_problems(anthropic_body()) == []
    assert responses_problems(responses_body()) == []  # a trailing call needs no output yet
    assert responses_problems({"input": "just text"}) == []


def test_a_tool_result_whose_tool_use_was_dropped_is_refused() -> None:
    """The planted broken cut, per wire: the call went, its result stayed."""
    body = anthropic_body()
    del body["messages"][1:2]  # the assistant turn holding toolu_1
    problems = anthropic_problems(body)
    assert any("unexpected `tool_use_id`" in p and "toolu_1" in p for p in problems), problems

    body = responses_body()
    del body["input"][2]  # function_call call_1
    problems = responses_problems(body)
    assert problems == ["input[2]: No tool call found for function call output with "
                        "call_id call_1."], problems
    body = responses_body()
    del body["input"][4]  # custom_tool_call call_2
    assert any("custom tool call output with call_id call_2" in p
               for p in responses_problems(body))


def test_the_other_rules() -> None:
    body = anthropic_body()
    del body["messages"][2]  # toolu_1's result: the next user turn does not answer it
    assert any("without `tool_result`" in p and "toolu_1" in p
               for p in anthropic_problems(body))
    body = anthropic_body()
    body["messages"][0]["content"].append({"type": "thinking", "thinking": "x"})
    assert any("`thinking` blocks" in p for p in anthropic_problems(body))
    assert anthropic_problems({"messages": []}) == ["messages: at least one message is "
                                                    "required"]
    assert any("first message" in p for p in anthropic_problems(
        {"messages": [{"role": "assistant", "content": "hi"}]}))

    body = responses_body()
    del body["input"][3]  # call_1's output, with more input after the call
    assert any("No tool output found for function call call_1" in p
               for p in responses_problems(body))
    body = responses_body()
    body["input"] = body["input"][:2]  # reasoning last
    assert any("'reasoning'" in p for p in responses_problems(body))


async def test_refusals_come_back_in_the_providers_shape() -> None:
    model = MockModel()
    await model.start()
    try:
        async with aiohttp.ClientSession() as http:
            body = anthropic_body()
            del body["messages"][1:2]
            async with http.post(f"{model.url}/v1/messages", json=body) as resp:
                assert resp.status == 400
                got = await resp.json()
            assert got["type"] == "error"
            assert got["error"]["type"] == "invalid_request_error"
            assert "toolu_1" in got["error"]["message"]

            body = responses_body()
            del body["input"][2]
            async with http.post(f"{model.url}/v1/responses", json=body) as resp:
                assert resp.status == 400
                got = await resp.json()
            assert got["error"]["type"] == "invalid_request_error"
            assert "call_1" in got["error"]["message"]

            async with http.post(f"{model.url}/v1/responses", json=responses_body()) as resp:
                assert resp.status == 200
    finally:
        await model.stop()
    assert [r.api for r in model.refused()] == ["anthropic", "responses"]
