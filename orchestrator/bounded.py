"""A bounded map in put order, with expiry: the mechanics kvtide's small books share.

``BoundedMap`` keeps entries oldest first (a ``put`` moves its key to the end), each
with a size in bytes and the time it expires. It is bounded by count and/or bytes: a
``put`` past a bound drops the oldest entries and *returns* them, so that the owner
can undo what it keeps elsewhere (a durable copy, a counter). ``expire(now_s)`` drops
and returns the expired entries from the oldest end and stops at the first live one:
owners keep expiry in put order (one TTL for all entries, or deadlines that only grow).
Reads never reorder. Pure: the clock is passed in, nothing here reads it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, NamedTuple, TypeVar

__all__ = ["BoundedMap"]

K = TypeVar("K")
V = TypeVar("V")


class _Entry(NamedTuple, Generic[V]):
    value: V
    expires_s: float
    size: int


class BoundedMap(Generic[K, V]):
    """Entries oldest first, at most ``max_entries`` and ``max_bytes`` of them (``None``:
    no bound)."""

    def __init__(self, *, max_entries: int | None = None, max_bytes: int | None = None) -> None:
        if (max_entries is not None and max_entries < 1) or (
            max_bytes is not None and max_bytes < 1
        ):
            raise ValueError(
                f"max_entries ({max_entries}) and max_bytes ({max_bytes}) must be >= 1"
            )
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[K, _Entry[V]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def items(self) -> Iterator[tuple[K, V]]:
        """``(key, value)`` pairs, oldest first."""
        return ((key, e.value) for key, e in self._entries.items())

    def get(self, key: K, now_s: float | None = None) -> V | None:
        """The value of ``key``; ``None`` when absent, or expired at ``now_s`` if given
        (an expired entry stays until ``expire`` drops it)."""
        entry = self._entries.get(key)
        if entry is None or (now_s is not None and entry.expires_s <= now_s):
            return None
        return entry.value

    def put(
        self, key: K, value: V, *, expires_s: float = math.inf, size: int = 0
    ) -> list[tuple[K, V]]:
        """Store ``value`` as the newest entry; returns the oldest entries dropped to stay
        within the bounds (``key``'s own among them if ``size`` exceeds ``max_bytes``)."""
        self.pop(key)
        self._entries[key] = _Entry(value, expires_s, size)
        self.num_bytes += size
        dropped: list[tuple[K, V]] = []
        while self._entries and self._over():
            old_key = next(iter(self._entries))
            dropped.append((old_key, self._take(old_key)))
        return dropped

    def pop(self, key: K) -> V | None:
        """Remove ``key``; its value, or ``None`` when absent."""
        return self._take(key) if key in self._entries else None

    def expire(self, now_s: float) -> list[tuple[K, V]]:
        """Drop the entries expired at ``now_s`` (``expires_s <= now_s``) from the oldest
        end, stopping at the first live one; returns them, oldest first."""
        dropped: list[tuple[K, V]] = []
        for key, entry in self._entries.items():
            if entry.expires_s > now_s:
                break
            dropped.append((key, entry.value))
        for key, _ in dropped:
            self._take(key)
        return dropped

    def _over(self) -> bool:
        return (self.max_entries is not None and len(self._entries) > self.max_entries) or (
            self.max_bytes is not None and self.num_bytes > self.max_bytes
        )

    def _take(self, key: K) -> V:
        entry = self._entries.pop(key)
        self.num_bytes -= entry.size
        return entry.value
