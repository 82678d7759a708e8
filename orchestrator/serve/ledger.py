"""An engine host's ledger of kept KV: what the KV service rebuilds itself from.

The KV lifecycle service keeps its books in memory. If it restarts, the engines still
pin the blocks they kept for send-back until their TTL, and the service must learn of
them again: otherwise they leak (pinned, unbudgeted, never drained), or, booked from a
stale source, they are "freed" twice (drained or offered after a read already freed
them). Two facts, each seen by one engine host, settle it:

- a **decode** host sees every finished request whose blocks its engine kept (the
  final ``kv_transfer_params`` name them and their expiry);
- a **prefill** host sees every read of kept blocks that succeeded (a pull or a drain):
  vLLM frees the blocks on the decode engine after a completed read.

A decode host also sees a release (``KVTransferParams.release``): a finished request on
its engine that freed another's kept blocks unread, once the turn extended on them was
booked; that entry leaves its kept half at once.

Kept minus consumed, minus expired, is exactly what the decode engines still hold. Each
host keeps its half until the blocks' TTL passes, then forgets it. The clock is passed in.

A decode host also asks the running service about each entry once it is ``check_grace_s``
old (``due_checks``): one no hand-over booked is drained (``orchestrator.kv.kept_check``).
Entries sent whole to a new epoch (``report``) are that epoch's adoption's, not checked.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from engines.base import GenerateChunk, GenerateRequest
from engines.kv_params import KVTransferParams
from orchestrator.bounded import BoundedMap
from orchestrator.kv.kept_check import KeptRef
from orchestrator.kv.messages import KeptBlocks, LedgerReport

__all__ = ["BOOKED_FOR_S", "MAX_UNSENT_READS", "EngineLedger"]

MAX_UNSENT_READS = 100_000
"""Reads kept for a KV service that does not answer (their blocks then expire at the TTL)."""

BOOKED_FOR_S = 10.0
"""How long the service's figure of the blocks it books on the engine stands (it answers
every heartbeat, each second); a service silent longer: the ledger's own count."""


@dataclass(frozen=True, slots=True)
class _Kept:
    session_id: str | None
    block_ids: tuple[int, ...]
    num_tokens: int
    token_ids: array[int]
    params: KVTransferParams
    expiry_s: float
    finished_s: float


class EngineLedger:
    """One engine host's half of the ledger. Single-threaded (the host's event loop)."""

    def __init__(
        self,
        *,
        engine_id: str,
        role: str,
        ttl_s: float,
        clock: Callable[[], float],
        check_grace_s: float | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.check_grace_s = check_grace_s
        self.role = role
        self.ttl_s = ttl_s
        self.clock = clock
        # Unbounded by count: each entry goes when its blocks' TTL passes. Put order is
        # expiry order (one TTL per engine), so ``expire`` stops at the first live one.
        self._kept: BoundedMap[tuple[str, str], _Kept] = BoundedMap()
        self._consumed: BoundedMap[tuple[str, str], None] = BoundedMap()
        self._reads: deque[tuple[str, str]] = deque(maxlen=MAX_UNSENT_READS)
        # Kept entries not checked yet (finish order), and those to ask about again.
        self._unchecked: deque[tuple[str, str]] = deque()
        self._again: set[tuple[str, str]] = set()
        self._booked: tuple[float, int] | None = None  # when, and the service's figure

    def __len__(self) -> int:
        return len(self._kept) + len(self._consumed)

    async def watch(
        self, request: GenerateRequest, stream: AsyncIterator[GenerateChunk]
    ) -> AsyncIterator[GenerateChunk]:
        """``stream`` (the engine's output for ``request``), noting its end in the ledger."""
        output: list[int] = []
        async for chunk in stream:
            output.extend(chunk.token_ids)
            if chunk.finished:
                self.on_finished(request, output, chunk)
            yield chunk

    def on_finished(
        self, request: GenerateRequest, output_ids: Sequence[int], chunk: GenerateChunk
    ) -> None:
        """A request on this host's engine finished (not failed): note its half."""
        if not chunk.finished or chunk.finish_reason == "error":
            return
        params = request.kv_transfer_params
        if self.role == "prefill":
            self.on_read(params)
        else:
            if params is not None and params.kvtide_release is not None:
                self.on_released(params.kvtide_release)
            self.on_decode_finished(
                session_id=request.session_id,
                token_ids=[*request.prompt_token_ids, *output_ids],
                kv_transfer_params=chunk.kv_transfer_params,
                expires_in_s=chunk.kv_expires_in_s,
            )

    def on_decode_finished(
        self,
        *,
        session_id: str | None,
        token_ids: Sequence[int],
        kv_transfer_params: KVTransferParams | None,
        expires_in_s: float | None,
    ) -> None:
        """A decode request finished: note the blocks its engine kept, if any."""
        if kv_transfer_params is None or (kept := kv_transfer_params.kept_blocks()) is None:
            return
        engine_id, request_id, blocks, num_tokens = kept
        now = self.clock()
        self._prune(now)
        expiry_s = now + (self.ttl_s if expires_in_s is None else expires_in_s)
        kept_blocks = _Kept(
            session_id=session_id,
            block_ids=blocks,
            num_tokens=num_tokens,
            token_ids=array("I", token_ids),
            params=kv_transfer_params,
            expiry_s=expiry_s,
            finished_s=now,
        )
        self._kept.put((engine_id, request_id), kept_blocks, expires_s=expiry_s)
        if self.check_grace_s is not None:
            self._unchecked.append((engine_id, request_id))

    def on_released(self, request_id: str) -> None:
        """This decode engine freed the blocks it kept for ``request_id`` unread (a
        release, ``KVTransferParams.release``): the entry goes."""
        self._kept.pop((self.engine_id, request_id))

    def on_read(self, params: KVTransferParams | None) -> None:
        """A prefill request that read kept blocks succeeded: the decode engine freed them."""
        target = params.read_target() if params is not None else None
        if target is None:
            return
        now = self.clock()
        self._prune(now)
        self._consumed.put(target, None, expires_s=now + self.ttl_s)
        self._reads.append(target)

    def take_reads(self) -> list[tuple[str, str]]:
        """The kept blocks this prefill engine read since the last call (the holders'
        engine and request ids), for holders that cannot see the reads themselves
        (``EngineAdapter.peers_read``); the oldest go past ``MAX_UNSENT_READS``."""
        reads, self._reads = list(self._reads), deque(maxlen=MAX_UNSENT_READS)
        return reads

    def booked(self, num_blocks: int) -> None:
        """The blocks the KV service books on this engine now (a heartbeat's answer)."""
        self._booked = (self.clock(), num_blocks)

    def num_kept_blocks(self) -> int:
        """Blocks this decode engine keeps for sessions between turns: what the KV
        service booked on it at its last answer, within ``BOOKED_FOR_S``. Without one,
        each entry until its TTL: an upper bound, as a read by a peer that this host
        does not see (a prefill's pull on vLLM) counts until then."""
        now = self.clock()
        self._prune(now)
        kept = sum(len(k.block_ids) for _, k in self._kept.items())
        if self._booked is not None and now - self._booked[0] <= BOOKED_FOR_S:
            return min(kept, self._booked[1])
        return kept

    def due_checks(self) -> list[KeptRef]:
        """The kept entries ``check_grace_s`` old or more not checked yet, and those the
        service asked about again; each leaves the ledger's queue as it is returned."""
        if self.check_grace_s is None:
            return []
        now = self.clock()
        self._prune(now)
        due: list[tuple[str, str]] = [k for k in self._again if k in self._kept]
        self._again.clear()
        while self._unchecked:
            key = self._unchecked[0]
            kept = self._kept.get(key)
            if kept is not None and now - kept.finished_s < self.check_grace_s:
                break
            self._unchecked.popleft()
            if kept is not None:
                due.append(key)
        return [self._ref(key, now) for key in due]

    def check_again(self, keys: Sequence[tuple[str, str]]) -> None:
        """Ask about these entries (engine and request ids) at the next check: their
        turn may still hand over."""
        self._again.update((e, r) for e, r in keys)  # tuples: a Ray call may send lists

    def kept(self, keys: Sequence[tuple[str, str]]) -> list[KeptBlocks]:
        """These entries whole, those the ledger still has."""
        now = self.clock()
        return [self._whole((e, r), k, now) for e, r in keys if (k := self._kept.get((e, r)))]

    def _ref(self, key: tuple[str, str], now: float) -> KeptRef:
        kept = self._kept.get(key)
        assert kept is not None
        return KeptRef(
            engine_id=key[0],
            request_id=key[1],
            session_id=kept.session_id,
            age_s=now - kept.finished_s,
        )

    def report(self) -> LedgerReport:
        """What the service needs to rebuild, with times as durations from now. Its
        entries are the new epoch's to adopt: none is checked after it."""
        now = self.clock()
        self._prune(now)
        self._unchecked.clear()
        self._again.clear()
        kept = [self._whole(key, k, now) for key, k in self._kept.items()]
        return LedgerReport(
            engine_id=self.engine_id, role=self.role, kept=kept, consumed=list(self._consumed)
        )

    @staticmethod
    def _whole(key: tuple[str, str], k: _Kept, now: float) -> KeptBlocks:
        return KeptBlocks(
            engine_id=key[0],
            request_id=key[1],
            session_id=k.session_id,
            block_ids=list(k.block_ids),
            num_tokens=k.num_tokens,
            token_ids=list(k.token_ids),
            kv_transfer_params=k.params,
            expires_in_s=k.expiry_s - now,
            age_s=now - k.finished_s,
        )

    def _prune(self, now: float) -> None:
        self._kept.expire(now)
        self._consumed.expire(now)
