"""The host store's blocks: which are free to take, and which rest before reuse.

A block leaves the free list when a take-in reads into it and comes back in one of two
ways: at once (its reader's notification said it is done; a READ that failed or ended
after its deadline, which no entry and no reader names), or after ``reuse_after_s``
(released or expired: a reader the store cannot see may still hold params naming it).
A READ still in flight keeps its blocks out of both until NIXL says it is over
(``engines.host_store``). Not thread-safe: the store's lock guards it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["BlockPool"]


class BlockPool:
    """``num_blocks`` store blocks, numbered from 0; ``clock`` is the store's."""

    def __init__(self, num_blocks: int, *, reuse_after_s: float, clock: Callable[[], float]):
        self.reuse_after_s = reuse_after_s
        self.clock = clock
        self._free: list[int] = list(range(num_blocks))
        self._resting: list[tuple[float, list[int]]] = []  # (reusable at, blocks), in order

    def resize(self, num_blocks: int) -> None:
        """Every block free, ``num_blocks`` of them (the store sized at its first take-in)."""
        self._free = list(range(num_blocks))
        self._resting = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, num_blocks: int) -> list[int] | None:
        """``num_blocks`` free blocks, or None when fewer are free."""
        if num_blocks > len(self._free):
            return None
        mine, self._free = self._free[:num_blocks], self._free[num_blocks:]
        return mine

    def give_back(self, block_ids: Sequence[int], *, rest: bool = False) -> None:
        """Free ``block_ids``: at once, or (``rest``) after ``reuse_after_s``."""
        if rest and self.reuse_after_s > 0:
            self._resting.append((self.clock() + self.reuse_after_s, list(block_ids)))
        else:
            self._free.extend(block_ids)

    def wake(self, now: float) -> None:
        """Resting blocks whose rest is over become free."""
        while self._resting and self._resting[0][0] <= now:
            self._free.extend(self._resting.pop(0)[1])
