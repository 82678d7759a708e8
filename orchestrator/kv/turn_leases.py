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

The lessee never starts a pull within ``grace_s`` of the end of the record's offer (the
service expires it there), so a use reaches the service while the record is still the
session's. Leases are granted only to a lessee whose watch is running.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from orchestrator.kv.messages import KVDecision, LeasedRecord, TurnLease
from orchestrator.kv.ownership import Principal
from policies.kv_cost import offer_refused
from policies.kv_records import KVRecord, RecomputeReason

__all__ = ["Grant", "HeldLeases", "LeaseBook", "RestoredLeases", "leased_decision"]

WATCH_WAIT_S = 2.0
"""How long a lessee's ``lease_watch`` call waits at the service for a revocation."""


@dataclass(slots=True)
class Grant:
    """A lease as the service books it."""

    session_id: str
    holder: str
    lease_id: int
    record: KVRecord | None
    lapses_s: float  # service clock: lasts_s + grace_s after the grant
    used: bool = False


@dataclass(slots=True)
class _Holder:
    last_seen_s: float
    revoked: set[int] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class LeaseBook:
    """The service's leases and lessees. Single event loop; the clock is the service's."""

    def __init__(self, *, lasts_s: float, grace_s: float, clock: Callable[[], float]) -> None:
        self.lasts_s = lasts_s
        self.grace_s = grace_s
        self.clock = clock
        self.grants: dict[str, Grant] = {}
        self._holders: dict[str, _Holder] = {}

    def watching(self, holder: str, now: float) -> bool:
        """Whether ``holder``'s watch is running (it called within the last few waits)."""
        seen = self._holders.get(holder)
        return seen is not None and now - seen.last_seen_s <= 3 * WATCH_WAIT_S

    def grant(self, session_id: str, holder: str, record: KVRecord | None, now: float) -> Grant:
        grant = Grant(
            session_id=session_id,
            holder=holder,
            lease_id=secrets.randbits(62),  # unique across service instances
            record=record,
            lapses_s=now + self.lasts_s + self.grace_s,
        )
        self.grants[session_id] = grant
        return grant

    def find(self, session_id: str, lease_id: int) -> Grant | None:
        grant = self.grants.get(session_id)
        return grant if grant is not None and grant.lease_id == lease_id else None

    def num_unused(self) -> int:
        return sum(not g.used for g in self.grants.values())

    def revoke_record(self, record: KVRecord) -> None:
        """``record`` is gone: revoke an unused lease that would read it."""
        grant = self.grants.get(record.session_id)
        if grant is not None and not grant.used and grant.record == record:
            self.revoke(grant)

    def revoke(self, grant: Grant) -> None:
        """Ask the lessee to give ``grant`` back."""
        holder = self._holders.get(grant.holder)
        if holder is not None:
            holder.revoked.add(grant.lease_id)
            holder.wake.set()

    def lapsed(self, now: float) -> list[Grant]:
        """Unused grants past their lapse time (their lessee went silent)."""
        return [g for g in self.grants.values() if not g.used and now >= g.lapses_s]

    async def watch(self, holder: str, wait_s: float) -> list[int]:
        """The leases ``holder`` is asked to give back, waiting up to ``wait_s`` for one."""
        state = self._holders.get(holder)
        if state is None:
            state = self._holders[holder] = _Holder(last_seen_s=self.clock())
        state.last_seen_s = self.clock()
        if not state.revoked:
            state.wake.clear()
            try:
                await asyncio.wait_for(state.wake.wait(), wait_s)
            except TimeoutError:
                pass
        state.last_seen_s = self.clock()
        revoked = sorted(state.revoked & {g.lease_id for g in self.grants.values()})
        state.revoked.clear()
        return revoked

    def forget_silent(self, now: float) -> None:
        for name in [h for h, s in self._holders.items() if now - s.last_seen_s > 60.0]:
            del self._holders[name]


@dataclass(frozen=True, slots=True)
class _Restored:
    session_id: str
    holder: str | None
    lapses_s: float


class RestoredLeases:
    """Unused leases a previous service instance granted, known to a restarted one only
    by their running marks (``orchestrator.kv.marks``). Each mark ends on its lessee's
    evidence: the lessee gives the lease back or uses it (``pop``), or its watch reports
    the leases it still holds and this one is not among them (``vouched``: a lease whose
    grant never reached it, or that it gave back before the restart and whose mark the
    old instance had no time to clear). One its lessee vouches for is a running turn
    like any (it ends with its turn). One nobody vouches for lapses when the lease would
    have (``lapsed``). The caller clears the returned sessions' running marks."""

    def __init__(self) -> None:
        self._by_id: dict[int, _Restored] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, lease_id: int, session_id: str, holder: str | None, lapses_s: float) -> None:
        self._by_id[lease_id] = _Restored(session_id, holder, lapses_s)

    def pop(self, lease_id: int) -> str | None:
        restored = self._by_id.pop(lease_id, None)
        return None if restored is None else restored.session_id

    def vouched(self, holder: str, held: Collection[int]) -> list[str]:
        """``holder`` holds exactly the leases ``held``: its restored leases not among
        them are over (returned); those among them are now its running turns."""
        over = []
        for lease_id, restored in list(self._by_id.items()):
            if restored.holder == holder:
                del self._by_id[lease_id]
                if lease_id not in held:
                    over.append(restored.session_id)
        return over

    def lapsed(self, now: float) -> list[str]:
        """Sessions of the leases nobody vouched for that are past their lapse time."""
        over = [lid for lid, r in self._by_id.items() if now >= r.lapses_s]
        return [self._by_id.pop(lid).session_id for lid in over]


@dataclass(slots=True)
class _Held:
    lease: TurnLease
    until_s: float  # lessee clock: usable before this
    offer_until_s: float | None  # lessee clock: pull the record before this
    in_use: bool = False


class HeldLeases:
    """An ingress replica's leases (the lessee's side; see the module doc)."""

    def __init__(self, holder: str, clock: Callable[[], float]) -> None:
        # The clock of the router these leases serve (``Router`` checks it is its own):
        # a lease's ``until_s`` and the turn that takes it must be read on one clock.
        self.holder = holder
        self.clock = clock
        self._held: dict[str, _Held] = {}
        self._released: list[int] = []
        self.epoch: str | None = None

    def __len__(self) -> int:
        return len(self._held)

    def add(self, lease: TurnLease, asked_s: float) -> None:
        """A lease granted in answer to a hand-over sent at ``asked_s`` (this clock):
        its times count from then, before the grant (so they end early, never late)."""
        if self.epoch is not None and lease.epoch != self.epoch:
            self.new_epoch(lease.epoch)
        self.epoch = lease.epoch
        old = self._held.get(lease.session_id)
        if old is not None and not old.in_use:
            self._released.append(old.lease.lease_id)
        record = lease.record
        self._held[lease.session_id] = _Held(
            lease=lease,
            until_s=asked_s + lease.lasts_s,
            offer_until_s=None if record is None else asked_s + record.offer_in_s,
        )

    def take(self, session_id: str, principal: Principal, digest: int | None) -> TurnLease | None:
        """The session's lease, now in use, when this turn may run under it: ``principal``
        owns the session, this replica's copy of the last turn (``digest``) is the one
        the lease was granted on, and it has not run out."""
        held = self._held.get(session_id)
        if held is None or held.in_use:
            return None
        lease = held.lease
        owner = None if principal.is_anonymous else principal.name
        if lease.owner != owner or lease.digest != digest or self.clock() >= held.until_s:
            return None
        held.in_use = True
        return lease

    def decide(self, lease: TurnLease, prompt_token_ids: Sequence[int]) -> KVDecision:
        """The turn's plan from the leased record, by ``decide_turn``'s checks."""
        held = self._held[lease.session_id]
        return leased_decision(lease.record, held.offer_until_s, prompt_token_ids, self.clock())

    def ended(self, session_id: str, lease_id: int) -> None:
        """The turn that used the lease ended (the service ends the lease with it)."""
        held = self._held.get(session_id)
        if held is not None and held.lease.lease_id == lease_id:
            del self._held[session_id]

    def revoke(self, lease_ids: Sequence[int]) -> None:
        """Give back the unused ones among ``lease_ids`` (with the next watch call)."""
        wanted = set(lease_ids)
        for sid, held in list(self._held.items()):
            if held.lease.lease_id in wanted and not held.in_use:
                del self._held[sid]
                self._released.append(held.lease.lease_id)

    def expire(self) -> None:
        """Give back unused leases that ran out."""
        now = self.clock()
        self.revoke([h.lease.lease_id for h in self._held.values() if now >= h.until_s])

    def new_epoch(self, epoch: str) -> None:
        """The service restarted: its leases are gone; give back (to the new instance,
        which still holds their running marks) every unused one."""
        if epoch == self.epoch:
            return
        self.epoch = epoch
        self.revoke([h.lease.lease_id for h in self._held.values()])

    def held_ids(self) -> list[int]:
        """Every lease this replica holds, used or not (its evidence to a restarted
        service, which drops the marks of the leases it no longer holds)."""
        return [h.lease.lease_id for h in self._held.values()]

    def unused(self) -> list[TurnLease]:
        return [h.lease for h in self._held.values() if not h.in_use]

    def take_released(self) -> list[int]:
        released, self._released = self._released, []
        return released

    def requeue(self, lease_ids: Sequence[int]) -> None:
        self._released.extend(lease_ids)


def leased_decision(
    record: LeasedRecord | None,
    offer_until_s: float | None,
    prompt_token_ids: Sequence[int],
    now_s: float,
) -> KVDecision:
    """``policies.kv_cost.decide_turn`` on a leased record: freshness (the offer's end
    less the lease's margin), the prompt extends the recorded tokens, and the verdict
    of the record alone (threshold, cost)."""
    if record is None or offer_until_s is None:
        return KVDecision(kind="recompute", reason=RecomputeReason.NO_RECORD.value)
    refused = offer_refused(
        offer_deadline_s=offer_until_s,
        num_tokens=record.num_tokens,
        recorded_prefix_hash=record.prefix_hash,
        not_worth=None if record.not_worth is None else RecomputeReason(record.not_worth),
        prompt_token_ids=prompt_token_ids,
        now_s=now_s,
    )
    if refused is not None:
        return KVDecision(kind="recompute", reason=refused.value)
    return KVDecision(
        kind="pull",
        reason="reuse",
        kv_transfer_params=record.kv_transfer_params,
        num_reusable_tokens=record.num_tokens,
    )
