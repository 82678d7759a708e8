"""The KV lifecycle policy: per session, where its KV lives and what the next turn does with it.

Import everything from here; the value types live in `policies.kv_records`.

Pure and single-threaded: every method takes the time as ``now_s`` and returns its
decisions (a `TurnDecision` or a list of `Effect`s) for the orchestrator to apply.
The orchestrator calls, per turn::

    decision = kv.on_turn_start(session_id, prompt_token_ids, now_s)
    # PULL_FROM_DECODE: prefill with decision.record.transfer_params; if the pull
    #   fails or hangs: kv.on_pull_result(session_id, ok=False, now_s=...) and prefill
    #   again without params. RECOMPUTE: plain prefill.
    effects = kv.on_turn_finished(session_id, engine_id=..., token_ids_covered=...,
                                  block_ids=..., transfer_params=..., expiry_s=..., now_s=...)
    # or, when the turn failed or the engine kept no KV:
    effects = kv.on_turn_abandoned(session_id, now_s=...)

and, outside turns, ``renew`` (SDK heartbeat), ``close``, ``on_tick`` (every second or
so), ``on_engine_lost``. Every started turn must end with ``on_turn_finished`` or
``on_turn_abandoned``: a session with a turn in flight is never evicted.

Books kept (invariants checked by the tests after every call):
- ``bytes_held(e)`` = sum of ``bytes_held`` over records booked on engine ``e``,
  including records handed to a pull that has not resolved yet (``blocks_held(e)``: the
  same over their block ids);
- ``idle_bytes(e)`` = the same over sessions with no turn running (a turn ``hold`` keeps
  for an ingress has not started), and never above ``idle_budget_bytes_per_engine``
  after a call returns: a held record is never evicted, so a newer idle record goes
  first when only held ones are left.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from policies.errors import InvalidTurn
from policies.kv_books import KVBooks, SessionState
from policies.kv_cost import decide_turn, kv_bytes, worth_pulling
from policies.kv_records import (
    HOST_POOL,
    Effect,
    Evict,
    EvictReason,
    Expire,
    KVLifecycleConfig,
    KVRecord,
    KVStats,
    RecomputeReason,
    Release,
    ReleaseReason,
    TurnAction,
    TurnDecision,
    prefix_hash,
)

__all__ = [
    "HOST_POOL",
    "Effect",
    "Evict",
    "EvictReason",
    "Expire",
    "KVLifecycle",
    "KVLifecycleConfig",
    "KVRecord",
    "KVStats",
    "RecomputeReason",
    "Release",
    "ReleaseReason",
    "TurnAction",
    "TurnDecision",
    "kept_record",
    "prefix_hash",
]

_RETIRED = {
    EvictReason.SCALED_IN: RecomputeReason.SCALED_IN,
    EvictReason.REPLACED: RecomputeReason.REPLACED,
}
"""Why an engine's records go before it stops (``retire``), and the reason its sessions
recompute with when the host tier did not take them."""

COPY_MIN_LEFT_S = 6.0
"""An expiring record's blocks are offered to a host tier's copy only with this long
left before the engine frees them: a reader within 5 s of the expiry is declined (vLLM's
margin, which the store applies too), and a second for the read itself."""


def kept_record(
    session_id: str,
    *,
    engine_id: str,
    token_ids_covered: Sequence[int],
    block_ids: Sequence[int],
    transfer_params: object,
    expiry_s: float,
    last_used_s: float,
    config: KVLifecycleConfig,
    pool_id: str = "decode",
) -> KVRecord:
    """The record of the KV an engine kept for exactly ``token_ids_covered``, as the
    lifecycle books it (``on_turn_finished``; ``adopt`` and ``rebuild`` take one; a turn
    lease's lessee builds the same one from its own copy)."""
    return KVRecord(
        session_id=session_id,
        engine_id=engine_id,
        pool_id=pool_id,
        block_ids=tuple(block_ids),
        num_tokens=len(token_ids_covered),
        prefix_hash=prefix_hash(token_ids_covered),
        expiry_s=expiry_s,
        last_used_s=last_used_s,
        bytes_held=kv_bytes(len(token_ids_covered), config),
        transfer_params=transfer_params,
    )


class KVLifecycle:
    """Records of where each session's KV lives, and the decisions made from them."""

    def __init__(self, config: KVLifecycleConfig | None = None) -> None:
        self._config = config if config is not None else KVLifecycleConfig()
        self._books = KVBooks(
            safety_margin_s=self._config.safety_margin_s, lease_ttl_s=self._config.lease_ttl_s
        )
        self._num_pulls = 0
        self._num_declines = 0
        self._num_expiries = 0
        self._num_evictions = 0
        self._num_releases = 0
        self._recomputes = dict.fromkeys(RecomputeReason, 0)
        self._reuse_off: frozenset[str] = frozenset()
        self._num_demotions = 0
        self._host_engines: set[str] = set()  # engines of HOST_POOL records: no idle budget
        self._room_made_s: dict[str, float] = {}  # each engine's last eviction for room

    @property
    def config(self) -> KVLifecycleConfig:
        return self._config

    # -- reuse turned off (an integrity check failed) -----------------------------------

    def set_reuse_off(self, engine_ids: Iterable[str]) -> None:
        """The engines whose kept KV no turn may pull: each turn that would pull from one
        recomputes (``INTEGRITY_CHECK_FAILED``), and a held turn that pulls from one is
        refused (``use_held``). Replaces the previous set."""
        self._reuse_off = frozenset(engine_ids)

    @property
    def reuse_off(self) -> frozenset[str]:
        return self._reuse_off

    def not_worth(self, record: KVRecord) -> RecomputeReason | None:
        """Why a prompt that extends ``record`` would not pull it, from the record alone
        (reuse from its engine off, then ``worth_pulling``); None: it would."""
        if record.engine_id in self._reuse_off:
            return RecomputeReason.INTEGRITY_CHECK_FAILED
        return worth_pulling(record, self._config)

    # -- turns -------------------------------------------------------------------

    def on_turn_start(
        self, session_id: str, prompt_token_ids: Sequence[int], now_s: float
    ) -> TurnDecision:
        """Decide what this turn's prefill does; the turn is in flight until it ends.

        Starts the session if unknown and renews its lease. A PULL hands the record to
        the prefill: it is not offered again, and stays booked until the pull resolves.
        """
        books = self._books
        session = books.session(session_id, now_s)
        session.evicted = None  # a copy made from now on would be of an older turn
        books.begin_turn(session_id, session)
        books.extend_lease(session_id, session, now_s)
        if session.record is None:
            reason = (
                RecomputeReason.PULL_IN_FLIGHT
                if session.pulling is not None
                else session.lost_reason or RecomputeReason.NO_RECORD
            )
            decision = TurnDecision(
                session_id=session_id, action=TurnAction.RECOMPUTE, reason=reason
            )
        else:
            decision = decide_turn(session.record, prompt_token_ids, now_s, self._config)
            if (
                decision.action is TurnAction.PULL_FROM_DECODE
                and session.record.engine_id in self._reuse_off
            ):
                decision = TurnDecision(
                    session_id=session_id,
                    action=TurnAction.RECOMPUTE,
                    reason=RecomputeReason.INTEGRITY_CHECK_FAILED,
                )
        if decision.action is TurnAction.PULL_FROM_DECODE:
            books.begin_pull(session_id, session)
            self._num_pulls += 1
        else:
            assert decision.reason is not None
            self._recomputes[decision.reason] += 1
        return decision

    # -- a turn held for an ingress (``orchestrator.kv.turn_leases``) ---------------------

    def hold(self, session_id: str, now_s: float) -> KVRecord | None:
        """Start the session's next turn before it arrives: an ingress decides it from
        the returned record (with ``decide_turn``) and reports what it did with
        ``use_held``, or gives it back with ``unhold``. While held the session counts as
        having a turn in flight and its record is not evicted, but the record still counts
        toward the idle budget (so newer idle records go first when only held ones are
        left) and is still offered and shown. The session must be idle."""
        books = self._books
        session = books.session(session_id, now_s)
        books.extend_lease(session_id, session, now_s)
        books.hold(session_id, session)
        return session.record

    def use_held(
        self,
        session_id: str,
        *,
        record: KVRecord | None,
        reason: RecomputeReason | None,
        now_s: float,
    ) -> bool:
        """The held turn runs: it pulls ``record`` (``reason`` None) or recomputes for
        ``reason``. False (nothing changed) when the pull's record is no longer the
        session's, or reuse from its engine was turned off since (the turn must not read
        it)."""
        session = self._books.sessions.get(session_id)
        if session is None or not session.held:
            return False
        if reason is None:
            current = session.record
            if record is None or current is None or current.block_ids != record.block_ids:
                return False
            if record.engine_id in self._reuse_off:
                return False  # reuse from its engine was turned off after the grant
            self._books.run_held(session)
            self._books.begin_pull(session_id, session)
            self._num_pulls += 1
        else:
            self._books.run_held(session)
            self._recomputes[reason] += 1
        return True

    def unhold(self, session_id: str, now_s: float) -> list[Effect]:
        """Give a held turn back unused: the session is idle again."""
        session = self._books.sessions.get(session_id)
        if session is None or not session.active:
            return []
        self._books.end_turn(session_id, session, now_s)
        if session.record is None:
            return []
        return self._enforce_budget(session.record.engine_id)

    def on_pull_result(self, session_id: str, *, ok: bool, now_s: float) -> list[Effect]:
        """Resolve the pull a PULL decision started; unknown or resolved pulls are ignored.

        ``ok=True``: the prefill read the blocks and the engine freed them. Reporting
        success is optional: ``on_turn_finished`` implies it. ``ok=False`` (failed,
        declined or timed out by the orchestrator): the record is never offered again,
        and the turn goes on as a recompute.
        """
        session = self._books.sessions.get(session_id)
        if session is None or session.pulling is None:
            return []
        record = self._books.end_pull(session_id, session)
        if ok:
            return []
        self._num_declines += 1
        self._recomputes[RecomputeReason.FAILED_PULL] += 1
        if session.record is None:
            session.lost_reason = RecomputeReason.FAILED_PULL
        return [self._release(record, ReleaseReason.FAILED_PULL)]

    def on_turn_finished(
        self,
        session_id: str,
        *,
        engine_id: str,
        token_ids_covered: Sequence[int],
        block_ids: Sequence[int],
        transfer_params: object,
        expiry_s: float | None,
        now_s: float,
        pool_id: str = "decode",
        hold: bool = False,
    ) -> list[Effect]:
        """Record the KV the turn's engine kept, replacing the session's previous record.
        ``hold``: the session's next turn is held at once (``hold``), before the idle
        budget is enforced, so the new record is not the one evicted (its lessee may be
        pulling it already).

        ``token_ids_covered``: exactly the tokens whose KV the blocks hold (vLLM's
        ``remote_num_tokens`` first tokens of prompt + output). ``expiry_s``: the
        engine's expiry converted to the clock of ``now_s``; None means
        ``now_s + ttl_s``. ``transfer_params``: opaque here, handed back with the
        record (``KVRecord``). A finished turn also resolves its pull as a success.
        """
        if not engine_id:
            raise InvalidTurn(
                f"on_turn_finished({session_id!r}): engine_id is empty; "
                "name the engine that kept the KV"
            )
        if len(token_ids_covered) == 0:
            raise InvalidTurn(
                f"on_turn_finished({session_id!r}): no token ids covered; "
                "call on_turn_abandoned when the engine kept no KV"
            )
        config = self._config
        record = kept_record(
            session_id,
            engine_id=engine_id,
            token_ids_covered=token_ids_covered,
            block_ids=block_ids,
            transfer_params=transfer_params,
            expiry_s=now_s + config.ttl_s if expiry_s is None else expiry_s,
            last_used_s=now_s,
            config=config,
            pool_id=pool_id,
        )
        books = self._books
        session = books.session(session_id, now_s)  # started anew if closed meanwhile
        effects: list[Effect] = []
        if session.pulling is not None:  # the prefill ran, so the read completed
            books.end_pull(session_id, session)
        old = session.record
        if old is not None:
            books.detach(session_id, session)
            if (old.engine_id, old.block_ids) != (record.engine_id, record.block_ids):
                effects.append(self._release(old, ReleaseReason.SUPERSEDED))
        books.attach(session_id, session, record)
        books.end_turn(session_id, session, now_s)
        if now_s >= record.offer_deadline_s(config.safety_margin_s):
            effects.append(self._expire(session_id, session, now_s))
        if hold:
            books.hold(session_id, session)
        effects.extend(self._enforce_budget(engine_id))
        return effects

    def on_turn_abandoned(
        self, session_id: str, *, now_s: float, unread: bool = False
    ) -> list[Effect]:
        """End a turn that kept no KV (failed, cancelled, or no params came back).

        The previous record, if the turn did not pull it, stays: it still covers a
        prefix of the conversation. A pull left unresolved counts as failed, unless
        ``unread``: the turn ran on the record's engine (an ``extend``) and read
        nothing, so the record is whole and offered again.
        """
        session = self._books.sessions.get(session_id)
        if session is None:
            return []
        effects: list[Effect] = []
        if session.pulling is not None and unread and session.record is None:
            self._books.attach(session_id, session, self._books.end_pull(session_id, session))
        elif session.pulling is not None:
            record = self._books.end_pull(session_id, session)
            self._num_declines += 1
            if session.record is None:
                session.lost_reason = RecomputeReason.FAILED_PULL
            effects.append(self._release(record, ReleaseReason.FAILED_PULL))
        self._books.end_turn(session_id, session, now_s)
        if session.record is not None:
            effects.extend(self._enforce_budget(session.record.engine_id))
        return effects

    def demote(self, evicted: KVRecord, record: KVRecord, now_s: float) -> bool:
        """Book ``record``, a host-memory tier's copy (``pool_id`` ``HOST_POOL``) of the
        ``evicted`` record, as the session's record, offered like any other. Only while
        ``evicted`` is still the session's last record (evicted, and no turn started or
        record kept since) and the copy is not within the safety margin of its expiry;
        False: not booked, and the caller frees the copy. A session held for an ingress
        (``hold``) gets the copy too: the lessee planned its turn without a record, and
        its lease is taken back (the caller's part) so the next turn finds the copy. The
        host tier's engines are bounded by their own capacity, not by the idle budget."""
        if record.pool_id != HOST_POOL:
            raise InvalidTurn(
                f"demote({record.session_id!r}): pool_id {record.pool_id!r} is not "
                f"{HOST_POOL!r}; only a host tier's copy is booked this way"
            )
        session = self._books.sessions.get(record.session_id)
        if (
            session is None
            or session.evicted != evicted
            or (session.active and not session.held)
            or session.record is not None
            or session.pulling is not None
            or (record.num_tokens, record.prefix_hash) != (evicted.num_tokens, evicted.prefix_hash)
            or now_s >= record.offer_deadline_s(self._config.safety_margin_s)
        ):
            return False
        self._note_pool(record)
        self._books.attach(record.session_id, session, record)
        self._num_demotions += 1
        return True

    def _note_pool(self, record: KVRecord) -> None:
        if record.pool_id == HOST_POOL:
            self._host_engines.add(record.engine_id)

    # -- leases and time -----------------------------------------------------------

    def renew(self, session_id: str, now_s: float) -> bool:
        """Extend the session's lease (SDK heartbeat); False if kvtide no longer knows it.

        Never extends how long its blocks are offered: that ends at engine expiry
        minus the safety margin, fixed when the engine kept them.
        """
        session = self._books.sessions.get(session_id)
        if session is None:
            return False
        self._books.extend_lease(session_id, session, now_s)
        return True

    def close(self, session_id: str, now_s: float) -> list[Effect]:
        """Forget the session and release its record. Closing twice is a no-op.

        A pull in flight resolves on its own (the read frees the blocks, or they
        expire); a turn finishing after the close starts a fresh, unrenewed session
        (the KV service frees such a turn's KV instead: ``SessionTurns.close``).
        """
        session = self._books.sessions.get(session_id)
        if session is None:
            return []
        return self._forget(session_id, session, ReleaseReason.CLOSED)

    def on_tick(self, now_s: float) -> list[Effect]:
        """Expire what is due: records at expiry minus margin, hung pulls at expiry, idle leases.

        Touches only what is due (heaps), not every session.
        """
        books = self._books
        effects: list[Effect] = []
        for session_id in books.offer_deadlines.pop_due(now_s):
            effects.append(self._expire(session_id, books.sessions[session_id], now_s))
        for session_id in books.pull_deadlines.pop_due(now_s):
            session = books.sessions[session_id]
            record = books.end_pull(session_id, session)
            if session.record is None:
                session.lost_reason = RecomputeReason.EXPIRED
            self._num_expiries += 1
            effects.append(Expire(record=record))
        for session_id in books.lease_deadlines.pop_due(now_s):
            session = books.sessions[session_id]
            if session.active:  # defensive: end_turn sets the lease deadline again
                continue
            effects.extend(self._forget(session_id, session, ReleaseReason.LEASE_EXPIRED))
        for engine_id in list(books.idle_bytes):
            effects.extend(self._enforce_budget(engine_id))
        books.prune(now_s)
        return effects

    def on_engine_lost(self, engine_id: str, now_s: float) -> list[Effect]:
        """The engine died or restarted: its blocks are gone, stop offering them.

        Pulls in flight from it fail on their own; report them with ``on_pull_result``.
        """
        effects: list[Effect] = []
        for session_id in sorted(self._books.sessions_by_engine.get(engine_id, ())):
            session = self._books.sessions[session_id]
            effects.append(self._evict(session_id, session, EvictReason.ENGINE_LOST))
        return effects

    # -- restart --------------------------------------------------------------------

    @classmethod
    def rebuild(
        cls,
        records: Iterable[KVRecord],
        *,
        now_s: float,
        config: KVLifecycleConfig | None = None,
    ) -> tuple[KVLifecycle, list[Effect]]:
        """Rebuild the books from records that engines and routers report after a restart.

        A session reported more than once keeps its newest record (latest
        ``last_used_s``, then ``expiry_s``), booked once; an older one holding other
        blocks is released, one holding the same blocks is a duplicate and dropped
        silently. Records past their offer deadline are expired. Every session gets
        a fresh lease: heartbeats from before the restart are lost.
        """
        kv = cls(config)
        effects: list[Effect] = []
        newest: dict[str, KVRecord] = {}
        for record in records:
            kept = newest.get(record.session_id)
            if kept is None:
                newest[record.session_id] = record
                continue
            newer, older = (
                (record, kept)
                if (record.last_used_s, record.expiry_s) > (kept.last_used_s, kept.expiry_s)
                else (kept, record)
            )
            newest[record.session_id] = newer
            if (older.engine_id, older.block_ids) != (newer.engine_id, newer.block_ids):
                effects.append(kv._release(older, ReleaseReason.SUPERSEDED))
        margin_s = kv._config.safety_margin_s
        for session_id, record in newest.items():
            session = kv._books.session(session_id, now_s)
            kv._note_pool(record)
            kv._books.attach(session_id, session, record)
            if now_s >= record.offer_deadline_s(margin_s):
                effects.append(kv._expire(session_id, session, now_s))
        for engine_id in list(kv._books.idle_bytes):
            effects.extend(kv._enforce_budget(engine_id))
        return kv, effects

    def adopt(self, record: KVRecord, now_s: float) -> list[Effect]:
        """Take into live books a record an engine reports after the service restarted.

        The service keeps serving while engines report what they still hold, so the
        session may have moved on already:

        - it holds the same blocks (current or being pulled): a duplicate, nothing to do;
        - it has another record or a turn in flight: the reported blocks belong to an
          older turn nobody will pull again: released (drainable, so they are read back
          now instead of pinned until their TTL);
        - otherwise the record is booked as the session's, with a fresh lease (leases
          from before the restart are lost), expired at once when past its offer
          deadline, and the engine's budget is enforced.
        """
        session = self._books.sessions.get(record.session_id)
        if session is not None:
            same = (record.engine_id, record.block_ids)
            for held in (session.record, session.pulling):
                if held is not None and (held.engine_id, held.block_ids) == same:
                    return []
            if session.record is not None or session.active or session.pulling is not None:
                return [self._release(record, ReleaseReason.SUPERSEDED)]
        session = self._books.session(record.session_id, now_s)
        self._note_pool(record)
        self._books.attach(record.session_id, session, record)
        if now_s >= record.offer_deadline_s(self._config.safety_margin_s):
            return [self._expire(record.session_id, session, now_s)]
        return self._enforce_budget(record.engine_id)

    # -- queries (side-effect free) ---------------------------------------------------

    def held(self, session_id: str) -> bool:
        """Whether the session's next turn is held (``hold``) and not yet running."""
        session = self._books.sessions.get(session_id)
        return session is not None and session.held

    def record(self, session_id: str) -> KVRecord | None:
        """The session's current record (not one handed to a pull), if any."""
        session = self._books.sessions.get(session_id)
        return None if session is None else session.record

    def lease_expiry(self, session_id: str) -> float | None:
        """When the session's lease runs out (None: unknown session)."""
        session = self._books.sessions.get(session_id)
        return None if session is None else session.lease_expiry_s

    def records(self) -> list[KVRecord]:
        """Every current record: what ``rebuild`` needs to restore these books."""
        return list(self._books.records())

    def engines_with_records(self) -> set[str]:
        """The engines some current record is booked on (the books' index, not a scan)."""
        return set(self._books.sessions_by_engine)

    def pulls_in_flight(self) -> list[KVRecord]:
        """Records handed to a prefill whose pull has not resolved (for pull timeouts)."""
        return list(self._books.pulling_records())

    def bytes_held(self, engine_id: str) -> int:
        """Bytes booked on the engine, including records with a pull in flight."""
        return self._books.held_bytes.get(engine_id, 0)

    def blocks_held(self, engine_id: str) -> int:
        """The engine's blocks those records name: what it keeps for sessions between
        turns (the autoscaler's paused-session demand)."""
        return self._books.held_blocks.get(engine_id, 0)

    def idle_bytes(self, engine_id: str) -> int:
        """Bytes booked on the engine by sessions with no turn in flight."""
        return self._books.idle_bytes.get(engine_id, 0)

    def num_sessions(self) -> int:
        return len(self._books.sessions)

    def stats(self) -> KVStats:
        return KVStats(
            num_sessions=len(self._books.sessions),
            num_records=self._books.num_records(),
            num_pulls=self._num_pulls,
            num_declines=self._num_declines,
            num_expiries=self._num_expiries,
            num_evictions=self._num_evictions,
            num_releases=self._num_releases,
            recomputes_by_reason=tuple(self._recomputes.items()),
            num_demotions=self._num_demotions,
        )

    # -- effects --------------------------------------------------------------------------

    def _expire(self, session_id: str, session: SessionState, now_s: float) -> Expire:
        record = self._books.detach(session_id, session)
        session.lost_reason = RecomputeReason.EXPIRED
        unread = (
            record.pool_id != HOST_POOL
            and now_s + COPY_MIN_LEFT_S < record.expiry_s
            and not (session.active and not session.held)  # a running turn keeps anew
            and session.lease_expiry_s > record.expiry_s  # the session outlives the blocks
        )
        if unread:
            session.evicted = record  # a host tier's copy of it may still be booked
        self._num_expiries += 1
        return Expire(record=record, unread=unread)

    def _release(self, record: KVRecord, reason: ReleaseReason) -> Release:
        self._num_releases += 1
        return Release(record=record, reason=reason)

    def _evict(self, session_id: str, session: SessionState, reason: EvictReason) -> Evict:
        record = self._books.detach(session_id, session)
        session.lost_reason = RecomputeReason.EVICTED
        session.evicted = record
        self._num_evictions += 1
        return Evict(record=record, reason=reason)

    def _forget(
        self, session_id: str, session: SessionState, reason: ReleaseReason
    ) -> list[Effect]:
        effects: list[Effect] = []
        if session.record is not None:
            effects.append(self._release(self._books.detach(session_id, session), reason))
        self._books.forget(session_id)
        return effects

    def make_room(self, engine_id: str, now_s: float) -> list[Effect]:
        """The engine is short of KV (``policies.admission.short_of_kv``: blocks kept for
        sessions fill it): evict the idle record on it nearest expiry (``Evict(pressure)``,
        drained), at most one per ``room_wait_s``, so that its drain shows in the engine's
        next report before another goes. Held records stay."""
        if engine_id in self._host_engines:
            return []
        if now_s < self._room_made_s.get(engine_id, -math.inf) + self._config.room_wait_s:
            return []
        session_id = self._books.idle_nearest_expiry(engine_id)
        if session_id is None:
            return []
        self._room_made_s[engine_id] = now_s
        return [self._evict(session_id, self._books.sessions[session_id], EvictReason.PRESSURE)]

    def retire(self, engine_id: str, reason: EvictReason = EvictReason.SCALED_IN) -> list[Effect]:
        """The engine is being stopped (``scaled_in``: a scale-in; ``replaced``: a
        redeploy or a removal): evict every record on it (``Evict(reason)``, for the host
        tier to take), as ``on_engine_lost`` does but while its blocks can still be read;
        a session held for an ingress loses its lease with the record (the caller's part).
        A session whose record is not booked again from the tier recomputes its next turn
        with the same reason."""
        assert reason in _RETIRED, reason
        effects: list[Effect] = []
        for session_id in sorted(self._books.sessions_by_engine.get(engine_id, ())):
            session = self._books.sessions[session_id]
            effects.append(self._evict(session_id, session, reason))
            session.lost_reason = _RETIRED[reason]
        return effects

    def held_nearest_expiry(self, engine_id: str) -> str | None:
        """The session held for an ingress (its next turn's lease, unused) whose record
        on the engine expires first: what to ask back when ``make_room`` finds nothing
        idle there (given back, it is idle and can go)."""
        held = [
            (session.record.expiry_s, session_id)
            for session_id, session in self._books.sessions.items()
            if session.held and session.record is not None and session.record.engine_id == engine_id
        ]
        return min(held)[1] if held else None

    def _enforce_budget(self, engine_id: str) -> list[Effect]:
        """Evict idle records on the engine, nearest expiry first, until within budget."""
        budget = self._config.idle_budget_bytes_per_engine
        effects: list[Effect] = []
        if budget is None or engine_id in self._host_engines:
            return effects
        books = self._books
        while books.idle_bytes.get(engine_id, 0) > budget:
            session_id = books.idle_nearest_expiry(engine_id)
            if session_id is None:
                break  # only held records left: evicted when given back (``unhold``)
            effects.append(self._evict(session_id, books.sessions[session_id], EvictReason.BUDGET))
        return effects
