"""Turn leases: a session's next turn held for the ingress replica that ran its last one.

A session turn needs its claim (the key owns the session, no other turn of it runs) and
its KV plan before it runs; asking the service for them (``begin_turn``) puts an actor
round trip on every turn's path. Most conversations send their next turn to the same
ingress replica, so the service grants that replica a lease on the next turn with its
answer to the last one's ``turn_done``:

* the service marks the session's turn running for the lessee (a running mark, written
  through like any: a restarted service still refuses a second turn) and holds the turn
  in its KV books (``KVLifecycle.hold``: the session counts as having a turn in flight,
  so its record is neither evicted nor its session expired);
* the lease (``TurnLease``) carries the owner, the digest of the last turn and the kept
  record's pull parameters: the lessee checks the key and its copy of the last turn and
  plans the turn itself, with the checks of ``policies.kv_cost.decide_turn``;
* the turn then starts at once; the lessee tells the service what it did
  (``lease_used``, off the path) and waits for that answer before the client's first
  token, which comes after the prefill: a refused lease (the service gave it up) ends
  the turn unseen and it runs again through ``begin_turn``;
* anything else that wants the session (a turn on another replica, a close) revokes the
  lease: each lessee keeps one ``lease_watch`` call waiting at the service, which answers
  with the leases to give back; an unused one is released with the next call, a used one
  ends with its turn. Until then ``begin_turn`` waits (``handover_wait_s``), as for any
  running turn. A lease not used within ``lasts_s`` is released by its lessee; one whose
  lessee went silent lapses at the service ``grace_s`` later.
* the watch also carries the service's questions: a turn of a session whose turn runs on
  another replica asks that replica whether the turn is still generating (``ask``); the
  answer comes with its next watch call, at once. Still generating: the turn is refused
  (409) without waiting; its last token already sent: the turn waits for the hand-over.

The lessee never starts a pull within ``grace_s`` of the end of the record's offer (the
service expires it there), so a use reaches the service while the record is still the
session's. Leases are granted only to a lessee whose watch is running.

**Provisional leases.** The lessee does not wait for the hand-over's answer to run the
session's next turn: with the hand-over it proposes the next lease's id
(``TurnDone.next_lease_id``) and holds a provisional lease built from its own copy of
the kept record (``offer_of`` on ``policies.kv_lifecycle.kept_record``: what the
service's grant would carry). A turn arriving before the answer runs under it at once;
its use (``lease_used(..., provisional=True)``) follows the hand-over from the same
caller and, should it overtake it, waits for it (``handover_wait_s``). The service
grants a proposed lease whenever leases are on, watch or not, and holds the record from
the booking on (``on_turn_finished(hold=True)``), so no drain frees the blocks a
provisional pull may be reading; an unused proposed lease lapses like any. Under an idle
budget nothing is proposed (a record booked over it is evicted at once). A use that
found no grant within the wait is refused, and its id is never granted later.

This module is the service's side of the channel to the lessees (its grants go through
``orchestrator.kv.lease_desk``; the rules that grant, use, end and revoke leases are
``policies.turn_state``'s); the lessee's, in each ingress replica, is
``orchestrator.router.held_leases``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from engines.kv_params import KVTransferParams
from orchestrator.kv.messages import LeasedRecord
from policies.kv_cost import worth_pulling
from policies.kv_records import KVLifecycleConfig, KVRecord, RecomputeReason
from policies.turn_leases import (
    Grant,
    LeaseGrants,
    RestoredLeases,
    RevokeLease,
    proposals_allowed,
)

__all__ = [
    "HANDOVER_WAIT_S",
    "WATCH_WAIT_S",
    "Grant",
    "LeaseBook",
    "RestoredLeases",
    "offer_of",
    "proposals_allowed",
]

HANDOVER_WAIT_S = 5.0
"""How long a session's next turn waits at the service for the running one's hand-over
(and a provisional lease's use for its grant); the lease's margin before an offer ends."""


WATCH_WAIT_S = 2.0
"""How long a lessee's ``lease_watch`` call waits at the service for a revocation."""


def offer_of(
    record: KVRecord,
    config: KVLifecycleConfig,
    grace_s: float,
    now_s: float,
    reuse_off: Collection[str] = (),
) -> LeasedRecord:
    """The kept record as a lease carries it: its pull parameters, the tokens it covers,
    when its offer ends less the lease's margin (``safety_margin_s`` + ``grace_s``), and
    the recompute reason the record alone gives (None: worth pulling): reuse from its
    engine off (``reuse_off``, after an integrity check), then ``worth_pulling``."""
    params = record.transfer_params
    if not isinstance(params, KVTransferParams):
        raise TypeError(f"a lease carries KVTransferParams, not {type(params).__name__}")
    not_worth = (
        RecomputeReason.INTEGRITY_CHECK_FAILED
        if record.engine_id in reuse_off
        else worth_pulling(record, config)
    )
    return LeasedRecord(
        kv_transfer_params=params,
        num_tokens=record.num_tokens,
        prefix_hash=record.prefix_hash,
        offer_in_s=record.expiry_s - config.safety_margin_s - grace_s - now_s,
        not_worth=None if not_worth is None else not_worth.value,
        source_pool=record.pool_id,
    )


@dataclass(slots=True)
class _Holder:
    last_seen_s: float
    revoked: set[int] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # Sessions asked about (their answer awaited), and those not yet sent with a watch.
    asked: dict[str, asyncio.Future[bool]] = field(default_factory=dict)
    to_ask: set[str] = field(default_factory=set)


class LeaseBook:
    """The service's lessees: each one's standing watch, the leases it is asked to give
    back and the sessions it is asked about, and the provisional uses waiting for their
    grant. The grants themselves, and the rules that grant and end them, are
    ``policies.turn_state``'s (``table``). Single event loop; the clock is the service's."""

    def __init__(self, *, lasts_s: float, grace_s: float, clock: Callable[[], float]) -> None:
        self.table = LeaseGrants(lasts_s=lasts_s, grace_s=grace_s)
        self.clock = clock
        self._holders: dict[str, _Holder] = {}
        # Provisional uses waiting for their proposed lease's grant, by lease id.
        self._awaited: dict[int, asyncio.Event] = {}

    @property
    def lasts_s(self) -> float:
        return self.table.lasts_s

    @lasts_s.setter
    def lasts_s(self, value: float) -> None:
        self.table.lasts_s = value

    @property
    def grace_s(self) -> float:
        return self.table.grace_s

    @grace_s.setter
    def grace_s(self, value: float) -> None:
        self.table.grace_s = value

    @property
    def grants(self) -> dict[str, Grant]:
        return self.table.grants

    def watching(self, holder: str, now: float) -> bool:
        """Whether ``holder``'s watch is running (it called within the last few waits)."""
        seen = self._holders.get(holder)
        return seen is not None and now - seen.last_seen_s <= 3 * WATCH_WAIT_S

    def grant(
        self,
        session_id: str,
        holder: str,
        record: KVRecord | None,
        now: float,
        lease_id: int | None = None,
    ) -> Grant:
        """Book a lease: ``lease_id`` the lessee proposed, or a new one."""
        grant = self.table.grant(session_id, holder, record, now, lease_id)
        self.announce(grant.lease_id)
        return grant

    def announce(self, lease_id: int) -> None:
        """The lease was granted: a provisional use waiting for it goes on."""
        awaited = self._awaited.pop(lease_id, None)
        if awaited is not None:
            awaited.set()

    async def granted(self, session_id: str, lease_id: int) -> Grant | None:
        """The lease, waiting up to ``grace_s`` for the hand-over that proposes it; a use
        that finds none is refused for good."""
        grant = self.table.find(session_id, lease_id)
        if grant is None and lease_id not in self.table.refused:
            awaited = self._awaited.setdefault(lease_id, asyncio.Event())
            try:
                await asyncio.wait_for(awaited.wait(), self.grace_s)
            except TimeoutError:
                pass
            finally:
                self._awaited.pop(lease_id, None)
            grant = self.table.find(session_id, lease_id)
        if grant is None:
            self.table.refuse(lease_id)
        return grant

    def num_unused(self) -> int:
        return self.table.num_unused()

    def revoke_record(self, record: KVRecord) -> None:
        """``record`` is gone: revoke an unused lease that would read it."""
        for revoke in self.table.revocations(record):
            self.revoke(revoke)

    def revoke_session(self, session_id: str) -> None:
        """The session's KV changed under an unused lease (a host tier's copy was booked):
        revoke the lease, so that the next turn asks and finds it."""
        for revoke in self.table.revoke_session(session_id):
            self.revoke(revoke)

    def revoke(self, revoke: RevokeLease) -> None:
        """Ask the lessee to give the lease back."""
        holder = self._holders.get(revoke.holder)
        if holder is not None:
            holder.revoked.add(revoke.lease_id)
            holder.wake.set()

    async def watch(self, holder: str, wait_s: float) -> tuple[list[int], list[str]]:
        """The leases ``holder`` is asked to give back and the sessions it is asked
        about (``ask``), waiting up to ``wait_s`` for one."""
        state = self._holders.get(holder)
        if state is None:
            state = self._holders[holder] = _Holder(last_seen_s=self.clock())
        state.last_seen_s = self.clock()
        if not state.revoked and not state.to_ask:
            state.wake.clear()
            try:
                await asyncio.wait_for(state.wake.wait(), wait_s)
            except TimeoutError:
                pass
        state.last_seen_s = self.clock()
        revoked = sorted(state.revoked & {g.lease_id for g in self.grants.values()})
        state.revoked.clear()
        asked = sorted(state.to_ask)
        state.to_ask.clear()
        return revoked, asked

    def ask(self, holder: str, session_id: str) -> asyncio.Future[bool] | None:
        """Ask ``holder`` (through its watch) whether its turn of the session is still
        generating; None when its watch is not running (nobody to ask)."""
        state = self._holders.get(holder)
        if state is None or not self.watching(holder, self.clock()):
            return None
        asked = state.asked.get(session_id)
        if asked is None or asked.done():
            asked = state.asked[session_id] = asyncio.get_running_loop().create_future()
            state.to_ask.add(session_id)
            state.wake.set()
        return asked

    def answered(self, holder: str, generating: Collection[str], asked: Collection[str]) -> None:
        """``holder``'s answers: of the sessions it was ``asked`` about, those in
        ``generating`` are."""
        state = self._holders.get(holder)
        if state is None:
            return
        for session_id in asked:
            waiting = state.asked.pop(session_id, None)
            if waiting is not None and not waiting.done():
                waiting.set_result(session_id in generating)

    def forget_silent(self, now: float) -> None:
        for name in [h for h, s in self._holders.items() if now - s.last_seen_s > 60.0]:
            del self._holders[name]
