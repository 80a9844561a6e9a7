"""Media, MCP, computer-use and document shapes counted at their true cost, through
real HTTP with the real SDKs (issue 23: items 1-4).

Reference counts: media by the provider's documented formula for the true size of the
image/PDF/audio the test made; everything else by tiktoken (the gateway's encoding for
the model) over the text of the fields the model reads -- a string field as it is
(a tool's arguments or output), a structured one (schemas, actions, search results) as
its JSON text -- plus OpenAI's framing (4 per item, 3 reply priming), times
tokens.approx_factor for Anthropic.
"""

from __future__ import annotations

import math
from typing import Any

import anthropic
import openai
import orjson
import pytest

from gateway.measure.tokens import Tokenizers
from tests.conftest import SECRET, Gateway, GatewayFactory, Upstream
from tests.payloads import b64, data_url, jpeg, pdf, png, wav

ON = {"enable_eviction": True}  # the shipped budget: 6000 tokens, 24000 chars, 60 messages


def text_history(turns: int = 5) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for t in range(turns):
        out.append({"role": "user", "content": f"Question {t}: " + "what about the invoice? " * 8})
        out.append({"role": "assistant", "content": f"Answer {t}: " + "the invoice is paid. " * 8})
    return out


def counter(gw: Gateway, model: str) -> Any:
    """A fresh counter with the encoding the gateway uses for `model`."""
    return Tokenizers(0).get(gw.state.rules.model_info(model).encoding)


def last_mem(gw: Gateway) -> dict[str, Any]:
    return gw.mem_events()[-1]


PNG_40K = png(800, 600, size=40_000)  # 800x600: 4 tiles (765) for OpenAI, 640 for Anthropic
CHAT_MEDIA = [
    pytest.param({"type": "image_url", "image_url": {"url": data_url("image/png", PNG_40K)}},
                 765, id="png-auto"),
    pytest.param({"type": "image_url", "image_url": {
        "url": data_url("image/jpeg", jpeg(640, 480, exif=40_000)), "detail": "high"}},
        425, id="jpeg-exif-high"),
    pytest.param({"type": "image_url", "image_url": {"url": data_url("image/png", PNG_40K),
                                                     "detail": "low"}}, 85, id="png-low"),
    pytest.param({"type": "input_audio", "input_audio": {"data": b64(wav(2.5, 8000)),
                                                         "format": "wav"}}, 25, id="wav"),
    pytest.param({"type": "file", "file": {"filename": "q3.pdf", "file_data": data_url(
        "application/pdf", pdf(2, pad=40_000))}}, 2 * 2300, id="pdf-2-pages"),
]


@pytest.mark.parametrize(("part", "cost"), CHAT_MEDIA)
async def test_chat_media_in_current_turn_keeps_history(
    gateway: GatewayFactory, upstream: Upstream, part: dict[str, Any], cost: int
) -> None:
    """A 40 KB image / audio / PDF in the current turn no longer wipes the history:
    nothing is dropped, the [mem] line says media=1 and est_tokens is text + cost."""
    gw = await gateway(memory=ON)
    messages = [{"role": "system", "content": "You describe attachments."}, *text_history(),
                {"role": "user", "content": [{"type": "text", "text": "What is in this?"},
                                             part]}]
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET, max_retries=0) as c:
        await c.chat.completions.create(model="gpt-4o-mini", messages=messages)  # type: ignore[arg-type]
    assert orjson.loads(upstream.received[-1]["raw"])["messages"] == messages
    ev = last_mem(gw)
    assert ev["dropped"] == "0" and "over_budget" not in ev
    assert ev["media"] == "1"
    assert int(ev["hist_chars"]) > 24_000  # the logged jq definition still holds the base64
    tok = counter(gw, "gpt-4o-mini")
    texts = [m["content"] for m in messages[:-1]] + ["What is in this?"]
    names = [part["file"]["filename"]] if part["type"] == "file" else []
    reference = 3 + 4 * len(messages) + sum(tok.count(t) for t in texts + names) + cost
    assert int(ev["est_tokens"]) == reference
    # the next turn keeps the attachment and its answer (they used to be cut with the rest)
    follow = [*messages, {"role": "assistant", "content": "hello from upstream"},
              {"role": "user", "content": "And the second page?"}]
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET, max_retries=0) as c:
        await c.chat.completions.create(model="gpt-4o-mini", messages=follow)  # type: ignore[arg-type]
    assert orjson.loads(upstream.received[-1]["raw"])["messages"] == follow


async def test_anthropic_pdf_and_image_in_current_turn_keep_history(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Anthropic base64 PDF document + base64 image in the current turn: history kept,
    the PDF counted by its pages and the image by width*height/750."""
    gw = await gateway(memory=ON)
    doc = pdf(1, pad=40_000)
    current = {"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                        "data": b64(doc)}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": b64(PNG_40K)}},
        {"type": "text", "text": "Does the chart match the report?"}]}
    messages = [*text_history(), current]
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=SECRET, max_retries=0) as c:
        await c.messages.create(model="claude-3-5-haiku-20241022", max_tokens=100,
                                messages=messages)  # type: ignore[arg-type]
    assert orjson.loads(upstream.received[-1]["raw"])["messages"] == messages
    ev = last_mem(gw)
    assert ev["dropped"] == "0" and "over_budget" not in ev and ev["media"] == "2"
    tok = counter(gw, "claude-3-5-haiku-20241022")
    texts = [m["content"] for m in messages[:-1]] + ["Does the chart match the report?"]
    raw = 3 + 4 * len(messages) + sum(tok.count(t) for t in texts)
    factor = gw.state.rules.approx_token_factor  # text only: media costs are Anthropic's own
    expected = math.ceil(raw * factor) + 2300 + 800 * 600 // 750
    assert abs(int(ev["est_tokens"]) - expected) <= len(messages) + 1  # rounding


def screenshot(n: int) -> str:
    return data_url("image/png", png(1024, 768, size=40_000, seed=n))


def computer_loop(steps: int) -> list[dict[str, Any]]:
    """The computer-use guide's loop: the task, then per step a reasoning item, a
    computer_call and its computer_call_output carrying a screenshot."""
    items: list[dict[str, Any]] = [{"role": "user", "content": "Find the price of the "
                                    "blue kettle on the shop's site."}]
    for s in range(steps):
        items += [
            {"type": "reasoning", "id": f"rs_{s}", "summary": [
                {"type": "summary_text", "text": f"Step {s}: click the search box."}]},
            {"type": "computer_call", "id": f"cu_{s}", "call_id": f"call_{s}",
             "action": {"type": "click", "button": "left", "x": 100 + s, "y": 200},
             "pending_safety_checks": [], "status": "completed"},
            {"type": "computer_call_output", "call_id": f"call_{s}",
             "output": {"type": "input_image", "image_url": screenshot(s)}},
        ]
    return items


async def test_responses_computer_use_loop_keeps_history(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Three 40 KB screenshots in the current turn: counted as images (765 each for
    1024x768), the earlier turns kept, the base64 never tokenized."""
    gw = await gateway(memory=ON)
    earlier = text_history()
    items = [*earlier, *computer_loop(3)]
    tools = [{"type": "computer_use_preview", "display_width": 1024, "display_height": 768,
              "environment": "browser"}]
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET, max_retries=0) as c:
        await c.responses.create(model="computer-use-preview", input=items,  # type: ignore[arg-type]
                                 tools=tools, truncation="auto")  # type: ignore[arg-type]
    assert orjson.loads(upstream.received[-1]["raw"])["input"] == items
    ev = last_mem(gw)
    assert ev["dropped"] == "0" and "over_budget" not in ev and ev["media"] == "3"
    tok = counter(gw, "computer-use-preview")
    reference = 3 + tok.count(orjson.dumps(tools).decode()) + 4 * len(items)
    reference += sum(tok.count(m["content"]) for m in items if "content" in m)
    for it in items:
        if it.get("type") == "reasoning":
            reference += tok.count(it["summary"][0]["text"])
        elif it.get("type") == "computer_call":
            reference += tok.count(orjson.dumps(it["action"]).decode())
        elif it.get("type") == "computer_call_output":
            reference += 765
    assert int(ev["est_tokens"]) == reference
    assert not any(";base64," in s for s in tok._cache)  # the reference counter: clean


MCP_TOOLS = [
    {"name": name, "description": desc, "annotations": {"read_only": True},
     "input_schema": {"type": "object", "properties": {
         "query": {"type": "string", "description": "What to look for, in plain words"},
         "limit": {"type": "integer", "description": "How many results at most"}},
         "required": ["query"]}}
    for name, desc in [
        ("search_issues", ("Search the issue tracker by text, label or assignee and return "
                           "matching issues with their titles, states and last comments.")),
        ("get_issue", "Fetch one issue with its full description, comments and history."),
        ("list_releases", "List the repository's releases with their notes and dates."),
        ("read_file", "Read a file of the repository at a given revision."),
    ]
]


def mcp_history() -> list[dict[str, Any]]:
    """An MCP agent's history as the Responses API returns it: list_tools, approvals,
    calls with their outputs, a file search and a web search."""
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "Which open issues block the 2.0 release?"},
        {"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "tracker", "tools": MCP_TOOLS},
    ]
    for n in range(4):
        args = orjson.dumps({"query": f"label:blocker milestone:2.0 page {n}", "limit": 5}).decode()
        items += [
            {"type": "mcp_approval_request", "id": f"mcpr_{n}", "server_label": "tracker",
             "name": "search_issues", "arguments": args},
            {"type": "mcp_approval_response", "approval_request_id": f"mcpr_{n}",
             "approve": True, "reason": "read-only search is fine"},
            {"type": "mcp_call", "id": f"mcp_{n}", "server_label": "tracker",
             "name": "search_issues", "arguments": args, "error": None,
             "output": orjson.dumps([{"number": 100 * n + k, "title": f"Crash when saving "
                                      f"large project {k}", "state": "open", "last_comment":
                                      "Reproduced on 2.0-beta; the writer times out after "
                                      "30 s on files above 2 GB."} for k in range(5)]).decode()},
            {"role": "assistant", "content": f"Page {n}: five blockers, all about saving."},
        ]
    items += [
        {"type": "file_search_call", "id": "fs_1", "status": "completed",
         "queries": ["release checklist 2.0", "known blockers"],
         "results": [{"file_id": f"file_{k}", "filename": f"release-notes-{k}.md", "score": 0.9,
                      "text": "The 2.0 release needs the saving rewrite merged, the migration "
                              "guide reviewed and the installer signed. " * 3}
                     for k in range(3)]},
        {"type": "web_search_call", "id": "ws_1", "status": "completed",
         "action": {"type": "search", "query": "project 2.0 release date announcement"}},
        {"role": "assistant", "content": "The saving rewrite is the main blocker."},
        {"role": "user", "content": "Summarise the blockers in three bullets."},
    ]
    return items


READS = {  # item type -> the fields the model reads (the reference's JSON text)
    "mcp_list_tools": ("server_label", "tools"),
    "mcp_approval_request": ("server_label", "name", "arguments"),
    "mcp_approval_response": ("reason",),
    "mcp_call": ("server_label", "name", "arguments", "output"),
    "file_search_call": ("queries", "results"),
    "web_search_call": ("action",),
}


async def test_responses_mcp_history_counted_within_ten_percent(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """An MCP-heavy history's est_tokens is within 10% of tiktoken over the JSON text
    the model reads (it used to count ~4 tokens per MCP item)."""
    gw = await gateway()
    items = mcp_history()
    tools = [{"type": "mcp", "server_label": "tracker", "server_url": "https://mcp.example/sse",
              "require_approval": "always"}]
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET, max_retries=0) as c:
        await c.responses.create(model="gpt-4o-mini", input=items, tools=tools)  # type: ignore[arg-type]
    tok = counter(gw, "gpt-4o-mini")
    reference = 3 + tok.count(orjson.dumps(tools).decode()) + 4 * len(items)
    for it in items:
        if "role" in it:
            reference += tok.count(it["content"])
        else:  # a string field as it is (arguments, output), the rest as JSON
            reference += sum(tok.count(v if isinstance(v, str) else orjson.dumps(v).decode())
                             for v in (it[k] for k in READS[it["type"]]))
    ev = last_mem(gw)
    est = int(ev["est_tokens"])
    assert abs(est - reference) <= 0.1 * reference, (est, reference)
    assert "media" not in ev  # written only when a request carries media


LONG_TEXT = ("Section {n}. The supplier shall deliver the goods within thirty days of the "
             "order; late deliveries are credited at two percent a week. ")


def anthropic_research_history() -> list[dict[str, Any]]:
    """Anthropic documents and server tools: a plain-text document with citations, a
    web search (server_tool_use + web_search_tool_result), search_result blocks in a
    tool result, and an MCP connector call."""
    contract = "".join(LONG_TEXT.format(n=n) for n in range(35))  # ~4.7k characters
    return [
        {"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                            "data": contract},
             "title": "Supply contract", "context": "Signed 2024-03-01",
             "citations": {"enabled": True}},
            {"type": "text", "text": "What are the delivery terms?"}]},
        {"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
             "input": {"query": "late delivery credit norms"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [
                {"type": "web_search_result", "url": "https://example.org/norms",
                 "title": "Late delivery credits explained", "encrypted_content": "E" * 2000,
                 "page_age": "2024-01-01"}]},
            {"type": "tool_use", "id": "toolu_1", "name": "kb_search",
             "input": {"query": "credit policy"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "search_result", "source": "https://kb.example/credits",
             "title": "Credit policy", "content": [
                 {"type": "text", "text": "Credits are capped at ten percent of the order. " * 10}]}
        ]}]},
        {"role": "assistant", "content": [
            {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "lookup_order",
             "server_name": "erp", "input": {"order": "PO-1042"}},
            {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_1", "is_error": False,
             "content": [{"type": "text", "text": "PO-1042: 120 units, due 2024-04-01, "
                          "delivered 2024-04-20." * 5}]},
            {"type": "text", "text": "Thirty days, two percent a week; PO-1042 was late."}]},
        {"role": "user", "content": "So what credit do we get?"},
    ]


def anthropic_reads(block: dict[str, Any]) -> list[str]:
    """The reference's JSON texts of one block: the fields the model reads."""
    kind = block["type"]
    if kind == "document":
        return [orjson.dumps({k: block[k] for k in ("title", "context", "citations")}).decode(),
                block["source"]["data"]]
    if kind == "web_search_tool_result":
        return [orjson.dumps({k: r[k] for k in ("url", "title", "page_age")}).decode()
                for r in block["content"]]
    if kind in ("server_tool_use", "tool_use", "mcp_tool_use"):
        return [orjson.dumps({k: block[k] for k in ("name", "input", "server_name")
                              if k in block}).decode()]
    if kind in ("tool_result", "mcp_tool_result"):
        return [t for b in block["content"] for t in anthropic_reads(b)]
    if kind == "search_result":
        return [orjson.dumps({k: block[k] for k in ("source", "title")}).decode(),
                *(b["text"] for b in block["content"])]
    return [block["text"]]


async def test_anthropic_documents_and_server_tools_counted_by_text(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """A 4.7k-character text document is counted by its text (it used to be a flat
    85), server tool results and MCP blocks by theirs: within 10% of the reference;
    the encrypted search result is estimated at 4 characters a token."""
    gw = await gateway()
    messages = anthropic_research_history()
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=SECRET, max_retries=0) as c:
        await c.messages.create(model="claude-3-5-haiku-20241022", max_tokens=100,
                                messages=messages)  # type: ignore[arg-type]
    tok = counter(gw, "claude-3-5-haiku-20241022")
    raw = 3 + 4 * len(messages) + 2000 // 4
    for m in messages:
        blocks = m["content"] if isinstance(m["content"], list) else [
            {"type": "text", "text": m["content"]}]
        raw += sum(tok.count(t) for b in blocks for t in anthropic_reads(b))
    reference = math.ceil(raw * gw.state.rules.approx_token_factor)
    est = int(last_mem(gw)["est_tokens"])
    assert abs(est - reference) <= 0.1 * reference, (est, reference)
    doc_tokens = tok.count(messages[0]["content"][0]["source"]["data"])
    assert doc_tokens > 900  # the document alone is ten times the old flat estimate
