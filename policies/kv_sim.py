"""Replay a multi-turn workload through the KV lifecycle policy on a virtual clock.

`simulate(trace, config)` drives one `KVLifecycle` exactly as the orchestrator does:
``on_turn_start`` when a turn's prefill begins, ``on_turn_finished`` when its decode
ends (with the tokens the decode engine's blocks cover), ``on_tick`` every ``tick_s``.
The clock is the simulation's own: nothing reads the wall clock or sleeps, so a run is
a pure function of the trace and the config.

What it models, per turn of a session:

- the prompt is the conversation so far (synthetic token ids, unique per session, so
  prefix hashes extend turn over turn) plus the turn's new tokens; a turn that
  rewrites history replaces every id after the first prompt with fresh ones;
- the prefill takes ``prompt / prefill_tokens_per_s``, or, when the policy says pull,
  the policy's transfer estimate plus the tokens after the record at the same rate;
- the decode takes ``output_tokens / decode_tokens_per_s`` on the session's decode
  engine (sessions are spread round-robin over ``num_decode_engines``, and stay);
- the decode engine keeps KV for prompt + output minus the last token (its KV is
  computed when it is fed back), expiring ``ttl_s`` after the turn ends.

Memory is measured two ways, per engine, summed over its GPUs:

- *held*: what the policy books (``bytes_held``): records it may still offer, and
  records a pull is reading. The idle budget bounds the idle part of it;
- *pinned*: what the engine itself keeps under vLLM 0.32's rules: every finished
  turn's blocks until a read of them completes or ``expiry_s``, whether or not the
  policy still books them (superseded, evicted or released records are not drained).

Neither counts the KV of sequences being decoded. TTFT saved is, summed over pulls,
the policy's recompute estimate minus its transfer estimate.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from policies.kv_lifecycle import KVLifecycle, KVLifecycleConfig, RecomputeReason, TurnAction
from policies.kv_workload import TraceTurn

__all__ = ["SimConfig", "SimResult", "simulate"]

_FINISH, _ARRIVE = 0, 1  # at equal times a turn finishes before the next one starts


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """The policy under test and the cluster it runs on.

    The policy config carries the cost inputs (``prefill_tokens_per_s``,
    ``link_bandwidth_gbps``, ``kv_bytes_per_token`` per engine, ...): the simulator
    prices turns with the same figures the policy decides with.
    """

    policy: KVLifecycleConfig = field(default_factory=KVLifecycleConfig)
    num_decode_engines: int = 4
    decode_tokens_per_s: float = 40.0
    """Decode speed per user: how long a turn's output takes."""
    tick_s: float = 1.0
    """How often ``on_tick`` runs (the orchestrator ticks about once a second)."""
    token_unit: int = 1
    """Tokens per synthetic token id. 1 replays token by token. A larger unit (a
    divisor of the block size and the threshold) makes the id lists, and so the
    policy's prefix hashes that dominate the run time, that many times shorter: each
    prompt addition and output is rounded up to whole units, and the policy is run on
    `policy_in_units`, which prices and books them as the same tokens and bytes."""
    measure_window_s: tuple[float, float] | None = None
    """Time span the mean memory is taken over; None: the whole run. Leave out the
    warm-up (memory grows for about a TTL) and the drain after the last arrival."""

    def __post_init__(self) -> None:
        if self.num_decode_engines < 1:
            raise ValueError(f"SimConfig.num_decode_engines={self.num_decode_engines}: use >= 1")
        if not (self.decode_tokens_per_s > 0 and self.tick_s > 0):
            raise ValueError("SimConfig: decode_tokens_per_s and tick_s must be > 0")
        unit, policy = self.token_unit, self.policy
        if unit < 1 or policy.block_size_tokens % unit or policy.recompute_threshold_tokens % unit:
            raise ValueError(
                f"SimConfig.token_unit={unit}: use a positive divisor of block_size_tokens "
                f"({policy.block_size_tokens}) and recompute_threshold_tokens "
                f"({policy.recompute_threshold_tokens}), or 1"
            )
        window = self.measure_window_s
        if window is not None and not 0 <= window[0] < window[1]:
            raise ValueError(f"SimConfig.measure_window_s={window}: use (start, end), start < end")

    @property
    def policy_in_units(self) -> KVLifecycleConfig:
        """The policy config with token counts and rates in ``token_unit``s."""
        unit, policy = self.token_unit, self.policy
        if unit == 1:
            return policy
        return replace(
            policy,
            kv_bytes_per_token=policy.kv_bytes_per_token * unit,
            block_size_tokens=policy.block_size_tokens // unit,
            recompute_threshold_tokens=policy.recompute_threshold_tokens // unit,
            prefill_tokens_per_s=policy.prefill_tokens_per_s / unit,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """What one replay measured. Bytes are per decode engine, summed over its GPUs."""

    num_sessions: int
    num_turns: int
    num_pulls: int
    recomputes_by_reason: tuple[tuple[RecomputeReason, int], ...]
    """Every reason with its count, in `RecomputeReason` order."""
    num_expiries: int
    num_evictions: int
    num_releases: int
    mean_held_bytes_per_engine: float
    """Time-weighted mean over the measure window and the engines."""
    peak_held_bytes_per_engine: int
    """Largest ``bytes_held`` of any engine at any moment."""
    peak_idle_bytes_per_engine: int
    """Largest ``idle_bytes`` of any engine after any call: never above the budget."""
    mean_pinned_bytes_per_engine: float
    peak_pinned_bytes_per_engine: int
    recompute_s_avoided: float
    """Prefill seconds the pulled prefixes would have cost to recompute."""
    transfer_s: float
    """Seconds the pulls took (estimated transfer time, setup included)."""
    end_s: float
    """When the last turn finished."""

    @property
    def hit_rate(self) -> float:
        """Share of turns that pulled their prefix back (first turns included)."""
        return self.num_pulls / self.num_turns if self.num_turns else 0.0

    @property
    def ttft_saved_s(self) -> float:
        return self.recompute_s_avoided - self.transfer_s

    @property
    def ttft_saved_per_turn_s(self) -> float:
        return self.ttft_saved_s / self.num_turns if self.num_turns else 0.0

    def num_recomputes_for(self, reason: RecomputeReason) -> int:
        return dict(self.recomputes_by_reason)[reason]


def simulate(trace: Sequence[TraceTurn], config: SimConfig) -> SimResult:
    """Replay ``trace`` (ordered by ``t_s``, as ``trace_from_jsonl`` returns it)."""
    return _Replay(trace, config).run()


@dataclass(slots=True)
class _Session:
    session_id: str
    engine_id: str
    turns_left: int
    tokens: list[int] = field(default_factory=list)
    next_id: int = 1
    first_prompt_tokens: int = 0
    num_finished: int = 0
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
        # Pinned blocks: engine -> bytes; (engine, first block) -> bytes; expiry heap.
        self._pinned = dict.fromkeys(self._engines, 0)
        self._pinned_records: dict[tuple[str, int], int] = {}
        self._pin_expiries: list[tuple[float, str, int]] = []
        # When the policy may have something due: (deadline, finish number, session).
        self._wakes: list[tuple[float, int, str]] = []
        self._last_tick_s = -math.inf
        window = config.measure_window_s
        self._window = window if window is not None else (0.0, math.inf)
        self._last_s = 0.0
        self._held = dict.fromkeys(self._engines, 0)  # kv.bytes_held after the last call
        self._held_total = self._pinned_total = 0
        self._held_area = self._pinned_area = 0.0
        self._peak_held = self._peak_idle = self._peak_pinned = 0
        self._recompute_s_avoided = self._transfer_s = 0.0

    def run(self) -> SimResult:
        for index, turn in enumerate(self._trace):
            self._push(turn.t_s, _ARRIVE, turn.session_id, index)
        now = 0.0
        while self._events:
            now, kind, _, session_id, payload = heapq.heappop(self._events)
            self._catch_up(now)
            self._advance(now)
            session = self._sessions[session_id]
            if kind == _ARRIVE:
                session.waiting.append(self._trace[payload])
                if not session.busy:
                    self._start(session, now)
            else:
                self._finish(session, payload, now)
                if session.waiting:
                    self._start(session, now)
        self._advance(now)
        return self._result(now)

    # -- turns ------------------------------------------------------------------------

    def _start(self, session: _Session, now: float) -> None:
        turn = session.waiting.popleft()
        session.busy = True
        tokens = session.tokens
        if turn.rewrite_history and session.first_prompt_tokens:
            kept = session.first_prompt_tokens
            tokens[kept:] = session.fresh_ids(len(tokens) - kept)
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
            self._unpin(record.engine_id, record.block_ids[0])
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
        self._kv.on_turn_finished(
            session.session_id,
            engine_id=engine_id,
            token_ids_covered=tokens if covered == len(tokens) else tokens[:covered],
            block_ids=(first_block,),  # the policy only compares them: one id per record
            transfer_params={"remote_engine_id": engine_id, "remote_num_tokens": covered},
            expiry_s=expiry_s,
            now_s=now,
        )
        self._pin(engine_id, first_block, self._bytes(covered), expiry_s)
        session.num_finished += 1
        policy = self._policy
        for deadline_s in (expiry_s - policy.safety_margin_s, expiry_s, now + policy.lease_ttl_s):
            heapq.heappush(self._wakes, (deadline_s, session.num_finished, session.session_id))
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
        tick_s, wakes, pins = self._config.tick_s, self._wakes, self._pin_expiries
        while True:
            while wakes and self._sessions[wakes[0][2]].num_finished != wakes[0][1]:
                heapq.heappop(wakes)  # superseded by a later finish of the session
            tick_at = math.ceil(wakes[0][0] / tick_s) * tick_s if wakes else math.inf
            tick_at = max(tick_at, self._last_tick_s + tick_s)  # whole ticks, in order
            pin_at = pins[0][0] if pins else math.inf
            if min(tick_at, pin_at) > now:
                return
            if pin_at < tick_at:  # the engine frees the blocks at their exact expiry
                self._advance(pin_at)
                _, engine_id, first_block = heapq.heappop(pins)
                self._unpin(engine_id, first_block)
                continue
            self._advance(tick_at)
            self._last_tick_s = tick_at
            while wakes and wakes[0][0] <= tick_at:
                heapq.heappop(wakes)
            if self._kv.on_tick(tick_at):  # effects only ever lower the books
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

    def _pin(self, engine_id: str, first_block: int, num_bytes: int, expiry_s: float) -> None:
        self._pinned_records[engine_id, first_block] = num_bytes
        self._pinned[engine_id] += num_bytes
        self._pinned_total += num_bytes
        self._peak_pinned = max(self._peak_pinned, self._pinned[engine_id])
        heapq.heappush(self._pin_expiries, (expiry_s, engine_id, first_block))

    def _unpin(self, engine_id: str, first_block: int) -> None:
        num_bytes = self._pinned_records.pop((engine_id, first_block), 0)
        self._pinned[engine_id] -= num_bytes
        self._pinned_total -= num_bytes

    def _advance(self, now: float) -> None:
        """Integrate memory over the measure window up to ``now``; call before changes.

        Between calls the books do not change, so the integral is exact. Turn starts
        change no engine's books (a pull keeps its record booked until it resolves);
        finishes change only the session's engine; ticks only lower them.
        """
        start, end = self._window
        span = min(now, end) - max(self._last_s, start)
        if span > 0:
            self._held_area += self._held_total * span
            self._pinned_area += self._pinned_total * span
        self._last_s = now

    def _refresh(self, engine_id: str) -> None:
        """Take the engine's books after a call that may have changed them."""
        held = self._kv.bytes_held(engine_id)
        self._held_total += held - self._held[engine_id]
        self._held[engine_id] = held
        self._peak_held = max(self._peak_held, held)
        self._peak_idle = max(self._peak_idle, self._kv.idle_bytes(engine_id))

    def _result(self, end_s: float) -> SimResult:
        start, end = self._window
        span = (min(end, end_s) - start) * len(self._engines)
        stats = self._kv.stats()
        return SimResult(
            num_sessions=len(self._sessions),
            num_turns=len(self._trace),
            num_pulls=stats.num_pulls,
            recomputes_by_reason=stats.recomputes_by_reason,
            num_expiries=stats.num_expiries,
            num_evictions=stats.num_evictions,
            num_releases=stats.num_releases,
            mean_held_bytes_per_engine=self._held_area / span if span > 0 else 0.0,
            peak_held_bytes_per_engine=self._peak_held,
            peak_idle_bytes_per_engine=self._peak_idle,
            mean_pinned_bytes_per_engine=self._pinned_area / span if span > 0 else 0.0,
            peak_pinned_bytes_per_engine=self._peak_pinned,
            recompute_s_avoided=self._recompute_s_avoided,
            transfer_s=self._transfer_s,
            end_s=end_s,
        )
