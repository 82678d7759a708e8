"""Engine-level A/B of a specialised path: the pure parts (``kvtide kernels ab``).

The same model and prompts go through a stock engine (side A) and an engine on the
specialised path (side B), greedy, at each batch size of the path's scope
(``VllmPathScope.cases()``). A batch size passes when all three hold:

- correct: every request's tokens are equal, or its first divergence is a near-tie (the
  stock engine's logprob of its token minus of side B's token under ``TIE_MARGIN``: any
  change of summation order may flip it); a confident divergence in any request, a token
  outside the top-k, or outputs of different lengths fail. Every request's first
  divergence is recorded, not only the first request's;
- not slower: side B's ITL median at most the stock side's (a narrowed scope ends where
  the path stops winning);
- the path ran: ``backend_proof`` finds, in what each side's engine reports it built
  (``kernels.ab_run.backend_report``), the path's ``additional_config`` and modules the
  stock engine does not have.

``kernels.ab_run`` runs the engines (GPU, vLLM); everything here is pure and CPU-tested.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kernels.scope import KIMI_K3, VllmPathScope
from kernels.timing import quantile

__all__ = [
    "TIE_MARGIN",
    "AbResult",
    "Divergence",
    "RequestRecord",
    "SideStats",
    "backend_proof",
    "compare",
    "divergences",
    "engine_args",
    "passing_range",
    "prompts",
    "side_stats",
    "write",
]

TIE_MARGIN = 0.05  # nats
FORMAT = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    """One greedy request as an engine served it: token ids, each token's arrival (s
    after the request was sent), and per position the top logprobs ``{token: logprob}``."""

    token_ids: tuple[int, ...]
    arrival_s: tuple[float, ...]
    top_logprobs: tuple[Mapping[int, float], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Divergence:
    request: int
    position: int
    stock_token: int
    path_token: int
    margin: float  # stock's logprob of its token minus of the path's (inf: not in top-k)


@dataclass(frozen=True, slots=True, kw_only=True)
class SideStats:
    ttft_ms_median: float
    ttft_ms_p90: float
    itl_ms_median: float
    itl_ms_p90: float


@dataclass(frozen=True, slots=True, kw_only=True)
class AbResult:
    """One batch size: ``passed`` = ``correct`` and ``not_slower`` (``speed_judged``
    False, a self-check: stock against stock, speed not judged)."""

    batch: int
    passed: bool
    correct: bool
    not_slower: bool
    speed_judged: bool
    tokens_equal: bool
    divergences: tuple[Divergence, ...]
    stock: SideStats
    path: SideStats

    @property
    def divergence(self) -> Divergence | None:
        """The most confident divergence (largest margin), or None."""
        return max(self.divergences, key=lambda d: d.margin, default=None)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def engine_args(
    model: str,
    *,
    tp: int,
    dcp: int,
    max_batch: int,
    scope: VllmPathScope | None,
    max_model_len: int = 4096,
) -> dict[str, Any]:
    """vLLM engine args of one side: ``scope`` None is the stock side, else the path's
    ``additional_config`` is added. Nothing else differs between the sides."""
    args: dict[str, Any] = {
        "model": model,
        "tensor_parallel_size": tp,
        "max_num_seqs": max_batch,
        "max_model_len": max_model_len,
        "enable_prefix_caching": False,  # both sides prefill every prompt
        "seed": 0,
    }
    if dcp > 1:
        args["decode_context_parallel_size"] = dcp
    if scope is not None:
        args["additional_config"] = dict(scope.additional_config)
    return args


def prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct, deterministic prompts of varied length."""
    topics = ("rivers", "compilers", "tides", "bridges", "orchards", "comets", "ledgers")
    out = []
    for i in range(count):
        topic = topics[(i + seed) % len(topics)]
        repeat = 1 + (i * 7 + seed) % 5
        out.append(f"Request {i}: " + f"Write plainly about {topic}. " * repeat)
    return out


def _margin(top: Mapping[int, float], stock_token: int, path_token: int) -> float:
    if stock_token not in top or path_token not in top:
        return float("inf")
    return top[stock_token] - top[path_token]


def _first(i: int, a: RequestRecord, b: RequestRecord) -> Divergence | None:
    for pos, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):
        if ta != tb:
            top = a.top_logprobs[pos] if pos < len(a.top_logprobs) else {}
            return Divergence(
                request=i, position=pos, stock_token=ta, path_token=tb,
                margin=_margin(top, ta, tb),
            )  # fmt: skip
    if len(a.token_ids) != len(b.token_ids):
        # Greedy with ignore_eos: a side that stopped early is broken, not near a tie.
        pos = min(len(a.token_ids), len(b.token_ids))
        return Divergence(
            request=i, position=pos, stock_token=-1, path_token=-1, margin=float("inf")
        )
    return None


def divergences(
    stock: Sequence[RequestRecord], path: Sequence[RequestRecord]
) -> tuple[Divergence, ...]:
    """Each request's first divergence (requests whose tokens are equal have none)."""
    found = (_first(i, a, b) for i, (a, b) in enumerate(zip(stock, path, strict=True)))
    return tuple(d for d in found if d is not None)


def side_stats(records: Sequence[RequestRecord]) -> SideStats:
    """TTFT (first arrival) and ITL (gaps between arrivals) over every request, in ms."""
    ttft = [r.arrival_s[0] * 1e3 for r in records if r.arrival_s]
    itl = [
        (b - a) * 1e3 for r in records for a, b in zip(r.arrival_s, r.arrival_s[1:], strict=False)
    ]
    ttft, itl = ttft or [0.0], itl or [0.0]
    return SideStats(
        ttft_ms_median=quantile(ttft, 0.5),
        ttft_ms_p90=quantile(ttft, 0.9),
        itl_ms_median=quantile(itl, 0.5),
        itl_ms_p90=quantile(itl, 0.9),
    )


def compare(
    batch: int,
    stock: Sequence[RequestRecord],
    path: Sequence[RequestRecord],
    judge_speed: bool = True,
) -> AbResult:
    """The A/B of one batch size: correct when every request's first divergence (if any)
    is a near-tie; not slower when side B's ITL median is at most the stock side's."""
    found = divergences(stock, path)
    stock_stats, path_stats = side_stats(stock), side_stats(path)
    correct = all(d.margin < TIE_MARGIN for d in found)
    not_slower = path_stats.itl_ms_median <= stock_stats.itl_ms_median
    return AbResult(
        batch=batch,
        passed=correct and (not_slower or not judge_speed),
        correct=correct,
        not_slower=not_slower,
        speed_judged=judge_speed,
        tokens_equal=not found,
        divergences=found,
        stock=stock_stats,
        path=path_stats,
    )


def passing_range(results: Sequence[AbResult]) -> tuple[int, int] | None:
    """(smallest, largest) batch of the run of batch sizes, from the smallest up, that
    all passed: the widest batch range a validated scope may claim (None: the smallest
    failed). Past the first failure (a confident divergence, or slower than stock) the
    scope stops, whatever larger batch sizes did."""
    ordered = sorted(results, key=lambda r: r.batch)
    passed = []
    for r in ordered:
        if not r.passed:
            break
        passed.append(r.batch)
    return (passed[0], passed[-1]) if passed else None


def backend_proof(
    stock: Mapping[str, Any], path: Mapping[str, Any], scope: VllmPathScope = KIMI_K3
) -> dict[str, Any]:
    """Whether side B ran the specialised backend, from what each engine reported it
    built (``{"additional_config": {...}, "modules": [class names]}``): the path's
    ``additional_config`` reached side B's engine, not the stock side's, and side B's
    model has modules the stock one does not (the backend's, not only a flag)."""
    wanted = dict(scope.additional_config)
    path_config = dict(path.get("additional_config") or {})
    stock_config = dict(stock.get("additional_config") or {})
    configured = all(path_config.get(k) == v for k, v in wanted.items())
    stock_clean = not any(stock_config.get(k) == v for k, v in wanted.items())
    extra = sorted(set(path.get("modules") or ()) - set(stock.get("modules") or ()))
    return {
        "ran": configured and stock_clean and bool(extra),
        "configured": configured,
        "stock_clean": stock_clean,
        "path_only_modules": extra,
    }


def write(
    stem: Path,
    *,
    arch: str,
    engine: Mapping[str, Any],
    vllm_version: str | None,
    fingerprint: Mapping[str, Any],
    results: Sequence[AbResult],
    backend: Mapping[str, Any] | None = None,
    scope: VllmPathScope = KIMI_K3,
    self_check: bool = False,
) -> tuple[Path, Path]:
    """``<stem>.json`` (kind "ab") and its Markdown twin. ``backend``: ``backend_proof``
    of the run. ``self_check``: both sides ran the stock path (a check of the A/B
    machinery, evidence for nothing)."""
    rows = [r.to_json() for r in results]
    data = {
        "format": FORMAT,
        "kind": "ab-self-check" if self_check else "ab",
        "path": scope.name,
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "arch": arch,
        "engine": dict(engine),
        "vllm_version": vllm_version,
        "fingerprint": dict(fingerprint),
        "backend": dict(backend or {}),
        "results": rows,
        "summary": {
            "passed": sum(r.passed for r in results),
            "failed": sum(not r.passed for r in results),
        },
    }
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    lines = [
        f"# A/B: {scope.name} on {arch}{' (self-check: stock vs stock)' if self_check else ''}",
        "",
        f"- engine: {json.dumps(dict(engine), sort_keys=True)}, vLLM {vllm_version}",
        f"- specialised backend ran: {json.dumps(dict(backend or {}), sort_keys=True)}",
        "",
        "| batch | result | diverging requests (most confident) | TTFT ms A / B "
        "| ITL ms A / B (p90) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        d = r.divergence
        where = (
            "-"
            if d is None
            else f"{len(r.divergences)} (req {d.request} pos {d.position}, margin {d.margin:.3g})"
        )
        verdict = "pass" if r.passed else "FAIL"
        if not r.correct:
            verdict += " (confident divergence)"
        if r.speed_judged and not r.not_slower:
            verdict += " (slower)"
        lines.append(
            f"| {r.batch} | {verdict} | {where} "
            f"| {r.stock.ttft_ms_median:.1f} / {r.path.ttft_ms_median:.1f} "
            f"| {r.stock.itl_ms_median:.2f} / {r.path.itl_ms_median:.2f} "
            f"({r.stock.itl_ms_p90:.2f} / {r.path.itl_ms_p90:.2f}) |"
        )
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path
