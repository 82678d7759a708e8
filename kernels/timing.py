"""Timing on a GPU as an engine sees it: under CUDA graphs, warmed up, medians and spread.

An engine replays its decode step from a CUDA graph, so a kernel's eager launch cost
(Python, ctypes, the driver) is not what it pays. ``time_cuda`` captures ``calls`` back
to back calls of ``fn`` into one graph, replays it ``warmup`` times, then times
``repeats`` replays with CUDA events; each sample is a replay's time over ``calls``.
Where capture fails (an op that cannot be captured) it times eager calls instead and
says so (``Timing.graph`` False). ``summarize`` is the statistics, pure and CPU-tested.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

__all__ = ["Timing", "quantile", "summarize", "time_cuda"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """µs per call: median, 10th and 90th percentiles, over ``repeats`` samples."""

    median_us: float
    p10_us: float
    p90_us: float
    repeats: int
    calls_per_sample: int
    graph: bool

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how much to trust the median (0.05: within a few %)."""
        return (self.p90_us - self.p10_us) / self.median_us if self.median_us > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        return asdict(self) | {"spread": round(self.spread, 4)}


def quantile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of ``samples`` (``q`` in [0, 1])."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(samples_us: Sequence[float], calls_per_sample: int, graph: bool) -> Timing:
    """``samples_us`` are µs per sample; the result is per call."""
    per_call = [s / calls_per_sample for s in samples_us]
    return Timing(
        median_us=float(statistics.median(per_call)),
        p10_us=quantile(per_call, 0.1),
        p90_us=quantile(per_call, 0.9),
        repeats=len(per_call),
        calls_per_sample=calls_per_sample,
        graph=graph,
    )


def _events_us(run: Callable[[], object], repeats: int) -> list[float]:
    import torch

    samples = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(float(start.elapsed_time(end)) * 1e3)
    return samples


def time_cuda(
    fn: Callable[[], object], warmup: int = 10, repeats: int = 50, calls: int = 20
) -> Timing:
    """Per-call timing of ``fn`` on the current CUDA device (see the module docstring)."""
    import torch

    for _ in range(warmup):  # compile, load, allocate outside the graph
        fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
        torch.cuda.synchronize()
    except RuntimeError:
        torch.cuda.synchronize()
        return summarize(_events_us(fn, repeats), 1, graph=False)
    for _ in range(warmup):
        graph.replay()
    samples = _events_us(graph.replay, repeats)
    return summarize(samples, calls, graph=True)
