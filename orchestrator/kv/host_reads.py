"""Decode blocks the host tier read, remembered past a KV service restart.

The host tier's store reads a session's kept blocks from a decode engine, and the
engine frees them when the read lands. The decode host's ledger does not see that read
(only prefill hosts report theirs), so a restarted service would adopt the freed blocks
from it as still kept, and a later turn would pull whatever the engine put there since.
So before each take-in the service writes a mark, ``host_read/<engine id>/<request id>``
= the wall-clock time the blocks would have expired anyway, to its ``DurableStore``
and waits for the write; a restarted service counts the marks not past that time as
reads (``LedgerAdoption``'s consumed blocks) and deletes the rest. A take-in that fails
leaves its mark: the blocks are then drained instead (read back into a prefill engine),
which frees them too. Marks are deleted once past their time.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from orchestrator.kv.durable import DurableStore, WriteBehind

__all__ = ["HOST_READ_PREFIX", "HostReads", "restore_host_reads"]

HOST_READ_PREFIX = "host_read/"


class HostReads:
    """The marks this service wrote, each deleted once past its time (``expire``)."""

    def __init__(
        self,
        marks: DurableStore | WriteBehind,
        *,
        ttl_s: float,
        wall_clock: Callable[[], float],
    ) -> None:
        self.marks = marks
        self.ttl_s = ttl_s  # a decode engine's blocks are kept at most this long
        self.wall_clock = wall_clock
        self._due: list[tuple[float, str]] = []

    async def mark(self, engine_id: str, request_id: str) -> None:
        """Mark the read of ``engine_id``'s blocks for ``request_id``, durably, before it."""
        until = self.wall_clock() + self.ttl_s
        key = f"{HOST_READ_PREFIX}{engine_id}/{request_id}"
        self.marks.put(key, f"{until:.3f}".encode())
        heapq.heappush(self._due, (until, key))
        if isinstance(self.marks, WriteBehind):
            await self.marks.flush()

    def expire(self) -> None:
        """Delete the marks past their time."""
        now = self.wall_clock()
        while self._due and self._due[0][0] <= now:
            self.marks.delete(heapq.heappop(self._due)[1])


def restore_host_reads(store: DurableStore, *, wall: float) -> set[tuple[str, str]]:
    """A previous instance's marks still in time, as (engine id, request id); those past
    their time are deleted."""
    reads: set[tuple[str, str]] = set()
    for key in store.keys(HOST_READ_PREFIX):
        raw = store.get(key)
        engine_id, _, request_id = key[len(HOST_READ_PREFIX) :].partition("/")
        try:
            until = float(raw or b"0")
        except ValueError:
            until = 0.0
        if until <= wall or not request_id:
            store.delete(key)
            continue
        reads.add((engine_id, request_id))
    return reads
