"""Replay a multi-turn workload through the KV lifecycle policy on a virtual clock.

`simulate(trace, config)` drives one `KVLifecycle` as the orchestrator does:
``on_turn_start`` when a turn's prefill begins, ``on_turn_finished`` when its decode
ends (with the tokens the decode engine's blocks cover), ``on_tick`` on a ``tick_s``
grid, and drains the records the router would drain. The clock is the simulation's
own: nothing reads the wall clock or sleeps, so a run is a pure function of the trace
and the config. `SimConfig` and `SimResult` live in `policies.kv_sim_types`, the
memory meters in `policies.kv_sim_memory`.

What it models, per turn of a session:

- the prompt is the conversation so far (synthetic token ids, unique within the
  session, so prefix hashes extend turn over turn) plus the turn's new tokens; a turn
  that rewrites history replaces every id after the first prompt with fresh ones;
- the prefill takes ``prompt / prefill_tokens_per_s``, or, when the policy says pull,
  the policy's transfer estimate plus the tokens after the record at the same rate;
- the decode takes ``output_tokens / decode_tokens_per_s`` on the session's decode
  engine (sessions are spread round-robin over ``num_decode_engines``, and stay);
- the decode engine keeps KV for prompt + output minus the last token (its KV is
  computed when it is fed back), expiring ``ttl_s`` after the turn ends. The report
  carries one block id per record: the policy only compares them, and books bytes
  from the token count;
- drainable effects (budget evictions, superseded, closed or lease-expired records)
  are drained as the router does, at once, when the session's tokens still start with
  the record's (not after a rewrite): the read frees the blocks on the decode engine.

Memory is measured two ways, per engine, summed over its GPUs: *held*, what the
policy books (records it may still offer, and records a pull is reading; the idle
budget bounds the idle part), and *pinned*, what the engine itself keeps: every
finished turn's blocks until a read of them (a pull or a drain) or their expiry.
Neither counts the KV of sequences being decoded. TTFT saved is, summed over pulls,
the policy's recompute estimate minus its transfer estimate.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from policies.kv_cost import estimate_cost
from policies.kv_lifecycle import Effect, KVLifecycle, TurnAction
from policies.kv_sim_memory import EngineMemory
from policies.kv_sim_types import SimConfig, SimResult
from policies.kv_workload import TraceTurn

__all__ = ["SimConfig", "SimResult", "simulate"]

_FINISH, _ARRIVE = 0, 1  # at equal times a turn finishes before the next one starts


def simulate(trace: Sequence[TraceTurn], config: SimConfig) -> SimResult:
    """Replay ``trace`` through a fresh policy; the same trace and config give the same result.

    Turns run in ``t_s`` order (a session's turns with equal ``t_s`` in trace order).
    """
    return _Replay(trace, config).run()


@dataclass(slots=True)
class _Session:
    session_id: str
    engine_id: str
    turns_left: int
    tokens: list[int] = field(default_factory=list)
    next_id: int = 1
    first_prompt_tokens: int = 0
    history_version: int = 0
    """Bumped when the client rewrites history: older records no longer match."""
    num_finished: int = 0
    deadlines: tuple[float, ...] = ()
    """What the policy times from the latest finished turn, earliest first."""
    busy: bool = False
    waiting: deque[TraceTurn] = field(default_factory=deque)

    def fresh_ids(self, num_tokens: int) -> range:
        # Ids need only be unique within the session: records are matched per session.
        # Small ids keep the policy's prefix hash fast (one-digit ints pack quicker).
        start = self.next_id
        self.next_id += num_tokens
        return range(start, start + num_tokens)


class _Replay:
    """One run: the policy, the sessions, the event heap and the meters."""

    def __init__(self, trace: Sequence[TraceTurn], config: SimConfig) -> None:
        self._config = config
        self._policy = config.policy_in_units  # all token counts below are in units
        self._unit = config.token_unit
        self._kv = KVLifecycle(self._policy)
        self._trace = trace
        self._engines = [f"decode-{i}" for i in range(config.num_decode_engines)]
        self._sessions: dict[str, _Session] = {}
        for turn in trace:
            session = self._sessions.get(turn.session_id)
            if session is None:
                index = len(self._sessions)
                session = _Session(
                    session_id=turn.session_id,
                    engine_id=self._engines[index % len(self._engines)],
                    turns_left=0,
                )
                self._sessions[turn.session_id] = session
            session.turns_left += 1
        self._events: list[tuple[float, int, int, str, int]] = []  # (t, kind, seq, id, payload)
        self._seq = 0
        self._next_block = dict.fromkeys(self._engines, 0)
        self._memory = EngineMemory(self._engines, config.measure_window_s)
        # When the policy may have something due: (deadline, finish number, session,
        # index in its deadlines). One live entry per session: its next deadline.
        self._wakes: list[tuple[float, int, str, int]] = []
        self._last_tick_s = -math.inf
        self._recompute_s_avoided = self._transfer_s = self._drain_s = 0.0
        self._num_drains = self._num_undrainable = 0

    def run(self) -> SimResult:
        for index, turn in enumerate(self._trace):
            self._push(turn.t_s, _ARRIVE, turn.session_id, index)
        now = 0.0
        while self._events:
            now, kind, _, session_id, payload = heapq.heappop(self._events)
            self._catch_up(now)
            self._memory.advance(now)
            session = self._sessions[session_id]
            if kind == _ARRIVE:
                session.waiting.append(self._trace[payload])
                if not session.busy:
                    self._start(session, now)
            else:
                self._finish(session, payload, now)
                if session.waiting:
                    self._start(session, now)
        self._memory.advance(now)
        return self._result(now)

    # -- turns ------------------------------------------------------------------------

    def _start(self, session: _Session, now: float) -> None:
        turn = session.waiting.popleft()
        session.busy = True
        tokens = session.tokens
        if turn.rewrite_history and session.first_prompt_tokens:
            kept = session.first_prompt_tokens
            tokens[kept:] = session.fresh_ids(len(tokens) - kept)
            session.history_version += 1
        tokens.extend(session.fresh_ids(-(-turn.new_prompt_tokens // self._unit)))
        if not session.first_prompt_tokens:
            session.first_prompt_tokens = len(tokens)
        decision = self._kv.on_turn_start(session.session_id, tokens, now)
        rate = self._policy.prefill_tokens_per_s
        prefill_s = len(tokens) / rate
        if decision.action is TurnAction.PULL_FROM_DECODE:
            record = decision.record
            assert record is not None
            transfer_s = decision.estimated_transfer_s
            self._recompute_s_avoided += decision.estimated_recompute_s
            self._transfer_s += transfer_s
            prefill_s = transfer_s + (len(tokens) - decision.num_reusable_tokens) / rate
            # The read completes during the prefill, and the engine frees the blocks.
            self._memory.unpin((record.engine_id, record.block_ids[0]))
        decode_s = turn.output_tokens / self._config.decode_tokens_per_s
        self._push(now + prefill_s + decode_s, _FINISH, session.session_id, turn.output_tokens)

    def _finish(self, session: _Session, output_tokens: int, now: float) -> None:
        tokens = session.tokens
        tokens.extend(session.fresh_ids(-(-output_tokens // self._unit)))
        # The last output token's KV is computed next turn. In units of u > 1 tokens,
        # the unit holding it is covered: ceil((u * len - 1) / u) units.
        covered = len(tokens) - 1 if self._unit == 1 else len(tokens)
        engine_id = session.engine_id
        num_blocks = -(-covered // self._policy.block_size_tokens)
        first_block = self._next_block[engine_id]
        self._next_block[engine_id] = first_block + num_blocks
        expiry_s = now + self._policy.ttl_s
        # Pinned before the call: the budget may evict the new record at once.
        self._memory.pin(
            (engine_id, first_block),
            num_bytes=self._bytes(covered),
            expiry_s=expiry_s,
            session_id=session.session_id,
            history_version=session.history_version,
        )
        effects = self._kv.on_turn_finished(
            session.session_id,
            engine_id=engine_id,
            token_ids_covered=tokens if covered == len(tokens) else tokens[:covered],
            block_ids=(first_block,),  # the policy only compares them: one id per record
            transfer_params={"remote_engine_id": engine_id, "remote_num_tokens": covered},
            expiry_s=expiry_s,
            now_s=now,
        )
        self._apply(effects)
        session.num_finished += 1
        policy = self._policy
        # Offer deadline, engine expiry (a pull in flight then), lease.
        session.deadlines = tuple(
            sorted({expiry_s - policy.safety_margin_s, expiry_s, now + policy.lease_ttl_s})
        )
        heapq.heappush(
            self._wakes, (session.deadlines[0], session.num_finished, session.session_id, 0)
        )
        session.busy = False
        session.turns_left -= 1
        if session.turns_left == 0:
            session.tokens = []  # nothing will read them again
        self._refresh(engine_id)  # the only engine whose books this call changed

    def _catch_up(self, now: float) -> None:
        """Run, in time order up to ``now``, the ticks that have something due and the
        engines' own expiries.

        Ticks keep to the ``tick_s`` grid, but one with nothing due is skipped: it
        would change nothing. Everything the policy times comes from a finished turn
        (offer deadline, engine expiry for a pull in flight, lease), so a tick is due
        at the first grid time at or after one of those of a session's latest finished
        turn; a later finish replaced the earlier ones.
        """
        tick_s, wakes, memory, sessions = (
            self._config.tick_s,
            self._wakes,
            self._memory,
            self._sessions,
        )
        if (not wakes or wakes[0][0] > now) and memory.next_expiry_s > now:
            return  # the common case: nothing is due before this event
        while True:
            while wakes and sessions[wakes[0][2]].num_finished != wakes[0][1]:
                heapq.heappop(wakes)  # superseded by a later finish of the session
            tick_at = math.ceil(wakes[0][0] / tick_s) * tick_s if wakes else math.inf
            tick_at = max(tick_at, self._last_tick_s + tick_s)  # whole ticks, in order
            pin_at = memory.next_expiry_s
            if min(tick_at, pin_at) > now:
                return
            if pin_at < tick_at:  # the engine frees the blocks at their exact expiry
                memory.expire_next()
                continue
            memory.advance(tick_at)
            self._last_tick_s = tick_at
            while wakes and wakes[0][0] <= tick_at:
                _, finished, session_id, index = heapq.heappop(wakes)
                session = sessions[session_id]
                if finished == session.num_finished and index + 1 < len(session.deadlines):
                    next_s = session.deadlines[index + 1]
                    heapq.heappush(wakes, (next_s, finished, session_id, index + 1))
            effects = self._kv.on_tick(tick_at)
            if effects:  # effects only ever lower the books
                self._apply(effects)
                for engine_id in self._engines:
                    self._refresh(engine_id)

    # -- bookkeeping ------------------------------------------------------------------

    def _push(self, at_s: float, kind: int, session_id: str, payload: int) -> None:
        """Queue an event; ``payload``: the trace index (arrival), output tokens (finish)."""
        self._seq += 1
        heapq.heappush(self._events, (at_s, kind, self._seq, session_id, payload))

    def _bytes(self, num_tokens: int) -> int:
        policy = self._policy
        blocks = -(-num_tokens // policy.block_size_tokens)
        return (
            blocks * policy.block_size_tokens * policy.kv_bytes_per_token
            + policy.linear_state_bytes_per_sequence
        )

    def _apply(self, effects: Sequence[Effect]) -> None:
        """Drain what the router drains: drainable records whose tokens it still has.

        The router reads such blocks into a prefill engine (a pull whose output it
        discards), which frees them on the decode engine, if the session's tokens
        still start with the record's: not after a rewrite of history.
        """
        if not self._config.drain:
            return
        for effect in effects:
            if not effect.drainable:
                continue
            record = effect.record
            key = (record.engine_id, record.block_ids[0])
            owner = self._memory.owner(key)
            if owner is None:
                continue  # read or expired already
            session_id, version = owner
            if self._sessions[session_id].history_version != version:
                self._num_undrainable += 1
                continue
            self._num_drains += 1
            self._drain_s += estimate_cost(
                num_tokens=record.num_tokens, num_bytes=record.bytes_held, config=self._policy
            ).transfer_s
            self._memory.unpin(key)

    def _refresh(self, engine_id: str) -> None:
        """Take the engine's books after a call that may have changed them."""
        kv = self._kv
        self._memory.take_books(
            engine_id, held_bytes=kv.bytes_held(engine_id), idle_bytes=kv.idle_bytes(engine_id)
        )

    def _result(self, end_s: float) -> SimResult:
        memory = self._memory
        mean_held, mean_pinned = memory.means(end_s)
        stats = self._kv.stats()
        return SimResult(
            num_sessions=len(self._sessions),
            num_turns=len(self._trace),
            num_pulls=stats.num_pulls,
            recomputes_by_reason=stats.recomputes_by_reason,
            num_expiries=stats.num_expiries,
            num_evictions=stats.num_evictions,
            num_releases=stats.num_releases,
            mean_held_bytes_per_engine=mean_held,
            peak_held_bytes_per_engine=memory.peak_held,
            peak_idle_bytes_per_engine=memory.peak_idle,
            mean_pinned_bytes_per_engine=mean_pinned,
            peak_pinned_bytes_per_engine=memory.peak_pinned,
            recompute_s_avoided=self._recompute_s_avoided,
            transfer_s=self._transfer_s,
            num_drains=self._num_drains,
            num_undrainable=self._num_undrainable,
            drain_s=self._drain_s,
            end_s=end_s,
        )
