"""Turn leases as an ingress replica holds them (the lessee's side of
``orchestrator.kv.turn_leases``, which describes the protocol): the leases its router's
turns take and plan from (``leased_decision``: the checks of
``policies.kv_cost.offer_refused``), and those it gives back with its next
``lease_watch``. Runs in the ingress replica, on its router's clock.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engines.kv_params import KVTransferParams
from orchestrator.kv.decider import kv_decision
from orchestrator.kv.messages import KVDecision, LeasedRecord, TurnLease
from orchestrator.kv.ownership import Principal
from orchestrator.kv.turn_leases import (
    HANDOVER_WAIT_S,
    WATCH_WAIT_S,
    offer_of,
    proposals_allowed,
)
from policies.kv_cost import offer_refused
from policies.kv_lifecycle import kept_record
from policies.kv_records import KVLifecycleConfig, RecomputeReason

__all__ = ["WATCH_WAIT_S", "HeldLeases", "leased_decision"]


@dataclass(slots=True)
class _Held:
    lease: TurnLease
    until_s: float  # lessee clock: usable before this
    offer_until_s: float | None  # lessee clock: pull the record before this
    in_use: bool = False
    provisional: bool = False  # proposed with a hand-over not yet answered


class HeldLeases:
    """An ingress replica's leases (the lessee's side; see the module doc)."""

    def __init__(
        self,
        holder: str,
        clock: Callable[[], float],
        *,
        lifecycle: KVLifecycleConfig | None = None,
        lasts_s: float = 0.0,
    ) -> None:
        # The clock of the router these leases serve (``Router`` checks it is its own):
        # a lease's ``until_s`` and the turn that takes it must be read on one clock.
        self.holder = holder
        self.clock = clock
        # The service's lifecycle config and lease length: with both, a hand-over
        # proposes the next turn's lease and holds it provisionally (``propose``).
        self.lifecycle = lifecycle
        self.lasts_s = lasts_s
        # The engines the service pulls from no more (its watch says; an integrity check
        # turned their reuse off): a provisional lease plans recompute for their records.
        self.reuse_off: frozenset[str] = frozenset()
        self._held: dict[str, _Held] = {}
        self._released: list[int] = []
        self.epoch: str | None = None

    def __len__(self) -> int:
        return len(self._held)

    def add(self, lease: TurnLease, asked_s: float, *, provisional: bool = False) -> None:
        """A lease granted in answer to a hand-over sent at ``asked_s`` (this clock):
        its times count from then, before the grant (so they end early, never late).
        The grant of a provisional lease (the same id) confirms it, in use or not."""
        if self.epoch is not None and lease.epoch != self.epoch:
            self.new_epoch(lease.epoch)
        self.epoch = lease.epoch
        old = self._held.get(lease.session_id)
        in_use = False
        if old is not None and old.lease.lease_id == lease.lease_id:
            in_use = old.in_use  # the provisional lease, confirmed
        elif old is not None and not old.in_use and not old.provisional:
            self._released.append(old.lease.lease_id)
        record = lease.record
        self._held[lease.session_id] = _Held(
            lease=lease,
            until_s=asked_s + lease.lasts_s,
            offer_until_s=None if record is None else asked_s + record.offer_in_s,
            in_use=in_use,
            provisional=provisional,
        )

    def proposal_id(self) -> int | None:
        """A new lease id for a hand-over to propose (None: no proposal: leases, the
        lifecycle config or the service's instance unknown, or proposals not allowed)."""
        config = self.lifecycle
        if config is None or self.epoch is None or not proposals_allowed(config, self.lasts_s):
            return None
        return secrets.randbits(62)

    def propose(
        self,
        session_id: str,
        lease_id: int,
        owner: str | None,
        digest: int,
        kept: KVTransferParams | None,
        token_ids: Sequence[int],
        kept_for_s: float | None,
    ) -> None:
        """Hold the session's next turn here provisionally, under ``lease_id`` (a
        ``proposal_id`` its hand-over proposes), from this replica's copy of what the
        service will book: the owner, the digest of the next turn's tokens, the decode's
        ``kept`` blocks for the first of ``token_ids``, offered for ``kept_for_s`` (None:
        the TTL)."""
        config, epoch = self.lifecycle, self.epoch
        if config is None or epoch is None:
            return
        now = self.clock()
        offer = None
        blocks = None if kept is None else kept.kept_blocks()
        if blocks is not None:
            engine_id, _, block_ids, num_tokens = blocks
            record = kept_record(
                session_id,
                engine_id=engine_id,
                token_ids_covered=token_ids[:num_tokens],
                block_ids=block_ids,
                transfer_params=kept,
                expiry_s=now + (config.ttl_s if kept_for_s is None else kept_for_s),
                last_used_s=now,
                config=config,
            )
            offer = offer_of(record, config, HANDOVER_WAIT_S, now, self.reuse_off)
        lease = TurnLease(
            session_id=session_id,
            lease_id=lease_id,
            epoch=epoch,
            lasts_s=self.lasts_s,
            owner=owner,
            digest=digest,
            record=offer,
        )
        self.add(lease, now, provisional=True)

    def unconfirmed(self, session_id: str, lease_id: int) -> None:
        """The hand-over proposing ``lease_id`` got no lease: an unused provisional lease
        goes (the service never held it); one in use has its use refused."""
        held = self._held.get(session_id)
        if held is not None and held.lease.lease_id == lease_id and not held.in_use:
            del self._held[session_id]

    def provisional(self, lease: TurnLease) -> bool:
        """Whether ``lease`` is still provisional (its hand-over not yet answered)."""
        held = self._held.get(lease.session_id)
        return held is not None and held.lease.lease_id == lease.lease_id and held.provisional

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
        return kv_decision(RecomputeReason.NO_RECORD)
    refused = offer_refused(
        offer_deadline_s=offer_until_s,
        num_tokens=record.num_tokens,
        recorded_prefix_hash=record.prefix_hash,
        not_worth=None if record.not_worth is None else RecomputeReason(record.not_worth),
        prompt_token_ids=prompt_token_ids,
        now_s=now_s,
    )
    return kv_decision(
        refused,
        record.kv_transfer_params,
        num_tokens=record.num_tokens,
        source_pool=record.source_pool,
    )
