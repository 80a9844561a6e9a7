"""Media bytes made in the test (struct/zlib), not shipped: PNG, JPEG, GIF, WebP, PDF, WAV."""

from __future__ import annotations

import base64
import random
import struct
import zlib


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(w: int, h: int, size: int = 0, seed: int = 1) -> bytes:
    """A valid w x h RGB PNG, grey with noisy rows at the top so that it weighs about
    `size` bytes (noise does not compress)."""
    rnd = random.Random(seed)
    row = 1 + 3 * w
    noisy = min(h, size // row + 1) if size else 0
    raw = b"".join(b"\0" + rnd.randbytes(row - 1) for _ in range(noisy))
    raw += (b"\0" + b"\x80" * (row - 1)) * (h - noisy)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw))
            + _chunk(b"IEND", b""))


def jpeg(w: int, h: int, exif: int = 0) -> bytes:
    """A baseline JPEG's marker chain (SOI, APP0, an `exif`-byte APP1 such as a camera's
    thumbnail, DQT, SOF0 with the size, SOS, EOI): what a header reader walks."""
    def seg(marker: int, body: bytes) -> bytes:
        return bytes((0xFF, marker)) + struct.pack(">H", len(body) + 2) + body

    app0 = seg(0xE0, b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0")
    app1 = seg(0xE1, b"Exif\0\0" + bytes(exif)) if exif else b""
    dqt = seg(0xDB, b"\0" + bytes(range(64)))
    sof = seg(0xC0, struct.pack(">BHHB", 8, h, w, 3) + b"\x01\x22\0\x02\x11\x01\x03\x11\x01")
    sos = seg(0xDA, b"\x03\x01\0\x02\x11\x03\x11\0\x3f\0")
    return b"\xff\xd8" + app0 + app1 + dqt + sof + sos + b"\x12\x34" * 32 + b"\xff\xd9"


def gif(w: int, h: int) -> bytes:
    return (b"GIF89a" + struct.pack("<HH", w, h) + b"\0\0\0"
            + b",\0\0\0\0\x01\0\x01\0\0\x02\x02D\x01\0;")


def webp_vp8x(w: int, h: int) -> bytes:
    body = b"VP8X" + struct.pack("<I", 10) + b"\0\0\0\0" + (w - 1).to_bytes(3, "little") \
        + (h - 1).to_bytes(3, "little")
    return b"RIFF" + struct.pack("<I", len(body) + 4) + b"WEBP" + body


def webp_vp8l(w: int, h: int) -> bytes:
    bits = (w - 1) | ((h - 1) << 14)
    body = b"VP8L" + struct.pack("<I", 5) + b"\x2f" + struct.pack("<I", bits)
    return b"RIFF" + struct.pack("<I", len(body) + 4) + b"WEBP" + body


def pdf(pages: int, text: str = "Quarterly report", pad: int = 0) -> bytes:
    """A valid PDF 1.4 with `pages` pages of text (page tree first, as most writers
    put it), with an embedded `pad`-byte stream after the pages (like an image's)."""
    objs = [b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % (4 + 2 * i) for i in range(pages))
            + b"] /Count %d >>" % pages,
            b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    for i in range(pages):
        stream = b"BT /F1 12 Tf 72 720 Td (%s %d) Tj ET" % (text.encode(), i + 1)
        objs.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
                    b"/Resources << /Font << /F1 3 0 R >> >> >>" % (5 + 2 * i))
        objs.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream))
    if pad:
        blob = random.Random(2).randbytes(pad)
        objs.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(blob), blob))
    out = b"%PDF-1.4\n"
    offsets = []
    for n, body in enumerate(objs, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (n, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    return out


def wav(seconds: float, rate: int = 16000) -> bytes:
    """Mono 16-bit PCM WAV of `seconds` of a quiet noise."""
    n = int(seconds * rate)
    data = random.Random(3).randbytes(2 * n)
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    body = (b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", len(data)) + data)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{b64(data)}"


def png_head(w: int, h: int, tail: bytes = b"") -> bytes:
    """A PNG's signature and IHDR followed by `tail`: what a header reader sees."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + tail
