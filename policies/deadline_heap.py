"""A min-heap of deadlines keyed by id, cheap to update on every turn.

The KV lifecycle keeps one per kind of deadline (record offer, pull, lease, idle
records per engine). Sessions move their deadlines later on every turn and drop in
and out of the idle set, so updates must not pile up heap entries, and nothing may
scan all sessions or rebuild a big heap on the hot path.

How: each key has at most one *queued* heap entry, whose deadline is never later than
the key's real deadline. Moving a key later pushes nothing; when its entry reaches the
top, it is re-queued at the real deadline. Moving a key earlier pushes a new entry and
makes the old one stale. A discarded key leaves its entry behind until it reaches the
top. Entries reach the top as time passes (``pop_due``) or as keys are taken (``pop``),
so stale entries are dropped within one deadline horizon; a compaction bounds them if
neither happens.
"""

from __future__ import annotations

import heapq

__all__ = ["DeadlineHeap"]

_COMPACT_SLACK = 1024  # stale entries tolerated before a compaction is considered


class DeadlineHeap:
    """Keys ordered by deadline (ties in a deterministic order)."""

    __slots__ = ("_deadlines", "_heap", "_next_seq", "_queued")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._deadlines: dict[str, float] = {}  # live keys
        self._queued: dict[str, tuple[float, int]] = {}  # key -> its valid entry
        self._next_seq = 0

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, key: str) -> bool:
        return key in self._deadlines

    def set(self, key: str, deadline_s: float) -> None:
        """Insert ``key`` or move it to a new deadline."""
        self._deadlines[key] = deadline_s
        queued = self._queued.get(key)
        if queued is None or deadline_s < queued[0]:
            self._push(key, deadline_s)
            if len(self._heap) > 4 * len(self._deadlines) + _COMPACT_SLACK:
                self._compact()

    def discard(self, key: str) -> None:
        """Remove ``key`` if present; O(1)."""
        self._deadlines.pop(key, None)

    def peek(self) -> tuple[float, str] | None:
        """The earliest (deadline_s, key), or None when empty."""
        return self._settle(None)

    def pop(self) -> tuple[float, str] | None:
        """Remove and return the earliest (deadline_s, key), or None when empty."""
        top = self._settle(None)
        if top is not None:
            self._take(top[1])
        return top

    def pop_due(self, now_s: float) -> list[str]:
        """Remove and return every key whose deadline is at or before ``now_s``, earliest first."""
        due: list[str] = []
        while (top := self._settle(now_s)) is not None:
            self._take(top[1])
            due.append(top[1])
        return due

    def prune(self, now_s: float) -> None:
        """Settle the entries queued at or before ``now_s`` without taking any key."""
        self._settle(now_s)

    def _settle(self, bound_s: float | None) -> tuple[float, str] | None:
        """Settle the top until it is a live key at its real deadline, and return it.

        With ``bound_s``, stop (returning None) once the top is queued after it: a
        queued deadline is never later than the real one, so nothing there is due,
        and keys moved later are re-queued only as time reaches them.
        """
        heap, queued, deadlines = self._heap, self._queued, self._deadlines
        while heap:
            deadline_s, seq, key = heap[0]
            if bound_s is not None and deadline_s > bound_s:
                return None
            entry = queued.get(key)
            if entry is None or entry[1] != seq:  # superseded by an earlier entry
                heapq.heappop(heap)
                continue
            real_s = deadlines.get(key)
            if real_s is None:  # discarded
                heapq.heappop(heap)
                del queued[key]
                continue
            if real_s != deadline_s:  # moved later: re-queue at the real deadline
                self._next_seq += 1
                heapq.heapreplace(heap, (real_s, self._next_seq, key))
                queued[key] = (real_s, self._next_seq)
                continue
            return deadline_s, key
        return None

    def _take(self, key: str) -> None:
        heapq.heappop(self._heap)
        del self._queued[key]
        del self._deadlines[key]

    def _push(self, key: str, deadline_s: float) -> None:
        self._next_seq += 1
        heapq.heappush(self._heap, (deadline_s, self._next_seq, key))
        self._queued[key] = (deadline_s, self._next_seq)

    def _compact(self) -> None:
        """One entry per live key. O(n), and rare: it takes 3n + 1024 pushes without
        the entries reaching the top (keys moving earlier, or many keys discarded)."""
        self._heap = []
        self._queued = {}
        for key, deadline_s in self._deadlines.items():
            self._next_seq += 1
            self._heap.append((deadline_s, self._next_seq, key))
            self._queued[key] = (deadline_s, self._next_seq)
        heapq.heapify(self._heap)
