"""Turn-2 TTFT with KV send-back against recomputing, and the KV policy's speed.

Part 1 (engines): for 1k, 2k and 4k-token contexts, a two-turn conversation where turn 2
is turn 1's prompt + answer + a short question. Turn 2's TTFT is measured three ways on
the same engines in the same run, through kvtide (HTTP) and through vLLM's direct P/D
flow (engine handles):

* send-back — turn 2's prefill pulls turn 1's KV back from the decode engine;
* recompute — a fresh prompt of the same length: the prefill engine computes it all.

Part 2: the KV lifecycle at 100,000 live sessions, three ways in the same run: the pure
policy (``on_turn_start`` + ``on_turn_finished``), the service in-process (the same plus
session tokens and messages: ``decide_turn`` + ``turn_done``), and the service as the Ray
actor every ingress talks to (a round trip per call). Events per second and decision
latency (p50/p99).

    python benchmarks/sendback.py [--sizes 1024,2048,4096] [--repeats 3] [--skip-engines]
                                  [--skip-actor]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.common import (
    add_serve_proxy_flag,
    direct_turn,
    embedded_app,
    kept_turn_done,
    stream_completion,
)
from benchmarks.stream_targets import sendback_targets
from engines.kv_params import KVTransferParams
from orchestrator.cli.table import format_table
from orchestrator.kv.messages import TurnDone

OUTPUT_TOKENS = 16
QUESTION_TOKENS = 32
SOURCES: dict[str, int] = {}  # kvtide's turn 2s by kv_source (the warm-up's included)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


async def _kvtide_pair(
    client: httpx.AsyncClient, model: str, rng: random.Random, n: int
) -> tuple[float, float, float]:
    """(turn-2 TTFT with send-back, TTFT recomputing a prompt of the same length, turn 2's
    prefill request as the router timed it). Turn 2 pulls the kept KV back; when the
    prefill engine's own prefix cache already holds every block the pull offers (the
    answer does not fill a block of its own), the engine reads nothing and the turn says
    ``kv_source: prefix_cache``."""
    session = f"bench-{uuid.uuid4().hex[:8]}"
    first = _ids(rng, n)
    r1 = await client.post(
        "/v1/completions",
        headers={"x-session-id": session},
        json={
            "model": model,
            "prompt": first,
            "max_tokens": OUTPUT_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    answer = r1.json()["choices"][0]["token_ids"]
    second = first + answer + _ids(rng, QUESTION_TOKENS)
    reused = await _server_ttft(client, model, second, session)
    assert reused[1].get("kv_plan") == "pull", reused[1]
    SOURCES[reused[1]["kv_source"]] = SOURCES.get(reused[1]["kv_source"], 0) + 1
    fresh = await _server_ttft(client, model, _ids(rng, len(second)), None)
    return reused[0], fresh[0], float(reused[1]["prefill_s"])


async def _server_ttft(
    client: httpx.AsyncClient, model: str, prompt: list[int], session: str | None
) -> tuple[float, dict[str, Any]]:
    """Client-side TTFT of a streamed completion, and the server's report."""
    turn = await stream_completion(client, model, prompt, OUTPUT_TOKENS, session)
    return turn.ttft_s, turn.report


async def _direct_pair(
    prefill: Any, decode: Any, rng: random.Random, n: int
) -> tuple[float, float, float]:
    first = _ids(rng, n)
    one = await direct_turn(prefill, decode, first, OUTPUT_TOKENS)
    assert one.kept is not None and one.kept.remote_block_ids
    second = first + one.token_ids + _ids(rng, QUESTION_TOKENS)
    reused = await direct_turn(prefill, decode, second, OUTPUT_TOKENS, pull=one.kept)
    fresh = await direct_turn(prefill, decode, _ids(rng, len(second)), OUTPUT_TOKENS)
    return reused.ttft_s, fresh.ttft_s, reused.prefill_s


async def _engines(
    base_url: str, model: str, prefill: Any, decode: Any, sizes: list[int], repeats: int
) -> list[str]:
    rng = random.Random(0)
    lines = [
        f"turn-2 TTFT, p50 of {repeats}; turn 2 = turn 1 ({OUTPUT_TOKENS} output tokens) "
        f"+ {QUESTION_TOKENS} new tokens; recompute = fresh prompt of the same length",
    ]
    table = []
    speed_ups: dict[int, dict[str, float]] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await _kvtide_pair(client, model, rng, 256)  # warm-up
        for n in sizes:
            for path in ("direct", "kvtide"):
                pairs = []
                for _ in range(repeats):
                    if path == "direct":
                        pairs.append(await _direct_pair(prefill, decode, rng, n))
                    else:
                        pairs.append(await _kvtide_pair(client, model, rng, n))
                reused = statistics.median(p[0] for p in pairs)
                fresh = statistics.median(p[1] for p in pairs)
                prefill_ms = statistics.median(p[2] for p in pairs) * 1e3
                speed_ups.setdefault(n, {})[path] = fresh / reused
                table.append(
                    [
                        n,
                        path,
                        f"{reused * 1e3:.1f}",
                        f"{prefill_ms:.1f}",
                        f"{reused * 1e3 - prefill_ms:.1f}",
                        f"{fresh * 1e3:.1f}",
                        f"{fresh / reused:.2f}",
                    ]
                )
    header = [
        "context",
        "path",
        "send-back ms",
        "of it prefill",
        "of it the rest",
        "recompute ms",
        "speed-up x",
    ]
    lines.append(
        "'of it prefill': turn 2's prefill request (pulling the kept KV back and computing "
        "the new tokens); 'the rest': everything else up to the first token (kvtide: "
        "HTTP proxy, ingress, KV service, decode's pull and first token)"
    )
    lines.append(
        "kvtide's turn 2s by where their KV came from (kv_source; prefix_cache: the pull "
        f"read 0 bytes, the prefill engine had every block): {SOURCES}"
    )
    return [*lines, format_table(header, table, align=[">"] * 7), sendback_targets(speed_ups)]


def policy_speed(num_sessions: int = 100_000, prompt_tokens: int = 1024) -> list[str]:
    """Events/s and decision latency of the pure KV policy with ``num_sessions`` live."""
    from policies.kv_lifecycle import KVLifecycle, KVLifecycleConfig

    kv = KVLifecycle(KVLifecycleConfig(kv_bytes_per_token=4096, block_size_tokens=128))
    rng = random.Random(1)
    base = _ids(rng, prompt_tokens)
    params = KVTransferParams(remote_engine_id="decode-0", remote_block_ids=((1, 2, 3),))
    now = 0.0
    # Populate: every session has finished one turn and holds a record.
    for i in range(num_sessions):
        sid = f"s{i}"
        prompt = [i, *base]
        kv.on_turn_start(sid, prompt, now)
        kv.on_turn_finished(
            sid,
            engine_id=f"decode-{i % 16}",
            token_ids_covered=prompt,
            block_ids=(1, 2, 3),
            transfer_params=params,
            expiry_s=None,
            now_s=now,
        )
        now += 0.001
    # Long-lived books: keep the collector from rescanning them on every pass (the
    # ingress does the same after start-up).
    gc.collect()
    gc.freeze()
    starts: list[float] = []
    finishes: list[float] = []
    t_all = time.perf_counter()
    num_events = 0
    for j in range(20_000):
        i = rng.randrange(num_sessions)
        sid = f"s{i}"
        prompt = [i, *base, 7, 8, 9]  # extends the record: a pull decision
        t0 = time.perf_counter()
        kv.on_turn_start(sid, prompt, now)
        t1 = time.perf_counter()
        kv.on_turn_finished(
            sid,
            engine_id=f"decode-{i % 16}",
            token_ids_covered=[i, *base],
            block_ids=(1, 2, 3),
            transfer_params=params,
            expiry_s=None,
            now_s=now,
        )
        t2 = time.perf_counter()
        starts.append(t1 - t0)
        finishes.append(t2 - t1)
        num_events += 2
        now += 0.001
        if j % 1000 == 0:
            kv.on_tick(now)
            num_events += 1
    wall = time.perf_counter() - t_all

    pct = _pct
    return [
        f"KV policy at {num_sessions:,} live sessions, {prompt_tokens}-token prompts "
        f"(prefix hashed per turn): {num_events / wall:,.0f} events/s",
        format_table(
            ["call", "p50 us", "p99 us"],
            [
                ["on_turn_start", f"{pct(starts, 0.5):.1f}", f"{pct(starts, 0.99):.1f}"],
                ["on_turn_finished", f"{pct(finishes, 0.5):.1f}", f"{pct(finishes, 0.99):.1f}"],
            ],
            align=[">"] * 3,
        ),
    ]


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))] * 1e6


def _done(sid: str, prompt: list[int], i: int) -> TurnDone:
    return kept_turn_done(
        sid,
        [*prompt, 5],
        engine_id=f"decode-{i % 16}",
        request_id=f"r{i}",
        kv_expires_in_s=480.0,
    )


def _service_config() -> Any:
    from policies.kv_lifecycle import KVLifecycleConfig

    return KVLifecycleConfig(kv_bytes_per_token=4096, block_size_tokens=128)


def service_speed(
    num_sessions: int = 100_000, prompt_tokens: int = 1024, with_actor: bool = True
) -> list[str]:
    """The service's calls per turn, in-process and through its Ray actor."""
    from orchestrator.kv.service import KVService, ServiceSettings

    rng = random.Random(0)
    base = list(range(100, 100 + prompt_tokens - 1))
    calls = 5_000

    async def populate(svc: Any) -> None:
        for start in range(0, num_sessions, 2_000):  # every session finished one turn
            await asyncio.gather(
                *(
                    svc.turn_done(_done(f"s{i}", [i, *base], i))
                    for i in range(start, min(num_sessions, start + 2_000))
                )
            )
        gc.collect()
        gc.freeze()

    async def drive(svc: Any, concurrency: int) -> tuple[float, list[float], list[float]]:
        plans: list[float] = []
        dones: list[float] = []

        async def one(j: int) -> None:
            i = rng.randrange(num_sessions)
            prompt = [i, *base, 5, 7, 8, 9]
            t0 = time.perf_counter()
            await svc.decide_turn(f"s{i}", prompt)
            t1 = time.perf_counter()
            await svc.turn_done(_done(f"s{i}", prompt, i))
            plans.append(t1 - t0)
            dones.append(time.perf_counter() - t1)

        t_all = time.perf_counter()
        for start in range(0, calls, concurrency):
            await asyncio.gather(*(one(j) for j in range(start, start + concurrency)))
        return time.perf_counter() - t_all, plans, dones

    rows = []
    service = KVService(
        _service_config(),
        prefill=None,
        settings=ServiceSettings(drain_timeout_s=5.0),
    )
    asyncio.run(populate(service))
    wall, plans, dones = asyncio.run(drive(service, 1))
    rows.append(("in-process", 2 * calls / wall, plans, dones))
    if with_actor:
        import ray

        from orchestrator.kv.actor import KVServiceActor, ServiceClient, ServiceSetup

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            actor = KVServiceActor.remote(ServiceSetup(_service_config(), 5.0, 1), None)  # type: ignore[attr-defined]
            client = ServiceClient(actor)
            asyncio.run(populate(client))
            for concurrency in (1, 16):
                wall, plans, dones = asyncio.run(drive(client, concurrency))
                rows.append((f"Ray actor, {concurrency} in flight", 2 * calls / wall, plans, dones))
        finally:
            ray.shutdown()
    lines = [
        f"KV lifecycle service at {num_sessions:,} live sessions, {prompt_tokens}-token "
        "prompts (decide_turn + turn_done per turn; latency per call):",
        format_table(
            ["where", "calls/s", "plan p50 us", "plan p99 us", "done p50 us", "done p99 us"],
            [
                [
                    name,
                    f"{rate:,.0f}",
                    *(f"{_pct(xs, q):.1f}" for xs in (plans, dones) for q in (0.5, 0.99)),
                ]
                for name, rate, plans, dones in rows
            ],
            align=[">"] * 6,
        ),
    ]
    base_rate = rows[0][1]
    for name, rate, _, _ in rows[1:]:
        lines.append(f"{name}: {base_rate / rate:.1f}x the in-process cost per call")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-engines", action="store_true")
    parser.add_argument("--skip-actor", action="store_true")
    add_serve_proxy_flag(parser)
    args = parser.parse_args()
    lines: list[str] = []
    if not args.skip_engines:
        sizes = [int(x) for x in args.sizes.split(",")]
        with embedded_app(serve_proxy=args.serve_proxy) as (base_url, model, prefill, decode):
            lines += asyncio.run(_engines(base_url, model, prefill, decode, sizes, args.repeats))
        lines.append("")
    lines += policy_speed()
    lines.append("")
    lines += service_speed(with_actor=not args.skip_actor)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
