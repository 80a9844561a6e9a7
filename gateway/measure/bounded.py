"""A memo bounded by the bytes it holds as well as by entries (LRU).

The per-process caches keyed by content (a message's text, a group's text) were bounded
by entries only: `functools.lru_cache(maxsize=50_000)` of long tool outputs held
gigabytes (issue #39). Each entry here is put with its size in bytes, as the caller
estimates it (sys.getsizeof of the strings it keeps and a fixed overhead), and the least
recently used go when either bound is passed; an entry larger than the byte bound is not
kept. Not thread-safe: used from the event loop's thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

ENTRY_BYTES = 100  # an ordered dict's slot and link, and the tuple of value and size


class BoundedMemo(Generic[K, V]):
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.bytes = 0
        self._memo: OrderedDict[K, tuple[V, int]] = OrderedDict()

    def get(self, key: K) -> V | None:
        hit = self._memo.get(key)
        if hit is None:
            return None
        self._memo.move_to_end(key)
        return hit[0]

    def put(self, key: K, value: V, size: int) -> None:
        """Keep `value` for `key` (new: the caller looked it up first), `size` bytes."""
        size += ENTRY_BYTES
        if size > self.max_bytes or not self.max_entries:
            return
        self._memo[key] = value, size
        self.bytes += size
        self._trim()

    def bound(self, max_bytes: int) -> None:
        """A new byte bound (a reload), the least recently used over it forgotten now."""
        self.max_bytes = max_bytes
        self._trim()

    def _trim(self) -> None:
        while len(self._memo) > self.max_entries or self.bytes > self.max_bytes:
            self.bytes -= self._memo.popitem(last=False)[1][1]

    def __contains__(self, key: K) -> bool:
        return key in self._memo

    def __len__(self) -> int:
        return len(self._memo)

    def keys(self) -> list[K]:
        return list(self._memo)

    def clear(self) -> None:
        self._memo.clear()
        self.bytes = 0
