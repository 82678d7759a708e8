"""The unit tier does not depend on the machine's uptime.

``time.monotonic()`` is the uptime: a component that compares its own monotonic clock
with a neighbour's (or a test's fake clock, which starts at 1,000 s) passes on a machine
up for long and fails on one booted a minute ago. This runs the unit tier again in a
time namespace whose monotonic clock reads a few seconds (a fresh boot) and one where it
reads ~11.6 days, so such a mix fails here wherever the suite runs. The runs are made by
a child the full suite starts at its first test (``tests/clock_runs.py``).

It needs root and ``unshare -T`` (util-linux); elsewhere it skips with the reason.
"""

from __future__ import annotations

import subprocess

import pytest
from clock_runs import BOUND_S, ORIGINS, runs_for, why_not


@pytest.mark.parametrize("name", list(ORIGINS))
def test_unit_tier_passes_whatever_the_uptime(name: str, request: pytest.FixtureRequest) -> None:
    why = why_not()
    if why is not None:
        pytest.skip(why)
    try:
        run = runs_for(request.config, request.node.nodeid).wait(name)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the clock-origin runs ran past {BOUND_S} s")
    at_s = ORIGINS[name]
    assert run.returncode == 0, f"unit tier with the monotonic clock at ~{at_s} s:\n{run.tail}"
