"""The targets kvtide's per-turn benchmarks hold its stream and turn path to, each
against vLLM's own P/D flow on the same engines in the same run, with a verdict per
target: met, or missed and by how much.

* inter-token latency p50 and p99 within ``ITL_MAX_X`` of the direct flow's, at every
  concurrency, both as time per token and as the gap between stream events (what vLLM's
  ``bench serve`` reads as inter-token latency);
* TTFT p50 within ``TTFT_MAX_X`` of the direct flow's + ``TTFT_SLACK_S``;
* throughput at least ``THROUGHPUT_MIN_X`` of the direct flow's at concurrency
  ``THROUGHPUT_FROM_CONCURRENCY`` and above;
* kvtide's own time on a session turn's path, without the chat template and
  tokenizing (work any OpenAI server does; the direct flow is handed token ids), within
  one bare actor round trip + ``OWN_SLACK_S``;
* ``benchmarks/sendback.py``: kvtide's send-back speed-up at least ``SENDBACK_MIN_X``
  of the direct flow's at every context length.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from orchestrator.cli.table import format_table

__all__ = [
    "ITL_MAX_X",
    "OWN_SLACK_S",
    "SENDBACK_MIN_X",
    "THROUGHPUT_MIN_X",
    "TTFT_MAX_X",
    "TTFT_SLACK_S",
    "format_turn_targets",
    "sendback_targets",
    "verdict",
]

ITL_MAX_X = 1.2
TTFT_MAX_X = 1.1
TTFT_SLACK_S = 0.005
THROUGHPUT_MIN_X = 0.95
THROUGHPUT_FROM_CONCURRENCY = 8
OWN_SLACK_S = 0.001
SENDBACK_MIN_X = 0.95
SESSION_WORKLOADS = ("session", "session-vllm")


def verdict(value: float, limit: float, *, at_most: bool, unit: str = "") -> str:
    """``value`` against ``limit``: "1.02 ok", or "1.35 miss +0.15" (by how much)."""
    met = value <= limit if at_most else value >= limit
    shown = f"{value:.2f}{unit}"
    return f"{shown} ok" if met else f"{shown} miss {value - limit:+.2f}{unit}"


def format_turn_targets(
    rows: Sequence[Any], baseline: Callable[[Any], Any], rtt_s: float
) -> list[str]:
    """A line per kvtide row of ``benchmarks/overhead.py`` (``Row``: ``p50_itl``,
    ``p99_itl``, ``gap``, ``p50_ttft``, ``tokens_per_s``, ``samples``) with each target's
    verdict against its direct row (``baseline``), and a count of those met."""
    table, met, total = [], 0, 0
    for r in rows:
        d = baseline(r)
        if r.path == "direct" or d is r:
            continue
        cells = [
            verdict(r.p50_itl() / d.p50_itl(), ITL_MAX_X, at_most=True),
            verdict(r.p99_itl() / d.p99_itl(), ITL_MAX_X, at_most=True),
            verdict(r.gap(50) / d.gap(50), ITL_MAX_X, at_most=True),
            verdict(r.gap(99) / d.gap(99), ITL_MAX_X, at_most=True),
            verdict(
                r.p50_ttft() * 1e3,
                (TTFT_MAX_X * d.p50_ttft() + TTFT_SLACK_S) * 1e3,
                at_most=True,
                unit=" ms",
            ),
            verdict(r.tokens_per_s() / d.tokens_per_s(), THROUGHPUT_MIN_X, at_most=False)
            if r.concurrency >= THROUGHPUT_FROM_CONCURRENCY
            else "-",
            verdict(
                statistics.median(s.own_s - s.tokenize_s for s in r.samples) * 1e3,
                (rtt_s + OWN_SLACK_S) * 1e3,
                at_most=True,
                unit=" ms",
            )
            if r.workload in SESSION_WORKLOADS
            else "-",
        ]
        total += sum(c != "-" for c in cells)
        met += sum(c.endswith("ok") for c in cells)
        table.append([r.num_prefill, r.workload, r.concurrency, *cells])
    header = [
        "P",
        "workload",
        "conc",
        f"ITL p50 x <= {ITL_MAX_X}",
        f"ITL p99 x <= {ITL_MAX_X}",
        f"gap p50 x <= {ITL_MAX_X}",
        f"gap p99 x <= {ITL_MAX_X}",
        f"TTFT p50 <= {TTFT_MAX_X}x direct + {TTFT_SLACK_S * 1e3:.0f} ms",
        f"tok/s x >= {THROUGHPUT_MIN_X} (c >= {THROUGHPUT_FROM_CONCURRENCY})",
        f"own-tok <= RTT + {OWN_SLACK_S * 1e3:.0f} ms (sessions)",
    ]
    return [
        f"targets against the direct flow (ok, or miss and by how much): {met} of {total} met",
        format_table(header, table, align=[">"] * len(header)),
    ]


def sendback_targets(speed_ups: dict[int, dict[str, float]]) -> str:
    """One line: at each context length, kvtide's send-back speed-up as a fraction of
    the direct flow's (``speed_ups[length][path]``) against ``SENDBACK_MIN_X``."""
    parts = [
        f"{n}: " + verdict(paths["kvtide"] / paths["direct"], SENDBACK_MIN_X, at_most=False)
        for n, paths in sorted(speed_ups.items())
    ]
    return f"kvtide's speed-up / the direct flow's, target >= {SENDBACK_MIN_X}: " + ", ".join(parts)
