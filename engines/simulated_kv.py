"""The KV blocks of one simulated engine: free, reserved, filled, and kept for peers.

Requests own blocks by request id. Admission reserves a request's worst case (prompt +
max_tokens) so that a running request never runs out and nothing is preempted; blocks
are then taken out of the reservation as tokens are computed. When a request finishes,
its blocks are freed, or kept for a peer until an expiry time (a prefill's blocks wait
for decode to read them; a decode's wait to be sent back), as vLLM's NixlConnector
keeps them. Block ids are handed out lowest first and freed blocks are reused last in,
last out (vLLM's free block queue), so tests can name exact ids.

``PrefixCache`` is the engine's prefix cache: the chained hashes of the full prompt
blocks it computed, the most recent ``max_blocks`` of them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engines.base import KVTransferSpec
from engines.kv_params import KVTransferParams
from placement.capacity import EngineShape
from policies.prefix_routing import block_hashes

if TYPE_CHECKING:
    from engines.simulated import SimulatedEngine

__all__ = ["KVBlockPool", "KeptBlocks", "PrefixCache", "SimulatedFabric", "nixl_params"]


@dataclass(frozen=True, slots=True, kw_only=True)
class KeptBlocks:
    """Blocks of a finished request, readable by a peer until ``expires_s``."""

    block_ids: tuple[int, ...]
    num_tokens: int
    expires_s: float


class KVBlockPool:
    """Invariant: free + filled + kept = num_blocks, and reserved <= free."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # The free queue is ids never used (from _next_fresh up) followed by freed ids
        # in the order they were freed; fresh ids are not materialized, since a large
        # engine has hundreds of thousands of blocks.
        self._next_fresh = 0
        self._freed: deque[int] = deque()
        self._reserved = 0
        self._reservations: dict[str, int] = {}  # blocks a request may still take
        self._filled: dict[str, list[int]] = {}
        self._kept: dict[str, KeptBlocks] = {}

    # ---- queries (side-effect free) --------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.num_blocks - self._next_fresh + len(self._freed)

    def can_admit(self, num_blocks: int) -> bool:
        return self.num_free - self._reserved >= num_blocks

    def blocks_of(self, request_id: str) -> list[int]:
        return list(self._filled.get(request_id, ()))

    def kept(self, request_id: str, now_s: float) -> KeptBlocks | None:
        """What ``request_id`` left for a peer, unless it has expired."""
        kept = self._kept.get(request_id)
        return kept if kept is not None and kept.expires_s > now_s else None

    def num_used(self, now_s: float) -> int:
        """Blocks filled by requests or kept for peers (expired ones count as free)."""
        expired = sum(len(k.block_ids) for k in self._kept.values() if k.expires_s <= now_s)
        return self.num_blocks - self.num_free - expired

    def next_expiry_s(self) -> float | None:
        return min((k.expires_s for k in self._kept.values()), default=None)

    # ---- commands ----------------------------------------------------------------------
    def admit(self, request_id: str, num_blocks: int) -> None:
        """Reserve a request's worst case; call ``can_admit`` first."""
        if not self.can_admit(num_blocks):
            raise RuntimeError(f"{num_blocks} blocks are not free for {request_id!r}")
        self._reservations[request_id] = num_blocks
        self._reserved += num_blocks
        self._filled[request_id] = []

    def fill(self, request_id: str, num_blocks: int) -> None:
        """Give an admitted request ``num_blocks`` blocks in all, out of its reservation."""
        blocks = self._filled[request_id]
        need = num_blocks - len(blocks)
        if need > self._reservations[request_id]:
            raise RuntimeError(f"{request_id!r} needs {need} blocks beyond its reservation")
        for _ in range(max(0, need)):
            if self._next_fresh < self.num_blocks:
                blocks.append(self._next_fresh)
                self._next_fresh += 1
            else:
                blocks.append(self._freed.popleft())
        self._reservations[request_id] -= max(0, need)
        self._reserved -= max(0, need)

    def finish(self, request_id: str, *, keep_until_s: float | None, num_tokens: int) -> None:
        """Drop the reservation; keep the blocks for a peer until ``keep_until_s``, or
        free them (``None``). Unknown ids are ignored."""
        self._reserved -= self._reservations.pop(request_id, 0)
        blocks = self._filled.pop(request_id, None)
        if not blocks:
            return
        if keep_until_s is None:
            self._freed.extend(blocks)
        else:
            self._kept[request_id] = KeptBlocks(
                block_ids=tuple(blocks), num_tokens=num_tokens, expires_s=keep_until_s
            )

    def release_kept(self, request_id: str) -> bool:
        """Free blocks kept for a peer (it read them, or they expired)."""
        kept = self._kept.pop(request_id, None)
        if kept is not None:
            self._freed.extend(kept.block_ids)
        return kept is not None

    def expire(self, now_s: float) -> int:
        """Free every kept block whose time is up; returns how many requests' blocks."""
        due = [r for r, k in self._kept.items() if k.expires_s <= now_s]
        for request_id in due:
            self.release_kept(request_id)
        return len(due)


class PrefixCache:
    """The chained hashes of prompt blocks an engine computed, least recently used first
    (it models what vLLM's cache can hold, not which free blocks it reuses first)."""

    def __init__(self, block_size: int, max_blocks: int) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def match(self, token_ids: list[int]) -> int:
        """Full blocks of ``token_ids``' longest prefix held here (marked recently used)."""
        num_blocks = 0
        for h in block_hashes(token_ids, self.block_size):
            if h not in self._hashes:
                break
            self._hashes.move_to_end(h)
            num_blocks += 1
        return num_blocks

    def remember(self, token_ids: list[int]) -> None:
        """Hold ``token_ids``' full blocks, dropping the least recently used past the bound."""
        for h in block_hashes(token_ids, self.block_size):
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.max_blocks:
            self._hashes.popitem(last=False)


class SimulatedFabric:
    """Running simulated engines by engine id, so that one can read KV another kept."""

    def __init__(self) -> None:
        self._engines: dict[str, SimulatedEngine] = {}

    def register(self, engine: SimulatedEngine) -> None:
        engine_id = engine.spec.engine_id
        other = self._engines.get(engine_id)
        if other is not None and other is not engine and other.is_running:
            raise ValueError(
                f"a simulated engine with id {engine_id!r} is already running on this fabric; "
                "give each engine its own engine_id or shut the other one down."
            )
        self._engines[engine_id] = engine

    def unregister(self, engine: SimulatedEngine) -> None:
        if self._engines.get(engine.spec.engine_id) is engine:
            del self._engines[engine.spec.engine_id]

    def get(self, engine_id: str) -> SimulatedEngine | None:
        return self._engines.get(engine_id)


def nixl_params(
    *,
    engine_id: str,
    request_id: str,
    kv: KVTransferSpec,
    shape: EngineShape,
    block_ids: list[int],
    num_tokens: int,
    is_prefill: bool,
    expires_s: float,
) -> KVTransferParams:
    """The ``kv_transfer_params`` vLLM 0.32's NixlConnector returns for kept blocks: a
    prefill's ask decode to pull them; a decode's offer them back to the next prefill."""
    return KVTransferParams(
        do_remote_prefill=is_prefill,
        do_remote_decode=not is_prefill,
        remote_block_ids=(tuple(block_ids),),  # one tuple per KV-cache group
        remote_engine_id=engine_id,
        remote_request_id=request_id,
        remote_host=kv.side_channel_host,
        remote_port=kv.side_channel_port,
        tp_size=shape.tp,
        dcp_size=shape.dcp,
        pp_size=shape.pp,
        remote_num_tokens=num_tokens,
        remote_blocks_expiry_time=None if is_prefill else expires_s,
        transfer_mode="pull",
    )
