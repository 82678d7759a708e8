"""A session's turn state, as rules: its running turn, the lease holding its next turn for
an ingress replica, the leases a previous service instance left, and a close that came
while a turn ran.

Pure and single-threaded, as ``policies.kv_lifecycle``: every method takes the time as
``now_s`` (where time matters) and returns its effects for the KV service to apply
(``orchestrator.kv.turn_effects``): running marks written through or cleared
(``MarkRunning``, ``ClearRunning``), an owner's idle clock restarted (``TouchOwner``) and
the KV books' own effects (``policies.kv_records.Effect``: kept blocks nobody will
reuse), in the order to apply them; and which lessee to ask for a lease back
(``RevokeLease``, from ``LeaseGrants``). The protocol these rules serve is described in
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

import secrets
from collections.abc import Collection
from dataclasses import dataclass, field

from policies.kv_lifecycle import KVLifecycle
from policies.kv_records import Effect, KVLifecycleConfig, KVRecord, RecomputeReason

__all__ = [
    "REFUSED_KEPT",
    "ClearRunning",
    "Grant",
    "LeaseGrants",
    "MarkRunning",
    "RestoredLeases",
    "RevokeLease",
    "TouchOwner",
    "TurnEffect",
    "TurnState",
    "proposals_allowed",
]

REFUSED_KEPT = 4096
"""How many refused proposals the state remembers (their hand-overs come within
``grace_s`` of the refusal, or never)."""


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


@dataclass(frozen=True, slots=True, kw_only=True)
class RevokeLease:
    """Ask ``holder`` (through its watch) to give the lease ``lease_id`` back."""

    holder: str
    lease_id: int


TurnEffect = MarkRunning | ClearRunning | TouchOwner | Effect


def proposals_allowed(config: KVLifecycleConfig, lasts_s: float) -> bool:
    """Whether a hand-over may propose its next turn's lease (a provisional lease): leases
    on and no idle budget (under one, a record booked over it is evicted at once, and
    holding every proposed record would keep the engines over it). Both sides ask it: the
    lessee before it proposes, the service before it grants a proposal."""
    return lasts_s > 0 and config.idle_budget_bytes_per_engine is None


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
class _Restored:
    session_id: str
    holder: str | None
    lapses_s: float
    vouched: bool = False


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
        them are over (returned), unless it vouched for them before (they ended since,
        with their turn or given back: their marks went then); those among them are now
        its running turns, kept here until they end, so that the lessee's giving one
        back, or its use refused, still ends the mark (``pop``)."""
        over = []
        for lease_id, restored in list(self._by_id.items()):
            if restored.holder != holder:
                continue
            if lease_id in held:
                restored.vouched = True
                continue
            del self._by_id[lease_id]
            if not restored.vouched:
                over.append(restored.session_id)
        return over

    def lapsed(self, now: float) -> list[str]:
        """Sessions of the leases nobody vouched for that are past their lapse time."""
        over = [lid for lid, r in self._by_id.items() if not r.vouched and now >= r.lapses_s]
        return [self._by_id.pop(lid).session_id for lid in over]


@dataclass(slots=True)
class LeaseGrants:
    """The granted leases, by session, and the proposals refused for good."""

    lasts_s: float
    grace_s: float
    grants: dict[str, Grant] = field(default_factory=dict)
    refused: dict[int, None] = field(default_factory=dict)  # oldest first

    def grant(
        self,
        session_id: str,
        holder: str,
        record: KVRecord | None,
        now_s: float,
        lease_id: int | None,
    ) -> Grant:
        """Book a lease: ``lease_id`` the lessee proposed, or a new one."""
        grant = Grant(
            session_id=session_id,
            holder=holder,
            # Unique across service instances.
            lease_id=secrets.randbits(62) if lease_id is None else lease_id,
            record=record,
            lapses_s=now_s + self.lasts_s + self.grace_s,
        )
        self.grants[session_id] = grant
        return grant

    def find(self, session_id: str, lease_id: int) -> Grant | None:
        grant = self.grants.get(session_id)
        return grant if grant is not None and grant.lease_id == lease_id else None

    def unused(self, session_id: str) -> Grant | None:
        grant = self.grants.get(session_id)
        return grant if grant is not None and not grant.used else None

    def num_unused(self) -> int:
        return sum(not g.used for g in self.grants.values())

    def lapsed(self, now_s: float) -> list[Grant]:
        """Unused grants past their lapse time (their lessee went silent)."""
        return [g for g in self.grants.values() if not g.used and now_s >= g.lapses_s]

    def revocations(self, record: KVRecord) -> list[RevokeLease]:
        """``record`` is gone: revoke an unused lease that would read it."""
        grant = self.unused(record.session_id)
        if grant is None or grant.record != record:
            return []
        return [RevokeLease(holder=grant.holder, lease_id=grant.lease_id)]

    def revoke_session(self, session_id: str) -> list[RevokeLease]:
        """The session's KV changed under an unused lease (a host tier's copy was booked,
        or an engine short of KV asks it back): revoke the lease, so that the next turn
        asks and finds it."""
        grant = self.unused(session_id)
        return [] if grant is None else [RevokeLease(holder=grant.holder, lease_id=grant.lease_id)]

    def refuse(self, lease_id: int) -> None:
        self.refused[lease_id] = None
        while len(self.refused) > REFUSED_KEPT:
            del self.refused[next(iter(self.refused))]


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
        running, or its hand-over on its way, has its KV freed when it hands over. Kept
        while that same mark stands (a later turn's mark is another)."""
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
