"""Replay a load trace against three ways of sizing the prefill and decode pools.

Run from the repository root (no install needed):

    python benchmarks/autoscale.py [--quick] [--start-s 90] [--seed 1] [--intervals]

The trace: sessions of chat turns (a prompt, an answer, a pause), arriving in a ramp up,
a burst, a lull in which most sessions pause (their KV kept on decode until their lease
ends), and a ramp down. It is replayed, second by second, on a model of the pools (below)
under

* **kvtide**: ``policies.autoscale.decide``, fed what the engines report, every
  ``interval`` s; a decode engine scaled in first moves its kept sessions to the host
  tier and finishes its running turns (docs/autoscaling.md says how far the deployed
  app does this);
* **serve-default**: Ray Serve's own default policy
  (``replica_queue_length_autoscaling_policy``, its scaling factors and delay logic, the
  functions Serve's controller runs, with its default delays: up 30 s, down 600 s),
  ``target_ongoing_requests`` set to 80 % of an engine's sequences; a scaled-in replica
  has Serve's graceful shutdown (its running turns get 5 s, then fail; its kept
  sessions' KV is lost and recomputed);
* **static-peak**: each pool at the size kvtide's policy reached at its peak, never
  changed.

The model (not a deployment: the deployed app's scale-out and scale-in are checked in
tests/ray/test_autoscale.py): a prefill engine computes ``prefill_tokens_per_s`` prompt
tokens per second from a queue shared by the pool; a decode engine runs up to
``max_num_seqs`` sequences, a step taking ``step_s + step_per_seq_s`` x batch (its ITL),
and keeps a session's KV blocks after its turn until the session's next turn or its
lease; a new engine serves ``--start-s`` after it is asked for. It prints, per policy:
TTFT and ITL p90 against the targets and the share of turns within both (SLO
attainment), replica-seconds per pool, turns failed, sessions whose KV a scale-in lost,
and scaling events; then, per policy, which targets it met and by how much it missed.
With ``--intervals``, kvtide's decisions first, one row per 10 s: the turns that arrived
then and how many of them missed the TTFT target, and each pool's engines serving, the
count decided and the signal that drove it, with decode's sequences running and waiting.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.cli.table import format_table
from orchestrator.config import AutoscalingConfig
from policies.autoscale import (
    POOLS,
    AutoscaleTargets,
    Pool,
    PoolBounds,
    PoolSignals,
    PoolState,
    decide,
)

PREFILL_TOKENS_PER_S = 4000.0
MAX_NUM_SEQS = 16
KV_BLOCKS = 6000  # of 16 tokens
BLOCK_TOKENS = 16
STEP_S = 0.015
STEP_PER_SEQ_S = 0.0012
LEASE_S = 240.0
HOST_PULL_S = 0.15  # a turn whose KV the host tier holds pulls it back
GRACEFUL_S = 5.0  # Serve's graceful shutdown of a scaled-in replica (kvtide's option)
TURN_TIMEOUT_S = 60.0
FIRST_PROMPT = 3000  # tokens of a session's first prompt
NEXT_PROMPT = 400  # new tokens of each later turn
ANSWER = 200  # tokens of each answer
DECIDE_EVERY_S = 5
TARGETS = AutoscaleTargets(
    ttft_p90_s=2.0,
    itl_p90_s=0.05,
    prefill=PoolBounds(min_replicas=1, max_replicas=8),
    decode=PoolBounds(min_replicas=1, max_replicas=8),
    engine_start_s=90.0,
    scale_down_window_s=60.0,
    headroom=AutoscalingConfig().headroom,  # the config's default
)


@dataclass(slots=True)
class Session:
    sid: int
    turns_left: int
    context: int = 0  # tokens the session's KV holds after its last turn
    held_on: int | None = None  # decode engine holding its KV
    held_until: float = 0.0
    on_host: bool = False
    lost: bool = False  # a scale-in lost its KV


@dataclass(slots=True)
class Turn:
    session: Session
    arrived: float
    prompt: int  # tokens to compute
    out: int
    done_prefill: float | None = None
    first_token: float | None = None
    engine: int | None = None
    generated: float = 0.0
    itls: list[float] = field(default_factory=list)
    failed: bool = False
    penalty_s: float = 0.0


@dataclass(slots=True)
class Engine:
    eid: int
    ready_at: float
    draining: bool = False
    drain_deadline: float | None = None
    running: list[Turn] = field(default_factory=list)


def trace(quick: bool, seed: int) -> list[tuple[float, Session, int]]:
    """(arrival time, session, its pause after each turn): ramp, burst, lull, ramp down."""
    rng = random.Random(seed)
    scale = 0.5 if quick else 1.0
    phases = [  # (seconds, new sessions per second, mean pause s)
        (120 * scale, 0.8, 20.0),  # ramp up (rate rises linearly over the phase)
        (60 * scale, 1.6, 20.0),  # burst
        (180 * scale, 0.05, 150.0),  # lull: sessions pause long
        (120 * scale, 0.8, 20.0),  # ramp down
    ]
    out: list[tuple[float, Session, int]] = []
    t, sid = 0.0, 0
    for index, (length, rate, mean_pause) in enumerate(phases):
        end = t + length
        while t < end:
            frac = (t - (end - length)) / length
            r = rate * (frac if index == 0 else (1 - frac) if index == 3 else 1.0)
            r = max(r, 0.02)
            for _ in range(int(r) + (rng.random() < r - int(r))):
                pause_s = int(rng.expovariate(1 / mean_pause))
                out.append((t, Session(sid, turns_left=rng.randint(2, 5)), pause_s))
                sid += 1
            t += 1.0
    return out


class Pools:
    """Both pools and the turns in them, one second at a time."""

    def __init__(self, start_s: float, prefill_n: int, decode_n: int) -> None:
        self.start_s = start_s
        self.next_id = 0
        self.engines: dict[Pool, list[Engine]] = {"prefill": [], "decode": []}
        for pool, n in (("prefill", prefill_n), ("decode", decode_n)):
            for _ in range(n):
                self._add(pool, ready_at=0.0)  # type: ignore[arg-type]
        self.held: list[Session] = []  # sessions whose KV a decode engine keeps
        self.prefill_queue: list[Turn] = []
        self.decode_queue: list[Turn] = []
        self.finished: list[Turn] = []
        self.replica_s: dict[Pool, float] = {"prefill": 0.0, "decode": 0.0}
        self.events = 0
        self.lost_sessions = 0
        self.prompt_done = 0.0
        self.prefill_budget = 0.0

    def _add(self, pool: Pool, ready_at: float) -> None:
        self.engines[pool].append(Engine(self.next_id, ready_at))
        self.next_id += 1

    def size(self, pool: Pool) -> int:
        return sum(1 for e in self.engines[pool] if not e.draining)

    def ready(self, pool: Pool, now: float) -> list[Engine]:
        return [e for e in self.engines[pool] if e.ready_at <= now and not e.draining]

    def resize(self, pool: Pool, target: int, now: float, *, moves_kv: bool) -> None:
        current = self.size(pool)
        if target == current:
            return
        self.events += 1
        for _ in range(target - current):
            self._add(pool, ready_at=now + self.start_s)
        for _ in range(current - target):
            live = [e for e in self.engines[pool] if not e.draining]
            # Serve stops the newest (a starting one first).
            victim = max(live, key=lambda e: (e.ready_at > now, e.eid))
            self._retire(pool, victim, now, moves_kv=moves_kv)

    def _retire(self, pool: Pool, engine: Engine, now: float, *, moves_kv: bool) -> None:
        engine.draining = True
        engine.drain_deadline = None if moves_kv else now + GRACEFUL_S
        if pool == "decode":
            for session in self.sessions_held_on(engine.eid):
                session.held_on = None
                if moves_kv:
                    session.on_host = True
                else:
                    session.lost = True
                    self.lost_sessions += 1

    def sessions_held_on(self, eid: int) -> list[Session]:
        return [s for s in self.held if s.held_on == eid]

    def step(self, now: float) -> None:
        for pool in ("prefill", "decode"):
            self.replica_s[pool] += len(self.engines[pool])  # type: ignore[index]
        # Prefill: the pool's ready engines compute from the shared queue.
        budget = PREFILL_TOKENS_PER_S * len(self.ready("prefill", now)) + self.prefill_budget
        self.prompt_done = 0.0
        while self.prefill_queue and budget > 0:
            turn = self.prefill_queue[0]
            take = min(budget, turn.prompt)
            turn.prompt -= int(take)
            budget -= take
            self.prompt_done += take
            if turn.prompt <= 0:
                self.prefill_queue.pop(0)
                turn.done_prefill = now + 1.0 - budget / max(1.0, PREFILL_TOKENS_PER_S)
                self.decode_queue.append(turn)
        self.prefill_budget = 0.0
        # Decode: seat waiting turns on the least busy ready engine with a seat; an
        # engine short of blocks has the KV service move its idle session nearest expiry
        # to the host tier first (``KVLifecycle.make_room``, under every policy).
        while self.decode_queue:
            turn = self.decode_queue[0]
            seats = [e for e in self.ready("decode", now) if len(e.running) < MAX_NUM_SEQS]
            need = math.ceil((turn.session.context + turn.out) / BLOCK_TOKENS)
            engine = next(
                (e for e in sorted(seats, key=lambda e: len(e.running)) if self._room(e, need)),
                None,
            )
            if engine is None:
                break
            self.decode_queue.pop(0)
            turn.engine = engine.eid
            engine.running.append(turn)
        for engine in self.engines["decode"]:
            self._decode(engine, now)
        self.engines["decode"] = [
            e for e in self.engines["decode"] if not (e.draining and not e.running)
        ]
        self.engines["prefill"] = [e for e in self.engines["prefill"] if not e.draining]
        for turn in [*self.prefill_queue, *self.decode_queue]:
            if now - turn.arrived > TURN_TIMEOUT_S:
                turn.failed = True
        self.prefill_queue = [t for t in self.prefill_queue if not t.failed]
        failed = [t for t in self.decode_queue if t.failed]
        self.decode_queue = [t for t in self.decode_queue if not t.failed]
        self.finished.extend(failed)
        self.held = [s for s in self.held if s.held_on is not None and s.held_until > now]

    def _room(self, engine: Engine, need: int) -> bool:
        """Whether ``need`` blocks fit the engine, moving idle sessions to the host tier
        (nearest expiry first) to make room."""
        while self._blocks(engine.eid) + need > KV_BLOCKS:
            idle = sorted(self.sessions_held_on(engine.eid), key=lambda s: s.held_until)
            if not idle:
                return False
            idle[0].held_on, idle[0].on_host = None, True
        return True

    def _blocks(self, eid: int) -> int:
        engine = next(e for e in self.engines["decode"] if e.eid == eid)
        running = sum(math.ceil((t.session.context + t.out) / BLOCK_TOKENS) for t in engine.running)
        held = sum(math.ceil(s.context / BLOCK_TOKENS) for s in self.sessions_held_on(eid))
        return running + held

    def _decode(self, engine: Engine, now: float) -> None:
        if not engine.running:
            return
        step = STEP_S + STEP_PER_SEQ_S * len(engine.running)
        if engine.draining and engine.drain_deadline is not None and now >= engine.drain_deadline:
            for turn in engine.running:  # Serve's graceful shutdown is over: aborted
                turn.failed = True
                self.finished.append(turn)
            engine.running = []
            return
        for turn in list(engine.running):
            if turn.first_token is None:
                turn.first_token = max(now, turn.done_prefill or now) + step + turn.penalty_s
            turn.generated += 1.0 / step
            turn.itls.append(step)
            if turn.generated >= turn.out:
                engine.running.remove(turn)
                self.finished.append(turn)
                session = turn.session
                session.context += turn.out
                session.held_on = engine.eid
                session.held_until = now + LEASE_S
                session.on_host = False
                self.held.append(session)

    def signals(self, now: float) -> dict[Pool, PoolSignals]:
        dec = self.ready("decode", now)
        running = sum(len(e.running) for e in dec)
        used = sum(self._blocks(e.eid) for e in dec)
        held = sum(
            math.ceil(s.context / BLOCK_TOKENS)
            for s in self.held
            if any(s.held_on == e.eid for e in dec)
        )
        batch = running / max(1, len(dec))
        return {
            "prefill": PoolSignals(
                num_replicas=len(self.ready("prefill", now)),
                queued_prompt_tokens=sum(t.prompt for t in self.prefill_queue),
                prompt_tokens_per_s=self.prompt_done,
                prefill_tokens_per_s_per_engine=PREFILL_TOKENS_PER_S,
                num_running_seqs=len(self.prefill_queue),
                max_num_seqs_per_engine=MAX_NUM_SEQS,
            ),
            "decode": PoolSignals(
                num_replicas=len(dec),
                num_running_seqs=running,
                num_waiting_seqs=len(self.decode_queue),
                max_num_seqs_per_engine=MAX_NUM_SEQS,
                kv_blocks_per_engine=KV_BLOCKS,
                kv_blocks_running=used - held,
                kv_blocks_held=held,
                itl_s=STEP_S + STEP_PER_SEQ_S * batch if running else None,
            ),
        }

    def start_turn(self, session: Session, now: float) -> None:
        """The session's next turn: its new tokens computed, the rest pulled back where
        its KV is kept (decode, or the host tier), else all of it recomputed."""
        session.turns_left -= 1
        new_tokens = FIRST_PROMPT if session.context == 0 else NEXT_PROMPT
        penalty = 0.0
        if session.held_on is not None or session.on_host:
            prompt = new_tokens
            penalty = HOST_PULL_S if session.on_host else 0.0
        else:
            prompt = session.context + new_tokens
        if session in self.held:
            self.held.remove(session)
        session.held_on, session.on_host = None, False
        session.context += new_tokens
        self.prefill_queue.append(Turn(session, now, prompt, ANSWER, penalty_s=penalty))

    def ongoing(self, pool: Pool) -> int:
        if pool == "prefill":
            return len(self.prefill_queue)
        return len(self.decode_queue) + sum(len(e.running) for e in self.engines["decode"])


class ServeDefault:
    """Ray Serve's default policy per pool, as its controller runs it."""

    def __init__(self) -> None:
        from ray.serve.config import AutoscalingConfig

        self.config = AutoscalingConfig(
            min_replicas=1,
            max_replicas=8,
            target_ongoing_requests=MAX_NUM_SEQS * 0.8,
            look_back_period_s=30.0,
        )
        self.state: dict[Pool, dict[str, Any]] = {"prefill": {}, "decode": {}}
        self.target: dict[Pool, int] = {"prefill": 1, "decode": 1}

    def __call__(self, pools: Pools, pool: Pool, now: float) -> int:
        from ray.serve.autoscaling_policy import (
            _apply_delay_logic,
            _apply_scaling_factors,
            replica_queue_length_autoscaling_policy,
        )
        from ray.serve.config import AutoscalingContext

        current = pools.size(pool)
        ctx = AutoscalingContext(
            deployment_id=None,  # type: ignore[arg-type]
            deployment_name=pool,
            app_name="bench",
            current_num_replicas=current,
            target_num_replicas=self.target[pool],
            running_replicas=[],
            total_num_requests=float(pools.ongoing(pool)),
            total_queued_requests=0.0,
            aggregated_metrics={},
            raw_metrics={},
            capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=8,
            policy_state={},
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=now,
            config=self.config,
        )
        desired, _ = replica_queue_length_autoscaling_policy(ctx)
        desired = _apply_scaling_factors(desired, current, self.config)
        final, self.state[pool] = _apply_delay_logic(
            max(0, desired), self.target[pool], self.config, self.state[pool], _now=now
        )
        self.target[pool] = max(1, min(8, final))
        return self.target[pool]


class Replay:
    """One policy over the trace: arrivals, pauses between a session's turns, and a
    decision every ``DECIDE_EVERY_S``."""

    def __init__(
        self,
        name: str,
        start_s: float,
        static: dict[Pool, int] | None,
        headroom: float = TARGETS.headroom,
    ) -> None:
        self.name = name
        self.static = static
        sizes = (static["prefill"], static["decode"]) if static else (1, 1)
        self.pools = Pools(start_s, *sizes)
        self.serve_default = ServeDefault() if name == "serve-default" else None
        self.states: dict[Pool, PoolState] = {}
        self.targets = replace(TARGETS, engine_start_s=start_s, headroom=headroom)
        self.peak: dict[Pool, int] = {"prefill": sizes[0], "decode": sizes[1]}
        self.paused: list[tuple[float, Session]] = []
        self.pause_of: dict[int, int] = {}
        self.num_seen = 0
        # kvtide's decisions: (now, the pools' signals, each pool's decision)
        self.decisions: list[tuple[float, dict[Pool, PoolSignals], dict[Pool, Any]]] = []

    def run(self, arrivals: list[tuple[float, Session, int]], horizon_s: float) -> None:
        pending = list(arrivals)
        now = 0.0
        while now < horizon_s:
            while pending and pending[0][0] <= now:
                _, session, pause = pending.pop(0)
                self.pause_of[session.sid] = pause
                self.pools.start_turn(session, now)
            for item in [p for p in self.paused if p[0] <= now]:
                self.paused.remove(item)
                self.pools.start_turn(item[1], now)
            self.pools.step(now)
            for turn in self.pools.finished[self.num_seen :]:
                session = turn.session
                if not turn.failed and session.turns_left > 0:
                    self.paused.append((now + self.pause_of[session.sid], session))
            self.num_seen = len(self.pools.finished)
            if self.static is None and int(now) % DECIDE_EVERY_S == 0:
                self.decide(now)
            for pool in POOLS:
                self.peak[pool] = max(self.peak[pool], self.pools.size(pool))
            now += 1.0

    def decide(self, now: float) -> None:
        if self.serve_default is not None:
            for pool in POOLS:
                target = self.serve_default(self.pools, pool, now)
                self.pools.resize(pool, target, now, moves_kv=False)
            return
        signals = self.pools.signals(now)
        decisions = decide(signals, self.targets, self.states, now)
        self.decisions.append((now, signals, decisions))
        for pool, d in decisions.items():
            self.states[pool] = d.state
            self.pools.resize(pool, d.desired_replicas, now, moves_kv=True)


def intervals(replay: Replay, every_s: int = 10) -> str:
    """kvtide's decisions as a table, one row per ``every_s``: the turns that arrived in
    it and how many missed the TTFT target (failed, or their first token late), and each
    pool's engines serving -> decided (the driving signal and what it asked for)."""
    arrived: dict[int, list[Turn]] = {}
    for turn in replay.pools.finished:
        arrived.setdefault(int(turn.arrived // every_s) * every_s, []).append(turn)
    rows = []
    for now, signals, decisions in replay.decisions:
        if int(now) % every_s:
            continue
        turns = arrived.get(int(now), [])
        late = sum(
            1
            for t in turns
            if t.failed or t.first_token is None or t.first_token - t.arrived > TARGETS.ttft_p90_s
        )
        cells: list[Any] = [int(now), len(turns), late]
        for pool in POOLS:
            d = decisions[pool]
            cells.append(f"{d.num_replicas}->{d.desired_replicas} {d.signal}={d.signal_replicas}")
        dec = signals["decode"]
        cells.append(f"{dec.num_running_seqs}/{dec.num_waiting_seqs}")
        rows.append(cells)
    headers = ["t_s", "turns", "over_ttft", "prefill", "decode", "decode_run/wait"]
    return format_table(headers, rows)


def _summary(name: str, pools: Pools) -> dict[str, Any]:
    done = [t for t in pools.finished if not t.failed and t.first_token is not None]
    ttft = sorted(t.first_token - t.arrived for t in done)  # type: ignore[operator]
    itl = sorted(sum(t.itls) / len(t.itls) for t in done if t.itls)
    within = sum(
        1
        for t in done
        if t.first_token - t.arrived <= TARGETS.ttft_p90_s  # type: ignore[operator]
        and (not t.itls or sum(t.itls) / len(t.itls) <= TARGETS.itl_p90_s)
    )
    failed = sum(1 for t in pools.finished if t.failed)
    return {
        "policy": name,
        "ttft_p90_s": _p90(ttft),
        "itl_p90_s": _p90(itl),
        "slo_met": f"{100 * within / max(1, len(pools.finished)):.0f}%",
        "prefill_replica_s": int(pools.replica_s["prefill"]),
        "decode_replica_s": int(pools.replica_s["decode"]),
        "turns": len(pools.finished),
        "failed": failed,
        "lost_sessions": pools.lost_sessions,
        "scaling_events": pools.events,
    }


def _p90(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{values[min(len(values) - 1, int(0.9 * len(values)))]:.3f}"


def compare(quick: bool, seed: int, start_s: float, headroom: float) -> list[Replay]:
    """kvtide, serve-default and static-peak (at kvtide's peak) over the same trace."""
    horizon = max(at for at, _, _ in trace(quick, seed)) + 300.0
    replays: list[Replay] = []
    for name in ("kvtide", "serve-default", "static-peak"):
        static = replays[0].peak if name == "static-peak" else None
        replay = Replay(name, start_s, static, headroom)
        replay.run(trace(quick, seed), horizon)
        replays.append(replay)
    return replays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a trace 0.4x as long (CI)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--start-s", type=float, default=None, help="engine start time (90 s; --quick: 30 s)"
    )
    parser.add_argument(
        "--headroom",
        type=float,
        default=TARGETS.headroom,
        help=f"kvtide's autoscaling.headroom ({TARGETS.headroom:g}, the config's default)",
    )
    parser.add_argument(
        "--intervals", action="store_true", help="print kvtide's decisions, one row per 10 s"
    )
    args = parser.parse_args(argv)
    start_s = args.start_s if args.start_s is not None else (30.0 if args.quick else 90.0)
    replays = compare(args.quick, args.seed, start_s, args.headroom)
    peak = replays[0].peak
    rows = [_summary(r.name, r.pools) for r in replays]
    if args.intervals:
        print(intervals(replays[0]))
    print(
        f"targets: TTFT p90 {TARGETS.ttft_p90_s} s, ITL p90 {TARGETS.itl_p90_s} s; "
        f"engine start {start_s:g} s; kvtide's headroom {args.headroom:g}; "
        f"static peak: {peak}"
    )
    print(format_table(list(rows[0]), [[str(r[k]) for k in rows[0]] for r in rows]))
    for row in rows:
        print(_verdict(row))
    return 0


def _verdict(row: dict[str, Any]) -> str:
    """Which targets the policy met: each p90 against its target, by how much."""
    parts = []
    for key, target in (("ttft_p90_s", TARGETS.ttft_p90_s), ("itl_p90_s", TARGETS.itl_p90_s)):
        if row[key] == "-":
            parts.append(f"{key} not measured")
            continue
        value = float(row[key])
        met = "met" if value <= target else f"missed by {value - target:.3f} s"
        parts.append(f"{key} {value:.3f} s vs {target:g} s: {met}")
    losses = f"{row['failed']} failed turns, {row['lost_sessions']} lost sessions"
    return f"{row['policy']}: {'; '.join(parts)}; {losses}"


if __name__ == "__main__":
    sys.exit(main())
