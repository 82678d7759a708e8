"""The KV lifecycle service: one place per application that knows where every
session's KV lives, shared by every ingress replica.

It owns, for the whole application:

- the KV lifecycle books (``policies.kv_lifecycle`` through ``KVDecider``): records,
  leases, the idle-memory budget, TTL margins;
- each session's exact token ids (``SessionTokens``): the prefix check and draining
  need the tokens the kept blocks hold, and a session's turns may land on different
  ingress replicas;
- the effects: every set of kept blocks nobody will reuse is *drained*
  (``orchestrator.kv.drains``); and a tick every second expires what is due;
- restart recovery (``orchestrator.kv.adoption``): a restarted service has empty books
  and rebuilds them from its durable marks and the engine hosts' ledgers.

``KVService`` composes the parts, each with one job: a session's turns
(``session_turns.SessionTurns``), the rules of each session's running turn and lease
(``policies.turn_state.TurnState``, pure) and their effects applied
(``turn_effects.TurnEffects``): running marks and owners with their durable entries
(``turn_marks``), turn leases (``lease_desk.LeaseDesk``), drains (``drains.Drains``); the
engine registry (``engines.EngineRegistry``), restart adoption
(``adoption.LedgerAdoption``) and the ingress replicas' metric books
(``metrics_book.MetricsBook``). It is plain asyncio (tested with fake pools and a moved
clock); ``KVServiceActor`` runs it as a named, detached, restartable Ray actor and
``ServiceClient`` is what routers and engine hosts hold. Messages are
``orchestrator.kv.messages`` structs.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import msgspec

from orchestrator.kv.adoption import LedgerAdoption, rebuild_from_marks
from orchestrator.kv.decider import KVDecider
from orchestrator.kv.drains import Drains, HostTier, PrefillPool, host_record
from orchestrator.kv.durable import BoundedStore, DurableStore, MemoryStore, WriteBehind
from orchestrator.kv.engines import EngineRegistry, count_decode_paths, engine_pool
from orchestrator.kv.host_reads import HostReads, restore_host_reads
from orchestrator.kv.integrity import ReuseOff
from orchestrator.kv.kept_check import KeptCheck, KeptRef, KeptVerdict
from orchestrator.kv.lease_desk import LeaseDesk
from orchestrator.kv.messages import (
    Beat,
    Claim,
    Handover,
    IntegrityMismatch,
    KeptBlocks,
    KVDecision,
    LeaseWatch,
    LedgerReport,
    SessionInfo,
    SessionPrefix,
    TurnDone,
)
from orchestrator.kv.metrics_book import MetricsBook, merge_counters
from orchestrator.kv.ownership import Principal, SessionOwners
from orchestrator.kv.replay import Replay, TurnReplayBook
from orchestrator.kv.service_settings import ServiceSettings
from orchestrator.kv.session_tokens import SessionTokens
from orchestrator.kv.session_turns import SessionTurns, whole_turn_done
from orchestrator.kv.turn_effects import TurnEffects
from orchestrator.kv.turn_leases import LeaseBook
from orchestrator.kv.turn_marks import OwnerMarks, RunningTurns
from policies.admission import AdmissionSettings, EngineBook, EngineLoad, short_of_kv
from policies.kv_lifecycle import EvictReason, KVLifecycleConfig, Release, ReleaseReason
from policies.turn_state import TurnState

log = logging.getLogger("kvtide.kv_service")

ROOM_REPORT_AGE_S = 5.0
"""An engine's load older than this makes no room on it (it is silent: lost, or busy)."""

__all__ = [
    "API_METHODS",
    "KVService",
    "KVServiceAPI",
    "PrefillPool",
    "ServiceSettings",
    "count_decode_paths",
    "engine_pool",
    "merge_counters",
]


class KVServiceAPI(Protocol):
    """Everything the service answers, in-process (``KVService``) or through its Ray
    actor (``orchestrator.kv.actor`` derives the actor's methods and the client's from
    this list: ``API_METHODS``). Callers: the ingress (``begin_turn``: a turn's one call before it
    runs; sessions, ownership, replays, stats), the router (``pull_failed``,
    ``turn_done``, ``turn_abandoned``; ``decide_turn`` for a turn not begun by the
    ingress) and the engine hosts (``heartbeat``, ``restore``). ``integrity_mismatch``:
    the router's integrity check; ``reuse_on``: an operator's."""

    async def session_prefix(
        self, session_id: str, principal: Principal | None = None
    ) -> SessionPrefix: ...

    async def session_owned(self, session_id: str, principal: Principal) -> bool: ...

    async def claim_session(self, session_id: str, principal: Principal) -> Claim: ...

    async def decide_turn(self, session_id: str, prompt_token_ids: list[int]) -> KVDecision: ...

    async def begin_turn(
        self,
        session_id: str,
        principal: Principal,
        prompt_token_ids: list[int],
        prefix_digest: int | None = None,
        prefix_len: int = 0,
        holder: str | None = None,
    ) -> Claim: ...

    async def pull_failed(self, session_id: str) -> None: ...

    async def turn_done(self, done: TurnDone) -> Handover: ...

    async def lease_used(
        self, session_id: str, lease_id: int, reason: str | None, provisional: bool = False
    ) -> bool: ...

    async def lease_watch(
        self,
        holder: str,
        released: list[int],
        wait_s: float,
        held: list[int] | None = None,
        answers: dict[str, bool] | None = None,
    ) -> LeaseWatch: ...

    async def turn_abandoned(self, session_id: str | None, *, unread: bool = False) -> None: ...

    async def integrity_mismatch(self, mismatch: IntegrityMismatch) -> bool: ...

    async def reuse_on(self, prefill_engine_id: str, source_engine_id: str) -> bool: ...

    async def replay_begin(
        self, key: str, fingerprints: Sequence[str] = (), attempt: str = ""
    ) -> Replay: ...

    async def replay_complete(self, key: str, body: dict[str, Any]) -> None: ...

    async def replay_fail(self, key: str, attempt: str = "") -> None: ...

    async def session(self, session_id: str) -> SessionInfo: ...

    async def renew(self, session_id: str, principal: Principal | None = None) -> SessionInfo: ...

    async def close(self, session_id: str) -> bool: ...

    async def stats(self) -> dict[str, Any]: ...

    async def heartbeat(
        self, engine_id: str, node_ids: Sequence[str] = (), stats: dict[str, Any] | None = None
    ) -> Beat: ...

    async def kept_check(self, refs: list[KeptRef]) -> KeptVerdict: ...

    async def kept_orphans(self, kept: list[KeptBlocks]) -> int: ...

    async def peer_reads(self, engine_id: str, reads: Sequence[tuple[str, str]]) -> list[str]: ...

    async def engines_lost(self, engine_ids: Sequence[str]) -> int: ...

    async def retire_engine(self, engine_id: str, reason: str = "scaled_in") -> dict[str, int]: ...

    async def engine_loads(self) -> dict[str, dict[str, float]]: ...

    async def restore(self, report: LedgerReport) -> None: ...

    async def report_metrics(self, source: str, snapshot: dict[str, Any]) -> None: ...


API_METHODS: tuple[str, ...] = tuple(
    name for name in vars(KVServiceAPI) if not name.startswith("_")
)
"""The service's methods, in one list: the actor and its client are built from it."""


class KVService:
    """The service's state and logic, in parts (see the module). Single event loop; the
    clock is passed in."""

    def __init__(
        self,
        config: KVLifecycleConfig,
        *,
        prefill: PrefillPool | None,
        settings: ServiceSettings,
        store: DurableStore | None = None,
        host: HostTier | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        s = settings
        self.decider = KVDecider(config)
        # Each session's last turn: bounded in bytes too (a long history is ~8 bytes a
        # token with its text), so the service's memory has a bound the config names.
        self.tokens = SessionTokens(
            max_sessions=s.max_sessions, ttl_s=config.ttl_s, max_bytes=s.session_state_max_bytes
        )
        self.clock = clock
        self.wall_clock = wall_clock
        self.epoch = uuid.uuid4().hex
        self.started_s = clock()
        # Owners and replays outlive the service in ``store`` (orchestrator.kv.durable).
        self.store: DurableStore = store if store is not None else MemoryStore()
        # A running turn's mark is written off the turn's path (see ``WriteBehind``),
        # each write within the store's deadline.
        self.marks: DurableStore | WriteBehind = (
            WriteBehind(self.store.store, timeout_s=self.store.timeout_s)
            if isinstance(self.store, BoundedStore)
            else self.store
        )
        self.replays = TurnReplayBook(
            clock=clock,
            store=self.store,
            max_bytes=s.replay_max_bytes,
            running_grace_s=s.running_grace_s,
        )
        self.owners = SessionOwners(idle_ttl_s=config.ttl_s, max_sessions=s.max_sessions)
        self.owner_marks = OwnerMarks(self.owners, marks=self.marks, wall_clock=wall_clock)
        # Turns held for the ingress replica that ran a session's last turn
        # (``orchestrator.kv.turn_leases``); the lease's margin is the handover wait.
        self.leases = LeaseBook(lasts_s=s.turn_lease_s, grace_s=s.handover_wait_s, clock=clock)
        # Each session's running turn and lease, as rules (``policies.turn_state``): one
        # running turn per session (a claim older than running_grace_s is stale: its
        # ingress is gone). Their marks are written through, and a session's next
        # begin_turn waits handover_wait_s for the running one's turn_done (``running``).
        self.turn_state = TurnState(
            self.decider.lifecycle, running_grace_s=s.running_grace_s, leases=self.leases.table
        )
        self.running = RunningTurns(
            state=self.turn_state,
            marks=self.marks,
            handover_wait_s=s.handover_wait_s,
            wall_clock=wall_clock,
        )
        # Decode blocks the host tier read, for a restarted service (host_reads.py).
        self.host_reads = HostReads(self.marks, ttl_s=config.ttl_s, wall_clock=wall_clock)
        # A host tier's copies are booked again once the engines' ledgers had their
        # wait (``adopt_host_copies``): a session the engines report keeps that record.
        self._host_adopted = host is None
        self.drains = Drains(
            prefill=prefill,
            timeout_s=s.drain_timeout_s,
            tokens=self.tokens,
            leases=self.leases,
            reuse_off=lambda: self.decider.lifecycle.reuse_off,
            host=host,
            demote=lambda evicted, copy: self.decider.lifecycle.demote(evicted, copy, clock()),
            clock=clock,
            mark_read=self.host_reads.mark,
        )
        self.turn_effects = TurnEffects(
            running=self.running, owners=self.owner_marks, drains=self.drains, clock=clock
        )
        self.lease_desk = LeaseDesk(
            state=self.turn_state,
            book=self.leases,
            effects=self.turn_effects,
            running=self.running,
            tokens=self.tokens,
            owners=self.owners,
            epoch=self.epoch,
            clock=clock,
        )
        self.turns = SessionTurns(
            state=self.turn_state,
            effects=self.turn_effects,
            decider=self.decider,
            tokens=self.tokens,
            owners=self.owner_marks,
            running=self.running,
            leases=self.lease_desk,
            drains=self.drains,
            clock=clock,
        )
        # What a previous instance marked: its running turns (unused leases among them)
        # and its keys' sessions.
        lapse_s = s.turn_lease_s + s.handover_wait_s
        rebuild_from_marks(
            self.store,
            self.running,
            self.turn_state.restored,
            self.owners,
            lease_lapse_s=lapse_s,
            now=clock(),
        )
        self.adoption = LedgerAdoption(
            decider=self.decider,
            tokens=self.tokens,
            drains=self.drains,
            num_prefill_engines=s.num_prefill_engines,
            restore_wait_s=s.restore_wait_s,
            started_s=self.started_s,
            clock=clock,
            consumed=restore_host_reads(self.store, wall=wall_clock()),
        )
        # The latest counters of every engine (from its heartbeat) and every ingress
        # replica (``report_metrics``): /kvtide/stats sums them.
        self.engines = EngineRegistry(
            silence_s=s.engine_silence_s, decider=self.decider, drains=self.drains
        )
        self.metrics = MetricsBook(silence_s=s.engine_silence_s)
        # The engines' loads with their last progress: which are short of KV (_make_room).
        self.engine_book = EngineBook()
        # Decode blocks no hand-over booked, found by the hosts' checks (kept_check.py).
        lifecycle = self.decider.lifecycle
        self.unbooked = KeptCheck(
            retention_s=config.ttl_s,
            margin_s=s.kept_check_margin_s,
            clock=clock,
            busy=lambda sid: (
                self.adoption.restoring
                or (sid is not None and (sid in self.running or lifecycle.held(sid)))
            ),
            drain=self.drains.drain,
        )
        # Engine pairs whose reuse an integrity check turned off (``orchestrator.kv.integrity``).
        self.reuse_off = ReuseOff(
            store=self.store, lifecycle=self.decider.lifecycle, wall_clock=wall_clock
        )

    @property
    def counters(self) -> dict[str, int]:
        """The service's counters, from its parts (a copy)."""
        return {
            **self.drains.counters,
            **self.adoption.counters,
            **self.engines.counters,
            **self.unbooked.counters,
        }

    @property
    def engine_silence_s(self) -> float:
        """How long an engine (or an ingress replica's metric book) may stay silent."""
        return self.engines.silence_s

    @engine_silence_s.setter
    def engine_silence_s(self, value: float) -> None:
        self.engines.silence_s = self.metrics.silence_s = value

    @property
    def running_grace_s(self) -> float:
        return self.turn_state.running_grace_s

    @running_grace_s.setter
    def running_grace_s(self, value: float) -> None:
        self.turn_state.running_grace_s = value

    @property
    def handover_wait_s(self) -> float:
        return self.running.handover_wait_s

    @handover_wait_s.setter
    def handover_wait_s(self, value: float) -> None:
        self.running.handover_wait_s = value

    # ---- turns (orchestrator.kv.session_turns) ----------------------------------------

    async def session_prefix(
        self, session_id: str, principal: Principal | None = None
    ) -> SessionPrefix:
        """The session's last turn, for tokenizing the next one (``SessionTurns.prefix``)."""
        return self.turns.prefix(session_id, principal)

    async def session_owned(self, session_id: str, principal: Principal) -> bool:
        """Whether ``principal`` may use the session (it owns it, or nobody does; API
        keys: see orchestrator.serve.auth)."""
        return self.turns.owned(session_id, principal)

    async def claim_session(self, session_id: str, principal: Principal) -> Claim:
        """Make ``principal`` the session's owner and mark its turn running, just before
        the turn runs (``SessionTurns.claim``)."""
        return await self.turns.claim(session_id, principal)

    async def decide_turn(self, session_id: str, prompt_token_ids: list[int]) -> KVDecision:
        return self.decider.decide_turn(session_id, prompt_token_ids, self.clock())

    async def begin_turn(
        self,
        session_id: str,
        principal: Principal,
        prompt_token_ids: list[int],
        prefix_digest: int | None = None,
        prefix_len: int = 0,
        holder: str | None = None,
    ) -> Claim:
        """A turn's one call before it runs: ``claim_session`` and ``decide_turn`` at
        once (``SessionTurns.begin``: a prompt tokenized from a stale last turn, a turn
        still running or held by a lease). ``holder``: the calling ingress replica's
        lessee id (its watch is asked whether the turn is still generating there)."""
        return await self.turns.begin(
            session_id, principal, prompt_token_ids, prefix_digest, prefix_len, holder
        )

    async def pull_failed(self, session_id: str) -> None:
        self.drains.apply(self.decider.pull_failed(session_id, self.clock()))

    def whole(self, done: TurnDone) -> TurnDone | None:
        """``done`` with what its sender left out put back (``whole_turn_done``)."""
        return whole_turn_done(done, self.tokens)

    async def turn_done(self, done: TurnDone) -> Handover:
        """Book the turn's kept blocks and the session's tokens (``SessionTurns.done``);
        the answer may hold the session's next turn for ``done.holder`` (a lease). Blocks
        a host's check found unbooked before this came are not booked (``KeptCheck``):
        the turn hands over as one that kept no KV."""
        params = done.kv_transfer_params
        if self.unbooked.refused(params):
            done = msgspec.structs.replace(done, kv_transfer_params=None)
        handover = self.turns.done(done)
        if handover.accepted:
            self.unbooked.booked(params)
        return handover

    async def turn_abandoned(self, session_id: str | None, *, unread: bool = False) -> None:
        """The session's turn ended without a record to book. ``unread``: it ran on the
        engine that kept the record it was handed and read none of it (an extended
        turn), so that record is offered again; otherwise a handed record counts as a
        failed pull."""
        if session_id is not None:
            self.turns.abandoned(session_id, unread=unread)

    # ---- integrity checks (orchestrator.kv.integrity) --------------------------------

    async def integrity_mismatch(self, mismatch: IntegrityMismatch) -> bool:
        """A sampled turn's pull gave KV whose output differs from a recompute: reuse is
        off for the pull's engine pair from now on (``ReuseOff.turn_off``); False when it
        was off already."""
        return await self.reuse_off.turn_off(mismatch)

    async def reuse_on(self, prefill_engine_id: str, source_engine_id: str) -> bool:
        """An operator turns reuse back on for a pair an integrity check turned off;
        False when it was not off."""
        return await self.reuse_off.turn_on(prefill_engine_id, source_engine_id)

    # ---- turn leases (orchestrator.kv.lease_desk) ------------------------------------

    async def lease_used(
        self, session_id: str, lease_id: int, reason: str | None, provisional: bool = False
    ) -> bool:
        """The lessee runs the held turn (``LeaseDesk.used``; ``provisional``: under the
        lease it proposed with the last turn's hand-over); False: the lease is no longer
        held, ask again with ``begin_turn``."""
        return await self.lease_desk.used(session_id, lease_id, reason, provisional)

    async def lease_watch(
        self,
        holder: str,
        released: list[int],
        wait_s: float,
        held: list[int] | None = None,
        answers: dict[str, bool] | None = None,
    ) -> LeaseWatch:
        """A lessee's standing call (``LeaseDesk.watch``)."""
        return await self.lease_desk.watch(holder, released, wait_s, held, answers)

    # ---- idempotent turns (shared by every ingress replica) --------------------------

    async def replay_begin(
        self, key: str, fingerprints: Sequence[str] = (), attempt: str = ""
    ) -> Replay:
        return self.replays.begin(key, fingerprints, attempt)

    async def replay_complete(self, key: str, body: dict[str, Any]) -> None:
        self.replays.complete(key, body)

    async def replay_fail(self, key: str, attempt: str = "") -> None:
        self.replays.fail(key, attempt)

    # ---- sessions ---------------------------------------------------------------------

    async def session(self, session_id: str) -> SessionInfo:
        return self.turns.info(session_id)

    async def renew(self, session_id: str, principal: Principal | None = None) -> SessionInfo:
        """Extend the session's lease (SDK heartbeat) and its owner's idle clock;
        ``known`` False if it is gone."""
        return self.turns.renew(session_id, principal)

    async def close(self, session_id: str) -> bool:
        """End a session (``SessionTurns.close``)."""
        return await self.turns.close(session_id)

    async def tick(self) -> None:
        now = self.clock()
        if not self._host_adopted and now - self.started_s >= self.adoption.restore_wait_s:
            await self.adopt_host_copies()
        # Stale running marks, lapsed leases and restored marks nobody vouched for end.
        self.turn_effects.apply(self.turn_state.on_tick(now))
        self.leases.forget_silent(now)
        for sid in self.owners.expire(now, keep=self.turn_state.started):
            self.owner_marks.delete(sid)
            await self.close(sid)
        self.drains.apply(self.decider.tick(now))
        self._make_room(now)
        self.host_reads.expire()
        self.engines.lose_silent(now)
        self.adoption.maybe_adopt()

    def _make_room(self, now: float) -> None:
        """Engines whose recent load shows them short of KV (``short_of_kv``: a cache full
        of kept blocks with nothing running or turns waiting, or turns waiting that none
        runs): an idle session's record on each is evicted and drained
        (``KVLifecycle.make_room``), so that an overload's kept KV does not wedge them.
        With none idle there, the held session nearest expiry is asked back from its
        ingress (its lease revoked); given back, it goes at a next tick."""
        lifecycle = self.decider.lifecycle
        cfg = lifecycle.config
        if cfg.room_kv_cache_usage is None:
            return
        settings = AdmissionSettings(
            max_kv_cache_usage=cfg.room_kv_cache_usage,
            stall_s=cfg.room_stall_s,
            max_report_age_s=ROOM_REPORT_AGE_S,
        )
        self.engine_book.observe(
            EngineLoad(
                engine_id=engine_id,
                pool=engine_pool(engine_id),
                num_running=int(load["num_running"]),
                num_waiting=int(load["num_waiting"]),
                kv_cache_usage=float(load["kv_cache_usage"]),
                num_finished=int(load["num_requests"]),
                reported_s=now - float(load["age_s"]),
            )
            for engine_id, load in self.engines.loads(now).items()
        )
        for view in self.engine_book.views():
            if not (view.is_recent(settings, now) and short_of_kv(view, settings, now)):
                continue
            engine_id = view.load.engine_id
            effects = lifecycle.make_room(engine_id, now)
            self.drains.apply(effects)
            held = None if effects else lifecycle.held_nearest_expiry(engine_id)
            if held is not None:  # only sessions held for an ingress: ask one back
                self.leases.revoke_session(held)

    # ---- engine liveness (orchestrator.kv.engines) -----------------------------------

    async def heartbeat(
        self, engine_id: str, node_ids: Sequence[str] = (), stats: dict[str, Any] | None = None
    ) -> Beat:
        """An engine host is alive (it calls this every second) with its shards on
        ``node_ids`` and its engine's counters ``stats``; returns the epoch and the
        blocks booked on the engine for sessions between turns."""
        self.engines.heartbeat(engine_id, node_ids, stats, self.clock())
        return Beat(epoch=self.epoch, kept_blocks=self.decider.lifecycle.blocks_held(engine_id))

    async def kept_check(self, refs: list[KeptRef]) -> KeptVerdict:
        """A decode host's kept entries, past their grace: which no hand-over booked
        (``KeptCheck.check``)."""
        return self.unbooked.check(refs)

    async def kept_orphans(self, kept: list[KeptBlocks]) -> int:
        """The entries a check called orphans, whole: drained (``KeptCheck``)."""
        return self.unbooked.drain_orphans(kept)

    async def peer_reads(self, engine_id: str, reads: Sequence[tuple[str, str]]) -> list[str]:
        """An engine host's reads of other engines' kept blocks since its last call
        (holder engine id, request id), and the request ids of its own engine's kept
        blocks that peers read: for engines that cannot see the reads themselves (the
        simulated engine's peers in other processes; ``EngineAdapter.peers_read``)."""
        return self.engines.peer_reads(engine_id, reads)

    async def engines_lost(self, engine_ids: Sequence[str]) -> int:
        """Engines that died: the KV booked on them is dropped (``EngineRegistry.lose``);
        returns the sessions whose KV was."""
        return self.engines.lose(engine_ids, self.clock())

    async def retire_engine(self, engine_id: str, reason: str = "scaled_in") -> dict[str, int]:
        """A decode engine is being stopped (its host calls this before it stops the
        engine; ``reason``: ``scaled_in`` by the autoscaler, ``replaced`` by a redeploy
        or a removal): the KV of its sessions goes to the host tier, and this answers once
        those moves are over, with how many sessions were on it and how many the tier
        took (``KVLifecycle.retire``). Where there is no tier, or its take-in fails,
        nothing moves: the blocks are drained back into a prefill engine (freed on the
        decode) and each of those sessions recomputes its next turn with ``reason``."""
        before = self.drains.counters["host_take_ins"]
        effects = self.decider.lifecycle.retire(engine_id, EvictReason(reason))
        self.drains.apply(effects)
        await self.drains.wait()
        moved = self.drains.counters["host_take_ins"] - before
        log.info(
            "engine %s %s: %d sessions, %d to the host tier, %d to recompute",
            engine_id,
            reason.replace("_", " "),
            len(effects),
            moved,
            len(effects) - moved,
        )
        return {"num_sessions": len(effects), "num_to_host": moved}

    async def engine_loads(self) -> dict[str, dict[str, float]]:
        """Each live engine's load as its last heartbeat reported it and ``age_s``: what
        the ingress replicas' admission control reads every second
        (``policies.admission``)."""
        return self.engines.loads(self.clock())

    def nodes_lost(self, node_ids: Iterable[str]) -> list[str]:
        """Mark every engine with a shard on ``node_ids`` lost (a TP engine that lost a
        rank is lost); returns their ids."""
        return self.engines.lose_nodes(node_ids, self.clock())

    def engines_by_decode_path(self) -> dict[str, dict[str, int]]:
        """Per pool, how many live engines run each decode path (from their heartbeats)."""
        return self.engines.by_decode_path()

    def engine_nodes(self) -> dict[str, tuple[str, ...]]:
        """The nodes of each live engine's shards, as its host reported them."""
        return self.engines.nodes()

    # ---- metrics (orchestrator.kv.metrics_book) --------------------------------------

    async def report_metrics(self, source: str, snapshot: dict[str, Any]) -> None:
        """An ingress replica's metric book (sent every second): stats sum them all."""
        self.metrics.report(source, snapshot, self.clock())

    def recent_metrics(self) -> list[dict[str, Any]]:
        """The ingress replicas' metric books reported within the engine silence window
        (a replica gone longer is dropped)."""
        return self.metrics.recent(self.clock())

    async def stats(self) -> dict[str, Any]:
        lifecycle = self.decider.lifecycle
        engines = sorted({r.engine_id for r in lifecycle.records()})
        counters = self.counters
        return {
            **self.decider.stats(),
            "bytes_held": {e: lifecycle.bytes_held(e) for e in engines},
            **self.drains.stats(),
            **self.unbooked.counters,  # kept decode blocks no hand-over booked (kept_check)
            # A turn held for an ingress replica is not running until it is used.
            "num_turns_running": len(self.turn_state) - self.leases.num_unused(),
            "num_turns_leased": self.leases.num_unused(),
            "replay_bytes": self.replays.num_bytes,
            "num_replay_duplicates": self.replays.num_duplicates,
            "engines": self.engines.stats(),
            "reuse_off": self.reuse_off.stats(),
            "ingress_metrics": merge_counters(self.recent_metrics()),
            "service": {
                "epoch": self.epoch,
                "uptime_s": round(self.clock() - self.started_s, 3),
                "restoring": self.adoption.restoring,
                **{
                    k: v
                    for k, v in counters.items()
                    if k.startswith(("restore", "adopt", "engines_", "sessions_"))
                },
                "engines_live": len(self.engines),
            },
            "host_tier": await self._host_tier_stats(),
        }

    async def _host_tier_stats(self) -> dict[str, Any] | None:
        """The host tier's store, as it reports itself (None: no tier)."""
        host = self.drains.host
        if host is None:
            return None
        try:
            answer: dict[str, Any] = await asyncio.wait_for(host.stats(), 5.0)
        except Exception as exc:  # the stats page must not fail with the tier
            return {"unreachable": type(exc).__name__}
        return answer

    # ---- restart recovery (orchestrator.kv.adoption) ---------------------------------

    async def adopt_host_copies(self) -> int:
        """Book the copies the host tier holds (a previous instance took them in), each
        as its session's record, unless the session has one already (the engines'
        ledgers, adopted first, or a turn since): that copy is released. Returns the
        copies booked; a tier that cannot be reached is asked again next tick."""
        host = self.drains.host
        if host is None:
            return 0
        try:
            held = await asyncio.wait_for(host.entries(), 30.0)
        except Exception as exc:
            log.warning("host tier not reachable for its copies: %s", exc)
            return 0
        self._host_adopted = True
        now = self.clock()
        lifecycle = self.decider.lifecycle
        booked = 0
        for copy, tag in held:
            record = host_record(copy, tag, now)
            if record is None:
                continue
            if lifecycle.record(record.session_id) is not None:
                self.drains.apply([Release(record=record, reason=ReleaseReason.SUPERSEDED)])
                continue
            effects = lifecycle.adopt(record, now)
            self.drains.apply(effects)
            booked += 1
        self.adoption.counters["adopt_host_copies"] += booked
        return booked

    async def restore(self, report: LedgerReport) -> None:
        """An engine host's ledger, sent after it saw a new ``epoch``, in pages
        (``LedgerReport.pages``): applied when its last page has come."""
        self.adoption.restore(report)

    async def wait_drains(self) -> None:
        """Wait for the drains in flight (tests and shutdown)."""
        await self.drains.wait()
