"""Sweep the KV lifecycle policy's TTL and recompute threshold over a simulated agent workload.

Run from the repository root (no install needed; an installed kvtide works too):

    python benchmarks/kv_sim.py [--model tests/data/hf_configs/deepseek_v3.json]
        [--device h200] [--sessions 2000] [--plot out.png]

Every point of the sweep replays the same trace (`policies.kv_workload`: a generated
multi-turn agent workload, or ``--trace`` JSONL) through `policies.kv_sim.simulate`,
which drives the real `KVLifecycle` on a virtual clock. The cost inputs come from the
capacity model in `placement/`:

- KV bytes per token of one engine: `kv_bytes_per_token(spec, tp=tp)` on each of its
  GPUs (MLA keeps a full copy on every TP rank), times its GPUs; bf16 KV cache;
- decode speed per user: `decode_step` at ``--decode-batch`` sequences of the
  workload's mean context;
- prefill speed: the engine's bf16 tensor throughput at the decode model's compute
  efficiency over 2 x active parameters per token. Attention FLOPs and FP8 matmuls
  are left out, so it is an optimistic prefill (a recompute looks cheap) and the TTFT
  saved a conservative figure;
- link bandwidth: prefill and decode engines of ``num_gpus`` GPUs each share one
  scale-up domain when both fit in it (then one direction of its links, half the
  quoted figure); otherwise the per-GPU scale-out network. Every GPU sends its share.

The table: TTL and threshold; hit rate (turns that pulled, first turns included);
the policy's booked bytes per decode engine (``held``, mean over the measure window
and peak) and the blocks the engines pin until read or expired (``pinned`` peak);
TTFT saved per turn; and recomputes by reason, columns that are zero everywhere left
out. ``no_record*`` counts later turns only: sessions kvtide forgot because their
lease (the TTL, as the orchestrator sets it) ran out, which happens 15 s after their
record expired.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from placement.capacity import (
    EngineShape,
    devices_needed,
    kv_bytes_per_token,
    linear_state_bytes_per_sequence,
    memory_plan,
)
from placement.decode_model import calibration_for, decode_step
from placement.devices import device_by_name
from placement.model_spec import ModelSpec
from policies.kv_lifecycle import KVLifecycleConfig, RecomputeReason
from policies.kv_sim import SimConfig, SimResult, simulate
from policies.kv_workload import (
    TraceTurn,
    WorkloadConfig,
    generate_workload,
    trace_from_jsonl,
    trace_to_jsonl,
)

REPO = Path(__file__).resolve().parents[1]
TTLS_S = (60.0, 120.0, 240.0, 480.0, 960.0)
THRESHOLDS = (0, 64, 256, 1024)
GiB = 2**30
REASON_COLUMNS = (
    ("no_record*", RecomputeReason.NO_RECORD),
    ("expired", RecomputeReason.EXPIRED),
    ("margin", RecomputeReason.WITHIN_MARGIN),
    ("mismatch", RecomputeReason.PREFIX_MISMATCH),
    ("below_thr", RecomputeReason.BELOW_THRESHOLD),
    ("cheaper", RecomputeReason.CHEAPER_TO_RECOMPUTE),
    ("evicted", RecomputeReason.EVICTED),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Deployment:
    """What the capacity model says about one engine of the model on the device."""

    label: str
    shape: EngineShape
    kv_bytes_per_token: int
    linear_state_bytes: int
    kv_capacity_bytes: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    link_gbps: float
    link_kind: str


def derive(args: argparse.Namespace, mean_context_tokens: float) -> Deployment:
    spec = ModelSpec.from_hf_config(json.loads(args.model.read_text()), name=args.model.stem)
    device = device_by_name(args.device)
    shape = EngineShape(tp=args.tp) if args.tp else devices_needed(spec, device)
    if shape is None:
        sys.exit(f"{spec.name} does not fit on {device.name} with up to 128 GPUs")
    gpus = shape.num_gpus
    plan = memory_plan(spec, device, shape)
    if not plan.fits:
        sys.exit(f"{spec.name} does not fit on {device.name} with {shape}: pass a larger --tp")
    same_domain = 2 * gpus <= device.nvlink_domain_size
    per_gpu_gb_s = (
        device.interconnect_bandwidth_gbps / 2 if same_domain else device.scale_out_bandwidth_gbps
    )
    compute = calibration_for(device).compute_efficiency
    decode = decode_step(
        spec, device, shape, batch_size=args.decode_batch, context_tokens=mean_context_tokens
    )
    return Deployment(
        label=f"{spec.name} on {device.name}, engines of {gpus} GPUs (tp={shape.tp}, pp={shape.pp})",
        shape=shape,
        kv_bytes_per_token=round(kv_bytes_per_token(spec, tp=shape.tp) * shape.tp),
        linear_state_bytes=round(linear_state_bytes_per_sequence(spec, tp=shape.tp) * shape.tp),
        kv_capacity_bytes=plan.kv_budget_bytes * gpus,
        prefill_tokens_per_s=gpus
        * device.bf16_dense_tflops
        * 1e12
        * compute
        / (2 * spec.num_active_params),
        decode_tokens_per_s=decode.tokens_per_s_per_user,
        link_gbps=per_gpu_gb_s * 8 * gpus,
        link_kind="scale-up (same domain)" if same_domain else "scale-out network",
    )


def mean_context(trace: list[TraceTurn]) -> float:
    """Mean prompt length over the trace's turns (rewrites keep lengths)."""
    sizes: dict[str, int] = {}
    prompts = []
    for turn in trace:
        size = sizes.get(turn.session_id, 0) + turn.new_prompt_tokens
        prompts.append(size)
        sizes[turn.session_id] = size + turn.output_tokens
    return statistics.fmean(prompts)


# -- the sweep (one process per core) -------------------------------------------------

_TRACE: list[TraceTurn] = []


def _init_worker(trace: list[TraceTurn]) -> None:
    global _TRACE
    _TRACE = trace


def _run(config: SimConfig) -> SimResult:
    return simulate(_TRACE, config)


def sweep(trace: list[TraceTurn], configs: list[SimConfig], jobs: int) -> list[SimResult]:
    if jobs <= 1:
        return [simulate(trace, config) for config in configs]
    with ProcessPoolExecutor(jobs, initializer=_init_worker, initargs=(trace,)) as pool:
        return list(pool.map(_run, configs))


# -- output -----------------------------------------------------------------------------


def table(rows: list[tuple[SimConfig, SimResult]], num_sessions: int) -> str:
    def reason_count(result: SimResult, reason: RecomputeReason) -> int:
        count = result.num_recomputes_for(reason)
        return count - num_sessions if reason is RecomputeReason.NO_RECORD else count

    reasons = [
        (name, reason)
        for name, reason in REASON_COLUMNS
        if any(reason_count(result, reason) for _, result in rows)
    ]
    header = [
        "TTL s",
        "thr tok",
        "budget GiB",
        "hit %",
        "held mean GiB",
        "held peak GiB",
        "pinned peak GiB",
        "TTFT saved ms/turn",
        *(name for name, _ in reasons),
    ]
    lines = [header]
    for config, result in rows:
        budget = config.policy.idle_budget_bytes_per_engine
        lines.append(
            [
                f"{config.policy.ttl_s:.0f}",
                str(config.policy.recompute_threshold_tokens),
                "-" if budget is None else f"{budget / GiB:.0f}",
                f"{100 * result.hit_rate:.1f}",
                f"{result.mean_held_bytes_per_engine / GiB:.1f}",
                f"{result.peak_held_bytes_per_engine / GiB:.1f}",
                f"{result.peak_pinned_bytes_per_engine / GiB:.1f}",
                f"{1e3 * result.ttft_saved_per_turn_s:.1f}",
                *(str(reason_count(result, reason)) for _, reason in reasons),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = [
        "| " + " | ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) + " |"
        for line in lines
    ]
    out.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(out)


def plot(path: Path, rows: list[tuple[SimConfig, SimResult]], deployment: Deployment) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot written to {path}: matplotlib is not installed (pip install matplotlib)")
        return
    fig, (hits, memory) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    ttls = sorted({c.policy.ttl_s for c, _ in rows})
    thresholds = sorted({c.policy.recompute_threshold_tokens for c, _ in rows})
    budgets = sorted({c.policy.idle_budget_bytes_per_engine or 0 for c, _ in rows})
    styles = ("-", "--", ":", "-.")
    markers = ("o", "s", "^", "D")
    for i, threshold in enumerate(thresholds):
        for j, budget in enumerate(budgets):
            points = [
                (c.policy.ttl_s, r)
                for c, r in rows
                if c.policy.recompute_threshold_tokens == threshold
                and (c.policy.idle_budget_bytes_per_engine or 0) == budget
            ]
            xs = [t for t, _ in points]
            label = f"threshold {threshold}"
            if budget:
                label += f", budget {budget / GiB:.0f} GiB"
            style = dict(marker=markers[i % 4], linestyle=styles[j % 4], color=f"C{i}")
            hits.plot(xs, [100 * r.hit_rate for _, r in points], label=label, **style)
            memory.plot(
                xs, [r.mean_held_bytes_per_engine / GiB for _, r in points], label=label, **style
            )
            memory.plot(
                xs,
                [r.peak_held_bytes_per_engine / GiB for _, r in points],
                alpha=0.35,
                **style,
            )
    memory.axhline(deployment.kv_capacity_bytes / GiB, color="k", linewidth=0.8)
    memory.annotate(
        "KV capacity of one engine",
        (ttls[0], deployment.kv_capacity_bytes / GiB),
        textcoords="offset points",
        xytext=(2, 4),
        fontsize=8,
    )
    for ax in (hits, memory):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ttls, [f"{t:.0f}" for t in ttls])
        ax.set_xlabel("TTL (s)")
        ax.grid(alpha=0.3)
    hits.set_ylabel("turns that pulled their KV back (%)")
    hits.set_title("Hit rate")
    hits.legend(fontsize=8)
    memory.set_ylabel("GiB per decode engine")
    memory.set_title("Idle KV booked: mean (bold), peak (faint)")
    fig.suptitle(deployment.label, fontsize=10)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


# -- main ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=REPO / "tests/data/hf_configs/deepseek_v3.json"
    )
    parser.add_argument("--device", default="h200")
    parser.add_argument("--tp", type=int, default=0, help="GPUs per engine (default: smallest)")
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--sessions-per-s", type=float, default=0.25)
    parser.add_argument("--decode-engines", type=int, default=4)
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", type=Path, help="replay this JSONL trace instead")
    parser.add_argument("--write-trace", type=Path, help="write the generated trace as JSONL")
    parser.add_argument(
        "--idle-budgets",
        default="none",
        help="comma-separated idle budgets as fractions of one engine's KV capacity, "
        "or 'none' (default: none)",
    )
    parser.add_argument(
        "--token-unit",
        type=int,
        default=16,
        help="tokens per synthetic token id (1: exact, slower; default 16, one KV block)",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--plot", type=Path, help="write a PNG of hit rate and memory vs TTL")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    workload = WorkloadConfig(num_sessions=args.sessions, sessions_per_s=args.sessions_per_s)
    if args.trace:
        trace = trace_from_jsonl(args.trace.read_text().splitlines())
    else:
        # The turn spacing depends on decode speed, which depends on the mean context:
        # draw once at the default speed, derive, then draw at the derived speed.
        draft = generate_workload(workload, seed=args.seed)
        first = derive(args, mean_context(draft))
        workload = replace(workload, decode_tokens_per_s=first.decode_tokens_per_s)
        trace = generate_workload(workload, seed=args.seed)
    deployment = derive(args, mean_context(trace))
    if args.write_trace:
        args.write_trace.write_text(trace_to_jsonl(trace))
    first_turns: dict[str, float] = {}
    for turn in trace:
        first_turns.setdefault(turn.session_id, turn.t_s)
    window = (max(TTLS_S), max(first_turns.values()))
    measure = window if window[0] < window[1] else None

    base = KVLifecycleConfig(
        kv_bytes_per_token=deployment.kv_bytes_per_token,
        linear_state_bytes_per_sequence=deployment.linear_state_bytes,
        prefill_tokens_per_s=deployment.prefill_tokens_per_s,
        link_bandwidth_gbps=deployment.link_gbps,
    )
    budgets = [
        None if b.strip() == "none" else round(float(b) * deployment.kv_capacity_bytes)
        for b in args.idle_budgets.split(",")
    ]
    configs = [
        SimConfig(
            policy=replace(
                base,
                ttl_s=ttl,
                lease_ttl_s=ttl,  # as the orchestrator sets it
                recompute_threshold_tokens=threshold,
                idle_budget_bytes_per_engine=budget,
            ),
            num_decode_engines=args.decode_engines,
            decode_tokens_per_s=deployment.decode_tokens_per_s,
            token_unit=args.token_unit,
            measure_window_s=measure,
        )
        for budget in budgets
        for ttl in TTLS_S
        for threshold in THRESHOLDS
    ]
    results = sweep(trace, configs, min(args.jobs, len(configs)))

    setup_s, rate = base.transfer_setup_s, deployment.prefill_tokens_per_s
    per_token_saving = 1 / rate - deployment.kv_bytes_per_token * 8 / (deployment.link_gbps * 1e9)
    sessions = len(first_turns)
    print(deployment.label)
    print(
        f"  KV {deployment.kv_bytes_per_token:,} B/token per engine (bf16, every GPU's share); "
        f"KV capacity {deployment.kv_capacity_bytes / GiB:.0f} GiB per engine"
    )
    print(
        f"  prefill {rate:,.0f} tokens/s (compute-bound estimate); decode "
        f"{deployment.decode_tokens_per_s:.1f} tokens/s per user (batch {args.decode_batch}); "
        f"link {deployment.link_gbps:,.0f} Gb/s ({deployment.link_kind})"
    )
    if per_token_saving > 0:
        print(f"  pull beats recompute from {setup_s / per_token_saving:,.0f} tokens (5 ms setup)")
    print(
        f"workload: {sessions} sessions, {len(trace)} turns, mean prompt "
        f"{mean_context(trace):,.0f} tokens; {args.decode_engines} decode engines; "
        f"token unit {args.token_unit}; means over t = "
        + (f"{measure[0]:.0f}..{measure[1]:.0f} s" if measure else "the whole run")
    )
    rows = list(zip(configs, results, strict=True))
    print(table(rows, sessions))
    print(f"({len(configs)} runs in {time.perf_counter() - started:.1f} s)")
    if args.plot:
        plot(args.plot, rows, deployment)


if __name__ == "__main__":
    main()
