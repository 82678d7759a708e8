"""The books of the KV lifecycle: sessions, their records, bytes per engine, deadlines.

`KVBooks` makes no decisions: `KVLifecycle` decides and moves records through these
methods, which are the only code that changes the books, so the invariants hold after
each of them:

- ``held_bytes[e]`` = sum of ``bytes_held`` over the records on engine ``e`` (current
  records and records handed to a pull that has not resolved), and ``held_blocks[e]``
  the same over their block ids;
- ``idle_bytes[e]`` = the same over current records of sessions with no turn running (a
  turn held for an ingress has not started: its record counts here, so the idle budget
  covers it), and ``idle_by_engine[e]`` holds exactly those sessions that are not held
  (the evictable ones), by engine expiry;
- every current record has an offer deadline, every unresolved pull a pull deadline,
  and every idle session a lease deadline; nothing else does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from policies.deadline_heap import DeadlineHeap
from policies.kv_records import KVRecord, RecomputeReason

__all__ = ["KVBooks", "SessionState"]


@dataclass(slots=True)
class SessionState:
    """What kvtide knows of one session."""

    lease_expiry_s: float
    num_turns_in_flight: int = 0
    record: KVRecord | None = None
    """The KV kept after the last finished turn; offered until its offer deadline."""
    pulling: KVRecord | None = None
    """A record handed to a prefill: still on its engine until the read resolves."""
    lost_reason: RecomputeReason | None = None
    """Why the last record went away without a successor (the next turn's reason)."""
    evicted: KVRecord | None = None
    """The last record evicted, until the session's next turn or record: a host tier's
    copy of it may still be booked (``KVLifecycle.demote``)."""
    held: bool = False
    """One of the turns in flight is held for an ingress and has not started: the
    record stays idle for the budget but is not evicted (``KVBooks.hold``)."""

    @property
    def active(self) -> bool:
        return self.num_turns_in_flight > 0


class KVBooks:
    """Sessions, records and their byte and deadline indexes, kept consistent."""

    def __init__(self, *, safety_margin_s: float, lease_ttl_s: float) -> None:
        self._safety_margin_s = safety_margin_s
        self._lease_ttl_s = lease_ttl_s
        self.sessions: dict[str, SessionState] = {}
        self.held_bytes: dict[str, int] = {}
        self.held_blocks: dict[str, int] = {}
        self.idle_bytes: dict[str, int] = {}
        self.idle_by_engine: dict[str, DeadlineHeap] = {}
        self.sessions_by_engine: dict[str, set[str]] = {}
        self.offer_deadlines = DeadlineHeap()  # current records, at expiry - safety margin
        self.pull_deadlines = DeadlineHeap()  # unresolved pulls, at engine expiry
        self.lease_deadlines = DeadlineHeap()  # idle sessions, at lease expiry

    def session(self, session_id: str, now_s: float) -> SessionState:
        """The session, started (with a lease from ``now_s``) if unknown."""
        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = SessionState(lease_expiry_s=now_s)
            self.extend_lease(session_id, session, now_s)
        return session

    def forget(self, session_id: str) -> None:
        """Drop a session whose record is gone; an unresolved pull is unbooked."""
        session = self.sessions.pop(session_id)
        assert session.record is None
        if session.pulling is not None:
            self._unbook_pull(session_id, session)
        self.lease_deadlines.discard(session_id)

    def num_records(self) -> int:
        return sum(len(ids) for ids in self.sessions_by_engine.values())

    def records(self) -> Iterator[KVRecord]:
        return (s.record for s in self.sessions.values() if s.record is not None)

    def pulling_records(self) -> Iterator[KVRecord]:
        return (s.pulling for s in self.sessions.values() if s.pulling is not None)

    # -- records -------------------------------------------------------------------

    def attach(self, session_id: str, session: SessionState, record: KVRecord) -> None:
        assert session.record is None
        session.record = record
        session.lost_reason = None
        session.evicted = None
        self._hold(record, 1)
        self.sessions_by_engine.setdefault(record.engine_id, set()).add(session_id)
        self.offer_deadlines.set(session_id, record.offer_deadline_s(self._safety_margin_s))
        if session.held:
            _add(self.idle_bytes, record.engine_id, record.bytes_held)
        elif not session.active:
            self._mark_idle(session_id, record)

    def detach(self, session_id: str, session: SessionState) -> KVRecord:
        record = session.record
        assert record is not None
        session.record = None
        self._hold(record, -1)
        engine_sessions = self.sessions_by_engine[record.engine_id]
        engine_sessions.discard(session_id)
        if not engine_sessions:
            del self.sessions_by_engine[record.engine_id]
        self.offer_deadlines.discard(session_id)
        if session.held:
            _add(self.idle_bytes, record.engine_id, -record.bytes_held)
        elif not session.active:
            self._unmark_idle(session_id, record)
        return record

    def begin_pull(self, session_id: str, session: SessionState) -> KVRecord:
        """Hand the current record to a prefill: no longer offered, still booked."""
        record = self.detach(session_id, session)
        session.pulling = record
        self._hold(record, 1)
        self.pull_deadlines.set(session_id, record.expiry_s)
        return record

    def end_pull(self, session_id: str, session: SessionState) -> KVRecord:
        """Unbook the record handed to a prefill (read, failed, or expired)."""
        return self._unbook_pull(session_id, session)

    def _unbook_pull(self, session_id: str, session: SessionState) -> KVRecord:
        record = session.pulling
        assert record is not None
        session.pulling = None
        self._hold(record, -1)
        self.pull_deadlines.discard(session_id)
        return record

    def _hold(self, record: KVRecord, sign: int) -> None:
        _add(self.held_bytes, record.engine_id, sign * record.bytes_held)
        _add(self.held_blocks, record.engine_id, sign * len(record.block_ids))

    def prune(self, now_s: float) -> None:
        """Drop idle-index entries that time has passed (see `DeadlineHeap`).

        The other heaps are drained by ``pop_due``; idle ones only by evictions."""
        for heap in self.idle_by_engine.values():
            heap.prune(now_s)

    def idle_nearest_expiry(self, engine_id: str) -> str | None:
        """The idle session on the engine whose record expires first."""
        heap = self.idle_by_engine.get(engine_id)
        top = None if heap is None else heap.peek()
        return None if top is None else top[1]

    # -- turns and leases ------------------------------------------------------------

    def begin_turn(self, session_id: str, session: SessionState) -> None:
        if not session.active:
            self.lease_deadlines.discard(session_id)
            if session.record is not None:
                self._unmark_idle(session_id, session.record)
        session.num_turns_in_flight += 1

    def hold(self, session_id: str, session: SessionState) -> None:
        """Start a turn held for an ingress: in flight (no lease deadline), but its
        record stays in ``idle_bytes`` and leaves only the eviction order."""
        was_active = session.active
        self.begin_turn(session_id, session)
        if was_active:
            return  # a turn runs already: nothing to hold (``use_held`` will refuse)
        session.held = True
        if session.record is not None:
            _add(self.idle_bytes, session.record.engine_id, session.record.bytes_held)

    def run_held(self, session: SessionState) -> None:
        """The held turn starts running (its record, if any, is no longer idle)."""
        if session.held:
            session.held = False
            if session.record is not None:
                _add(self.idle_bytes, session.record.engine_id, -session.record.bytes_held)

    def end_turn(self, session_id: str, session: SessionState, now_s: float) -> None:
        # A report without a matching start (after a close or a restart) ends nothing:
        # the session is idle already and its record, if any, is booked as idle.
        self.run_held(session)  # a held turn ends unused (given back or abandoned)
        was_active = session.active
        if was_active:
            session.num_turns_in_flight -= 1
        self.extend_lease(session_id, session, now_s)
        if was_active and not session.active and session.record is not None:
            self._mark_idle(session_id, session.record)

    def extend_lease(self, session_id: str, session: SessionState, now_s: float) -> None:
        """Lease until ``now_s + lease_ttl_s`` at least; only idle sessions have a deadline."""
        session.lease_expiry_s = max(session.lease_expiry_s, now_s + self._lease_ttl_s)
        if not session.active:
            self.lease_deadlines.set(session_id, session.lease_expiry_s)

    # -- idle index --------------------------------------------------------------------

    def _mark_idle(self, session_id: str, record: KVRecord) -> None:
        heap = self.idle_by_engine.get(record.engine_id)
        if heap is None:
            heap = self.idle_by_engine[record.engine_id] = DeadlineHeap()
        heap.set(session_id, record.expiry_s)
        _add(self.idle_bytes, record.engine_id, record.bytes_held)

    def _unmark_idle(self, session_id: str, record: KVRecord) -> None:
        heap = self.idle_by_engine[record.engine_id]
        heap.discard(session_id)
        if not heap:
            del self.idle_by_engine[record.engine_id]
        _add(self.idle_bytes, record.engine_id, -record.bytes_held)


def _add(books: dict[str, int], engine_id: str, num_bytes: int) -> None:
    """Add to an engine's total; engines at zero leave the dict, so it stays small."""
    total = books.get(engine_id, 0) + num_bytes
    if total:
        books[engine_id] = total
    else:
        books.pop(engine_id, None)
