"""The KV lifecycle simulator's memory meters: what each decode engine holds over time.

Two quantities per decode engine, in bytes summed over the engine's GPUs:

- *held*: what the policy books (``KVLifecycle.bytes_held``), taken after each call
  that may change it (`EngineMemory.take_books`);
- *pinned*: blocks the engine itself keeps, per vLLM 0.32's rules: from the end of
  the turn that kept them until a read of them completes or their expiry
  (`pin`, `unpin`, `expire_next`).

Both are piecewise constant between events, so the time-weighted means
(`advance` before every change) are exact integrals over the measure window.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

__all__ = ["EngineMemory"]

BlockKey = tuple[str, int]
"""(engine id, first block id): one kept run of blocks."""


class EngineMemory:
    """Held and pinned bytes per engine, their peaks and time-weighted means."""

    def __init__(self, engine_ids: Sequence[str], window_s: tuple[float, float] | None) -> None:
        self._num_engines = len(engine_ids)
        self._window = window_s if window_s is not None else (0.0, math.inf)
        self._last_s = 0.0
        self._held = dict.fromkeys(engine_ids, 0)
        self._pinned = dict.fromkeys(engine_ids, 0)
        self._held_total = self._pinned_total = 0
        self._held_area = self._pinned_area = 0.0
        self._owners: dict[BlockKey, tuple[int, str, int]] = {}  # bytes, session, version
        self._expiries: list[tuple[float, str, int]] = []  # (expiry_s, engine, first block)
        self.peak_held = self.peak_idle = self.peak_pinned = 0

    def advance(self, now: float) -> None:
        """Integrate up to ``now``; call before anything changes at ``now``."""
        start, end = self._window
        span = min(now, end) - max(self._last_s, start)
        if span > 0:
            self._held_area += self._held_total * span
            self._pinned_area += self._pinned_total * span
        self._last_s = now

    def take_books(self, engine_id: str, *, held_bytes: int, idle_bytes: int) -> None:
        """The policy's books for the engine after a call that may have changed them."""
        self._held_total += held_bytes - self._held[engine_id]
        self._held[engine_id] = held_bytes
        self.peak_held = max(self.peak_held, held_bytes)
        self.peak_idle = max(self.peak_idle, idle_bytes)

    # -- pinned blocks -------------------------------------------------------------

    def pin(
        self,
        key: BlockKey,
        *,
        num_bytes: int,
        expiry_s: float,
        session_id: str,
        history_version: int,
    ) -> None:
        """The engine keeps ``num_bytes`` of blocks until ``expiry_s`` or a read."""
        engine_id, first_block = key
        self._owners[key] = (num_bytes, session_id, history_version)
        self._pinned[engine_id] += num_bytes
        self._pinned_total += num_bytes
        self.peak_pinned = max(self.peak_pinned, self._pinned[engine_id])
        heapq.heappush(self._expiries, (expiry_s, engine_id, first_block))

    def owner(self, key: BlockKey) -> tuple[str, int] | None:
        """(session, history version) of pinned blocks; None once read or expired."""
        entry = self._owners.get(key)
        return None if entry is None else entry[1:]

    def unpin(self, key: BlockKey) -> None:
        """A read completed: the engine freed the blocks. Unknown keys are ignored."""
        num_bytes = self._owners.pop(key, (0, "", 0))[0]
        self._pinned[key[0]] -= num_bytes
        self._pinned_total -= num_bytes

    @property
    def next_expiry_s(self) -> float:
        """When the engine next frees blocks at their expiry (inf: never)."""
        return self._expiries[0][0] if self._expiries else math.inf

    def expire_next(self) -> None:
        """Free the blocks expiring first (already freed ones are skipped)."""
        expiry_s, engine_id, first_block = heapq.heappop(self._expiries)
        self.advance(expiry_s)
        self.unpin((engine_id, first_block))

    # -- results -----------------------------------------------------------------------

    def means(self, end_s: float) -> tuple[float, float]:
        """Mean held and pinned bytes per engine over the window (cut at ``end_s``)."""
        start, end = self._window
        span = (min(end, end_s) - start) * self._num_engines
        if span <= 0:
            return 0.0, 0.0
        return self._held_area / span, self._pinned_area / span
