"""benchmarks/autoscale.py's CI-size run: the three policies replay the same trace, and
kvtide's policy sizes the pools below static peak sizing without losing a session."""

from __future__ import annotations

import pytest

from benchmarks.autoscale import POOLS, Replay, trace


def test_the_quick_replay_compares_the_three_policies(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.autoscale import main

    assert main(["--quick"]) == 0
    out = capsys.readouterr().out
    for name in ("kvtide", "serve-default", "static-peak"):
        assert f"\n{name} " in out


def test_kvtide_uses_fewer_replica_seconds_than_static_peak_and_loses_nothing() -> None:
    arrivals = trace(quick=True, seed=1)
    horizon = max(at for at, _, _ in arrivals) + 300.0
    kvtide = Replay("kvtide", 30.0, None)
    kvtide.run(arrivals, horizon)
    static = Replay("static-peak", 30.0, kvtide.peak)
    static.run(trace(quick=True, seed=1), horizon)
    for pool in POOLS:
        assert kvtide.pools.replica_s[pool] < static.pools.replica_s[pool]
    assert kvtide.pools.lost_sessions == 0
    assert not any(t.failed for t in kvtide.pools.finished)
    assert len(kvtide.pools.finished) == len(static.pools.finished)
