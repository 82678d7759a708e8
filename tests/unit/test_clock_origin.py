"""The unit tier does not depend on the machine's uptime.

``time.monotonic()`` is the uptime: a component that compares its own monotonic clock
with a neighbour's (or a test's fake clock, which starts at 1,000 s) passes on a machine
up for long and fails on one booted a minute ago. This runs the unit tier again in a
time namespace whose monotonic clock reads a few seconds (a fresh boot) and one where it
reads ~11.6 days, so such a mix fails here wherever the suite runs.

It needs root and ``unshare -T`` (util-linux); elsewhere it skips with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

# Set in the child pytest: it must not start itself again.
CHILD_ENV = "KVTIDE_CLOCK_ORIGIN_CHILD"


def _unshare_time() -> str | None:
    """Why a time namespace cannot be made here (None: it can)."""
    if os.environ.get(CHILD_ENV) == "1":
        return "already inside the clock-origin run"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    if os.geteuid() != 0:
        return "needs root for a time namespace (unshare -T)"
    probe = subprocess.run(
        ["unshare", "-T", "--monotonic=1", "true"], capture_output=True, timeout=30
    )
    if probe.returncode != 0:
        return f"unshare -T failed: {probe.stderr.decode(errors='replace').strip()}"
    return None


@pytest.mark.parametrize("clock_at_s", [3, 1_000_000], ids=["fresh_boot", "long_up"])
def test_unit_tier_passes_whatever_the_uptime(clock_at_s: int) -> None:
    why = _unshare_time()
    if why is not None:
        pytest.skip(why)
    offset = int(clock_at_s - time.monotonic())
    cmd = [
        "unshare",
        "-T",
        f"--monotonic={offset}",
        f"--boottime={offset}",
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "-m",
        "not ray and not engine and not gpu",
        # Lint reads no clock, and is slow.
        "--deselect",
        "tests/unit/test_lint.py",
        "tests/unit",
    ]
    env = {**os.environ, CHILD_ENV: "1"}
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    tail = "\n".join((run.stdout + run.stderr).splitlines()[-30:])
    assert run.returncode == 0, f"unit tier with the monotonic clock at ~{clock_at_s} s:\n{tail}"
