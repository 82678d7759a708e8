"""``kvtide kernels {validate,show,diff,compile,ab}``.

The orchestrator's CLI mounts this with ``kernels.cli.add_parser(subparsers)``; each
subcommand sets ``func`` to a handler that takes the parsed ``argparse.Namespace`` and
returns the exit code. ``main(argv)`` runs the same commands standalone
(``python -m kernels ...``).

    validate  run every case in scope on this machine's GPU; write evidence JSON + Markdown
    show      list scopes and which cases have evidence under kernels/evidence/
    diff      compare two evidence files
    compile   compile every kernel for every arch in scope (no GPU needed) and report
    ab        engine-level A/B of vLLM's Kimi K3 path against the stock path (kernels.ab)
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "main"]


def add_parser(subparsers: Any) -> None:
    """Register ``kernels`` and its subcommands on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "kernels", help="specialised decode kernels: compile, validate, show evidence"
    )
    parser.set_defaults(func=lambda _args: _usage(parser))
    sub = parser.add_subparsers(dest="kernels_command")

    p = sub.add_parser("validate", help="check every case in scope on this GPU; write evidence")
    p.add_argument("--kernel", action="append", help="only this kernel (repeatable)")
    p.add_argument("--cubins", type=Path, help="cubin directory (default: compile, or shipped)")
    p.add_argument("--out", type=Path, help="evidence path stem (default: kernels/evidence/..)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run the harness on CPU with the kernels' emulation (kernels.emulate) in "
        "place of the kernels (a minute at the largest batches; combine with "
        "--max-batch); write nothing unless --out",
    )
    p.add_argument("--max-batch", type=int, help="only cases with at most this batch")
    p.set_defaults(func=_validate)

    p = sub.add_parser("show", help="scopes and their evidence")
    p.add_argument("--evidence-dir", type=Path, help="default: kernels/evidence/")
    p.add_argument("--cases", action="store_true", help="list every case and its evidence")
    p.set_defaults(func=_show)

    p = sub.add_parser("diff", help="compare two evidence files")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.set_defaults(func=_diff)

    p = sub.add_parser("compile", help="compile every kernel for every arch in scope (CPU)")
    p.add_argument("--out", type=Path, help="output directory (default: a temporary one)")
    p.add_argument("--arch", action="append", help="only this arch (repeatable)")
    p.add_argument(
        "--ship", action="store_true", help="rewrite the cubins shipped in kernels/cubins/"
    )
    p.add_argument("--sass", action="store_true", help="also count spills in the SASS")
    p.set_defaults(func=_compile)

    p = sub.add_parser("ab", help="A/B a specialised vLLM path against the stock path (GPU)")
    p.add_argument("--model", required=True, help="local checkpoint directory")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--batch", type=int, action="append", help="batch sizes (default: scope's)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, help="evidence path stem (default: kernels/evidence/..)")
    p.add_argument(
        "--self-check",
        action="store_true",
        help="both sides on the stock path: checks the A/B machinery, evidence for nothing",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print both sides' engine args; start nothing"
    )
    p.set_defaults(func=_ab)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _show(args: argparse.Namespace) -> int:
    from kernels import evidence

    print(evidence.show(args.evidence_dir or evidence.EVIDENCE_DIR, cases=args.cases))
    return 0


def _diff(args: argparse.Namespace) -> int:
    from kernels import evidence

    print(evidence.diff(args.a, args.b))
    return 0


def _compile(args: argparse.Namespace) -> int:
    from kernels.compile import SHIPPED_ARCHS, SHIPPED_DIR, compile_all, format_report
    from kernels.cute import CutlassUnavailable

    archs = args.arch
    out = args.out
    if args.ship:
        out, archs = SHIPPED_DIR, archs or list(SHIPPED_ARCHS)
        for old in SHIPPED_DIR.glob("*/*.*"):
            old.unlink()
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="kvtide-kernels-"))
    try:
        compiled = compile_all(out, archs=archs, sass=args.sass)
    except CutlassUnavailable as exc:
        print(exc, file=sys.stderr)
        return 1
    print(format_report(compiled))
    print(f"\n{len(compiled)} cubins in {out}")
    return 0


def _cubins_for(explicit: Path | None) -> tuple[Path, str]:
    """(directory, how it was chosen): explicit, or the shipped cubins (every arch in
    scope ships; evidence is bound to them)."""
    from kernels.sources import SHIPPED_DIR

    if explicit is not None:
        return explicit, "given"
    return SHIPPED_DIR, "shipped"


def _validate(args: argparse.Namespace) -> int:
    import torch

    from kernels import evidence, validate

    cases = [
        c
        for c in validate.all_cases()
        if (not args.kernel or c.kernel in args.kernel)
        and (args.max_batch is None or c.batch <= args.max_batch)
    ]
    if args.dry_run:
        from kernels.emulate import Emulated

        emulated = {"source": "CPU emulation (dry run)"}
        results = _run_writing(
            cases, Emulated(), torch.device("cpu"), args.out, "cpu", emulated, {}
        )
        failed = [r for r in results if not r.passed]
        print(f"dry run: {len(results) - len(failed)} passed, {len(failed)} failed")
        return 1 if failed else 0
    if not torch.cuda.is_available():
        print("no CUDA GPU here: validate needs one (try --dry-run)", file=sys.stderr)
        return 2

    from kernels.ops import CubinSet, Kernels
    from kernels.scope import arch_from_capability
    from kernels.sources import binding_for

    device = torch.device("cuda", 0)
    arch = arch_from_capability(*torch.cuda.get_device_capability(device))
    cubin_dir, how = _cubins_for(args.cubins)
    cubins = CubinSet.open(cubin_dir)
    impl = Kernels(cubins, device)
    binding = binding_for(arch, {"source_sha256": cubins.source_sha256, "kernels": cubins.entries})
    meta: dict[str, Any] = {
        "dir": str(cubin_dir),
        "chosen": how,
        "nvidia_cutlass_dsl": cubins.nvidia_cutlass_dsl,
    }
    gpu = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    stem = args.out or evidence.EVIDENCE_DIR / f"{arch}-{gpu}-{stamp}"
    results = _run_writing(cases, impl, device, stem, arch, meta, binding or {}, impl.launched)
    num_failed = sum(1 for r in results if not r.passed)
    print(f"{len(results) - num_failed} passed, {num_failed} failed; evidence: {stem}.json/.md")
    return 1 if num_failed else 0


def _run_writing(
    cases: Sequence[Any],
    impl: Any,
    device: Any,
    stem: Path | None,
    arch: str,
    meta: dict[str, Any],
    binding: dict[str, Any],
    launched: Any = None,
) -> list[Any]:
    """Run ``cases``, rewriting the evidence at ``stem`` after each one (a run cut short
    keeps every case it finished; the summary counts those not run)."""
    from kernels import evidence, validate

    fp = evidence.fingerprint()
    results: list[validate.CaseResult] = []

    def progress(r: validate.CaseResult) -> None:
        results.append(r)
        timing = f"{r.kernel_us:.2f} vs {r.stock_us:.2f} µs" if r.kernel_us and r.stock_us else ""
        print(f"{'pass' if r.passed else 'FAIL'} {r.case_id} {timing} {r.detail}", flush=True)
        if stem is None:
            return
        loaded = next(iter(launched or ()), None)
        if loaded is not None:
            meta.update(backend=loaded.backend, image_kind=loaded.image_kind)
        evidence.write(stem, arch, results, meta, fp, binding, planned=len(cases))

    validate.run_cases(cases, impl, device, progress=progress)
    return results


def ab_plan(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], list[int]]:
    """(stock side's engine args, the other side's, batch sizes) of ``kvtide kernels ab``."""
    from kernels import ab
    from kernels.scope import KIMI_K3

    batches = sorted(set(args.batch or [c.batch for c in KIMI_K3.cases()]))
    common = {"tp": args.tp, "dcp": args.dcp, "max_batch": max(batches)}
    stock = ab.engine_args(args.model, scope=None, **common)
    other = ab.engine_args(args.model, scope=None if args.self_check else KIMI_K3, **common)
    return stock, other, batches


def _ab(args: argparse.Namespace) -> int:
    import json

    stock_args, path_args, batches = ab_plan(args)
    if args.dry_run:
        print(json.dumps({"stock": stock_args, "path": path_args, "batches": batches}, indent=1))
        return 0
    import torch

    from kernels import ab, evidence
    from kernels.ab_run import run_side
    from kernels.scope import arch_from_capability
    from kernels.vllm_plugin import installed_vllm_version

    if not torch.cuda.is_available():
        print("no CUDA GPU here: kernels ab needs one (try --dry-run)", file=sys.stderr)
        return 2
    arch = arch_from_capability(*torch.cuda.get_device_capability(0))
    texts = ab.prompts(max(batches))
    stock = run_side(stock_args, texts, batches, args.max_tokens)
    path = run_side(path_args, texts, batches, args.max_tokens)
    judge_speed = not args.self_check  # stock against stock: neither side is faster
    results = [
        ab.compare(b, stock.records[b], path.records[b], judge_speed=judge_speed) for b in batches
    ]
    proof = ab.backend_proof(stock.backend, path.backend)
    for r in results:
        speed = f"ITL {r.stock.itl_ms_median:.2f} -> {r.path.itl_ms_median:.2f} ms"
        print(
            f"{'pass' if r.passed else 'FAIL'} batch {r.batch}: {len(r.divergences)} diverging "
            f"(worst {r.divergence}), {speed}"
        )
    print(f"specialised backend ran: {proof['ran']} ({proof['path_only_modules'][:5]})")
    span = ab.passing_range(results)
    print(
        "a validated scope may claim "
        + ("nothing" if span is None else f"batch {span[0]}..{span[1]}")
        + " of this run"
    )
    model_type = json.loads((Path(args.model) / "config.json").read_text()).get("model_type")
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    kind = "ab-self-check" if args.self_check else "ab"
    stem = args.out or evidence.EVIDENCE_DIR / f"{kind}-{arch}-tp{args.tp}-dcp{args.dcp}-{stamp}"
    engine = {"model_type": model_type, "tp": args.tp, "dcp": args.dcp, "model": args.model}
    json_path, _ = ab.write(
        stem,
        arch=arch,
        engine=engine,
        vllm_version=installed_vllm_version(),
        fingerprint=evidence.fingerprint(),
        results=results,
        backend=proof,
        self_check=args.self_check,
    )
    print(f"A/B evidence: {json_path}")
    ran = args.self_check or proof["ran"]
    return 0 if ran and all(r.passed for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kernels <validate|show|diff|compile> ...``."""
    parser = argparse.ArgumentParser(prog="kvtide")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["kernels", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
