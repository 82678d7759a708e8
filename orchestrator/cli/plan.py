"""``kvtide plan``: does a model fit, how fast does it decode, and which DCP degree to use.

    kvtide plan --model deepseek-v3 --device h200 --tp 8 --context 131072 --users 64

prints the model, where it fits, one row per device / TP / DCP degree (weights, KV
budget and KV bytes per token per GPU, sequences of the context that fit, decode speed
at the batch the engine can hold) and, per device and TP, the DCP degree the chooser
picks with its reasons. Everything comes from the pure capacity model in
``placement/`` (``fits_on``, ``plan_table``, ``choose_dcp``); docs/plan.md shows how
to read it. ``--plot PATH`` also draws decode speed against context (needs matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from orchestrator.cli.table import Align, format_table
from orchestrator.errors import ConfigError
from placement.capacity import (
    DEFAULT_MEMORY,
    FitReport,
    fits_on,
    kv_bytes_per_token,
    valid_tp_degrees,
)
from placement.dcp import ContextMix, DCPDecision, choose_dcp, evaluate_shape
from placement.devices import DEVICES, DeviceSpec, device_by_name
from placement.model_catalog import BUILTIN_MODELS, load_model_spec
from placement.model_errors import UnknownDevice, UnsupportedModel
from placement.model_spec import ModelSpec
from placement.pools import PlanRow, PoolPlan, Workload, plan_pools, plan_table
from placement.quantization import WEIGHT_PRECISIONS, stored_as

__all__ = ["add_plan_parser", "cmd_plan", "format_plan"]

_GB = 1e9
_PLOT_MIN_CONTEXT = 1024


def add_plan_parser(subparsers: Any) -> None:
    """Register ``plan`` on the ``kvtide`` command's subparsers."""
    devices = ", ".join(d.name for d in DEVICES)
    plan = subparsers.add_parser(
        "plan",
        help="capacity, decode speed and the DCP choice of a model on devices",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument(
        "--model",
        required=True,
        type=_model_arg,
        help=f"built-in model ({', '.join(BUILTIN_MODELS)}) or a config.json path",
    )
    plan.add_argument(
        "--device",
        required=True,
        action="append",
        type=_devices_arg,
        help=f"catalog device, repeatable or comma-separated: {devices}",
    )
    plan.add_argument(
        "--tp",
        action="append",
        type=_ints_arg,
        help="tensor-parallel degrees (default: those inside the device's scale-up domain "
        "whose weights fit)",
    )
    plan.add_argument(
        "--context",
        type=_tokens_arg,
        default=131072,
        help="context tokens per sequence at decode time, e.g. 131072 or 128k (default 128k)",
    )
    plan.add_argument(
        "--users", type=_positive_int, default=64, help="concurrent users (default 64)"
    )
    plan.add_argument(
        "--weights",
        choices=WEIGHT_PRECISIONS,
        help="plan the weights stored at this precision instead of the checkpoint's "
        "(scales included: int4 is group-quantized, 4.25 bits a weight; fp8 per tensor; "
        "int8 per channel)",
    )
    plan.add_argument("--plot", metavar="PATH", help="also write a PNG of decode speed vs context")
    plan.add_argument(
        "--pools",
        metavar="MIX",
        type=_mix_arg,
        help="also size a TP-only decode pool and a TP+DCP long-context pool for a workload "
        "whose decode contexts are MIX (context:share,... e.g. 8k:0.7,64k:0.2,256k:0.1), and "
        "print the routing threshold between them as kvtide config",
    )
    plan.add_argument(
        "--sessions-per-s", type=float, default=1.0, help="with --pools: arrivals (default 1)"
    )
    plan.add_argument(
        "--turns", type=float, default=1.0, help="with --pools: turns per session (default 1)"
    )
    plan.add_argument(
        "--output-tokens",
        type=_positive_int,
        default=512,
        help="with --pools: output tokens per turn (default 512)",
    )
    plan.add_argument(
        "--min-tokens-per-s-per-user",
        type=float,
        default=0.0,
        help="with --pools: latency target per user (default none)",
    )
    plan.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the plan; 0 on success, 1 when the plot was asked for but not written."""
    spec: ModelSpec = args.model
    if args.weights is not None:
        spec = dataclasses.replace(spec, quant=stored_as(args.weights, spec.quant))
    devices = _unique(d for group in args.device for d in group)
    tps = sorted({tp for group in args.tp or () for tp in group}) or None
    if tps:
        _check_tps(spec, tps)
    print(format_plan(spec, devices, context_tokens=args.context, users=args.users, tps=tps))
    if args.pools is not None:
        workload = Workload(
            sessions_per_s=args.sessions_per_s,
            contexts=args.pools,
            turns_per_session=args.turns,
            output_tokens_per_turn=args.output_tokens,
            min_tokens_per_s_per_user=args.min_tokens_per_s_per_user,
        )
        for device in devices:
            print()
            print(format_pools(plan_pools(spec, device, workload, tps=tps), spec, device))
    if args.plot:
        return _write_plot(spec, devices, args.context, args.users, tps, args.plot)
    return 0


def format_pools(plan: PoolPlan, spec: ModelSpec, device: DeviceSpec) -> str:
    """The pool plan and the config the router uses (``decode``, ``decode_long``,
    ``routing.long_context_threshold_tokens``)."""
    lines = [f"decode pools for {spec.name} on {device.name}:"]
    lines += [f"  {reason}" for reason in plan.reasons]
    if plan.short_pool is None and plan.long_pool is None:
        return "\n".join(lines)
    lines.append("  kvtide config:")
    pools = [p for p in (plan.short_pool, plan.long_pool) if p is not None]
    # One pool serves everything: it is the decode pool, whatever its shape.
    for name, pool in zip(("decode", "decode_long"), pools, strict=False):
        lines += [
            f"    {name}:",
            f"      num_engines: {pool.num_replicas}",
            f"      tensor_parallel_size: {pool.shape.tp}",
        ]
        if pool.shape.dcp > 1:
            lines.append(f"      decode_context_parallel_size: {pool.shape.dcp}")
    if plan.short_pool is not None and plan.long_pool is not None:
        lines += [
            "    routing:",
            f"      long_context_threshold_tokens: {plan.threshold_tokens}",
        ]
    return "\n".join(lines)


def format_plan(
    spec: ModelSpec,
    devices: Sequence[DeviceSpec],
    *,
    context_tokens: int,
    users: int,
    tps: Sequence[int] | None = None,
) -> str:
    """The text ``kvtide plan`` prints (no trailing newline)."""
    rows = plan_table(spec, devices, context_tokens=context_tokens, concurrent_users=users, tps=tps)
    engines = _unique((r.device, r.shape.tp) for r in rows)
    decisions = {(d.name, tp): choose_dcp(spec, d, tp, context_tokens, users) for d, tp in engines}
    tp_text = "tp=" + ",".join(str(t) for t in tps) if tps else "tp inside the scale-up domain"
    names = ", ".join(d.name for d in devices)
    lines = [
        f"kvtide plan: {spec.name} on {names}, {tp_text}; context {context_tokens:,} tokens, "
        f"{users:,} concurrent users",
        "",
        *_model_lines(spec),
        "",
        *_fit_lines(spec, devices, context_tokens),
        "",
        *_table_lines(rows, decisions),
    ]
    for device, tp in engines:
        lines += ["", *_decision_lines(device, tp, decisions[(device.name, tp)])]
        lines += _kernel_lines(spec, device, tp, decisions[(device.name, tp)].dcp)
    return "\n".join(lines)


# The PTX target of each catalog GPU that has specialised kernels in kernels/.
GPU_ARCH = {"h100-sxm": "sm_90a", "h200": "sm_90a", "b200": "sm_100a", "gb200": "sm_100a"}
GPU_ARCH["gb300"] = "sm_103a"


def _kernel_lines(spec: ModelSpec, device: DeviceSpec, tp: int, dcp: int) -> list[str]:
    """Which specialised decode path this engine would run, and why (``kernels.gate``):
    each is enabled only inside a scope its GPU evidence covers, and only where the
    config's ``specialised_paths`` opts in (a plan has no config: "not opted in" then
    means the evidence would allow it)."""
    from kernels.gate import decide
    from kernels.vllm_plugin import installed_vllm_version
    from orchestrator.config.decode_paths import model_engine_shape

    arch = GPU_ARCH.get(device.name)
    if arch is None:
        return [f"  specialised decode paths: none for {device.name} (no kernels target it)"]
    engine = model_engine_shape(
        spec,
        gpu_arch=arch,
        dtype="bf16",
        tp=tp,
        dcp=max(1, dcp),
        max_batch=DEFAULT_MEMORY.max_num_seqs,
        vllm_version=installed_vllm_version(),
    )
    return [f"  specialised decode paths ({arch}, dcp={engine.dcp}):"] + [
        f"    {d.path}: {'on' if d.enabled else 'off'} ({d.reason})" for d in decide(engine)
    ]


def _model_lines(spec: ModelSpec) -> list[str]:
    mem = DEFAULT_MEMORY
    kv = kv_bytes_per_token(spec, kv_dtype_bytes=mem.kv_cache_dtype_bytes)
    attention = spec.attention.value.upper()
    if spec.linear_attention is not None:
        attention += f" + {spec.linear_attention.kind.value} linear attention"
    return [
        f"model: {spec.name} ({spec.model_type}), {spec.num_params / 1e9:,.1f}B parameters, "
        f"{spec.num_active_params / 1e9:,.1f}B active per token, "
        f"{spec.weight_bytes(include_mtp=mem.include_mtp) / _GB:,.1f} GB of weights "
        f"({spec.quant.name})",
        f"KV cache: {attention}, {spec.num_full_attention_layers} attention layers, "
        f"{kv:,.0f} B/token for the whole model at {mem.kv_cache_dtype_bytes} bytes per value",
        f"engine memory: gpu_memory_utilization {mem.gpu_memory_utilization}, "
        f"{mem.activation_reserve_bytes / 2**30:g} GiB activation reserve per GPU, "
        f"max_num_seqs {mem.max_num_seqs:,}",
    ]


def _fit_lines(spec: ModelSpec, devices: Sequence[DeviceSpec], context_tokens: int) -> list[str]:
    report: FitReport = fits_on(spec, devices, context_tokens=context_tokens)
    lines = [
        f"fits on (the smallest engine holding the weights and one {context_tokens:,}-token "
        "sequence):"
    ]
    for device, shape in report.per_device:
        if shape is None:
            lines.append(f"  {device.name:<10} no engine of up to 128 GPUs")
            continue
        where = "one device" if shape.num_gpus == 1 else f"{shape.num_gpus} GPUs"
        domain = device.nvlink_domain_size
        if shape.num_gpus > domain:
            where += f", {-(-shape.num_gpus // domain)} scale-up domains of {domain}"
        lines.append(f"  {device.name:<10} tp={shape.tp} pp={shape.pp} ({where})")
    return lines


_HEADER: tuple[tuple[str, Align], ...] = (
    ("device", "<"),
    ("tp", ">"),
    ("dcp", ">"),
    ("weights/GPU", ">"),
    ("KV budget/GPU", ">"),
    ("KV B/token/GPU", ">"),
    ("max seqs", ">"),
    ("batch", ">"),
    ("tok/s/user", ">"),
    ("tok/s/GPU", ">"),
    ("step ms", ">"),
    ("", "<"),
)


def _table_lines(
    rows: Sequence[PlanRow], decisions: dict[tuple[str, int], DCPDecision]
) -> list[str]:
    cells: list[list[str]] = []
    for r in rows:
        e = r.engine.estimate
        chosen = decisions[(r.device.name, r.shape.tp)].dcp == r.shape.dcp
        note = "does not fit" if not r.fits else ("<- chosen" if chosen else "")
        cells.append(
            [
                r.device.name,
                str(r.shape.tp),
                str(r.shape.dcp),
                f"{r.weight_bytes_per_gpu / _GB:,.1f} GB",
                f"{r.kv_budget_bytes_per_gpu / _GB:,.1f} GB",
                f"{r.kv_bytes_per_token_per_gpu:,.0f}",
                f"{r.engine.max_sequences:,}",
                f"{r.engine.batch_size:,}" if e else "-",
                f"{e.tokens_per_s_per_user:,.1f}" if e else "-",
                f"{e.tokens_per_s_per_gpu:,.1f}" if e else "-",
                f"{e.step_s * 1e3:,.2f}" if e else "-",
                note,
            ]
        )
    headers = [h for h, _ in _HEADER]
    return format_table(headers, cells, align=[a for _, a in _HEADER]).splitlines()


def _decision_lines(device: DeviceSpec, tp: int, decision: DCPDecision) -> list[str]:
    fits = any(c.fits for c in decision.candidates)
    choice = f"dcp={decision.dcp}" if fits else "none, the engine does not fit"
    return [f"DCP on {device.name} tp={tp}: {choice}"] + [
        f"  {reason}" for reason in decision.reasons
    ]


def _write_plot(
    spec: ModelSpec,
    devices: Sequence[DeviceSpec],
    context_tokens: int,
    users: int,
    tps: Sequence[int] | None,
    path: str,
) -> int:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(
            "kvtide plan: --plot needs matplotlib, which is not installed here; "
            "install kvtide's `plot` extra (`pip install -e '.[plot]'` in a clone, or "
            "`pip install matplotlib`); the table above is complete without it.",
            file=sys.stderr,
        )
        return 1
    contexts = [_PLOT_MIN_CONTEXT]
    while contexts[-1] < context_tokens:
        contexts.append(contexts[-1] * 2)
    rows = plan_table(spec, devices, context_tokens=context_tokens, concurrent_users=users, tps=tps)
    engines = _unique((r.device, r.shape.tp) for r in rows if r.fits)
    if not engines:
        print(f"kvtide plan: nothing to plot, no engine above fits; {path} not written.")
        return 1
    # One panel per device and TP, one line per DCP degree: where the lines cross is
    # the context at which DCP starts to pay off for this many users.
    num_cols = min(3, len(engines))
    num_rows = -(-len(engines) // num_cols)
    fig = Figure(figsize=(4.2 * num_cols, 3.4 * num_rows), layout="constrained")
    axes = fig.subplots(num_rows, num_cols, squeeze=False).flatten()
    for ax, (device, tp) in zip(axes, engines, strict=False):
        for row in rows:
            if (row.device, row.shape.tp) != (device, tp) or not row.fits:
                continue
            mixes = [(c, ContextMix.single(c)) for c in contexts]
            points = [(c, evaluate_shape(spec, device, row.shape, m, users)) for c, m in mixes]
            xs = [c for c, e in points if e.fits]
            ys = [e.tokens_per_s_per_gpu for _, e in points if e.fits]
            ax.plot(xs, ys, marker="o", markersize=3, label=f"dcp={row.shape.dcp}")
        ax.set_title(f"{device.name} tp={tp}", fontsize="medium")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("tokens/s per GPU")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[len(engines) :]:
        ax.set_visible(False)
    fig.suptitle(f"{spec.name}: decode throughput with {users} concurrent users")
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return 0


def _check_tps(spec: ModelSpec, tps: Sequence[int]) -> None:
    valid = valid_tp_degrees(spec, max_tp=max(128, *tps))
    bad = [tp for tp in tps if tp not in valid]
    if bad:
        raise ConfigError(
            f"--tp {','.join(map(str, bad))} cannot run {spec.name}: heads, KV heads or "
            f"experts do not split evenly; valid degrees: {', '.join(map(str, valid))}.",
            field="--tp",
        )


def _model_arg(value: str) -> ModelSpec:
    try:
        return load_model_spec(value)
    except UnsupportedModel as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _devices_arg(value: str) -> list[DeviceSpec]:
    try:
        return [device_by_name(name.strip()) for name in value.split(",") if name.strip()]
    except UnknownDevice as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ints_arg(value: str) -> list[int]:
    return [_positive_int(v) for v in value.split(",") if v.strip()]


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive integer")
    return number


def _tokens_arg(value: str) -> int:
    """Tokens as an integer, or with a k suffix (x 1,024): 128k = 131,072."""
    text = value.strip().lower()
    if text.endswith("k"):
        return _positive_int(text[:-1]) * 1024
    return _positive_int(text)


def _mix_arg(value: str) -> ContextMix:
    """``8k:0.7,64k:0.2,256k:0.1`` → a ContextMix (shares need not sum to 1)."""
    buckets = []
    for part in value.split(","):
        tokens, sep, share = part.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(
                f"{part!r}: write each bucket as context:share, e.g. 64k:0.2"
            )
        try:
            weight = float(share)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: the share must be a number") from None
        if weight <= 0:
            raise argparse.ArgumentTypeError(f"{part!r}: the share must be above 0")
        buckets.append((_tokens_arg(tokens), weight))
    return ContextMix.of(buckets)


def _unique(items: Any) -> list[Any]:
    seen: list[Any] = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen
