"""The KV lifecycle service: one place per application that knows where every
session's KV lives, shared by every ingress replica.

It owns, for the whole application:

- the KV lifecycle books (``policies.kv_lifecycle`` through ``KVDecider``): records,
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

import msgspec

from engines.base import GenerateRequest, final_chunk
from engines.decode_path import STOCK
from engines.kv_params import KVTransferParams
from orchestrator.errors import LimitExceeded, SessionNotFound
from orchestrator.kv.decider import KVDecider, params_of
from orchestrator.kv.durable import DurableStore, MemoryStore, RayKVStore, WriteBehind
from orchestrator.kv.marks import (
    OWNER_PREFIX,
    RUNNING_PREFIX,
    entries,
    owner_entry,
    read_owner,
    read_running,
    running_mark,
)
from orchestrator.kv.messages import (
    Claim,
    Handover,
    KeptBlocks,
    KVDecision,
    LeasedRecord,
    LeaseWatch,
    LedgerReport,
    SessionInfo,
    SessionPrefix,
    TurnDone,
    TurnLease,
)
from orchestrator.kv.ownership import Principal, SessionOwners
from orchestrator.kv.replay import Replay, TurnReplayBook
from orchestrator.kv.session_tokens import SessionTokens
from orchestrator.kv.turn_leases import Grant, LeaseBook, RestoredLeases
from policies.kv_cost import worth_pulling
from policies.kv_lifecycle import Effect, KVLifecycleConfig, RecomputeReason, prefix_hash

__all__ = [
    "API_METHODS",
    "KVService",
    "KVServiceAPI",
    "PrefillPool",
    "count_decode_paths",
    "engine_pool",
    "merge_counters",
]

log = logging.getLogger("kvtide.kv_service")


def engine_pool(engine_id: str) -> str:
    """The pool of an engine hosted by ``EngineHost`` (its id is ``<pool>-<replica id>``)."""
    return engine_id.rsplit("-", 1)[0]


def count_decode_paths(books: Iterable[dict[str, Any]]) -> dict[str, int]:
    """How many of the engines' books report each decode path (``EngineStats``)."""
    counts: dict[str, int] = {}
    for book in books:
        path = str(book.get("decode_path") or STOCK)
        counts[path] = counts.get(path, 0) + 1
    return dict(sorted(counts.items()))


def merge_counters(books: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Sum metric books key by key (nested dicts recursively): counters and histogram
    counts from several replicas add up; a value that is not a number is kept from the
    first book that has it."""
    merged: dict[str, Any] = {}
    for book in books:
        for key, value in book.items():
            if isinstance(value, dict):
                merged[key] = merge_counters([merged.get(key) or {}, value])
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = merged.get(key, 0) + value
            else:
                merged.setdefault(key, value)
    return merged


class PrefillPool(Protocol):
    """How the service reaches the prefill pool to drain kept blocks."""

    def generate(self, request: GenerateRequest) -> Any: ...


class KVServiceAPI(Protocol):
    """Everything the service answers, in-process (``KVService``) or through its Ray
    actor (``orchestrator.kv.actor`` derives the actor's methods and the client's from
    this list: ``API_METHODS``). Callers: the ingress (``begin_turn``: a turn's one call before it
    runs; sessions, ownership, replays, stats), the router (``pull_failed``,
    ``turn_done``, ``turn_abandoned``; ``decide_turn`` for a turn not begun by the
    ingress) and the engine hosts (``heartbeat``, ``restore``)."""

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
    ) -> Claim: ...

    async def pull_failed(self, session_id: str) -> None: ...

    async def turn_done(self, done: TurnDone) -> Handover: ...

    async def lease_used(self, session_id: str, lease_id: int, reason: str | None) -> bool: ...

    async def lease_watch(
        self, holder: str, released: list[int], wait_s: float, held: list[int] | None = None
    ) -> LeaseWatch: ...

    async def turn_abandoned(self, session_id: str | None) -> None: ...

    async def replay_begin(self, key: str, fingerprints: Sequence[str] = ()) -> Replay: ...

    async def replay_complete(self, key: str, body: dict[str, Any]) -> None: ...

    async def replay_fail(self, key: str) -> None: ...

    async def session(self, session_id: str) -> SessionInfo: ...

    async def renew(self, session_id: str, principal: Principal | None = None) -> SessionInfo: ...

    async def close(self, session_id: str) -> bool: ...

    async def stats(self) -> dict[str, Any]: ...

    async def heartbeat(
        self, engine_id: str, node_ids: Sequence[str] = (), stats: dict[str, Any] | None = None
    ) -> str: ...

    async def engines_lost(self, engine_ids: Sequence[str]) -> int: ...

    async def engine_loads(self) -> dict[str, dict[str, float]]: ...

    async def restore(self, report: LedgerReport) -> None: ...

    async def report_metrics(self, source: str, snapshot: dict[str, Any]) -> None: ...


API_METHODS: tuple[str, ...] = tuple(
    name for name in vars(KVServiceAPI) if not name.startswith("_")
)
"""The service's methods, in one list: the actor and its client are built from it."""


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
        store: DurableStore | None = None,
        replay_max_bytes: int = 64 * 2**20,
        session_state_max_bytes: int | None = None,
        running_grace_s: float = 600.0,
        handover_wait_s: float = 5.0,
        turn_lease_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.decider = KVDecider(config)
        # Each session's last turn: bounded in bytes too (a long history is ~8 bytes a
        # token with its text), so the service's memory has a bound the config names.
        self.tokens = SessionTokens(
            max_sessions=max_sessions, ttl_s=config.ttl_s, max_bytes=session_state_max_bytes
        )
        self.prefill = prefill
        self.drain_timeout_s = drain_timeout_s
        self.num_prefill_engines = num_prefill_engines
        self.restore_wait_s = restore_wait_s
        self.clock = clock
        # Owners and replays outlive the service in ``store`` (orchestrator.kv.durable).
        self.store: DurableStore = store if store is not None else MemoryStore()
        # A running turn's mark is written off the turn's path (see ``WriteBehind``).
        self.marks: DurableStore | WriteBehind = (
            WriteBehind(self.store) if isinstance(self.store, RayKVStore) else self.store
        )
        self.replays = TurnReplayBook(
            clock=clock,
            store=self.store,
            max_bytes=replay_max_bytes,
            running_grace_s=running_grace_s,
        )
        self.owners = SessionOwners(idle_ttl_s=config.ttl_s, max_sessions=max_sessions)
        # session id -> when its running turn was claimed (one turn per session at once;
        # a claim older than running_grace_s is stale: its ingress is gone).
        # The marks are written through to the store, so a restarted service still
        # refuses a second turn of a session whose turn its ingress is running.
        self.running_grace_s = running_grace_s
        self.wall_clock = wall_clock
        self._running: dict[str, float] = {}
        # Turns held for the ingress replica that ran a session's last turn
        # (``orchestrator.kv.turn_leases``); the lease's margin is the handover wait.
        self.leases = LeaseBook(lasts_s=turn_lease_s, grace_s=handover_wait_s, clock=clock)
        # Running marks a previous instance left for its unused turn leases (their
        # lessee gives them back, uses them, or disowns them as the new instance's).
        self._restored_leases = RestoredLeases()
        self._restore_running()
        self._adopt_owners()
        # A turn hands itself over (``turn_done``) after its client has its last token:
        # the session's next ``begin_turn`` waits this long for it before refusing.
        self.handover_wait_s = handover_wait_s
        self._ended: dict[str, asyncio.Event] = {}
        # The latest counters of every engine (from its heartbeat) and every ingress
        # replica (``report_metrics``): /kvtide/stats sums them.
        self._engine_stats: dict[str, dict[str, Any]] = {}
        self._metrics_by_source: dict[str, tuple[float, dict[str, Any]]] = {}
        self.epoch = uuid.uuid4().hex
        self.started_s = clock()
        self._drains: set[asyncio.Task[None]] = set()
        self._kept_reports: dict[str, list[KeptBlocks]] = {}
        self._ledger_pages: dict[str, list[LedgerReport]] = {}
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

    async def claim_session(self, session_id: str, principal: Principal) -> Claim:
        """Make ``principal`` the session's owner and mark its turn running, just before
        the turn runs (see ``Claim``). Sessions whose ownership ended are closed first,
        so no key inherits another's KV or tokens. The turn must end with ``turn_done``
        or ``turn_abandoned``, which clear the mark."""
        now = self.clock()
        started = self._running.get(session_id)
        if started is not None and now - started < self.running_grace_s:
            if self.owners.owner(session_id, now) not in (None, principal.name):
                return Claim(outcome="not_found")
            return Claim(
                outcome="turn_in_progress",
                message=f"session {session_id!r} already has a turn running; send the next "
                "turn after it has finished",
            )
        was_owner = self.owners.owner(session_id, now)
        try:
            ended = self.owners.claim(session_id, principal, now)
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
            self.marks.delete(OWNER_PREFIX + sid)  # the owners book has forgotten it
            await self.close(sid)
        self._set_running(session_id, now)
        if not principal.is_anonymous and was_owner != principal.name:
            # Written before the answer (behind the writes queued before it, so that a
            # queued delete of an earlier owner cannot land after it).
            self._write_owner(session_id, principal.name, now)
            if isinstance(self.marks, WriteBehind):
                await self.marks.flush()
        return Claim(outcome="claimed")

    def _write_owner(self, session_id: str, key_name: str, now: float) -> None:
        expires_wall_s = self.wall_clock() + self.owners.idle_ttl_s
        self.marks.put(OWNER_PREFIX + session_id, owner_entry(key_name, expires_wall_s))

    def _touch_owner(self, session_id: str, key_name: str | None, now: float) -> None:
        """Restart the owner's idle clock, here and in its durable entry."""
        if key_name is not None and self.owners.owner(session_id, now) == key_name:
            self.owners.touch(session_id, Principal(name=key_name), now)
            self._write_owner(session_id, key_name, now)

    def _adopt_owners(self) -> None:
        """The owners a previous instance left, each until the expiry its entry carries
        (one already past is deleted: no restart resurrects an expired owner; a session
        with a turn running keeps its owner until the turn ends)."""
        now, wall, ttl = self.clock(), self.wall_clock(), self.owners.idle_ttl_s
        for sid, raw in entries(self.store, OWNER_PREFIX):
            name, expires_wall_s = read_owner(raw)
            left_s = ttl if expires_wall_s is None else min(expires_wall_s - wall, ttl)
            if left_s <= 0 and sid not in self._running:
                self.store.delete(OWNER_PREFIX + sid)
                continue
            self.owners.adopt(sid, name, now, expires_s=now + max(left_s, 0.0))

    def _set_running(self, session_id: str, now: float, grant: Grant | None = None) -> None:
        self._running[session_id] = now
        mark = (
            running_mark(self.wall_clock())
            if grant is None
            else running_mark(self.wall_clock(), grant.lease_id, grant.holder)
        )
        self.marks.put(RUNNING_PREFIX + session_id, mark)

    def _clear_running(self, session_id: str) -> None:
        if self._running.pop(session_id, None) is not None:
            self.marks.delete(RUNNING_PREFIX + session_id)
        ended = self._ended.pop(session_id, None)
        if ended is not None:
            ended.set()

    async def _after_running_turn(self, session_id: str) -> None:
        """Wait (``handover_wait_s`` at most) for the session's running turn to end: its
        client may send the next turn before the finished one's ``turn_done`` lands."""
        if session_id not in self._running or self.handover_wait_s <= 0:
            return
        ended = self._ended.setdefault(session_id, asyncio.Event())
        try:
            await asyncio.wait_for(ended.wait(), self.handover_wait_s)
        except TimeoutError:
            pass  # still running: claim_session refuses the turn

    def _restore_running(self) -> None:
        """The running marks a previous instance left (its turns' ingresses may still
        finish them), each at its age; marks past ``running_grace_s`` are dropped. An
        unused lease's mark ends on its lessee's evidence (``RestoredLeases``)."""
        now, wall = self.clock(), self.wall_clock()
        lapse_s = self.leases.lasts_s + self.leases.grace_s
        for sid, raw in entries(self.store, RUNNING_PREFIX):
            mark = read_running(raw)
            age = self.running_grace_s if mark is None else wall - mark.claimed_wall_s
            if mark is None or not 0 <= age < self.running_grace_s:
                self.store.delete(RUNNING_PREFIX + sid)
                continue
            self._running[sid] = now - age
            if mark.lease_id is not None:
                self._restored_leases.add(mark.lease_id, sid, mark.holder, now - age + lapse_s)

    async def decide_turn(self, session_id: str, prompt_token_ids: list[int]) -> KVDecision:
        return self.decider.decide_turn(session_id, prompt_token_ids, self.clock())

    async def begin_turn(
        self,
        session_id: str,
        principal: Principal,
        prompt_token_ids: list[int],
        prefix_digest: int | None = None,
        prefix_len: int = 0,
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
        turn held for an ingress replica (a turn lease), which is revoked first."""
        grant = self.leases.grants.get(session_id)
        if grant is not None and not grant.used:
            # Another key learns nothing and revokes nothing.
            if not await self.session_owned(session_id, principal):
                return Claim(outcome="not_found")
            await self._give_back(session_id)  # a silent lessee's lease lapses now
        await self._after_running_turn(session_id)
        now = self.clock()
        if prefix_digest is not None and prefix_digest != self.tokens.last_digest(session_id, now):
            if not await self.session_owned(session_id, principal):
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
        claim = await self.claim_session(session_id, principal)
        if claim.outcome != "claimed":
            return claim
        decision = self.decider.decide_turn(session_id, prompt_token_ids, now)
        return msgspec.structs.replace(claim, decision=decision)

    async def pull_failed(self, session_id: str) -> None:
        self._apply(self.decider.pull_failed(session_id, self.clock()))

    def whole(self, done: TurnDone) -> TurnDone | None:
        """``done`` with what its sender left out put back (``TurnDone``): the session's
        last turn in front of its ids, its next ids cut from them. None when the last
        turn here is not the one it names (by digest): the sender sends it whole."""
        if done.prefix_len == 0 and done.next_len is None:
            return done
        ids = done.token_ids
        if done.prefix_len:
            sid = done.session_id
            last = None if sid is None else self.tokens.token_ids(sid)
            if (
                sid is None
                or last is None
                or len(last) != done.prefix_len
                or self.tokens.digest(sid) != done.prefix_digest
            ):
                return None
            ids = [*last, *ids]
        nxt = done.next_token_ids if done.next_len is None else ids[: done.next_len]
        return msgspec.structs.replace(
            done, token_ids=ids, next_token_ids=nxt, prefix_len=0, prefix_digest=None, next_len=None
        )

    async def turn_done(self, done: TurnDone) -> Handover:
        """Book the kept blocks and the session's tokens together (one step: a record is
        never booked without the tokens that drain it). Not accepted (nothing done) when
        the turn names a last turn this service does not hold: send it whole. With
        ``done.holder``, the session's next turn is held for that ingress replica (the
        answer's lease) when its lease watch runs."""
        whole = self.whole(done)
        if whole is None:
            return Handover(accepted=False)
        done = whole
        now = self.clock()
        sid = done.session_id
        if sid is None:
            # Nobody will pull these blocks back: free them now, not at the TTL.
            self._drain(done.kv_transfer_params, done.token_ids)
            return Handover(accepted=True)
        self.leases.grants.pop(sid, None)  # a turn under a lease ends the lease
        self._clear_running(sid)
        self._touch_owner(sid, done.owner, now)
        # The record this turn supersedes covers the *previous* tokens: drain it with
        # those (a rewritten history does not start with them).
        previous = self.tokens.token_ids(sid)
        if done.next_token_ids is None:
            self.tokens.forget(sid)
        else:
            self.tokens.remember(sid, done.next_text, done.next_token_ids, now)
        expiry = None if done.kv_expires_in_s is None else now + done.kv_expires_in_s
        self._apply(
            self.decider.turn_finished(
                sid, done.token_ids, done.kv_transfer_params, now, expiry_s=expiry
            ),
            candidates=(previous, done.token_ids),
        )
        return Handover(accepted=True, lease=self._grant(sid, done.holder, now))

    # ---- turn leases (orchestrator.kv.turn_leases) -----------------------------------

    def _grant(self, session_id: str, holder: str | None, now: float) -> TurnLease | None:
        """Hold the session's next turn for ``holder``: claimed (a running mark) and
        held in the books until it runs there, is given back, or lapses."""
        leases = self.leases
        if holder is None or leases.lasts_s <= 0 or not leases.watching(holder, now):
            return None
        digest = self.tokens.last_digest(session_id, now)
        if digest is None or session_id in self._running:
            return None  # nothing to check a next turn's tokens against
        lifecycle = self.decider.lifecycle
        record = lifecycle.hold(session_id, now)
        grant = leases.grant(session_id, holder, record, now)
        self._set_running(session_id, now, grant)
        leased = None
        if record is not None:
            margin = lifecycle.config.safety_margin_s + leases.grace_s
            not_worth = worth_pulling(record, lifecycle.config)
            leased = LeasedRecord(
                kv_transfer_params=params_of(record),
                num_tokens=record.num_tokens,
                prefix_hash=record.prefix_hash,
                offer_in_s=record.expiry_s - margin - now,
                not_worth=None if not_worth is None else not_worth.value,
            )
        return TurnLease(
            session_id=session_id,
            lease_id=grant.lease_id,
            epoch=self.epoch,
            lasts_s=leases.lasts_s,
            owner=self.owners.owner(session_id, now),
            digest=digest,
            record=leased,
        )

    def _end_grant(self, grant: Grant) -> None:
        """Give a lease's turn back unused: the session is idle and free again."""
        if self.leases.grants.get(grant.session_id) is grant:
            del self.leases.grants[grant.session_id]
            self._apply(self.decider.lifecycle.unhold(grant.session_id, self.clock()))
            self._clear_running(grant.session_id)

    async def lease_used(self, session_id: str, lease_id: int, reason: str | None) -> bool:
        """The lessee runs the held turn: it pulls the leased record (``reason`` None) or
        recomputes for ``reason``. False when the lease is no longer held (revoked and
        given back, lapsed, or granted by an instance before a restart): the lessee ends
        the turn before its client sees it and asks again with ``begin_turn``."""
        now = self.clock()
        grant = self.leases.find(session_id, lease_id)
        if grant is None or grant.used:
            restored = self._restored_leases.pop(lease_id)
            if restored is not None:  # the previous instance's: free its running mark
                self._clear_running(restored)
            return False
        why = None if reason is None else RecomputeReason(reason)
        if not self.decider.lifecycle.use_held(
            session_id, record=grant.record, reason=why, now_s=now
        ):
            self._end_grant(grant)
            return False
        grant.used = True
        # The turn's grace counts from now; its mark no longer names an unused lease.
        self._set_running(session_id, now)
        self._touch_owner(session_id, self.owners.owner(session_id, now), now)
        return True

    async def lease_watch(
        self, holder: str, released: list[int], wait_s: float, held: list[int] | None = None
    ) -> LeaseWatch:
        """A lessee's standing call: take back the unused leases it gives back
        (``released``), then wait up to ``wait_s`` for leases to revoke from it.
        ``held``: every lease it still holds, used or not (None: not said): a previous
        instance's lease of this holder not among them is over, and its mark cleared."""
        for lease_id in released:
            restored = self._restored_leases.pop(lease_id)
            if restored is not None:
                self._clear_running(restored)
        if held is not None:
            for sid in self._restored_leases.vouched(holder, held):
                self._clear_running(sid)
        wanted = set(released)
        for grant in [g for g in self.leases.grants.values() if g.lease_id in wanted]:
            if grant.holder == holder and not grant.used:
                self._end_grant(grant)
        revoked = await self.leases.watch(holder, wait_s)
        return LeaseWatch(epoch=self.epoch, revoked=revoked)

    async def _give_back(self, session_id: str) -> None:
        """Revoke an unused lease on the session and wait (``handover_wait_s``) for its
        lessee to give it back; one still unused then lapses now."""
        grant = self.leases.grants.get(session_id)
        if grant is None or grant.used:
            return
        self.leases.revoke(grant)
        await self._after_running_turn(session_id)
        grant = self.leases.grants.get(session_id)
        if grant is not None and not grant.used:
            self._end_grant(grant)

    async def turn_abandoned(self, session_id: str | None) -> None:
        if session_id is not None:
            self.leases.grants.pop(session_id, None)
            self._clear_running(session_id)
            self._apply(self.decider.abandon(session_id, self.clock()))

    # ---- idempotent turns (shared by every ingress replica) --------------------------

    async def replay_begin(self, key: str, fingerprints: Sequence[str] = ()) -> Replay:
        return self.replays.begin(key, fingerprints)

    async def replay_complete(self, key: str, body: dict[str, Any]) -> None:
        self.replays.complete(key, body)

    async def replay_fail(self, key: str) -> None:
        self.replays.fail(key)

    # ---- sessions ---------------------------------------------------------------------

    async def session(self, session_id: str) -> SessionInfo:
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

    async def renew(self, session_id: str, principal: Principal | None = None) -> SessionInfo:
        """Extend the session's lease (SDK heartbeat) and its owner's idle clock;
        ``known`` False if it is gone."""
        now = self.clock()
        self.decider.lifecycle.renew(session_id, now)
        if principal is not None:
            self._touch_owner(session_id, principal.name, now)
        return await self.session(session_id)

    async def close(self, session_id: str) -> bool:
        """End a session: its kept KV is drained back to prefill (freed on decode now).
        A turn held for an ingress replica is given back first."""
        await self._give_back(session_id)
        known = self.decider.lifecycle.lease_expiry(session_id) is not None
        self._apply(self.decider.close(session_id, self.clock()))
        self.tokens.forget(session_id)
        if self.owners.owner(session_id, self.clock()) is not None:
            self.marks.delete(OWNER_PREFIX + session_id)
        self.owners.forget(session_id)
        return known

    async def tick(self) -> None:
        now = self.clock()
        stale = [s for s, t in self._running.items() if now - t >= self.running_grace_s]
        for sid in stale:
            self.leases.grants.pop(sid, None)
            self._clear_running(sid)
        for grant in self.leases.lapsed(now):  # their lessee went silent
            self._end_grant(grant)
        for sid in self._restored_leases.lapsed(now):  # nobody vouched for them
            self._clear_running(sid)
        self.leases.forget_silent(now)
        for sid in self.owners.expire(now, keep=self._running):
            self.marks.delete(OWNER_PREFIX + sid)
            await self.close(sid)
        self._apply(self.decider.tick(now))
        silent = [e for e, (_, seen) in self._engines.items() if now - seen > self.engine_silence_s]
        if silent:
            self._lose_engines(silent)
        self._maybe_adopt()

    # ---- engine liveness -------------------------------------------------------------

    async def heartbeat(
        self, engine_id: str, node_ids: Sequence[str] = (), stats: dict[str, Any] | None = None
    ) -> str:
        """An engine host is alive (it calls this every second) with its shards on
        ``node_ids`` and its engine's counters ``stats``; returns the epoch."""
        self._engines[engine_id] = (tuple(node_ids), self.clock())
        if stats is not None:
            self._engine_stats[engine_id] = stats
        return self.epoch

    async def engines_lost(self, engine_ids: Sequence[str]) -> int:
        return self._lose_engines(engine_ids)

    async def engine_loads(self) -> dict[str, dict[str, float]]:
        """Each live engine's load as its last heartbeat reported it (requests running
        and waiting, KV cache use, requests finished) and ``age_s``, how long ago: what
        the ingress replicas' admission control reads every second
        (``policies.admission``)."""
        now = self.clock()
        loads: dict[str, dict[str, float]] = {}
        for engine_id, stats in self._engine_stats.items():
            seen = self._engines.get(engine_id)
            if seen is None:
                continue
            loads[engine_id] = {
                "num_running": stats.get("num_running", 0),
                "num_waiting": stats.get("num_waiting", 0),
                "kv_cache_usage": stats.get("kv_cache_usage", 0.0),
                "num_requests": stats.get("num_requests", 0),
                "age_s": max(0.0, now - seen[1]),
            }
        return loads

    async def report_metrics(self, source: str, snapshot: dict[str, Any]) -> None:
        """An ingress replica's metric book (sent every second): stats sum them all."""
        self._metrics_by_source[source] = (self.clock(), snapshot)

    def _lose_engines(self, engine_ids: Sequence[str]) -> int:
        """Engines that died (their node was lost, or they went silent for
        ``engine_silence_s``): their KV is gone, so no session's next turn is decided
        to read it; those turns recompute at once instead of waiting on a pull.
        Returns the sessions whose KV was dropped."""
        now = self.clock()
        dropped = 0
        for engine_id in engine_ids:
            self._engines.pop(engine_id, None)
            self._engine_stats.pop(engine_id, None)
            effects = self.decider.lifecycle.on_engine_lost(engine_id, now)
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
            self._lose_engines(lost)
        return lost

    def engines_by_decode_path(self) -> dict[str, dict[str, int]]:
        """Per pool, how many live engines run each decode path (from their heartbeats)."""
        by_pool: dict[str, list[dict[str, Any]]] = {}
        for engine_id, stats in self._engine_stats.items():
            by_pool.setdefault(engine_pool(engine_id), []).append(stats)
        return {pool: count_decode_paths(books) for pool, books in sorted(by_pool.items())}

    def engine_nodes(self) -> dict[str, tuple[str, ...]]:
        """The nodes of each live engine's shards, as its host reported them."""
        return {e: nodes for e, (nodes, _) in self._engines.items()}

    async def stats(self) -> dict[str, Any]:
        lifecycle = self.decider.lifecycle
        engines = sorted({r.engine_id for r in lifecycle.records()})
        return {
            **self.decider.stats(),
            "bytes_held": {e: lifecycle.bytes_held(e) for e in engines},
            "num_drains": self.counters["drains"],
            "num_drain_failures": self.counters["drain_failures"],
            "num_drains_running": len(self._drains),
            "num_undrainable": self.counters["undrainable"],
            # A turn held for an ingress replica is not running until it is used.
            "num_turns_running": len(self._running) - self.leases.num_unused(),
            "num_turns_leased": self.leases.num_unused(),
            "replay_bytes": self.replays.num_bytes,
            "num_replay_duplicates": self.replays.num_duplicates,
            "engines": dict(sorted(self._engine_stats.items())),
            "ingress_metrics": merge_counters(self.recent_metrics()),
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

    def recent_metrics(self) -> list[dict[str, Any]]:
        """The ingress replicas' metric books reported within the engine silence window
        (a replica gone longer is dropped)."""
        now = self.clock()
        for source, (seen, _) in list(self._metrics_by_source.items()):
            if now - seen > self.engine_silence_s:
                del self._metrics_by_source[source]
        return [snapshot for _, snapshot in self._metrics_by_source.values()]

    # ---- restart recovery --------------------------------------------------------------

    async def restore(self, report: LedgerReport) -> None:
        """An engine host's ledger, sent after it saw a new ``epoch``, in pages
        (``LedgerReport.pages``): applied when its last page has come."""
        pending = self._ledger_pages.setdefault(report.engine_id, [])
        if report.page == 0:
            pending.clear()  # a host that started over
        elif len(pending) != report.page:
            log.warning("ledger page %d of %s out of order", report.page, report.engine_id)
            return  # the host sees no new epoch acknowledged and sends it all again
        pending.append(report)
        if not report.last:
            return
        del self._ledger_pages[report.engine_id]
        self.counters["restores"] += 1
        kept = [k for page in pending for k in page.kept]
        if report.role == "prefill":
            self._prefill_reporters.add(report.engine_id)
            self._consumed.update((e, r) for page in pending for e, r in page.consumed)
        if kept:
            self._kept_reports[report.engine_id] = kept
        self._maybe_adopt()

    def _maybe_adopt(self) -> None:
        if not self._kept_reports:
            return
        waited = self.clock() - self.started_s >= self.restore_wait_s
        if len(self._prefill_reporters) < self.num_prefill_engines and not waited:
            return  # a read we have not heard of yet would make us book freed blocks
        now = self.clock()
        lifecycle = self.decider.lifecycle
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
            self._apply(effects, candidates=(k.token_ids,))

    # ---- effects -------------------------------------------------------------------

    def _apply(
        self, effects: Sequence[Effect], candidates: Sequence[Sequence[int] | None] = ()
    ) -> None:
        """Drain records nobody will reuse, with the tokens they hold: the first of
        ``candidates`` (then the session's current tokens) that starts with the record's
        covered tokens. A record no known tokens match stays until its TTL (counted as
        undrainable). A record gone from under an unused turn lease revokes the lease:
        its next turn asks ``begin_turn`` instead of reading KV that is no longer there."""
        for effect in effects:
            grant = self.leases.grants.get(effect.record.session_id)
            if grant is not None and not grant.used and grant.record == effect.record:
                self.leases.revoke(grant)
            if not effect.drainable:
                continue  # expiring anyway: the engine frees the blocks at its TTL
            record = effect.record
            options = (*candidates, self.tokens.token_ids(record.session_id))
            ids = next(
                (
                    c
                    for c in options
                    if c is not None
                    and len(c) > record.num_tokens
                    and prefix_hash(c, record.num_tokens) == record.prefix_hash
                ),
                None,
            )
            if ids is None:
                self.counters["undrainable"] += 1
                continue
            self._drain(params_of(record), ids[: record.num_tokens + 1])

    def _drain(self, params: KVTransferParams | None, token_ids: Sequence[int]) -> None:
        """Free a decode engine's kept blocks by reading them into a prefill engine."""
        if self.prefill is None or params is None or params.kept_blocks() is None:
            return
        task = asyncio.get_running_loop().create_task(self._read_back(params, list(token_ids)))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _read_back(self, params: KVTransferParams, token_ids: list[int]) -> None:
        assert self.prefill is not None
        req = GenerateRequest(
            request_id=f"drain-{uuid.uuid4().hex}",
            prompt_token_ids=token_ids,
            max_tokens=1,
            # Nobody decodes after a drain: the prefill frees its copy at once.
            kv_transfer_params=params.pull_back(keep=False),
        )
        try:
            await asyncio.wait_for(final_chunk(self.prefill.generate(req)), self.drain_timeout_s)
            self.counters["drains"] += 1
        except Exception as exc:
            self.counters["drain_failures"] += 1
            log.warning("drain of %s failed: %s", params.remote_request_id, exc)

    async def wait_drains(self) -> None:
        """Wait for the drains in flight (tests and shutdown)."""
        while self._drains:
            await asyncio.gather(*list(self._drains), return_exceptions=True)
