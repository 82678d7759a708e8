"""The service's side of turn leases (``orchestrator.kv.turn_leases``): granting a
session's next turn to the ingress replica that ran its last one, taking it back, and
hearing of its use. A granted turn is a running turn held in the KV books
(``KVLifecycle.hold``) until it runs on its lessee, is given back, or lapses: those rules
are ``policies.turn_state``'s; this part reaches the lessees (``LeaseBook``), waits, and
applies the state's effects (``TurnEffects``). Single event loop; the clock is the
service's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.kv.messages import LeaseWatch, TurnLease
from orchestrator.kv.ownership import SessionOwners
from orchestrator.kv.session_tokens import SessionTokens
from orchestrator.kv.turn_effects import TurnEffects
from orchestrator.kv.turn_leases import Grant, LeaseBook, offer_of
from orchestrator.kv.turn_marks import RunningTurns
from policies.turn_state import TurnState

__all__ = ["LeaseDesk"]


@dataclass(kw_only=True, eq=False)
class LeaseDesk:
    """Grants, revocations and uses of turn leases, and the restored marks of a previous
    instance's unused ones (``TurnState.restored``)."""

    state: TurnState
    book: LeaseBook
    effects: TurnEffects
    running: RunningTurns
    tokens: SessionTokens
    owners: SessionOwners
    epoch: str
    clock: Callable[[], float]

    def grant(
        self,
        session_id: str,
        holder: str | None,
        now: float,
        proposed: int | None = None,
        digest: int | None = None,
    ) -> TurnLease | None:
        """Hold the session's next turn for ``holder`` (``TurnState.grant``). ``proposed``:
        the lease id the lessee proposed with its hand-over (a provisional lease it may
        be using already), with ``digest``, that of the tokens the hand-over gave, used
        when the service keeps no tokens for it."""
        kept = self.tokens.last_digest(session_id, now)
        digest = kept if kept is not None or proposed is None else digest
        watching = holder is not None and self.book.watching(holder, now)
        grant, effects = self.state.grant(
            session_id, holder, now, watching=watching, digest=digest, proposed=proposed
        )
        self.effects.apply(effects)
        if grant is None or digest is None:
            return None
        self.book.announce(grant.lease_id)
        lifecycle, table = self.state.lifecycle, self.state.leases
        record = grant.record
        return TurnLease(
            session_id=session_id,
            lease_id=grant.lease_id,
            epoch=self.epoch,
            lasts_s=table.lasts_s,
            owner=self.owners.owner(session_id, now),
            digest=digest,
            record=None
            if record is None
            else offer_of(record, lifecycle.config, table.grace_s, now, lifecycle.reuse_off),
        )

    def end(self, grant: Grant) -> None:
        """Give a lease's turn back unused (``TurnState.end``)."""
        self.effects.apply(self.state.end(grant, self.clock()))

    async def used(
        self, session_id: str, lease_id: int, reason: str | None, provisional: bool = False
    ) -> bool:
        """The lessee runs the held turn (``TurnState.use``). False when the lease is no
        longer held: the lessee ends the turn before its client sees it and asks again
        with ``begin_turn``. ``provisional``: a lease the lessee proposed with its
        hand-over, used before the answer; a use that overtook the hand-over waits for
        it (``LeaseBook.granted``)."""
        if provisional:
            await self.book.granted(session_id, lease_id)
        used, effects = self.state.use(session_id, lease_id, reason, self.clock())
        self.effects.apply(effects)
        return used

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
        (None: not said; ``TurnState.released``). ``answers``: whether its turn of each
        session it was asked about is still generating."""
        if answers:
            self.book.answered(holder, [s for s, g in answers.items() if g], answers)
        self.effects.apply(self.state.released(holder, released, held, self.clock()))
        revoked, asked = await self.book.watch(holder, wait_s)
        reuse_off = sorted(self.state.lifecycle.reuse_off)
        return LeaseWatch(epoch=self.epoch, revoked=revoked, asked=asked, reuse_off=reuse_off)

    def still_running(self, session_id: str, caller: str | None) -> asyncio.Future[bool] | None:
        """Ask the replica running the session's turn, when it is another than
        ``caller`` and watching, whether that turn is still generating (``LeaseBook.ask``)."""
        holder = self.state.holders.get(session_id)
        if holder is None or holder == caller:
            return None
        return self.book.ask(holder, session_id)

    async def give_back(self, session_id: str, ask: bool = True) -> None:
        """Revoke an unused lease on the session and wait (``handover_wait_s``) for its
        lessee to give it back; one still unused then ends now, unless its lessee says
        it runs the turn under it (its use not yet here; ``ask``: a turn elsewhere, which
        is then refused). A close does not ask: it waits for the use, so that the record
        is booked as pulled, not drained under the pull."""
        grant = self.state.leases.unused(session_id)
        if grant is None:
            return
        self.book.revoke_session(session_id)
        # Its lessee may be running the turn under it already (its use on the way):
        # then it says so, and the lease stays.
        asked = self.book.ask(grant.holder, session_id) if ask else None
        await self.running.wait_ended(session_id, asked)
        if asked is not None and asked.done() and not asked.cancelled() and asked.result():
            return
        grant = self.state.leases.unused(session_id)
        if grant is not None:
            self.end(grant)
