"""What media parts cost the model, in tokens, read from a bounded peek at their bytes.

Images, audio and PDFs arrive as base64 (a data URL or a `data` field). They are
never tokenized and never decoded whole: at most `PEEK` bytes are decoded from a few
places (the image header, a JPEG marker chain, a PDF's first and last bytes) and the
provider's documented formula is applied; what cannot be read gets a documented
fixed estimate. Pure: no I/O.

Formulas (docs, as of 2025):
- OpenAI images (platform.openai.com/docs/guides/images-vision, "Calculating
  costs"): `detail: low` costs 85; `high` (and `auto`, counted as high) scales
  the image to fit 2048x2048, then its shortest side to 768 (never up), and
  costs 170 per 512px tile + 85.
- Anthropic images (docs.anthropic.com/en/docs/build-with-claude/vision,
  "Evaluate image size"): `width * height / 750`; an image whose long edge
  exceeds 1568 px or that would cost more than ~1600 tokens (~1.15-1.2 megapixels)
  is first scaled down keeping its aspect ratio, so one image costs at most ~1600.
- PDFs (Anthropic docs/build-with-claude/pdf-support, "Estimate your costs";
  OpenAI docs/guides/pdf-files): each page is read as its text (Anthropic: 1,500
  to 3,000 tokens a page) plus an image of the page; `PDF_PAGE_TOKENS` a page.
- Audio (OpenAI Realtime "audio tokens": a user audio token is 100 ms):
  10 tokens per second of audio; the duration comes from a WAV header, else
  from the payload size at `AUDIO_BYTES_PER_S` (128 kbit/s, a common MP3 rate).
"""

from __future__ import annotations

import binascii
import math
import re
import struct
from typing import Any, NamedTuple

import orjson

PEEK = 768  # bytes decoded from one place (1024 base64 characters)
_MAX_HOPS = 12  # JPEG segments skipped looking for the frame header

OPENAI_LOW = 85
OPENAI_BASE = 85
OPENAI_TILE = 170
OPENAI_UNKNOWN = 765  # high detail, size unread: a 1024x1024 image (the docs' example)
ANTHROPIC_MAX = 1600  # an image scaled to the documented limit
ANTHROPIC_UNKNOWN = ANTHROPIC_MAX  # size unread (URL, file id, odd header): the most
PDF_PAGE_TOKENS = 2300  # text of a page (documented 1,500-3,000) with its page image
PDF_BYTES_PER_PAGE = 50_000  # page count unread: one page per 50 KB of PDF
AUDIO_TOKENS_PER_S = 10
AUDIO_BYTES_PER_S = 16_000


class Media(NamedTuple):
    """One media part: its token cost and the characters of its inline payload."""

    tokens: int
    payload_chars: int


# What a wire says the model reads in one item: text to tokenize, fixed tokens (the
# message framing: always fewer than the JSON bytes they stand for), or a media part.
Piece = str | int | Media


class _B64:
    """Random access to the bytes a base64 string encodes, decoding only what is read."""

    def __init__(self, s: str, start: int = 0) -> None:
        self.s = s
        self.start = start  # where the base64 begins (after a data URL's comma)
        pad = 2 if s.endswith("==") else 1 if s.endswith("=") else 0
        self.size = (len(s) - start) * 3 // 4 - pad

    def read(self, offset: int, n: int = PEEK) -> bytes:
        """Up to n decoded bytes from `offset`; b"" when that stretch is not clean
        base64 (line breaks, URL-safe alphabet): the caller falls back."""
        if offset < 0 or offset >= self.size:
            return b""
        n = min(n, PEEK)
        q = offset // 3
        a = self.start + 4 * q
        b = self.start + 4 * ((offset + n + 2) // 3)
        chunk = self.s[a:b]
        if len(chunk) % 4:
            chunk = chunk[: len(chunk) // 4 * 4]
        try:
            raw = binascii.a2b_base64(chunk, strict_mode=True)
        except (binascii.Error, ValueError):
            return b""
        skip = offset - 3 * q
        return raw[skip : skip + n]


def data_url(url: Any) -> tuple[str, _B64] | None:
    """(media type, payload) of a base64 data URL, else None (a remote URL)."""
    if not isinstance(url, str) or not url.startswith("data:"):
        return None
    comma = url.find(",", 0, 200)
    if comma < 0 or not url[:comma].endswith(";base64"):
        return None
    return url[5:comma].split(";", 1)[0].lower(), _B64(url, comma + 1)


def image_size(data: _B64) -> tuple[int, int] | None:
    """(width, height) from a PNG, GIF, WebP or JPEG header, else None."""
    head = data.read(0, 32)
    if head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR":
        w, h = struct.unpack(">II", head[16:24])
        return (w, h) if w and h else None
    if head[:6] in (b"GIF87a", b"GIF89a"):
        w, h = struct.unpack("<HH", head[6:10])
        return (w, h) if w and h else None
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp_size(head)
    if head[:2] == b"\xff\xd8":
        return _jpeg_size(data)
    return None


def _webp_size(h: bytes) -> tuple[int, int] | None:
    kind = h[12:16]
    if kind == b"VP8X" and len(h) >= 30:
        w = int.from_bytes(h[24:27], "little") + 1
        return w, int.from_bytes(h[27:30], "little") + 1
    if kind == b"VP8L" and len(h) >= 25 and h[20] == 0x2F:
        bits = int.from_bytes(h[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8 " and len(h) >= 30 and h[23:26] == b"\x9d\x01\x2a":
        w, hh = struct.unpack("<HH", h[26:30])
        return (w & 0x3FFF, hh & 0x3FFF) if w and hh else None
    return None


_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # frame headers (not DHT/JPG/DAC)


def _jpeg_size(data: _B64) -> tuple[int, int] | None:
    """Walk the marker chain from SOI to the frame header, reading ~10 bytes a hop
    (APP segments with EXIF thumbnails are skipped by their length, not decoded)."""
    pos = 2
    for _ in range(_MAX_HOPS):
        seg = data.read(pos, 10)
        if len(seg) < 4 or seg[0] != 0xFF:
            return None
        marker = seg[1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        length = int.from_bytes(seg[2:4], "big")
        if marker in _SOF:
            if len(seg) < 9:
                return None
            h, w = struct.unpack(">HH", seg[5:9])
            return (w, h) if w and h else None
        pos += 2 + length
    return None


def openai_image(url: Any, detail: Any) -> Media:
    """An OpenAI `image_url` / `input_image` (a data URL or a remote URL)."""
    parsed = data_url(url)
    if parsed is None:
        return _openai_cost(None, detail, 0)
    return _openai_cost(parsed[1], detail, len(url))


def openai_b64_image(data: Any, detail: Any = None) -> Media:
    """An image given as raw base64 (a Responses `image_generation_call` result)."""
    if not isinstance(data, str):
        return _openai_cost(None, detail, 0)
    return _openai_cost(_B64(data), detail, len(data))


def _openai_cost(payload: _B64 | None, detail: Any, chars: int) -> Media:
    """Tiles by detail and size; `auto` (or none) counts as high."""
    if detail == "low":
        return Media(OPENAI_LOW, chars)
    size = image_size(payload) if payload is not None else None
    return Media(OPENAI_UNKNOWN if size is None else openai_tiles(*size), chars)


def openai_tiles(w: int, h: int) -> int:
    """High-detail cost of a w x h image (OpenAI's tile formula)."""
    fit = min(1.0, 2048 / max(w, h))
    short = min(1.0, 768 / (min(w, h) * fit))  # scaled down only, never up
    sw, sh = w * fit * short, h * fit * short
    return OPENAI_TILE * math.ceil(sw / 512) * math.ceil(sh / 512) + OPENAI_BASE


def anthropic_pixels(w: int, h: int) -> int:
    """Anthropic's cost of a w x h image, after its documented downscaling."""
    scale = min(1.0, 1568 / max(w, h), math.sqrt(ANTHROPIC_MAX * 750 / (w * h)))
    return min(ANTHROPIC_MAX, max(1, math.ceil(w * scale * h * scale / 750)))


def anthropic_image(source: Any) -> Media:
    """An Anthropic `image` block's source: base64 with a readable header, or the most."""
    if not isinstance(source, dict) or source.get("type") != "base64":
        return Media(ANTHROPIC_UNKNOWN, 0)
    data = source.get("data")
    if not isinstance(data, str):
        return Media(ANTHROPIC_UNKNOWN, 0)
    size = image_size(_B64(data))
    return Media(ANTHROPIC_UNKNOWN if size is None else anthropic_pixels(*size), len(data))


_PAGES = re.compile(rb"/Type\s*/Pages\b[^>]*?/Count\s+(\d+)|/Count\s+(\d+)[^>]*?/Type\s*/Pages\b")
_LINEARIZED = re.compile(rb"/Linearized\b[^>]*?/N\s+(\d+)")


def pdf_pages(data: _B64) -> int:
    """Page count from the first and last PEEK bytes (a linearized file's /N, or the
    page tree's /Count where the writer put it there), else estimated from the size."""
    found = []
    for window in (data.read(0), data.read(max(0, data.size - PEEK))):
        m = _LINEARIZED.search(window)
        if m:
            return max(1, int(m.group(1)))
        found += [int(a or b) for a, b in _PAGES.findall(window)]
    if found:
        return max(1, max(found))
    return max(1, math.ceil(data.size / PDF_BYTES_PER_PAGE))


def pdf(data: Any) -> Media:
    """A PDF given inline (raw base64 or a data URL); unknown content: one page."""
    if not isinstance(data, str):
        return Media(PDF_PAGE_TOKENS, 0)
    parsed = data_url(data)
    payload = parsed[1] if parsed is not None else _B64(data)
    return Media(PDF_PAGE_TOKENS * pdf_pages(payload), len(data))


def file_data(data: Any) -> Media:
    """An OpenAI `file` / `input_file` payload: a PDF by its pages; a text file
    (text/*, JSON, CSV, XML) at ~4 characters a token of its decoded size."""
    parsed = data_url(data)
    if parsed is not None and isinstance(data, str):
        mime, payload = parsed
        if mime.startswith("text/") or mime.endswith(("json", "csv", "xml")):
            return Media(max(1, payload.size // 4), len(data))
    return pdf(data)


def audio(data: Any, fmt: Any = None) -> Media:
    """Audio given inline as base64: seconds (WAV header, else size) x 10."""
    if not isinstance(data, str):
        return Media(AUDIO_TOKENS_PER_S, 0)
    b64 = _B64(data)
    rate, size = AUDIO_BYTES_PER_S, b64.size
    head = b64.read(0, 44)
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE" and head[12:16] == b"fmt ":
        rate = int.from_bytes(head[28:32], "little") or rate
        if head[36:40] == b"data":  # the canonical 44-byte header: the samples' size
            size = int.from_bytes(head[40:44], "little")
    seconds = size / rate
    return Media(max(1, math.ceil(seconds * AUDIO_TOKENS_PER_S)), len(data))


def is_payload(s: str) -> bool:
    """Does this string look like an inline binary payload (never to be tokenized)?"""
    if s.startswith("data:") and ";base64," in s[:200]:
        return True
    return len(s) > 256 and " " not in s[:256] and _B64_RUN.fullmatch(s[:256]) is not None


_B64_RUN = re.compile(r"[A-Za-z0-9+/=]+")


UNKNOWN_PAYLOAD = 85  # an inline payload in a block type no provider formula covers


def strip_payloads(value: Any) -> tuple[Any, list[Media]]:
    """`value` with every inline payload string emptied, and one Media per payload:
    what an unknown block type costs without its base64 being tokenized."""
    found: list[Media] = []

    def walk(v: Any) -> Any:
        if isinstance(v, str):
            if is_payload(v):
                found.append(Media(UNKNOWN_PAYLOAD, len(v)))
                return ""
            return v
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    return walk(value), found


def opaque(value: Any) -> list[Piece]:
    """An item or block of a type no wire knows: its JSON text, inline payloads cut
    out and costed as media."""
    stripped, found = strip_payloads(value)
    return [orjson.dumps(stripped).decode("utf-8"), *found]
