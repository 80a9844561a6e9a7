#!/usr/bin/env python3
"""Regenerate the chat payload samples (deterministic; stdlib only).

    python samples/make_samples.py

The samples are the demo's input and the golden tests' fixtures: a short chat,
a long coding-agent session with tool calls, an early [PIN] constraint and
Chinese turns, a Chinese session with memgate metadata pins/scores/ttl, a
streaming request, and the coding session as Anthropic Messages and OpenAI
Responses bodies. The file name's prefix names the API: chat_ -> /v1/chat/completions,
anthropic_ -> /v1/messages, responses_ -> /v1/responses.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEM = "You are a careful data engineering assistant. Answer concisely."


def tool_call(cid: str, name: str, args: dict) -> dict:
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def listing(directory: str, n: int) -> str:
    rows = [f"{directory}/part-{i:05d}.parquet\t{1000 + 37 * i} bytes\t2026-04-{14 + i % 7:02d}"
            for i in range(n)]
    return "\n".join(rows)


def long_tools() -> dict:
    msgs: list[dict] = [{"role": "system", "content": SYSTEM}]
    msgs.append({"role": "user", "content": "[PIN] Constraint: every report is a CSV with a "
                 "UTF-8 BOM and the output file is report_0421.csv. Do not drop cancelled orders."})
    msgs.append({"role": "assistant", "content": "Understood: CSV with UTF-8 BOM, output "
                 "report_0421.csv, cancelled orders included."})
    topics = [
        ("/data/orders", "orders"), ("/data/refunds", "refunds"), ("/data/customers", "customers"),
        ("/data/inventory", "inventory"), ("/data/shipments", "shipments"),
    ]
    for t in range(1, 31):
        directory, name = topics[t % len(topics)]
        if t % 5 == 0:
            msgs.append({"role": "user", "content": f"请检查 {directory} 目录下上周的数据，"
                         f"按状态汇总{name}，看看有没有异常的分区。"})
        else:
            msgs.append({"role": "user", "content": f"Turn {t}: list {directory} and tell me "
                         f"which {name} partitions changed last week."})
        cid = f"call_{t:03d}_ls"
        msgs.append({"role": "assistant", "content": None,
                     "tool_calls": [tool_call(cid, "list_dir", {"path": directory})]})
        msgs.append({"role": "tool", "tool_call_id": cid, "content": listing(directory, 12)})
        if t % 3 == 0:
            cid2 = f"call_{t:03d}_stat"
            cid3 = f"call_{t:03d}_head"
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                tool_call(cid2, "stat", {"path": f"{directory}/part-00003.parquet"}),
                tool_call(cid3, "head", {"path": f"{directory}/part-00004.parquet", "rows": 3}),
            ]})
            msgs.append({"role": "tool", "tool_call_id": cid2,
                         "content": json.dumps({"size": 1111, "rows": 40210, "modified": "2026-04-17"})})
            msgs.append({"role": "tool", "tool_call_id": cid3,
                         "content": "order_id,status,amount\n1001,paid,12.50\n1002,cancelled,8.00"})
        if t == 12:
            msgs.append({"role": "assistant", "content": "[PIN] Confirmed: the status column has "
                         "four values (paid, cancelled, refunded, pending); group by all four."})
        else:
            msgs.append({"role": "assistant", "content": f"{name.capitalize()}: 12 partitions, "
                         f"3 changed last week (part-00002, part-00005, part-00009). "
                         "Sizes grew by about 4%; nothing looks corrupt."})
    msgs.append({"role": "user", "content": "Now write the summary for /data/orders into the "
                 "report file we agreed on, grouped by status."})
    return {"model": "gpt-4o-mini", "messages": msgs, "temperature": 0,
            "tools": [{"type": "function", "function": {
                "name": "list_dir", "description": "List a directory",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                               "required": ["path"]}}}]}


def zh_pinned() -> dict:
    msgs: list[dict] = [{"role": "system", "content": "你是一个严谨的运维助手，回答要简洁。"}]
    msgs.append({"role": "user", "content": "我们的预算是 10 万元，所有方案都不能超过这个数。",
                 "memgate": {"pin": True}})
    msgs.append({"role": "assistant", "content": "明白，预算上限 10 万元。"})
    services = ["订单服务", "支付服务", "库存服务", "用户服务"]
    for t in range(1, 25):
        svc = services[t % len(services)]
        msgs.append({"role": "user", "content": f"第 {t} 轮：{svc}的日志目录 /var/log/{t % 4}/app "
                     f"最近有什么告警？请详细说明每一条告警的原因和处理建议。" * 2})
        reply = {"role": "assistant", "content": f"{svc}最近一周有 {t % 5 + 1} 条告警，主要是连接池"
                 "耗尽和慢查询。建议扩大连接池并为慢查询加索引。" * 3}
        if t == 6:
            reply["memgate"] = {"score": 0.9}
        if t == 8:
            reply["memgate"] = {"pin": True, "ttl": 2}
        if t == 10:
            reply["memgate"] = {"score": 0.3}
        msgs.append(reply)
    msgs.append({"role": "user", "content": "那按刚才的预算，给我一个扩容方案。"})
    return {"model": "gpt-4o", "messages": msgs}


def short() -> dict:
    return {"model": "gpt-4o-mini", "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris today?"},
        {"role": "assistant", "content": "Sunny, 21 °C."},
        {"role": "user", "content": "Thanks! And tomorrow?"},
    ]}


def stream() -> dict:
    body = long_tools()
    body["messages"] = body["messages"][:1] + body["messages"][-40:]
    while body["messages"][1]["role"] != "user":
        del body["messages"][1]
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return body


def anthropic_long_tools() -> dict:
    """The coding session as an Anthropic Messages body (system top-level, tool_use blocks,
    tool_result blocks in the following user message, a cache_control breakpoint)."""
    chat = long_tools()
    out: list[dict] = []
    for m in chat["messages"][1:]:
        if m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        elif m.get("tool_calls"):
            out.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": c["id"].replace("call", "toolu"),
                 "name": c["function"]["name"], "input": json.loads(c["function"]["arguments"])}
                for c in m["tool_calls"]]})
            for c in m["tool_calls"]:
                c["id"] = c["id"].replace("call", "toolu")
        else:
            out.append({"role": m["role"], "content": m["content"]})
    for m in out:
        if isinstance(m["content"], list):
            for b in m["content"]:
                if b.get("type") == "tool_result":
                    b["tool_use_id"] = b["tool_use_id"].replace("call", "toolu")
    out[1] = {"role": "assistant", "content": [{"type": "text", "text": out[1]["content"],
                                                "cache_control": {"type": "ephemeral"}}]}
    return {"model": "claude-3-5-haiku-20241022", "max_tokens": 1024,
            "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "messages": out}


def responses_long_tools() -> dict:
    """The coding session as an OpenAI Responses body (function_call / _output items)."""
    chat = long_tools()
    items: list[dict] = []
    for m in chat["messages"][1:]:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
        elif m.get("tool_calls"):
            for c in m["tool_calls"]:
                items.append({"type": "function_call", "call_id": c["id"],
                              "name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        else:
            items.append({"type": "message", "role": m["role"], "content": m["content"]})
    return {"model": "gpt-4o-mini", "instructions": SYSTEM, "input": items}


def main() -> None:
    for name, body in (("chat_short", short()), ("chat_long_tools", long_tools()),
                       ("chat_zh_pinned", zh_pinned()), ("chat_stream", stream()),
                       ("anthropic_long_tools", anthropic_long_tools()),
                       ("responses_long_tools", responses_long_tools())):
        (HERE / f"{name}.json").write_text(
            json.dumps(body, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
