"""Bounded decoding of compressed request bodies (Content-Encoding gzip / deflate).

A few KB of gzip can inflate to gigabytes: the output is produced with zlib's
`max_length`, so no more than the limit (plus one byte, to notice it) ever exists.
"""

from __future__ import annotations

import zlib

from gateway.errors import BadRequest, PayloadTooLarge, UnsupportedEncoding

_GZIP = 16 + zlib.MAX_WBITS  # gzip header and trailer
_ZLIB = zlib.MAX_WBITS  # RFC 1950 deflate: zlib header and checksum
_RAW = -zlib.MAX_WBITS  # headerless deflate, which some clients send as "deflate"
_CODINGS = {"gzip": _GZIP, "x-gzip": _GZIP, "deflate": _ZLIB}


class Inflater:
    """Feeds compressed chunks in, decoded bytes out; never more than `limit` in all."""

    def __init__(self, codings: list[str], limit: int) -> None:
        # `Content-Encoding: deflate, gzip` was deflated first: undone last-applied first,
        # every stage bounded, so an inner bomb stops as early as an outer one
        self.stages = [_Stage(c, limit) for c in reversed(codings)]

    @classmethod
    def for_encoding(cls, header: str | None, limit: int) -> Inflater | None:
        """The decoder for a Content-Encoding header; None when there is nothing to undo."""
        if header is None:
            return None
        codings = [c for c in (c.strip().lower() for c in header.split(","))
                   if c and c != "identity"]
        for c in codings:
            if c not in _CODINGS:
                raise UnsupportedEncoding(
                    f"Content-Encoding {c!r} is not supported by the gateway (gzip and "
                    "deflate are decoded; send the body uncompressed or in one of those)")
        return cls(codings, limit) if codings else None

    def feed(self, chunk: bytes) -> bytes:
        for stage in self.stages:
            chunk = stage.feed(chunk)
        return chunk

    def finish(self) -> None:
        """BadRequest unless every stage reached the end of its stream."""
        for stage in self.stages:
            stage.finish()


class _Stage:
    """One coding; a gzip body may hold several members (RFC 1952), each decoded."""

    def __init__(self, coding: str, limit: int) -> None:
        self.coding = coding
        self.wbits = _CODINGS[coding]
        self.limit = limit
        self.out = 0
        self.d: zlib._Decompress | None = None
        self.started = False

    def _invalid(self) -> BadRequest:
        return BadRequest(f"request body is not valid {self.coding} (Content-Encoding)")

    def feed(self, chunk: bytes) -> bytes:
        out: list[bytes] = []
        while chunk:
            if self.d is None:
                if self.started and self.wbits != _GZIP:
                    raise self._invalid()  # bytes after the end of a deflate stream
                wbits = self.wbits
                if wbits == _ZLIB and chunk[0] & 0x0F != 8:  # no zlib header: raw deflate
                    wbits = _RAW
                self.d = zlib.decompressobj(wbits)
                self.started = True
            try:
                # at most one byte past the limit: enough to refuse, never the whole bomb
                part = self.d.decompress(chunk, self.limit - self.out + 1)
            except zlib.error:
                raise self._invalid() from None
            self.out += len(part)
            if self.out > self.limit:
                raise PayloadTooLarge(
                    f"request body decodes to over {self.limit} bytes, the most the gateway "
                    "accepts (limits.max_body_bytes)")
            out.append(part)
            if self.d.eof:
                chunk, self.d = self.d.unused_data, None
            else:
                chunk = self.d.unconsumed_tail
        return b"".join(out)

    def finish(self) -> None:
        if not self.started or self.d is not None:  # empty, or cut before its end
            raise self._invalid()
