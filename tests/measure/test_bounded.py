"""The memo behind the content-keyed caches (carry extraction, the fill's group words):
bounded by bytes as well as entries (issue #39), least recently used out first, and a
hit answers what was put."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.measure.bounded import ENTRY_BYTES, BoundedMemo

# (key, size) puts and gets, keys from a small set so that hits and re-puts happen
OPS = st.lists(st.tuples(st.booleans(), st.integers(0, 15), st.integers(0, 3000)),
               max_size=80)


@given(ops=OPS, entries=st.integers(0, 8), limit=st.integers(0, 8000))
def test_memo_within_bounds_lru_order_and_hits_answer_what_was_put(
        ops: list[tuple[bool, int, int]], entries: int, limit: int) -> None:
    memo: BoundedMemo[int, str] = BoundedMemo(entries, limit)
    model: list[tuple[int, int]] = []  # (key, size), least recently used first
    for is_put, key, size in ops:
        if memo.get(key) is not None:  # a hit: its value, and it is used last
            assert memo.get(key) == f"v{key}"
            model = [e for e in model if e[0] != key] + [e for e in model if e[0] == key]
        elif is_put:
            memo.put(key, f"v{key}", size)
            if size + ENTRY_BYTES <= limit and entries:
                model.append((key, size + ENTRY_BYTES))
                while len(model) > entries or sum(s for _, s in model) > limit:
                    model.pop(0)
        assert memo.keys() == [k for k, _ in model]
        assert memo.bytes == sum(s for _, s in model) <= limit and len(memo) <= entries
    memo.clear()
    assert not len(memo) and memo.bytes == 0


def test_long_texts_are_bounded_by_bytes_not_entries() -> None:
    from gateway.policy import fill

    before = fill.COUNTED.max_bytes
    fill.COUNTED.clear()
    fill.COUNTED.max_bytes = 1 << 20
    try:
        for k in range(100):
            words = fill._counted(f"group {k} " + "research results " * 1000)  # ~17 KB
        assert words["research"] == 1000
        assert fill.COUNTED.bytes <= 1 << 20 and 20 <= len(fill.COUNTED) < 100
    finally:
        fill.COUNTED.clear()
        fill.COUNTED.max_bytes = before
