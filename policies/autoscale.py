"""How many prefill and decode engines the load needs: the autoscaler's decision.

Each tick (Ray Serve's control loop asks every few seconds) the caller hands in what the
pools report (``PoolSignals``: one per pool, summed over its engines) and the targets
(``AutoscaleTargets``: the config's ``autoscaling`` section), with the pools' hysteresis
state from the last tick; ``decide`` returns each pool's ``PoolDecision`` (its desired
replicas, the signal that drove them, and the state for the next tick). Pure: no clock
but ``now_s``, no I/O.

What each pool needs:

* **prefill** (the TTFT target): the prompt tokens arriving per second, plus the backlog
  (prompt tokens queued or being computed) drained within half the TTFT target, over
  what one engine computes per second (measured; the config's figure until measured).
  The backlog is looked ahead by the engine start time along its growth since the last
  tick: an engine asked for now serves in ``engine_start_s``, so a burst is met with
  the engines it will need when they are up, not those it needs now.
* **decode** (the ITL target): the larger of
  - sequences: those running and waiting on decode, plus those in prefill now (they
    reach decode next), over the sequences one engine runs at ``seq_utilization``;
    looked ahead by the engine start time along their growth, where they grew over
    the last two ticks both (a load rising tick after tick, not one wobbling around
    its mean): a decode engine asked for once the seats are full serves only
    ``engine_start_s`` later, and the turns in between wait for a seat;
  - KV: the blocks in use for running turns, plus the blocks **held for paused
    sessions** (kept after their turn until their lease ends or the host tier takes
    them), over one engine's blocks at ``kv_cache_utilization``. A paused session's KV
    is demand: scaling decode in under it would throw it away;
  - ITL: when the engines' measured ITL is above target, the replicas that bring it to
    target with ITL proportional to the sequences per engine.

With ``headroom`` the prompt tokens and the sequences are sized for ``(1 + headroom)`` x
the load: a burst that arrives faster than an engine starts (the look-ahead sees it
only once it is there) is served by the engines kept spare. Held KV gets none: it is
not a load that bursts.

Hysteresis, so that a steady load never flaps:

* up at once, to what the load needs at the scale-up utilization;
* down only to what the load fits at the lower scale-down utilization (a band between
  the two holds), and only once every tick of ``scale_down_window_s`` wanted fewer: the
  pool goes to the most any tick of the window wanted;
* never down while replicas are still starting (``num_replicas`` below the target).

Every count is then held within the pool's ``min``/``max``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

__all__ = [
    "POOLS",
    "AutoscaleTargets",
    "Pool",
    "PoolBounds",
    "PoolDecision",
    "PoolSignals",
    "PoolState",
    "Signal",
    "decide",
]

Pool = Literal["prefill", "decode"]
POOLS: tuple[Pool, ...] = ("prefill", "decode")

Action = Literal["up", "down", "hold"]

Signal = Literal[
    "prefill_load",  # prompt tokens arriving per second
    "ttft_backlog",  # prompt tokens queued, looked ahead by the engine start time
    "running_seqs",  # sequences running or waiting (decode), and those on their way
    "kv_use",  # KV blocks of running turns
    "held_kv",  # KV blocks held for paused sessions
    "itl",  # measured inter-token latency above target
    "idle",  # no load: the pool's minimum
]
"""The signal that asked for the most replicas (what drove a decision)."""

# Backlog drained within this share of the TTFT target: queueing is not the whole TTFT.
TTFT_BACKLOG_SHARE = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolBounds:
    min_replicas: int = 1
    max_replicas: int = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class AutoscaleTargets:
    """The targets and the hysteresis (``autoscaling`` in the config file)."""

    ttft_p90_s: float = 2.0
    itl_p90_s: float = 0.1
    prefill: PoolBounds = PoolBounds()
    decode: PoolBounds = PoolBounds()
    engine_start_s: float = 30.0  # how long a new engine takes to serve (look-ahead)
    scale_down_window_s: float = 60.0
    scale_up_utilization: float = 0.8  # of an engine's seats, blocks, prefill rate
    scale_down_utilization: float = 0.6
    # Spare capacity kept for a burst an engine asked for then cannot meet in time: the
    # load signals (prompt tokens, sequences) size for (1 + headroom) x the load.
    headroom: float = 0.0

    def bounds(self, pool: Pool) -> PoolBounds:
        return self.prefill if pool == "prefill" else self.decode


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSignals:
    """What one pool's engines report now, summed over them.

    ``num_replicas``: engines running (Serve's actual count). Rates are per second over
    the last report interval; ``*_per_engine`` figures are one engine's capacity."""

    num_replicas: int
    # prefill
    queued_prompt_tokens: int = 0  # waiting or being computed
    prompt_tokens_per_s: float = 0.0  # computed (the load served)
    prefill_tokens_per_s_per_engine: float = 0.0  # capacity, measured or configured
    # sequences (both pools)
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    max_num_seqs_per_engine: int = 1
    # decode KV
    kv_blocks_per_engine: int = 0
    kv_blocks_running: int = 0  # in use by running turns
    kv_blocks_held: int = 0  # kept for paused sessions (until their lease or the host tier)
    itl_s: float | None = None  # measured mean inter-token latency; None: unknown


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolState:
    """A pool's hysteresis between ticks (Serve keeps it as a plain dict: ``as_dict``)."""

    target: int = 0  # replicas last decided (0: none yet; the current count is taken)
    below_since_s: float | None = None  # since when every tick wanted fewer
    window_need: int = 0  # the most any tick of that window wanted
    backlog_tokens: float = 0.0  # at the last tick (prefill look-ahead)
    seqs: float | None = None  # decode's sequences at the last tick (its look-ahead)
    seqs_growth_per_s: float = 0.0  # their growth to that tick from the one before
    last_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "below_since_s": self.below_since_s,
            "window_need": self.window_need,
            "backlog_tokens": self.backlog_tokens,
            "seqs": self.seqs,
            "seqs_growth_per_s": self.seqs_growth_per_s,
            "last_s": self.last_s,
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> PoolState:
        """Back from ``as_dict`` (an empty or foreign dict: the initial state)."""
        try:
            below = state.get("below_since_s")
            last = state.get("last_s")
            seqs = state.get("seqs")
            return cls(
                target=int(state.get("target", 0)),
                below_since_s=None if below is None else float(below),
                window_need=int(state.get("window_need", 0)),
                backlog_tokens=float(state.get("backlog_tokens", 0.0)),
                seqs=None if seqs is None else float(seqs),
                seqs_growth_per_s=float(state.get("seqs_growth_per_s", 0.0)),
                last_s=None if last is None else float(last),
            )
        except (TypeError, ValueError):
            return cls()


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolDecision:
    pool: Pool
    desired_replicas: int
    num_replicas: int  # actual, as reported
    signal: Signal  # the signal that asked for the most replicas
    signal_replicas: int  # what that signal asked for (before bounds and hysteresis)
    action: Action
    reason: str  # one line: why this count
    state: PoolState


def decide(
    signals: Mapping[Pool, PoolSignals],
    targets: AutoscaleTargets,
    states: Mapping[Pool, PoolState],
    now_s: float,
) -> dict[Pool, PoolDecision]:
    """Both pools' replicas for the load in ``signals`` at ``now_s``."""
    prefill = signals["prefill"]
    # Sequences in prefill now reach decode next: decode counts them as its own.
    incoming = prefill.num_running_seqs + prefill.num_waiting_seqs
    out: dict[Pool, PoolDecision] = {}
    for pool in POOLS:
        state = states.get(pool) or PoolState()
        sig = signals[pool]
        if pool == "prefill":
            needs_up, backlog = _prefill_needs(
                sig, targets, state, now_s, targets.scale_up_utilization
            )
            needs_down, _ = _prefill_needs(
                sig, targets, state, now_s, targets.scale_down_utilization
            )
        else:
            backlog = 0.0
            seqs = float(sig.num_running_seqs + sig.num_waiting_seqs + incoming)
            previous_growth = state.seqs_growth_per_s
            growth = _growth_per_s(state, seqs, now_s)
            state = replace(state, seqs=seqs, seqs_growth_per_s=growth)
            # Grown over both of the last two ticks: the smaller growth goes on for as
            # long as an engine asked for now takes to serve.
            ahead = seqs + max(0.0, min(growth, previous_growth)) * targets.engine_start_s
            needs_up = _decode_needs(sig, targets, ahead, targets.scale_up_utilization)
            needs_down = _decode_needs(sig, targets, ahead, targets.scale_down_utilization)
        out[pool] = _hysteresis(pool, sig, targets, state, needs_up, needs_down, backlog, now_s)
    return out


def _growth_per_s(state: PoolState, seqs: float, now_s: float) -> float:
    """Decode's sequences' growth per second since the last tick (0: no last tick)."""
    if state.seqs is None or state.last_s is None or now_s <= state.last_s:
        return 0.0
    return (seqs - state.seqs) / (now_s - state.last_s)


def _prefill_needs(
    sig: PoolSignals, targets: AutoscaleTargets, state: PoolState, now_s: float, util: float
) -> tuple[dict[Signal, int], float]:
    capacity = sig.prefill_tokens_per_s_per_engine * util / (1 + targets.headroom)
    backlog = float(sig.queued_prompt_tokens)
    if capacity <= 0:
        return {}, backlog
    growth = 0.0
    if state.last_s is not None and now_s > state.last_s:
        growth = max(0.0, (backlog - state.backlog_tokens) / (now_s - state.last_s))
    ahead = backlog + growth * targets.engine_start_s
    drain_s = max(1e-3, targets.ttft_p90_s * TTFT_BACKLOG_SHARE)
    return {
        "prefill_load": _ceil(sig.prompt_tokens_per_s / capacity),
        "ttft_backlog": _ceil((sig.prompt_tokens_per_s + ahead / drain_s) / capacity),
    }, backlog


def _decode_needs(
    sig: PoolSignals, targets: AutoscaleTargets, seqs: float, util: float
) -> dict[Signal, int]:
    """``seqs``: the sequences to seat, prefill's and the look-ahead's included."""
    needs: dict[Signal, int] = {}
    seats = sig.max_num_seqs_per_engine * util / (1 + targets.headroom)
    if seats > 0:
        needs["running_seqs"] = _ceil(seqs / seats)
    blocks = sig.kv_blocks_per_engine * util
    if blocks > 0:
        # What the held KV alone keeps, before all KV in use: on a tie (the paused
        # sessions are what holds the pool up) it is the signal named.
        needs["held_kv"] = _ceil(sig.kv_blocks_held / blocks)
        needs["kv_use"] = _ceil((sig.kv_blocks_running + sig.kv_blocks_held) / blocks)
    if sig.itl_s is not None and sig.num_running_seqs > 0 and targets.itl_p90_s > 0:
        ratio = sig.itl_s / targets.itl_p90_s
        # Scaled by the utilization so that the band holds here too.
        needs["itl"] = _ceil(sig.num_replicas * ratio * targets.scale_up_utilization / util)
    return needs


def _hysteresis(
    pool: Pool,
    sig: PoolSignals,
    targets: AutoscaleTargets,
    state: PoolState,
    needs_up: Mapping[Signal, int],
    needs_down: Mapping[Signal, int],
    backlog: float,
    now_s: float,
) -> PoolDecision:
    bounds = targets.bounds(pool)
    current = state.target or sig.num_replicas
    signal, up = _top(needs_up)
    _, down = _top(needs_down)
    if not needs_up:  # no capacity figure to size by: hold what runs
        up = down = current
    want_up = _clamp(up, bounds)
    want_down = _clamp(down, bounds)
    held = _clamp(current, bounds)  # a bound changed: the count follows it at once
    below_since: float | None = None
    window_need = 0
    action: Action
    if want_up > held:
        target, action = want_up, "up"
        reason = f"{signal} needs {up} (> {held})"
    elif want_down < held and sig.num_replicas >= held:
        below_since = state.below_since_s if state.below_since_s is not None else now_s
        window_need = max(want_down, state.window_need if state.below_since_s is not None else 0)
        if now_s - below_since >= targets.scale_down_window_s:
            target, action = window_need, "down"
            reason = (
                f"{signal} fits {window_need} for {now_s - below_since:.0f} s "
                f"(window {targets.scale_down_window_s:.0f} s)"
            )
            below_since, window_need = None, 0
        else:
            target, action = held, "hold"
            reason = (
                f"{signal} fits {want_down}; waiting "
                f"{targets.scale_down_window_s - (now_s - below_since):.0f} s more"
            )
    else:
        target = held
        action = "up" if held > current else "down" if held < current else "hold"
        if sig.num_replicas < held and want_down < held:
            reason = f"{sig.num_replicas} of {held} up: no scale-in while engines start"
        else:
            reason = f"{signal} needs {up}: within the band"
    new_state = replace(
        state,
        target=target,
        below_since_s=below_since,
        window_need=window_need,
        backlog_tokens=backlog,
        last_s=now_s,
    )
    return PoolDecision(
        pool=pool,
        desired_replicas=target,
        num_replicas=sig.num_replicas,
        signal=signal,
        signal_replicas=up,
        action=action,
        reason=reason,
        state=new_state,
    )


def _top(needs: Mapping[Signal, int]) -> tuple[Signal, int]:
    """The signal asking for the most replicas (the first listed on a tie); no load:
    ``idle``, 0."""
    best: tuple[Signal, int] = ("idle", 0)
    for signal, count in needs.items():
        if count > best[1]:
            best = (signal, count)
    return best


def _clamp(count: int, bounds: PoolBounds) -> int:
    return max(bounds.min_replicas, min(bounds.max_replicas, count))


def _ceil(value: float) -> int:
    # A hair under an integer is that integer (float sums of exact loads).
    return max(0, math.ceil(value - 1e-9))
