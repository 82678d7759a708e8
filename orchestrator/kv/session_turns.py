"""A session's turns as the KV service books them: claimed (one at a time, for the key
that owns the session), planned (``KVDecider``), handed over (``turn_done``: the kept
blocks and the session's tokens booked together) or abandoned, and the session closed.

The rules of a session's running turn, its lease and a close while it runs are
``policies.turn_state``'s (``TurnState``); this class asks it, applies what it returns
(``TurnEffects``), and keeps the order of a turn's steps: the owner's claim
(``SessionOwners``), the waits (``RunningTurns``, ``LeaseDesk``), the KV plan
(``KVDecider``) and the session's tokens. Single event loop; the clock is the service's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from orchestrator.errors import LimitExceeded, SessionNotFound, TurnInProgress
from orchestrator.kv.decider import KVDecider
from orchestrator.kv.drains import Drains
from orchestrator.kv.durable import WriteBehind
from orchestrator.kv.lease_desk import LeaseDesk
from orchestrator.kv.messages import Claim, Handover, SessionInfo, SessionPrefix, TurnDone
from orchestrator.kv.ownership import Principal
from orchestrator.kv.session_tokens import SessionTokens, prefix_digest
from orchestrator.kv.turn_effects import TurnEffects
from orchestrator.kv.turn_marks import OwnerMarks, RunningTurns
from policies.turn_state import TurnState

__all__ = ["SessionTurns", "whole_turn_done"]


def whole_turn_done(done: TurnDone, tokens: SessionTokens) -> TurnDone | None:
    """``done`` with what its sender left out put back (``TurnDone``): the session's
    last turn in front of its ids, its next ids cut from them. None when the last
    turn here is not the one it names (by digest): the sender sends it whole."""
    if done.prefix_len == 0 and done.next_len is None:
        return done
    ids = done.token_ids
    if done.prefix_len:
        sid = done.session_id
        last = None if sid is None else tokens.token_ids(sid)
        if (
            sid is None
            or last is None
            or len(last) != done.prefix_len
            or tokens.digest(sid) != done.prefix_digest
        ):
            return None
        ids = [*last, *ids]
    nxt = done.next_token_ids if done.next_len is None else ids[: done.next_len]
    return msgspec.structs.replace(
        done, token_ids=ids, next_token_ids=nxt, prefix_len=0, prefix_digest=None, next_len=None
    )


@dataclass(kw_only=True, eq=False)
class SessionTurns:
    """Claims, begins, hands over and abandons sessions' turns; closes sessions."""

    state: TurnState
    effects: TurnEffects
    decider: KVDecider
    tokens: SessionTokens
    owners: OwnerMarks
    running: RunningTurns
    leases: LeaseDesk
    drains: Drains
    clock: Callable[[], float]
    _closing: set[asyncio.Task[bool]] = field(default_factory=set, init=False)

    def prefix(self, session_id: str, principal: Principal | None) -> SessionPrefix:
        """The session's last turn; ``owned`` False (and nothing else) when another API
        key than ``principal``'s owns the session."""
        if principal is not None and not self.owned(session_id, principal):
            return SessionPrefix(owned=False)
        text, ids = self.tokens.last_turn(session_id, self.clock())
        return SessionPrefix(text=text, token_ids=list(ids))

    def owned(self, session_id: str, principal: Principal) -> bool:
        """Whether ``principal`` may use the session (it owns it, or nobody does)."""
        try:
            self.owners.owners.check(session_id, principal, self.clock())
        except SessionNotFound:
            return False
        return True

    async def claim(
        self, session_id: str, principal: Principal, holder: str | None = None
    ) -> Claim:
        """Make ``principal`` the session's owner and mark its turn running, just before
        the turn runs (see ``Claim``). Sessions whose ownership ended are closed first,
        so no key inherits another's KV or tokens. The turn must end with ``turn_done``
        or ``turn_abandoned``, which clear the mark."""
        now = self.clock()
        owners = self.owners.owners
        if self.state.in_progress(session_id, now):
            if owners.owner(session_id, now) not in (None, principal.name):
                return Claim(outcome="not_found")
            return Claim(
                outcome="turn_in_progress",
                message=TurnInProgress.words(session_id),
            )
        was_owner = owners.owner(session_id, now)
        try:
            ended = owners.claim(session_id, principal, now)
        except SessionNotFound:
            return Claim(outcome="not_found")
        except LimitExceeded as exc:
            return Claim(
                outcome="limit",
                code=exc.code,
                message=exc.message,
                retry_after_s=exc.retry_after_s,
            )
        for sid in ended:
            self.owners.delete(sid)  # the owners book has forgotten it
            await self.close(sid)
        self.effects.apply(self.state.mark(session_id, now, holder=holder))
        if not principal.is_anonymous and was_owner != principal.name:
            # Written before the answer (behind the writes queued before it, so that a
            # queued delete of an earlier owner cannot land after it).
            self.owners.write(session_id, principal.name)
            if isinstance(self.owners.marks, WriteBehind):
                await self.owners.marks.flush()
        return Claim(outcome="claimed")

    async def begin(
        self,
        session_id: str,
        principal: Principal,
        prompt_token_ids: list[int],
        prefix_digest: int | None,
        prefix_len: int,
        holder: str | None = None,
    ) -> Claim:
        """A turn's one call before it runs: ``claim_session`` and ``decide_turn`` at once.

        ``prefix_digest``: the ``session_tokens.prefix_digest`` of the last turn the
        prompt was tokenized from (None: not tokenized here, e.g. sent as token ids). When
        it is not the session's, nothing is claimed and the answer (``retokenize``) holds
        the session's last turn, for the owner's key only.

        ``prefix_len``: the prompt starts with that last turn's ``prefix_len`` ids (all of
        them), which are not sent again: ``prompt_token_ids`` holds only what the session
        added since (a turn's call carries its new tokens, not its whole history).

        A turn of the session still running is waited for (``handover_wait_s``) before
        anything is compared: a finished turn is handed over after its last token. So is a
        turn held for an ingress replica (a turn lease), which is revoked first. The
        replica running it, when another than ``holder`` (the caller) and known, is asked
        whether it is still generating: then the turn is refused at once."""
        if not await self._waited(session_id, principal, holder):
            return Claim(outcome="not_found")  # not waited for: another key learns nothing
        now = self.clock()
        if prefix_digest is not None and prefix_digest != self.tokens.last_digest(session_id, now):
            if not self.owned(session_id, principal):
                return Claim(outcome="not_found")
            text, ids = self.tokens.last_turn(session_id, now)
            return Claim(outcome="retokenize", prefix=SessionPrefix(text=text, token_ids=list(ids)))
        if prefix_len:
            last = self.tokens.last_turn(session_id, now)[1]
            if prefix_digest is None or len(last) != prefix_len:
                raise ValueError(
                    f"prefix_len {prefix_len} needs the digest of a last turn of that length"
                )
            prompt_token_ids = [*last, *prompt_token_ids]
        claim = await self.claim(session_id, principal, holder)
        if claim.outcome != "claimed":
            return claim
        decision = self.decider.decide_turn(session_id, prompt_token_ids, now)
        return msgspec.structs.replace(claim, decision=decision)

    async def _waited(self, session_id: str, principal: Principal, holder: str | None) -> bool:
        """Wait for the session's running turn, or its lease, to end (see ``begin``);
        False at once for another key's session (it learns nothing, revokes nothing)."""
        for _ in range(2):  # a hand-over waited for may hold the next turn for its replica
            if self.state.leases.unused(session_id) is not None:
                if not self.owned(session_id, principal):
                    return False
                await self.leases.give_back(session_id)  # a silent lessee's lapses now
            if session_id not in self.state:
                return True
            if not self.owned(session_id, principal):
                return False
            await self.running.wait_ended(session_id, self.leases.still_running(session_id, holder))
        return True

    def done(self, done: TurnDone) -> Handover:
        """Book the kept blocks and the session's tokens together (one step: a record is
        never booked without the tokens that drain it). Not accepted (nothing done) when
        the turn names a last turn this service does not hold: send it whole. With
        ``done.holder``, the session's next turn is held for that ingress replica (the
        answer's lease) when its lease watch runs."""
        whole = whole_turn_done(done, self.tokens)
        if whole is None:
            return Handover(accepted=False)
        done = whole
        now = self.clock()
        sid = done.session_id
        # A turn under a lease ends the lease.
        closed, ended = (False, []) if sid is None else self.state.hand_over(sid)
        self.effects.apply(ended)
        if sid is None or (closed and done.next_lease_id is None):
            # Nobody will pull these blocks back (no session, or it was closed while
            # this turn ran): free them now, not at the TTL.
            self.drains.drain(done.kv_transfer_params, done.token_ids)
            return Handover(accepted=True)
        self.owners.touch(sid, done.owner, now)
        # The record this turn supersedes covers the *previous* tokens: drain it with
        # those (a rewritten history does not start with them).
        previous = self.tokens.token_ids(sid)
        if done.next_token_ids is None:
            self.tokens.forget(sid)
        else:
            self.tokens.remember(sid, done.next_text, done.next_token_ids, now)
        expiry = None if done.kv_expires_in_s is None else now + done.kv_expires_in_s
        # A proposed lease's record is held from its booking: its lessee may be pulling
        # it already (``orchestrator.kv.turn_leases``, provisional leases).
        proposed = self.state.proposal(done.next_lease_id, done.holder)
        self.drains.apply(
            self.decider.turn_finished(
                sid,
                done.token_ids,
                done.kv_transfer_params,
                now,
                expiry_s=expiry,
                hold=proposed is not None,
            ),
            candidates=(previous, done.token_ids),
        )
        digest = None if done.next_token_ids is None else prefix_digest(done.next_token_ids)
        lease = self.leases.grant(sid, done.holder, now, proposed, digest)
        if closed:
            # Closed while this turn ran, but its lessee proposed the next lease and may
            # be pulling the record under it already: booked and held as any, then
            # closed again, which waits for that lease's use or its return.
            task = asyncio.get_running_loop().create_task(self.close(sid))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return Handover(accepted=True, lease=lease)

    def abandoned(self, session_id: str, *, unread: bool = False) -> None:
        self.effects.apply(self.state.abandoned(session_id))
        self.drains.apply(self.decider.abandon(session_id, self.clock(), unread=unread))

    def info(self, session_id: str) -> SessionInfo:
        now = self.clock()
        lifecycle = self.decider.lifecycle
        lease = lifecycle.lease_expiry(session_id)
        if lease is None:
            return SessionInfo(session_id=session_id, known=False)
        rec = lifecycle.record(session_id)
        return SessionInfo(
            session_id=session_id,
            known=True,
            engine_id=None if rec is None else rec.engine_id,
            num_tokens=0 if rec is None else rec.num_tokens,
            bytes_held=0 if rec is None else rec.bytes_held,
            expires_in_s=None if rec is None else round(rec.expiry_s - now, 3),
            lease_expires_in_s=round(lease - now, 3),
        )

    def renew(self, session_id: str, principal: Principal | None) -> SessionInfo:
        """Extend the session's lease and its owner's idle clock."""
        now = self.clock()
        self.decider.lifecycle.renew(session_id, now)
        if principal is not None:
            self.owners.touch(session_id, principal.name, now)
        return self.info(session_id)

    async def close(self, session_id: str) -> bool:
        """End a session: its kept KV is drained back to prefill (freed on decode now).
        A turn held for an ingress replica is given back first; a turn still running
        (or its hand-over still on its way) has its KV freed when it hands over."""
        await self.leases.give_back(session_id, ask=False)
        self.state.closing(session_id)
        known = self.decider.lifecycle.lease_expiry(session_id) is not None
        self.drains.apply(self.decider.close(session_id, self.clock()))
        self.tokens.forget(session_id)
        owners = self.owners.owners
        if owners.owner(session_id, self.clock()) is not None:
            self.owners.delete(session_id)
        owners.forget(session_id)
        return known
