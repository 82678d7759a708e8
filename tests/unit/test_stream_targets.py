"""The per-turn benchmarks' verdicts: a target met says so, a missed one says by how
much, and only the rows a target covers are judged (throughput from concurrency 8,
kvtide's own time on session turns)."""

from __future__ import annotations

from benchmarks.overhead import Row, Sample
from benchmarks.stream_targets import format_turn_targets, sendback_targets, verdict


def _row(path: str, workload: str, concurrency: int, scale: float) -> Row:
    row = Row(workload=workload, num_prefill="1", path=path, concurrency=concurrency)
    row.samples = [
        Sample(
            ttft_s=0.050 * scale,
            itl_s=[0.010 * scale] * 31,
            gap_s=[0.010 * scale] * 31,
            num_tokens=32,
            own_s=0.0025,
            tokenize_s=0.0010,
        )
        for _ in range(4)
    ]
    row.wall_s = 1.0 * scale
    return row


def test_a_verdict_names_the_miss_and_its_margin() -> None:
    assert verdict(1.1, 1.2, at_most=True) == "1.10 ok"
    assert verdict(1.35, 1.2, at_most=True) == "1.35 miss +0.15"
    assert verdict(0.9, 0.95, at_most=False) == "0.90 miss -0.05"


def test_turn_targets_judge_each_kvtide_row_against_its_direct_row() -> None:
    rows = [
        _row("direct", "single", 1, 1.0),
        _row("kvtide", "single", 1, 1.1),  # within every bound
        _row("direct", "session", 8, 1.0),
        _row("kvtide", "session", 8, 1.3),  # 1.3x: ITL and throughput missed
    ]
    lines = format_turn_targets(rows, lambda r: rows[rows.index(r) - 1], rtt_s=0.0008)
    single, session = lines[1].splitlines()[1:]
    # c1 has no throughput target and a sessionless row no own-time one.
    assert single.count(" ok") == 5 and single.split()[-2:] == ["-", "-"]
    # ITL and gaps p50/p99 1.30 > 1.2; TTFT 65 ms > 1.1 x 50 + 5; tok/s 0.77 < 0.95;
    # own time without tokenizing 1.5 ms <= 0.8 + 1.
    assert session.count("miss") == 6 and session.endswith("1.50 ms ok")
    assert lines[0].endswith("6 of 12 met")


def test_sendback_targets_hold_kvtide_to_the_direct_flows_speed_up() -> None:
    line = sendback_targets(
        {2048: {"direct": 4.9, "kvtide": 4.8}, 1024: {"direct": 2.8, "kvtide": 2.1}}
    )
    assert line.endswith("1024: 0.75 miss -0.20, 2048: 0.98 ok")
