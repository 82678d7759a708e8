"""A session's turn state, as rules: its running turn, the lease holding its next turn for
an ingress replica, the leases a previous service instance left, and a close that came
while a turn ran.

Pure and single-threaded, as ``policies.kv_lifecycle``: every method takes the time as
``now_s`` (where time matters) and returns its effects for the KV service to apply
(``orchestrator.kv.turn_effects``): running marks written through or cleared
(``MarkRunning``, ``ClearRunning``), an owner's idle clock restarted (``TouchOwner``) and
the KV books' own effects (``policies.kv_records.Effect``: kept blocks nobody will
reuse), in the order to apply them. The leases' own books are ``policies.turn_leases``
(``LeaseGrants``, ``RestoredLeases``); the protocol these rules serve is described in
``orchestrator.kv.turn_leases``.

The rules, per session:

- **One turn at a time.** A turn is marked running when it is claimed, or held for an
  ingress replica by a lease (``mark``), and cleared when it ends (``clear``); a mark
  older than ``running_grace_s`` is stale (its ingress is gone): the tick clears it.
- **A lease is granted** (``grant``) only with leases on (``lasts_s`` > 0), to a lessee
  whose watch runs or that proposed the lease with its hand-over, when the digest of the
  session's last turn is known (a next turn's tokens are checked against it) and no turn
  of the session runs. The session's record is held in the KV books from then on
  (``KVLifecycle.hold``); a record held for a proposal that is not granted is let go.
- **A lease ends** unused (``end``: given back, revoked, lapsed ``lasts_s + grace_s``
  after its grant, or its use refused by the books): its hold and its running mark go.
  Ending one that has ended already (a double release), or one a newer grant replaced,
  does nothing. **Used** (``use``), its turn's mark is rewritten without the lease and
  its owner's idle clock restarts; it then ends with its turn (``hand_over``,
  ``abandoned``, or the tick's stale marks).
- **A proposed lease** whose provisional use found no grant is refused for good
  (``refuse``): never granted later.
- **A previous instance's unused leases** (``RestoredLeases``) end on their lessee's
  evidence, or lapse when the lease would have.
- **A close while a turn runs** (``closing``) is remembered with that turn's mark: its
  hand-over frees its KV instead of starting the session anew (``hand_over`` says so).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from policies.kv_lifecycle import KVLifecycle
from policies.kv_records import Effect, RecomputeReason
from policies.turn_leases import Grant, LeaseGrants, RestoredLeases, proposals_allowed

__all__ = ["ClearRunning", "MarkRunning", "TouchOwner", "TurnEffect", "TurnState"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MarkRunning:
    """Write the session's running mark (claimed now, wall clock), naming the unused
    lease that holds the turn and its lessee when ``lease_id`` is set."""

    session_id: str
    lease_id: int | None = None
    holder: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ClearRunning:
    """The session's turn ended: its mark goes (``marked``: there was one) and a next
    turn waiting on it runs."""

    session_id: str
    marked: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class TouchOwner:
    """Restart the idle clock of the key that owns the session (a held turn runs)."""

    session_id: str


TurnEffect = MarkRunning | ClearRunning | TouchOwner | Effect


class TurnState:
    """Each session's running turn and lease (see the module). ``lifecycle``: the KV
    books whose records a lease holds."""

    def __init__(
        self,
        lifecycle: KVLifecycle,
        *,
        running_grace_s: float,
        leases: LeaseGrants,
    ) -> None:
        self.lifecycle = lifecycle
        self.running_grace_s = running_grace_s
        self.leases = leases
        self.restored = RestoredLeases()
        # Session id -> when its running turn was marked; the lessee running it, if said.
        self.started: dict[str, float] = {}
        self.holders: dict[str, str] = {}
        # Sessions closed while a turn of theirs ran, with that turn's mark (see ``closing``).
        self.closed_running: dict[str, float] = {}

    # -- queries ------------------------------------------------------------------------

    def __contains__(self, session_id: object) -> bool:
        return session_id in self.started

    def __len__(self) -> int:
        return len(self.started)

    def running_since(self, session_id: str) -> float | None:
        return self.started.get(session_id)

    def in_progress(self, session_id: str, now_s: float) -> bool:
        """Whether a turn of the session runs and its mark is not stale."""
        started = self.started.get(session_id)
        return started is not None and now_s - started < self.running_grace_s

    def stale(self, now_s: float) -> list[str]:
        """The sessions whose running mark is past ``running_grace_s``."""
        return [s for s, t in self.started.items() if now_s - t >= self.running_grace_s]

    # -- running marks ------------------------------------------------------------------

    def mark(
        self, session_id: str, now_s: float, grant: Grant | None = None, holder: str | None = None
    ) -> list[TurnEffect]:
        """Mark the session's turn running from ``now_s`` (for ``grant``'s lessee: a turn
        held by an unused lease, whose mark names the lease), on ``holder`` when known."""
        self.started[session_id] = now_s
        holder = grant.holder if grant is not None else holder
        if holder is None:
            self.holders.pop(session_id, None)
        else:
            self.holders[session_id] = holder
        if grant is None:
            return [MarkRunning(session_id=session_id)]
        return [MarkRunning(session_id=session_id, lease_id=grant.lease_id, holder=grant.holder)]

    def clear(self, session_id: str) -> list[TurnEffect]:
        """The session's turn ended."""
        self.holders.pop(session_id, None)
        marked = self.started.pop(session_id, None) is not None
        return [ClearRunning(session_id=session_id, marked=marked)]

    def restore(self, session_id: str, started_s: float) -> None:
        """A turn a previous instance marked (its mark is already in the store)."""
        self.started[session_id] = started_s

    def _ended(self, session_id: str) -> list[TurnEffect]:
        """The session's turn ended otherwise than by its lease's return: the lease (if
        it ran under one) goes with its running mark."""
        self.leases.grants.pop(session_id, None)
        return self.clear(session_id)

    # -- leases -------------------------------------------------------------------------

    def proposal(self, proposed: int | None, holder: str | None) -> int | None:
        """The proposed lease id a hand-over may be granted (None: none, or leases are
        off, or a provisional use of it was refused already, or an idle budget is set)."""
        if proposed is None or holder is None:
            return None
        if not proposals_allowed(self.lifecycle.config, self.leases.lasts_s):
            return None
        return None if proposed in self.leases.refused else proposed

    def grant(
        self,
        session_id: str,
        holder: str | None,
        now_s: float,
        *,
        watching: bool,
        digest: int | None,
        proposed: int | None = None,
    ) -> tuple[Grant | None, list[TurnEffect]]:
        """Hold the session's next turn for ``holder`` (``watching``: its watch runs):
        marked running and its record held in the books until it runs there, is given
        back, or lapses. ``proposed``: the lease id the lessee proposed (``proposal``),
        granted whether or not its watch runs. ``digest``: that of the session's last
        turn (None: unknown, nothing to check a next turn's tokens against). Not
        granted, a record held for the proposal is let go."""
        lasts_s = self.leases.lasts_s
        refused = (
            holder is None
            or lasts_s <= 0
            or (proposed is None and not watching)
            or digest is None
            or session_id in self.started
        )
        if refused or holder is None:
            if self.lifecycle.held(session_id):  # held for a proposal not granted
                return None, list(self.lifecycle.unhold(session_id, now_s))
            return None, []
        if self.lifecycle.held(session_id):
            record = self.lifecycle.record(session_id)
        else:
            record = self.lifecycle.hold(session_id, now_s)
        grant = self.leases.grant(session_id, holder, record, now_s, proposed)
        return grant, self.mark(session_id, now_s, grant)

    def end(self, grant: Grant, now_s: float) -> list[TurnEffect]:
        """Give a lease's turn back unused: the session is idle and free again. A lease
        no longer the session's (ended already, or replaced) changes nothing."""
        if self.leases.grants.get(grant.session_id) is not grant:
            return []
        del self.leases.grants[grant.session_id]
        return [*self.lifecycle.unhold(grant.session_id, now_s), *self.clear(grant.session_id)]

    def use(
        self, session_id: str, lease_id: int, reason: str | None, now_s: float
    ) -> tuple[bool, list[TurnEffect]]:
        """The lessee runs the held turn: it pulls the leased record (``reason`` None) or
        recomputes for ``reason`` (a ``RecomputeReason``'s value). False when the lease
        is no longer held (ended, used, or granted by a previous instance: its restored
        mark goes), or the books refuse its use (``KVLifecycle.use_held``: it ends)."""
        grant = self.leases.find(session_id, lease_id)
        if grant is None or grant.used:
            restored = self.restored.pop(lease_id)
            return False, [] if restored is None else self.clear(restored)
        why = None if reason is None else RecomputeReason(reason)
        if not self.lifecycle.use_held(session_id, record=grant.record, reason=why, now_s=now_s):
            return False, self.end(grant, now_s)
        grant.used = True
        # The turn's grace counts from now; its mark no longer names an unused lease.
        return True, [
            *self.mark(session_id, now_s, holder=grant.holder),
            TouchOwner(session_id=session_id),
        ]

    def refuse(self, lease_id: int) -> None:
        """A provisional use of the proposed ``lease_id`` found no grant: never granted."""
        self.leases.refuse(lease_id)

    def released(
        self, holder: str, released: Collection[int], held: Collection[int] | None, now_s: float
    ) -> list[TurnEffect]:
        """``holder``'s watch gives back the unused leases ``released`` and says it holds
        exactly ``held`` (None: not said): a previous instance's lease of this holder
        given back, or not among ``held``, is over."""
        effects: list[TurnEffect] = []
        for lease_id in released:
            restored = self.restored.pop(lease_id)
            if restored is not None:
                effects += self.clear(restored)
        if held is not None:
            for sid in self.restored.vouched(holder, held):
                effects += self.clear(sid)
        wanted = set(released)
        for grant in [g for g in self.leases.grants.values() if g.lease_id in wanted]:
            if grant.holder == holder and not grant.used:
                effects += self.end(grant, now_s)
        return effects

    # -- a turn's end, a close, the tick -------------------------------------------------

    def hand_over(self, session_id: str) -> tuple[bool, list[TurnEffect]]:
        """The session's turn handed over (``turn_done``): its lease and running mark
        end. True when the session was closed while this turn ran (its running mark the
        one the close saw): its KV is freed, not kept."""
        at = self.closed_running.pop(session_id, None)
        closed = at is not None and at == self.started.get(session_id)
        return closed, self._ended(session_id)

    def abandoned(self, session_id: str) -> list[TurnEffect]:
        """The session's turn failed or was dropped before its hand-over."""
        self.closed_running.pop(session_id, None)
        return self._ended(session_id)

    def closing(self, session_id: str) -> None:
        """A close of the session (its unused lease given back first): a turn of it still
        running, or its hand-over on its way, has its KV freed when it hands over, instead
        of starting the session anew (a client that closes as its last token lands,
        before the hand-over, would otherwise leave that turn's KV kept under the closed
        session until its TTL). Kept while that same mark stands (a later turn's mark is
        another)."""
        since = self.started.get
        for sid in [s for s, at in self.closed_running.items() if since(s) != at]:
            del self.closed_running[sid]  # that turn's mark is gone
        started = since(session_id)
        if started is not None:
            self.closed_running[session_id] = started

    def on_tick(self, now_s: float) -> list[TurnEffect]:
        """Stale running marks clear (their ingress is gone), then unused leases whose
        lessee went silent end, and restored marks nobody vouched for lapse."""
        effects: list[TurnEffect] = []
        for sid in self.stale(now_s):
            effects += self._ended(sid)
        for grant in self.leases.lapsed(now_s):
            effects += self.end(grant, now_s)
        for sid in self.restored.lapsed(now_s):
            effects += self.clear(sid)
        return effects
