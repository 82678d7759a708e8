"""The service's side of turn leases (``orchestrator.kv.turn_leases``): granting a
session's next turn to the ingress replica that ran its last one, taking it back, and
hearing of its use. A granted turn is a running turn (``RunningTurns``) held in the KV
books (``KVLifecycle.hold``) until it runs on its lessee, is given back, or lapses.
Single event loop; the clock is the service's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from orchestrator.kv.decider import KVDecider
from orchestrator.kv.drains import Drains
from orchestrator.kv.messages import LeaseWatch, TurnLease
from orchestrator.kv.session_tokens import SessionTokens
from orchestrator.kv.turn_leases import (
    Grant,
    LeaseBook,
    RestoredLeases,
    offer_of,
    proposals_allowed,
)
from orchestrator.kv.turn_marks import OwnerMarks, RunningTurns
from policies.kv_lifecycle import RecomputeReason

__all__ = ["LeaseDesk"]


class LeaseDesk:
    """Grants, revocations and uses of turn leases, and the restored marks of a previous
    instance's unused ones (``RestoredLeases``)."""

    def __init__(
        self,
        *,
        book: LeaseBook,
        decider: KVDecider,
        tokens: SessionTokens,
        running: RunningTurns,
        owners: OwnerMarks,
        drains: Drains,
        epoch: str,
        clock: Callable[[], float],
    ) -> None:
        self.book = book
        self.restored = RestoredLeases()
        self.decider = decider
        self.tokens = tokens
        self.running = running
        self.owners = owners
        self.drains = drains
        self.epoch = epoch
        self.clock = clock

    def grant(
        self,
        session_id: str,
        holder: str | None,
        now: float,
        proposed: int | None = None,
        digest: int | None = None,
    ) -> TurnLease | None:
        """Hold the session's next turn for ``holder``: claimed (a running mark) and
        held in the books until it runs there, is given back, or lapses. ``proposed``:
        the lease id the lessee proposed with its hand-over (a provisional lease it may
        be using already: granted whether or not its watch runs, with ``digest``, that
        of the tokens the hand-over gave, when the service keeps no tokens for it; its
        record was held when the turn was booked)."""
        book = self.book
        if holder is None or book.lasts_s <= 0:
            return None
        if proposed is None and not book.watching(holder, now):
            return None
        kept = self.tokens.last_digest(session_id, now)
        digest = kept if kept is not None or proposed is None else digest
        if digest is None or session_id in self.running:
            return None  # nothing to check a next turn's tokens against
        lifecycle = self.decider.lifecycle
        if lifecycle.held(session_id):
            record = lifecycle.record(session_id)
        else:
            record = lifecycle.hold(session_id, now)
        grant = book.grant(session_id, holder, record, now, proposed)
        self.running.mark(session_id, now, grant)
        return TurnLease(
            session_id=session_id,
            lease_id=grant.lease_id,
            epoch=self.epoch,
            lasts_s=book.lasts_s,
            owner=self.owners.owners.owner(session_id, now),
            digest=digest,
            record=None
            if record is None
            else offer_of(record, lifecycle.config, book.grace_s, now, lifecycle.reuse_off),
        )

    def proposal(self, proposed: int | None, holder: str | None) -> int | None:
        """The proposed lease id a hand-over may be granted (None: none, or leases are
        off, or a provisional use of it was refused already, or an idle budget is set:
        holding every proposed record from its booking would keep the engines over it)."""
        if proposed is None or holder is None:
            return None
        if not proposals_allowed(self.decider.lifecycle.config, self.book.lasts_s):
            return None
        return None if self.book.refused(proposed) else proposed

    def end(self, grant: Grant) -> None:
        """Give a lease's turn back unused: the session is idle and free again."""
        if self.book.grants.get(grant.session_id) is grant:
            del self.book.grants[grant.session_id]
            self.drains.apply(self.decider.lifecycle.unhold(grant.session_id, self.clock()))
            self.running.clear(grant.session_id)

    def drop(self, session_id: str) -> None:
        """The session's turn ended otherwise (it ran, or was abandoned or stale)."""
        self.book.grants.pop(session_id, None)

    def unused(self, session_id: str) -> Grant | None:
        """The session's lease, if granted and not used yet."""
        grant = self.book.grants.get(session_id)
        return grant if grant is not None and not grant.used else None

    async def used(
        self, session_id: str, lease_id: int, reason: str | None, provisional: bool = False
    ) -> bool:
        """The lessee runs the held turn: it pulls the leased record (``reason`` None) or
        recomputes for ``reason``. False when the lease is no longer held (revoked and
        given back, lapsed, or granted by an instance before a restart): the lessee ends
        the turn before its client sees it and asks again with ``begin_turn``.
        ``provisional``: a lease the lessee proposed with its hand-over, used before the
        answer; a use that overtook the hand-over waits for it (``LeaseBook.granted``)."""
        if provisional:
            await self.book.granted(session_id, lease_id)
        now = self.clock()
        grant = self.book.find(session_id, lease_id)
        if grant is None or grant.used:
            restored = self.restored.pop(lease_id)
            if restored is not None:  # the previous instance's: free its running mark
                self.running.clear(restored)
            return False
        why = None if reason is None else RecomputeReason(reason)
        if not self.decider.lifecycle.use_held(
            session_id, record=grant.record, reason=why, now_s=now
        ):
            self.end(grant)
            return False
        grant.used = True
        # The turn's grace counts from now; its mark no longer names an unused lease.
        self.running.mark(session_id, now, holder=grant.holder)
        self.owners.touch(session_id, self.owners.owners.owner(session_id, now), now)
        return True

    async def watch(
        self,
        holder: str,
        released: list[int],
        wait_s: float,
        held: list[int] | None,
        answers: dict[str, bool] | None = None,
    ) -> LeaseWatch:
        """A lessee's standing call: take back the unused leases it gives back
        (``released``), then wait up to ``wait_s`` for leases to revoke from it or
        sessions to ask it about. ``held``: every lease it still holds, used or not
        (None: not said): a previous instance's lease of this holder not among them is
        over, and its mark cleared. ``answers``: whether its turn of each session it was
        asked about is still generating."""
        if answers:
            self.book.answered(holder, [s for s, g in answers.items() if g], answers)
        for lease_id in released:
            restored = self.restored.pop(lease_id)
            if restored is not None:
                self.running.clear(restored)
        if held is not None:
            for sid in self.restored.vouched(holder, held):
                self.running.clear(sid)
        wanted = set(released)
        for grant in [g for g in self.book.grants.values() if g.lease_id in wanted]:
            if grant.holder == holder and not grant.used:
                self.end(grant)
        revoked, asked = await self.book.watch(holder, wait_s)
        reuse_off = sorted(self.decider.lifecycle.reuse_off)
        return LeaseWatch(epoch=self.epoch, revoked=revoked, asked=asked, reuse_off=reuse_off)

    def still_running(self, session_id: str, caller: str | None) -> asyncio.Future[bool] | None:
        """Ask the replica running the session's turn, when it is another than
        ``caller`` and watching, whether that turn is still generating (``LeaseBook.ask``)."""
        holder = self.running.holders.get(session_id)
        if holder is None or holder == caller:
            return None
        return self.book.ask(holder, session_id)

    async def give_back(self, session_id: str, ask: bool = True) -> None:
        """Revoke an unused lease on the session and wait (``handover_wait_s``) for its
        lessee to give it back; one still unused then lapses now, unless its lessee says
        it runs the turn under it (its use not yet here; ``ask``: a turn elsewhere, which
        is then refused). A close does not ask: it waits for the use, so that the record
        is booked as pulled, not drained under the pull."""
        grant = self.unused(session_id)
        if grant is None:
            return
        self.book.revoke(grant)
        # Its lessee may be running the turn under it already (its use on the way):
        # then it says so, and the lease stays.
        asked = self.book.ask(grant.holder, session_id) if ask else None
        await self.running.wait_ended(session_id, asked)
        if asked is not None and asked.done() and not asked.cancelled() and asked.result():
            return
        grant = self.unused(session_id)
        if grant is not None:
            self.end(grant)

    def lapse(self, now: float) -> None:
        """The tick's part: leases whose lessee went silent, and restored marks nobody
        vouched for, end."""
        for grant in self.book.lapsed(now):
            self.end(grant)
        for sid in self.restored.lapsed(now):
            self.running.clear(sid)
        self.book.forget_silent(now)
