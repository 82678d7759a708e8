"""The autoscaler's decision (policies/autoscale.py), told as loads over time: each test
ticks ``decide`` every 5 s of a moved ``now_s`` and carries its state forward, as Ray
Serve's control loop does."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace

from policies.autoscale import (
    AutoscaleTargets,
    Pool,
    PoolBounds,
    PoolDecision,
    PoolSignals,
    PoolState,
    decide,
)

TICK_S = 5.0
# One engine: 1,000 prompt tokens/s, 16 sequences, 1,000 KV blocks.
TARGETS = AutoscaleTargets(
    ttft_p90_s=2.0,
    itl_p90_s=0.1,
    prefill=PoolBounds(min_replicas=1, max_replicas=6),
    decode=PoolBounds(min_replicas=1, max_replicas=6),
    engine_start_s=30.0,
    scale_down_window_s=60.0,
)


def prefill(
    replicas: int, *, rate: float = 0.0, queued: int = 0, seqs: int = 0, waiting: int = 0
) -> PoolSignals:
    return PoolSignals(
        num_replicas=replicas,
        queued_prompt_tokens=queued,
        prompt_tokens_per_s=rate,
        prefill_tokens_per_s_per_engine=1000.0,
        num_running_seqs=seqs,
        num_waiting_seqs=waiting,
        max_num_seqs_per_engine=16,
    )


def decode(
    replicas: int,
    *,
    seqs: int = 0,
    running_blocks: int = 0,
    held_blocks: int = 0,
    itl_s: float | None = None,
) -> PoolSignals:
    return PoolSignals(
        num_replicas=replicas,
        num_running_seqs=seqs,
        max_num_seqs_per_engine=16,
        kv_blocks_per_engine=1000,
        kv_blocks_running=running_blocks,
        kv_blocks_held=held_blocks,
        itl_s=itl_s,
    )


class Cluster:
    """The pools as Serve runs them: replicas follow each decision on the next tick
    (engines start instantly here; the look-ahead is tested on its own)."""

    def __init__(self, targets: AutoscaleTargets = TARGETS, prefill_n: int = 1, decode_n: int = 1):
        self.targets = targets
        self.replicas: dict[Pool, int] = {"prefill": prefill_n, "decode": decode_n}
        self.states: dict[Pool, PoolState] = {}
        self.now_s = 1000.0
        self.log: list[dict[Pool, PoolDecision]] = []

    def tick(self, load: dict[Pool, PoolSignals]) -> dict[Pool, PoolDecision]:
        signals = {p: replace(s, num_replicas=self.replicas[p]) for p, s in load.items()}
        out = decide(signals, self.targets, self.states, self.now_s)
        self.log.append(out)
        for pool, d in out.items():
            self.states[pool] = d.state
            self.replicas[pool] = d.desired_replicas
        self.now_s += TICK_S
        return out

    def run(
        self, load: dict[Pool, PoolSignals], seconds: float
    ) -> Iterator[dict[Pool, PoolDecision]]:
        for _ in range(int(seconds / TICK_S)):
            yield self.tick(load)

    def changes(self, pool: Pool) -> int:
        counts = [d[pool].desired_replicas for d in self.log]
        return sum(1 for a, b in itertools.pairwise(counts) if a != b)


def steady(prefill_rate: float, decode_seqs: int) -> dict[Pool, PoolSignals]:
    return {
        "prefill": prefill(1, rate=prefill_rate, queued=int(prefill_rate * 0.2), seqs=2),
        "decode": decode(1, seqs=decode_seqs, running_blocks=decode_seqs * 20),
    }


def test_a_steady_load_never_flaps() -> None:
    # 2,000 prompt tokens/s (2 engines at 80 %: 2.5, so 3) and 30 sequences (16 x 0.8 =
    # 12.8 per engine: 3 with the 2 coming from prefill). Ten minutes of the same load
    # settle once and never move again; a load near a threshold too.
    for rate, seqs in ((2000.0, 30), (1600.0, 25), (700.0, 10), (2390.0, 36)):
        cluster = Cluster()
        list(cluster.run(steady(rate, seqs), 600))
        assert cluster.changes("prefill") <= 1, (rate, [d["prefill"] for d in cluster.log])
        assert cluster.changes("decode") <= 1, (seqs, [d["decode"] for d in cluster.log])
        last = cluster.log[-1]
        assert last["prefill"].action == "hold" and last["decode"].action == "hold"


def test_headroom_keeps_engines_spare_for_a_burst_and_a_steady_load_still_never_flaps() -> None:
    spare = replace(TARGETS, headroom=0.5)
    # 600 prompt tokens/s with 120 queued (drained in 1 s) and 10 sequences (+ 2 in
    # prefill) fit one engine of each at 80 %; with half the load again kept spare:
    # 1,080 / 800 → 2 and 18 / 12.8 → 2. KV held for paused sessions is not a load that
    # bursts: no headroom for it.
    load = steady(600.0, 10)
    load["decode"] = replace(load["decode"], kv_blocks_held=400)
    bare = decide(load, TARGETS, {}, now_s=0.0)
    kept = decide(load, spare, {}, now_s=0.0)
    assert (bare["prefill"].desired_replicas, bare["decode"].desired_replicas) == (1, 1)
    assert (kept["prefill"].desired_replicas, kept["decode"].desired_replicas) == (2, 2)
    assert kept["decode"].signal == "running_seqs"
    held_only = {"prefill": prefill(1), "decode": decode(1, held_blocks=700)}
    assert decide(held_only, spare, {}, now_s=0.0)["decode"].desired_replicas == 1
    # The band holds with headroom as without: ten minutes of one load settle once.
    for rate, seqs in ((2000.0, 30), (1600.0, 25), (700.0, 10), (2390.0, 36)):
        cluster = Cluster(spare)
        list(cluster.run(steady(rate, seqs), 600))
        assert cluster.changes("prefill") <= 1 and cluster.changes("decode") <= 1
        assert cluster.log[-1]["prefill"].action == cluster.log[-1]["decode"].action == "hold"


def test_a_load_wobbling_inside_the_band_holds() -> None:
    # Settled at 3 decode engines for 34 sequences, the load wobbles between 24 and 34
    # sequences tick by tick: 24 still needs 3 at the scale-down utilization (60 %).
    cluster = Cluster(decode_n=3)
    for i in range(120):
        cluster.tick(steady(500.0, 34 if i % 2 else 24))
    assert cluster.changes("decode") == 0
    assert cluster.replicas["decode"] == 3


def test_a_burst_scales_up_on_the_first_tick() -> None:
    cluster = Cluster()
    list(cluster.run(steady(500.0, 8), 60))
    assert cluster.replicas == {"prefill": 1, "decode": 1}
    # A burst: 20,000 prompt tokens queued and 60 sequences running.
    out = cluster.tick(
        {
            "prefill": prefill(1, rate=1000.0, queued=20_000, seqs=16, waiting=20),
            "decode": decode(1, seqs=60, running_blocks=600),
        }
    )
    # Prefill: the backlog grew from 100 to 20,000 tokens in 5 s, so in the 30 s an
    # engine takes to start it is 20,000 + 3,980 x 30 = 139,400; drained in 1 s (half
    # the TTFT target) with the 1,000 tokens/s arriving: 140,400 / 800 per engine = 175.5
    # engines → capped at 6.
    assert out["prefill"].action == "up" and out["prefill"].desired_replicas == 6
    assert out["prefill"].signal == "ttft_backlog" and out["prefill"].signal_replicas == 176
    # Decode: 60 + 36 coming from prefill = 96 sequences / 12.8 = 7.5 → capped at 6.
    assert out["decode"].action == "up" and out["decode"].desired_replicas == 6
    assert out["decode"].signal == "running_seqs"


def test_a_growing_backlog_is_looked_ahead_by_the_engine_start_time() -> None:
    targets = replace(TARGETS, prefill=PoolBounds(min_replicas=1, max_replicas=100))
    # The same backlog now (1,000 tokens), but growing 200 tokens/s since the last tick:
    # in 30 s, when an engine asked for now serves, it is 7,000.
    grown = decide(
        {"prefill": prefill(1, queued=1000), "decode": decode(1)},
        targets,
        {"prefill": PoolState(target=1, backlog_tokens=0.0, last_s=95.0)},
        now_s=100.0,
    )["prefill"]
    flat = decide(
        {"prefill": prefill(1, queued=1000), "decode": decode(1)},
        targets,
        {"prefill": PoolState(target=1, backlog_tokens=1000.0, last_s=95.0)},
        now_s=100.0,
    )["prefill"]
    assert flat.desired_replicas == 2  # 1,000 / 1 s / 800
    assert grown.desired_replicas == 9  # 7,000 / 1 s / 800 = 8.75
    no_look_ahead = replace(targets, engine_start_s=0.0)
    assert (
        decide(
            {"prefill": prefill(1, queued=1000), "decode": decode(1)},
            no_look_ahead,
            {"prefill": PoolState(target=1, backlog_tokens=0.0, last_s=95.0)},
            now_s=100.0,
        )["prefill"].desired_replicas
        == 2
    )


def test_decode_sequences_rising_tick_after_tick_are_looked_ahead_by_the_engine_start_time() -> (
    None
):
    targets = replace(TARGETS, decode=PoolBounds(min_replicas=1, max_replicas=100))

    def decode_counts(targets: AutoscaleTargets, seqs: list[int]) -> list[int]:
        cluster = Cluster(targets)
        return [
            cluster.tick({"prefill": prefill(1), "decode": decode(1, seqs=n)})[
                "decode"
            ].desired_replicas
            for n in seqs
        ]

    # Decode's sequences rise 4 a tick (0.8/s): 8, 12, 16. At the third tick they have
    # grown over two ticks running, and an engine asked for now serves in 30 s, when
    # they are 16 + 0.8 x 30 = 40: 40 / 12.8 → 4 engines, not the 2 that 16 needs now
    # (the seats full until the engines asked for then are up).
    assert decode_counts(targets, [8, 12, 16]) == [1, 1, 4]
    assert decode_counts(replace(targets, engine_start_s=0.0), [8, 12, 16]) == [1, 1, 2]
    # One step up, then flat: no trend to follow (the step is met at once, as it is).
    assert decode_counts(targets, [8, 16, 16, 16]) == [1, 2, 2, 2]
    # Falling after a rise: the smaller growth (none) is looked ahead.
    assert decode_counts(targets, [8, 12, 10]) == [1, 1, 1]


def test_a_lull_scales_down_only_after_the_window() -> None:
    cluster = Cluster(prefill_n=5, decode_n=5)
    cluster.states = {p: PoolState(target=5) for p in ("prefill", "decode")}
    lull = steady(300.0, 4)
    # The lull's first 60 s (ticks at 0, 5, ..., 55 s; the window is 60 s): nothing moves.
    for out in cluster.run(lull, 60):
        assert out["prefill"].action == "hold" and out["decode"].action == "hold"
        assert "waiting" in out["decode"].reason
    assert cluster.replicas == {"prefill": 5, "decode": 5}
    # The tick at 60 s scales both pools in, to what the lull needs, in one step.
    out = cluster.tick(lull)
    assert out["prefill"].action == "down" and out["prefill"].desired_replicas == 1
    assert out["decode"].action == "down" and out["decode"].desired_replicas == 1


def test_one_busy_tick_in_the_window_starts_it_again() -> None:
    cluster = Cluster(decode_n=4)
    cluster.states = {"decode": PoolState(target=4)}
    list(cluster.run(steady(300.0, 4), 50))
    # 40 sequences at 4 engines: 40 / (16 x 0.6) = 4.2 → 5 at the scale-down utilization,
    # 40 / 12.8 = 3.1 → 4 at the scale-up one: within the band; the window restarts.
    assert cluster.tick(steady(300.0, 40))["decode"].action == "hold"
    for out in cluster.run(steady(300.0, 4), 60):
        assert out["decode"].desired_replicas == 4
    assert cluster.tick(steady(300.0, 4))["decode"].desired_replicas == 1


def test_scale_down_goes_to_the_most_the_window_wanted() -> None:
    cluster = Cluster(decode_n=6)
    cluster.states = {"decode": PoolState(target=6)}
    # The window wants 2 for a tick (20 sequences / 9.6 = 2.1 → 3 at 60 %: 3), then 1.
    cluster.tick(steady(300.0, 18))
    outs = list(cluster.run(steady(300.0, 2), 60))
    assert [o["decode"].action for o in outs[:-1]] == ["hold"] * 11
    out = outs[-1]
    assert out["decode"].action == "down"
    assert out["decode"].desired_replicas == 3


def test_paused_sessions_hold_decode_until_their_kv_is_gone() -> None:
    cluster = Cluster(decode_n=3)
    cluster.states = {"decode": PoolState(target=3)}
    # No running turns, but 1,500 blocks kept for paused sessions: 1,500 / 800 → 2 at
    # 80 %, 1,500 / 600 → 3 at 60 %: decode holds all 3 through a long lull.
    paused = {
        "prefill": prefill(1),
        "decode": decode(3, held_blocks=1500),
    }
    for out in cluster.run(paused, 600):
        assert out["decode"].desired_replicas == 3
    # 1,000 blocks held (a lease ended; the host tier took some): 2 engines, and the
    # held KV is named as what keeps them.
    paused["decode"] = decode(3, held_blocks=1000)
    outs = list(cluster.run(paused, 65))
    assert outs[-1]["decode"].action == "down" and outs[-1]["decode"].desired_replicas == 2
    assert outs[-1]["decode"].signal == "held_kv"
    # Their leases end: nothing held, decode goes to its minimum after the window.
    paused["decode"] = decode(2)
    outs = list(cluster.run(paused, 65))
    assert outs[-1]["decode"].desired_replicas == 1


def test_itl_above_target_scales_decode_up() -> None:
    # 8 sequences fit one engine by seats and blocks, but the engine's ITL is 0.25 s
    # against 0.1 s: 2.5 engines' worth.
    out = decide(
        {"prefill": prefill(1), "decode": decode(1, seqs=8, running_blocks=100, itl_s=0.25)},
        TARGETS,
        {},
        now_s=0.0,
    )["decode"]
    assert out.signal == "itl" and out.desired_replicas == 3 and out.action == "up"


def test_min_and_max_are_respected() -> None:
    targets = replace(
        TARGETS,
        prefill=PoolBounds(min_replicas=2, max_replicas=3),
        decode=PoolBounds(min_replicas=1, max_replicas=2),
    )
    cluster = Cluster(targets, prefill_n=2, decode_n=1)
    huge = {
        "prefill": prefill(2, rate=50_000.0, queued=100_000, seqs=64),
        "decode": decode(1, seqs=500, running_blocks=5000),
    }
    out = cluster.tick(huge)
    assert out["prefill"].desired_replicas == 3 and out["prefill"].signal_replicas > 3
    assert out["decode"].desired_replicas == 2
    list(cluster.run(steady(0.0, 0), 300))
    assert cluster.replicas == {"prefill": 2, "decode": 1}
    # Bounds changed under a running pool: the count follows them at once.
    out = decide(
        {"prefill": prefill(5), "decode": decode(1)},
        targets,
        {"prefill": PoolState(target=5)},
        now_s=0.0,
    )
    assert out["prefill"].desired_replicas == 3


def test_no_scale_in_while_engines_are_still_starting() -> None:
    # Decided 4 decode engines; 2 are up. The load dropped, but the window does not
    # start until the pool is at its target (a start under way is not a lull).
    states = {"decode": PoolState(target=4)}
    for i in range(30):
        out = decide(
            {"prefill": prefill(1), "decode": decode(2)}, TARGETS, states, now_s=100.0 + 5 * i
        )
        states = {"decode": out["decode"].state}
        assert out["decode"].desired_replicas == 4
    assert "start" in out["decode"].reason


def test_state_round_trips_through_serves_dict() -> None:
    state = PoolState(
        target=3,
        below_since_s=12.5,
        window_need=2,
        backlog_tokens=40.0,
        seqs=14.0,
        seqs_growth_per_s=0.4,
        last_s=13.0,
    )
    assert PoolState.from_dict(state.as_dict()) == state
    assert PoolState.from_dict({}) == PoolState()
    assert PoolState.from_dict({"target": "x"}) == PoolState()
