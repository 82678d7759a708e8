"""What a session turn waits for from the KV lifecycle service, through its Ray actor.

Before a session's turn runs, the ingress needs the session claimed and the turn's KV
plan. Two call sequences on the same actor in the same run, each followed by the turn's
``turn_done``:

* three calls — ``session_prefix`` (the last turn, to tokenize from), ``claim_session``,
  ``decide_turn``: the ingress's sequence before ``begin_turn``;
* one call, Ray arguments — ``begin_turn`` (claim and plan at once; the ingress
  tokenizes from its own copy of the last turn, checked by digest) with the whole prompt,
  its arguments as Python objects on the raw actor handle;
* one call, one message — the same call as the ingress makes it: through
  ``ServiceClient``, arguments and answer each one msgpack message
  (``orchestrator.kv.envelope``), carrying only the ids the turn adds to the last turn.

The three-call sequence goes through ``ServiceClient`` too.

Each is reported as the time before the turn can run (the critical path), in ms and in
units of a bare round trip to the same actor (a method that does nothing), measured in
between; and, for scale, a plain actor's empty method waited for with ``ray.get`` (the
round trip ``benchmarks/overhead.py`` states kvtide's own time in).

    python benchmarks/turn_calls.py [--sessions 2000] [--turns 400] [--prompt-tokens 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import kept_turn_done
from benchmarks.overhead import actor_round_trip_s
from orchestrator.cli.table import format_table
from orchestrator.kv.messages import TurnDone


def _done(sid: str, prompt: list[int], turn: int) -> TurnDone:
    done = kept_turn_done(
        sid,
        [*prompt, 5],
        engine_id="decode-0",
        request_id=f"{sid}-{turn}",
        kv_expires_in_s=480.0,
    )
    return msgspec.structs.replace(done, owner="bench")


async def _timed(step: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await step()
    return time.perf_counter() - t0


async def run(num_sessions: int, num_turns: int, prompt_tokens: int) -> list[str]:
    from orchestrator.kv.actor import KVServiceActor, ServiceClient, ServiceSetup
    from orchestrator.kv.ownership import Principal
    from orchestrator.kv.session_tokens import prefix_digest
    from policies.kv_lifecycle import KVLifecycleConfig

    config = KVLifecycleConfig(kv_bytes_per_token=4096, block_size_tokens=128)
    actor = KVServiceActor.remote(ServiceSetup(config, 5.0, 1), None)  # type: ignore[attr-defined]
    kv = ServiceClient(actor, timeout_s=60)
    who = Principal(name="bench")
    history = {f"s{i}": [i, *range(100, 100 + prompt_tokens - 1)] for i in range(num_sessions)}
    for start in range(0, num_sessions, 500):
        batch = list(history.items())[start : start + 500]
        await asyncio.gather(*(kv.claim_session(s, who) for s, _ in batch))
        await asyncio.gather(*(kv.turn_done(_done(s, ids, 0)) for s, ids in batch))
        for s, ids in batch:
            history[s] = [*ids, 5]

    async def three_calls(sid: str, prompt: list[int]) -> None:
        await kv.session_prefix(sid, who)
        await kv.claim_session(sid, who)
        await kv.decide_turn(sid, prompt)

    async def one_call(sid: str, prompt: list[int]) -> None:
        claim = await actor.begin_turn.remote(sid, who, prompt, prefix_digest(history[sid]))
        assert claim.outcome == "claimed", claim

    async def one_call_new_ids(sid: str, prompt: list[int]) -> None:
        last = history[sid]
        claim = await kv.begin_turn(sid, who, prompt[len(last) :], prefix_digest(last), len(last))
        assert claim.outcome == "claimed", claim

    async def bare() -> None:
        await actor.epoch.remote()

    sequences = {
        "three calls": three_calls,
        "one call, Ray arguments": one_call,
        "one call, one message": one_call_new_ids,
    }
    times: dict[str, list[float]] = {name: [] for name in [*sequences, "bare round trip"]}
    for turn in range(num_turns):
        sid = f"s{turn % num_sessions}"
        # The sequences interleaved, so a slow moment of the box hits all of them.
        for name, begin in sequences.items():
            prompt = [*history[sid], 7, 8, 9]
            times[name].append(await _timed(lambda: begin(sid, prompt)))  # noqa: B023
            await kv.turn_done(_done(sid, prompt, turn))
            history[sid] = [*prompt, 5]
        times["bare round trip"].append(await _timed(bare))
    rtt = statistics.median(times["bare round trip"])
    # The unit benchmarks/overhead.py states kvtide's own time in: a method of a plain
    # (not async) actor, waited for with ray.get.
    sync_rtt = await asyncio.to_thread(actor_round_trip_s)
    rows = [
        [
            name,
            f"{1e3 * statistics.median(xs):.2f}",
            f"{1e3 * sorted(xs)[int(0.99 * (len(xs) - 1))]:.2f}",
            f"{statistics.median(xs) / rtt:.2f}",
        ]
        for name, xs in times.items()
    ]
    one = statistics.median(times["one call, one message"])
    ratio = one / statistics.median(times["three calls"])
    return [
        f"A session turn's KV-service calls before it runs, through the Ray actor "
        f"({num_sessions:,} live sessions, {prompt_tokens}-token histories, {num_turns} turns "
        "each way):",
        format_table(
            ["before the turn runs", "p50 ms", "p99 ms", "x bare round trip"],
            rows,
            align=["<", ">", ">", ">"],
        ),
        f"one call (one message) / three calls: {ratio:.2f}x the time on the critical path; "
        f"one call = a bare round trip + {1e3 * (one - rtt):.2f} ms (target: + 1 ms)",
        f"a plain actor's empty method with ray.get (overhead.py's round trip): "
        f"{1e3 * sync_rtt:.2f} ms; the service's empty method awaited here: "
        f"{1e3 * rtt:.2f} ms ({rtt / sync_rtt:.2f}x)",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=400)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        lines = asyncio.run(run(args.sessions, args.turns, args.prompt_tokens))
    finally:
        ray.shutdown()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
