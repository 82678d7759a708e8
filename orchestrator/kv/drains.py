"""The KV lifecycle's effects, applied: every set of kept blocks nobody will reuse
(sessionless turns, closed, superseded or budget-evicted sessions) is *drained*, read
back into a prefill engine with a ``max_tokens=1`` pull, because vLLM 0.32's decode
engine pins them until its TTL otherwise.

A drain needs the exact tokens the blocks hold: the caller's candidates, then the
session's last turn (``SessionTokens``). A record no known tokens match stays until its
TTL (counted as undrainable). A record gone from under an unused turn lease revokes the
lease (``LeaseBook.revoke_record``): its next turn asks ``begin_turn`` instead of reading
KV that is no longer there. A record on an engine whose reuse an integrity check turned
off (``orchestrator.kv.integrity``) is not drained either: the read-back is the same read
that check found wrong, and its KV would land in the prefill engine's prefix cache; its
blocks stay until the TTL (counted as withheld).

With a host-memory tier (``kv.host_tier_mib``, ``orchestrator.kv.host_tier``) a record
evicted under the idle budget, or one that reached its offer deadline unpulled (an SDK
session kept alive past the decode's TTL by its heartbeats: a long tool call), is first
copied there instead: the tier's store reads the blocks over NIXL (the decode engine
frees them when the read lands, as after any read), and the copy is booked as the
session's record (``KVLifecycle.demote``), which the session's next turn pulls as it
would from a decode engine. A take-in that fails falls back to the drain (an expiring
record's blocks are left to their TTL), but only when nothing reads the blocks: a take-in
whose READ may still land (``HostReadPending``: in flight at the store's deadline, or no
answer from the store) leaves them to the store, which ends the decode's hold on them
when the READ is over (its notification), so they are never freed twice nor read back
while the store may still be reading them. A copy the lifecycle no longer wants (the
session moved on meanwhile) is released in the store. A host copy's own effects release
it there: nothing is read back from a host tier.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, Protocol

from engines.base import GenerateRequest, final_chunk
from engines.kv_params import KVTransferParams
from orchestrator.errors import KVTideError
from orchestrator.kv.decider import params_of
from orchestrator.kv.session_tokens import SessionTokens
from orchestrator.kv.turn_leases import LeaseBook
from policies.kv_lifecycle import (
    HOST_POOL,
    Effect,
    Evict,
    EvictReason,
    Expire,
    KVRecord,
    prefix_hash,
)

__all__ = [
    "Drains",
    "HostCopy",
    "HostReadPending",
    "HostTier",
    "PrefillPool",
    "host_record",
    "host_tag",
]

log = logging.getLogger("kvtide.kv_service")


class PrefillPool(Protocol):
    """How the service reaches the prefill pool to drain kept blocks."""

    def generate(self, request: GenerateRequest) -> Any: ...


@dataclasses.dataclass(frozen=True, slots=True)
class HostCopy:
    """A host tier's copy of kept blocks: the params a prefill pulls it with."""

    params: KVTransferParams
    expires_in_s: float


def host_tag(record: KVRecord) -> dict[str, Any]:
    """What a host copy keeps of its record, for a restarted service to book it again
    (``host_record``)."""
    return {
        "session_id": record.session_id,
        "num_tokens": record.num_tokens,
        "prefix_hash": record.prefix_hash,
        "bytes_held": record.bytes_held,
    }


def host_record(copy: HostCopy, tag: dict[str, Any], now: float) -> KVRecord | None:
    """The record of a host copy a store reports, from its tag; None for a copy without
    one (not taken in by a service)."""
    kept = copy.params.kept_blocks()
    try:
        return KVRecord(
            session_id=str(tag["session_id"]),
            engine_id=copy.params.remote_engine_id or "",
            pool_id=HOST_POOL,
            block_ids=() if kept is None else kept[2],
            num_tokens=int(tag["num_tokens"]),
            prefix_hash=str(tag["prefix_hash"]),
            expiry_s=now + copy.expires_in_s,
            last_used_s=now,
            bytes_held=int(tag["bytes_held"]),
            transfer_params=copy.params,
        )
    except (KeyError, TypeError, ValueError):
        return None


class HostReadPending(KVTideError, RuntimeError):
    """A take-in failed with its READ possibly still in flight: the store, not the
    service, ends the decode engine's hold on the blocks (``engines.host_store``)."""


class HostTier(Protocol):
    """The host-memory tier as the service reaches it (``orchestrator.kv.host_tier``).
    ``take_in`` answers within the tier's own deadline: the copy; None, nothing read;
    ``HostReadPending``, the READ may still land; any other error, nothing read."""

    async def take_in(
        self, params: KVTransferParams, tag: dict[str, Any] | None = None
    ) -> HostCopy | None: ...

    async def release(self, params: KVTransferParams) -> None: ...

    async def entries(self) -> list[tuple[HostCopy, dict[str, Any]]]: ...

    async def stats(self) -> dict[str, Any]: ...


class Drains:
    """Applies lifecycle effects and runs the drains they call for (one task each)."""

    def __init__(
        self,
        *,
        prefill: PrefillPool | None,
        timeout_s: float,
        tokens: SessionTokens,
        leases: LeaseBook,
        reuse_off: Callable[[], Collection[str]] = frozenset,
        host: HostTier | None = None,
        demote: Callable[[KVRecord, KVRecord], bool] | None = None,
        clock: Callable[[], float] | None = None,
        mark_read: Callable[[str, str], Awaitable[None]] | None = None,
    ) -> None:
        self.prefill = prefill
        # The host-memory tier, and how a copy there is booked (``KVLifecycle.demote``
        # at the service's clock).
        self.host = host
        self.demote = demote
        self.clock = clock
        # Durably, before the store reads a decode's blocks (``orchestrator.kv.host_reads``).
        self.mark_read = mark_read
        # The engines no read-back may read from (an integrity check failed there).
        self.reuse_off = reuse_off
        self.timeout_s = timeout_s
        self.tokens = tokens
        self.leases = leases
        self._tasks: set[asyncio.Task[None]] = set()
        self.counters = dict.fromkeys(
            (
                "drains",
                "drain_failures",
                "undrainable",
                "drains_withheld",
                "host_take_ins",
                "host_take_in_failures",
                "host_reads_pending",
                "host_unbooked",
                "host_releases",
            ),
            0,
        )

    def __len__(self) -> int:
        """The drains in flight."""
        return len(self._tasks)

    def stats(self) -> dict[str, int]:
        """The drains' part of the service's stats."""
        c = self.counters
        return {
            "num_drains": c["drains"],
            "num_drain_failures": c["drain_failures"],
            "num_drains_running": len(self._tasks),
            "num_undrainable": c["undrainable"],
            "num_drains_withheld": c["drains_withheld"],
            "num_host_take_ins": c["host_take_ins"],
            "num_host_take_in_failures": c["host_take_in_failures"],
            "num_host_reads_pending": c["host_reads_pending"],
            "num_host_unbooked": c["host_unbooked"],
            "num_host_releases": c["host_releases"],
        }

    def apply(
        self, effects: Sequence[Effect], candidates: Sequence[Sequence[int] | None] = ()
    ) -> None:
        """Drain records nobody will reuse, with the tokens they hold: the first of
        ``candidates`` (then the session's current tokens) that starts with the record's
        covered tokens (see the module)."""
        for effect in effects:
            self.leases.revoke_record(effect.record)
            record = effect.record
            if record.pool_id == HOST_POOL:
                self._spawn(self._release_host(record))
                continue
            to_host = self._to_host(effect)
            if not effect.drainable and not to_host:
                continue  # expiring anyway: the engine frees the blocks at its TTL
            if record.engine_id in self.reuse_off():
                self.counters["drains_withheld"] += effect.drainable
                continue
            options = (*candidates, self.tokens.token_ids(record.session_id))
            ids = next(
                (
                    c
                    for c in options
                    if c is not None
                    and len(c) > record.num_tokens
                    and prefix_hash(c, record.num_tokens) == record.prefix_hash
                ),
                None,
            )
            if to_host:  # a drain only if the take-in fails, and the blocks are drainable
                held = ids and ids[: record.num_tokens + 1]
                self._spawn(self._take_in(record, held, drain=effect.drainable))
                continue
            if ids is None:
                self.counters["undrainable"] += 1
                continue
            self.drain(params_of(record), ids[: record.num_tokens + 1])

    def _to_host(self, effect: Effect) -> bool:
        """The effect's record goes to the host tier, with a tier to take it: a decode's
        record evicted under the idle budget, for room or before its engine stops, or one
        that reached its offer deadline unpulled (its engine frees it at its TTL: an
        agent's SDK session outliving it)."""
        return (
            self.host is not None
            and self.demote is not None
            and (
                (
                    isinstance(effect, Evict)
                    and effect.reason
                    in (
                        EvictReason.BUDGET,
                        EvictReason.PRESSURE,
                        EvictReason.SCALED_IN,
                        EvictReason.REPLACED,
                    )
                )
                or (isinstance(effect, Expire) and effect.unread)
            )
        )

    async def _take_in(
        self, record: KVRecord, token_ids: Sequence[int] | None, *, drain: bool = True
    ) -> None:
        """Copy ``record``'s blocks to the host tier and book the copy; else, with
        ``drain`` and nothing reading them, drain them (with the tokens the blocks
        hold, when known). The take-in is bounded by the tier's own deadline, which
        knows its READ's: one of the service's own would pass first and leave a READ
        in flight under the drain."""
        assert self.host is not None and self.demote is not None and self.clock is not None
        params = params_of(record)
        try:
            if self.mark_read is not None:
                mark = self.mark_read(record.engine_id, params.remote_request_id or "")
                await asyncio.wait_for(mark, self.timeout_s)
            copy = await self.host.take_in(params, host_tag(record))
        except HostReadPending as exc:  # the store frees them when its READ is over
            log.warning("host tier take-in of %s failed: %s", params.remote_request_id, exc)
            self.counters["host_take_in_failures"] += 1
            self.counters["host_reads_pending"] += 1
            return
        except Exception as exc:  # the tier failed before reading: the blocks stay put
            log.warning("host tier take-in of %s failed: %s", params.remote_request_id, exc)
            copy = None
        if copy is None:
            self.counters["host_take_in_failures"] += 1
            if not drain:
                return  # its engine frees the blocks at their TTL
            if token_ids is None:
                self.counters["undrainable"] += 1
            else:
                await self._read_back(params, list(token_ids))
            return
        on_host = host_record(copy, host_tag(record), self.clock())
        assert on_host is not None  # the tag is this record's own
        if self.demote(record, on_host):
            self.counters["host_take_ins"] += 1
            self.leases.revoke_session(record.session_id)  # a lease planned without it
            return
        self.counters["host_unbooked"] += 1
        await self._release_host(on_host)

    async def _release_host(self, record: KVRecord) -> None:
        """Free a host copy nobody will pull (the store keeps freed blocks unused a
        while: a reader it cannot see may still hold their params)."""
        if self.host is None:
            return
        params = params_of(record)
        try:
            await asyncio.wait_for(self.host.release(params), self.timeout_s)
            self.counters["host_releases"] += 1
        except Exception as exc:  # the store frees it at its own expiry
            log.warning("host tier release of %s failed: %s", params.remote_request_id, exc)

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def drain(self, params: KVTransferParams | None, token_ids: Sequence[int]) -> None:
        """Free a decode engine's kept blocks by reading them into a prefill engine."""
        if self.prefill is None or params is None or params.kept_blocks() is None:
            return
        self._spawn(self._read_back(params, list(token_ids)))

    async def _read_back(self, params: KVTransferParams, token_ids: list[int]) -> None:
        assert self.prefill is not None
        req = GenerateRequest(
            request_id=f"drain-{uuid.uuid4().hex}",
            prompt_token_ids=token_ids,
            max_tokens=1,
            # Nobody decodes after a drain: the prefill frees its copy at once.
            kv_transfer_params=params.pull_back(keep=False),
        )
        try:
            await asyncio.wait_for(final_chunk(self.prefill.generate(req)), self.timeout_s)
            self.counters["drains"] += 1
        except Exception as exc:
            self.counters["drain_failures"] += 1
            log.warning("drain of %s failed: %s", params.remote_request_id, exc)

    async def wait(self) -> None:
        """Wait for the drains in flight (tests and shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
