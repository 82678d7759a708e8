"""The KV lifecycle service: one place per application that knows where every
session's KV lives, shared by every ingress replica.

It owns, for the whole application:

- the KV lifecycle books (``policies.kv_lifecycle`` through ``KVPlanner``): records,
  leases, the idle-memory budget, TTL margins;
- each session's exact token ids (``SessionTokens``): the prefix check and draining
  need the tokens the kept blocks hold, and a session's turns may land on different
  ingress replicas;
- the effects: every set of kept blocks nobody will reuse (sessionless turns, closed,
  superseded or budget-evicted sessions) is *drained*, read back into a prefill engine
  with a ``max_tokens=1`` pull, because vLLM 0.32's decode engine pins them until its
  TTL otherwise; and a tick every second expires what is due;
- restart recovery: a restarted service has empty books. Engine hosts notice the new
  ``epoch`` and send their ledgers (``orchestrator.kv.ledger``); once every prefill
  host has reported what it read (or ``restore_wait_s`` passed), the service adopts the
  decode engines' kept blocks minus those reads. A session that moved on meanwhile
  keeps its newer record and the old blocks are drained: nothing booked twice, nothing
  left pinned unbudgeted.

``KVService`` is plain asyncio (tested with fake pools and a moved clock);
``KVServiceActor`` runs it as a named, detached, restartable Ray actor and
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

from engines.base import GenerateChunk, GenerateRequest
from orchestrator.errors import SessionNotFound
from orchestrator.kv.ledger import kept_blocks_of
from orchestrator.kv.messages import (
    KeptBlocks,
    LedgerReport,
    SessionInfo,
    SessionPrefix,
    TurnDone,
    TurnPlan,
)
from orchestrator.kv.ownership import Principal, SessionOwners
from orchestrator.kv.replay import Replay, TurnReplayBook
from orchestrator.kv.session_tokens import SessionTokens
from orchestrator.kv.turn_planner import KVPlanner
from policies.kv_lifecycle import Effect, KVLifecycleConfig, prefix_hash

__all__ = ["KVService", "KVServiceAPI", "PrefillPool"]

log = logging.getLogger("kvtide.kv_service")


class PrefillPool(Protocol):
    """How the service reaches the prefill pool to drain kept blocks."""

    def generate(self, request: GenerateRequest) -> Any: ...


class KVServiceAPI(Protocol):
    """What a router needs from the service (in-process or through Ray)."""

    async def session_prefix(
        self, session_id: str, principal: Principal | None = None
    ) -> SessionPrefix: ...

    async def plan_turn(self, session_id: str, prompt_token_ids: list[int]) -> TurnPlan: ...

    async def pull_failed(self, session_id: str) -> None: ...

    async def turn_done(self, done: TurnDone) -> None: ...

    async def turn_abandoned(self, session_id: str | None) -> None: ...


async def _read_to_end(stream: Any) -> GenerateChunk:
    last: GenerateChunk | None = None
    async for chunk in stream:
        last = chunk
    if last is None or not last.finished or last.finish_reason == "error":
        raise RuntimeError("the prefill engine did not complete the read")
    return last


class KVService:
    """The service's state and logic. Single event loop; the clock is passed in."""

    def __init__(
        self,
        config: KVLifecycleConfig,
        *,
        prefill: PrefillPool | None,
        drain_timeout_s: float,
        num_prefill_engines: int = 1,
        restore_wait_s: float = 10.0,
        max_sessions: int = 50_000,
        engine_silence_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.planner = KVPlanner(config)
        self.tokens = SessionTokens(max_sessions=max_sessions, ttl_s=config.ttl_s)
        self.prefill = prefill
        self.drain_timeout_s = drain_timeout_s
        self.num_prefill_engines = num_prefill_engines
        self.restore_wait_s = restore_wait_s
        self.clock = clock
        self.replays = TurnReplayBook(clock=clock)
        self.owners = SessionOwners(idle_ttl_s=config.ttl_s, max_sessions=max_sessions)
        self.epoch = uuid.uuid4().hex
        self.started_s = clock()
        self._drains: set[asyncio.Task[None]] = set()
        self._kept_reports: dict[str, list[KeptBlocks]] = {}
        self._consumed: set[tuple[str, str]] = set()
        self._prefill_reporters: set[str] = set()
        self.engine_silence_s = engine_silence_s
        # engine id -> (the nodes its shards run on, last heartbeat)
        self._engines: dict[str, tuple[tuple[str, ...], float]] = {}
        self.counters = dict.fromkeys(
            (
                "drains",
                "drain_failures",
                "undrainable",
                "restores",
                "adopted",
                "adopt_skipped_consumed",
                "adopt_superseded",
                "engines_lost",
                "sessions_lost",
            ),
            0,
        )

    # ---- turns -----------------------------------------------------------------------

    async def session_prefix(
        self, session_id: str, principal: Principal | None = None
    ) -> SessionPrefix:
        """The session's last turn, for tokenizing the next one; ``owned`` False (and
        nothing else) when another API key owns the session."""
        if principal is not None and not await self.session_owned(session_id, principal):
            return SessionPrefix(owned=False)
        text, ids = self.tokens.last_turn(session_id, self.clock())
        return SessionPrefix(text=text, token_ids=list(ids))

    # ---- ownership (API keys; see orchestrator.serve.auth) ---------------------------

    async def session_owned(self, session_id: str, principal: Principal) -> bool:
        """Whether ``principal`` may use the session (it owns it, or nobody does)."""
        try:
            self.owners.check(session_id, principal, self.clock())
        except SessionNotFound:
            return False
        return True

    async def claim_session(self, session_id: str, principal: Principal) -> bool:
        """Make ``principal`` the session's owner just before its turn runs; False when
        another key owns it. Sessions whose ownership ended are closed first, so no key
        inherits another's KV or tokens."""
        try:
            ended = self.owners.claim(session_id, principal, self.clock())
        except SessionNotFound:
            return False
        for sid in ended:
            await self.close(sid)
        return True

    async def plan_turn(self, session_id: str, prompt_token_ids: list[int]) -> TurnPlan:
        return self.planner.plan_turn(session_id, prompt_token_ids, self.clock())

    async def pull_failed(self, session_id: str) -> None:
        self._apply(self.planner.pull_failed(session_id, self.clock()))

    async def turn_done(self, done: TurnDone) -> None:
        """Book the kept blocks and the session's tokens together (one step: a record is
        never booked without the tokens that drain it)."""
        now = self.clock()
        sid = done.session_id
        if sid is None:
            # Nobody will pull these blocks back: free them now, not at the TTL.
            self._drain(done.kv_transfer_params, done.token_ids)
            return
        if done.next_token_ids is None:
            self.tokens.forget(sid)
        else:
            self.tokens.remember(sid, done.next_text, done.next_token_ids, now)
        expiry = None if done.kv_expires_in_s is None else now + done.kv_expires_in_s
        self._apply(
            self.planner.turn_finished(
                sid, done.token_ids, done.kv_transfer_params, now, expiry_s=expiry
            )
        )

    async def turn_abandoned(self, session_id: str | None) -> None:
        if session_id is not None:
            self._apply(self.planner.abandon(session_id, self.clock()))

    # ---- idempotent turns (shared by every ingress replica) --------------------------

    async def replay_begin(self, key: str) -> Replay:
        return self.replays.begin(key)

    async def replay_complete(self, key: str, body: dict[str, Any]) -> None:
        self.replays.complete(key, body)

    async def replay_fail(self, key: str) -> None:
        self.replays.fail(key)

    # ---- sessions ---------------------------------------------------------------------

    async def session(self, session_id: str) -> SessionInfo:
        now = self.clock()
        lifecycle = self.planner.lifecycle
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

    async def renew(self, session_id: str) -> SessionInfo:
        """Extend the session's lease (SDK heartbeat); ``known`` False if it is gone."""
        self.planner.lifecycle.renew(session_id, self.clock())
        return await self.session(session_id)

    async def close(self, session_id: str) -> bool:
        """End a session: its kept KV is drained back to prefill (freed on decode now)."""
        known = self.planner.lifecycle.lease_expiry(session_id) is not None
        self._apply(self.planner.close(session_id, self.clock()))
        self.tokens.forget(session_id)
        self.owners.forget(session_id)
        return known

    async def tick(self) -> None:
        now = self.clock()
        for sid in self.owners.expire(now):
            await self.close(sid)
        self._apply(self.planner.tick(now))
        silent = [e for e, (_, seen) in self._engines.items() if now - seen > self.engine_silence_s]
        if silent:
            self.engines_lost(silent)
        self._maybe_adopt()

    # ---- engine liveness -------------------------------------------------------------

    def heartbeat(self, engine_id: str, node_ids: Sequence[str] = ()) -> str:
        """An engine host is alive (it calls this every second) with its shards on
        ``node_ids``; returns the epoch."""
        self._engines[engine_id] = (tuple(node_ids), self.clock())
        return self.epoch

    def engines_lost(self, engine_ids: Sequence[str]) -> int:
        """Engines that died (their node was lost, or they went silent for
        ``engine_silence_s``): their KV is gone, so no session's next turn is planned
        to read it; those turns recompute at once instead of waiting on a pull.
        Returns the sessions whose KV was dropped."""
        now = self.clock()
        dropped = 0
        for engine_id in engine_ids:
            self._engines.pop(engine_id, None)
            effects = self.planner.lifecycle.on_engine_lost(engine_id, now)
            self.counters["engines_lost"] += 1
            dropped += len(effects)
            self._apply(effects)  # never drainable: nothing is left to read
        self.counters["sessions_lost"] += dropped
        return dropped

    def nodes_lost(self, node_ids: Iterable[str]) -> list[str]:
        """Mark every engine with a shard on ``node_ids`` lost (a TP engine that lost a
        rank is lost); returns their ids."""
        gone = set(node_ids)
        lost = sorted(e for e, (nodes, _) in self._engines.items() if gone.intersection(nodes))
        if lost:
            self.engines_lost(lost)
        return lost

    def engine_nodes(self) -> dict[str, tuple[str, ...]]:
        """The nodes of each live engine's shards, as its host reported them."""
        return {e: nodes for e, (nodes, _) in self._engines.items()}

    async def stats(self) -> dict[str, Any]:
        lifecycle = self.planner.lifecycle
        engines = sorted({r.engine_id for r in lifecycle.records()})
        return {
            **self.planner.stats(),
            "bytes_held": {e: lifecycle.bytes_held(e) for e in engines},
            "num_drains": self.counters["drains"],
            "num_drain_failures": self.counters["drain_failures"],
            "num_undrainable": self.counters["undrainable"],
            "service": {
                "epoch": self.epoch,
                "uptime_s": round(self.clock() - self.started_s, 3),
                "restoring": bool(self._kept_reports),
                **{
                    k: v
                    for k, v in self.counters.items()
                    if k.startswith(("restore", "adopt", "engines_", "sessions_"))
                },
                "engines_live": len(self._engines),
            },
        }

    # ---- restart recovery --------------------------------------------------------------

    async def restore(self, report: LedgerReport) -> None:
        """An engine host's ledger, sent after it saw a new ``epoch``."""
        self.counters["restores"] += 1
        if report.role == "prefill":
            self._prefill_reporters.add(report.engine_id)
            self._consumed.update((e, r) for e, r in report.consumed)
        if report.kept:
            self._kept_reports[report.engine_id] = list(report.kept)
        self._maybe_adopt()

    def _maybe_adopt(self) -> None:
        if not self._kept_reports:
            return
        waited = self.clock() - self.started_s >= self.restore_wait_s
        if len(self._prefill_reporters) < self.num_prefill_engines and not waited:
            return  # a read we have not heard of yet would make us book freed blocks
        now = self.clock()
        lifecycle = self.planner.lifecycle
        reports, self._kept_reports = self._kept_reports, {}
        # Oldest first: a session reported twice keeps its newest blocks.
        entries = sorted((k for kept in reports.values() for k in kept), key=lambda k: -k.age_s)
        for k in entries:
            if (k.engine_id, k.request_id) in self._consumed:
                self.counters["adopt_skipped_consumed"] += 1
                continue
            if k.session_id is None:
                self._drain(k.kv_transfer_params, k.token_ids)
                continue
            record = lifecycle.new_record(
                k.session_id,
                engine_id=k.engine_id,
                token_ids_covered=k.token_ids[: k.num_tokens],
                block_ids=k.block_ids,
                transfer_params=k.kv_transfer_params,
                expiry_s=now + k.expires_in_s,
                last_used_s=now - k.age_s,
            )
            effects = lifecycle.adopt(record, now)
            if effects and effects[0].record is record:
                self.counters["adopt_superseded"] += 1
            else:
                self.counters["adopted"] += 1
                if self.tokens.token_ids(k.session_id) is None:
                    # The next turn tokenizes from scratch (text was not kept); the
                    # prefix check then decides whether these blocks still match.
                    self.tokens.remember(k.session_id, None, k.token_ids, now)
            self._apply(effects, tokens=k.token_ids)

    # ---- effects -------------------------------------------------------------------

    def _apply(self, effects: Sequence[Effect], tokens: Sequence[int] | None = None) -> None:
        """Drain records nobody will reuse, when the tokens they hold are known."""
        for effect in effects:
            if not effect.drainable:
                continue  # expiring anyway: the engine frees the blocks at its TTL
            record = effect.record
            ids = tokens if tokens is not None else self.tokens.token_ids(record.session_id)
            if (
                ids is None
                or len(ids) <= record.num_tokens
                or prefix_hash(ids, record.num_tokens) != record.prefix_hash
            ):
                self.counters["undrainable"] += 1
                continue
            self._drain(record.transfer_params, ids[: record.num_tokens + 1])

    def _drain(self, params: Any, token_ids: Sequence[int]) -> None:
        """Free a decode engine's kept blocks by reading them into a prefill engine."""
        if self.prefill is None or kept_blocks_of(params) is None:
            return
        task = asyncio.get_running_loop().create_task(
            self._read_back(dict(params), list(token_ids))
        )
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _read_back(self, params: dict[str, Any], token_ids: list[int]) -> None:
        assert self.prefill is not None
        req = GenerateRequest(
            request_id=f"drain-{uuid.uuid4().hex}",
            prompt_token_ids=token_ids,
            max_tokens=1,
            kv_transfer_params={**params, "do_remote_decode": True, "do_remote_prefill": False},
        )
        try:
            await asyncio.wait_for(_read_to_end(self.prefill.generate(req)), self.drain_timeout_s)
            self.counters["drains"] += 1
        except Exception as exc:
            self.counters["drain_failures"] += 1
            log.warning("drain of %s failed: %s", params.get("remote_request_id"), exc)

    async def wait_drains(self) -> None:
        """Wait for the drains in flight (tests and shutdown)."""
        while self._drains:
            await asyncio.gather(*list(self._drains), return_exceptions=True)
