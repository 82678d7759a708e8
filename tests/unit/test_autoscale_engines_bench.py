"""benchmarks/autoscale_engines.py's figures, from what a run saw: a failed turn and a
turn after the scale-in that lost its KV are counted against their targets, and Serve's
controller lines are the decode pool's, up to the app's deletion."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.autoscale_engines import PoolWatch, Run, Session, Turn, controller_lines, report


def turn(phase: str, status: str = "200", source: str = "sent_back", reason: str = "reuse") -> Turn:
    return Turn(phase, status, "pull", source, reason, "decode-a", 1.0, 1.0)


def test_the_totals_count_failed_turns_and_sessions_whose_kv_was_lost(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sessions = [
        Session("s-kept", [], [turn("open"), turn("load"), turn("after")]),
        Session("s-moved", [], [turn("open"), turn("after", source="host_tier")]),
        Session("s-lost", [], [turn("load", status="503"), turn("after", reason="evicted")]),
    ]
    run = Run(None, None, "m", None, PoolWatch(t0=0.0), sessions)  # type: ignore[arg-type]
    run.before = {"s-kept": "decode-a", "s-moved": "decode-b", "s-lost": "decode-b"}
    run.survivor = "decode-a"
    report(run, "", {"num_host_take_ins": 1}, tmp_path)
    out = capsys.readouterr().out
    assert "turns served 6, failed 1 (target 0)" in out
    assert "sessions whose KV was lost (reason evicted) 1 (target 0)" in out
    assert "turns after the scale-in 3 of 3" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("s-")}
    assert "decode-b (stopped)" in rows["s-moved"] and "host_tier" in rows["s-moved"]
    assert "decode-a (kept)" in rows["s-kept"]


def test_the_controller_lines_are_the_decode_pools_until_the_app_is_deleted(
    tmp_path: Path,
) -> None:
    logs = tmp_path / "session_latest" / "logs" / "serve"
    logs.mkdir(parents=True)
    head = "INFO 2026-12-07 18:42:25,273 controller 1 -- "
    (logs / "controller_1.log").write_text(
        "\n".join(
            head + line
            for line in (
                "Downscaling Deployment(name='decode-pool', app='kvtide') from 2 to 1",
                "Stopping Replica(id='x', deployment='prefill-pool', app='kvtide')",
                "Replica(id='x', deployment='decode-pool', app='kvtide') started successfully "
                "on node 'ab12' after 50.3s",
                "Deleting app 'kvtide'.",
                "Replica(id='y', deployment='decode-pool', app='kvtide') did not shut down "
                "after grace period, force-killing it.",
            )
        )
    )
    assert controller_lines(tmp_path) == [
        "18:42:25,273 Downscaling Deployment(name='decode-pool', app='kvtide') from 2 to 1",
        "18:42:25,273 Replica(id='x', deployment='decode-pool', app='kvtide') started "
        "successfully after 50.3s",
    ]
