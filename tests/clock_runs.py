"""The unit tier run again with the machine's monotonic clock elsewhere
(``tests/unit/test_clock_origin.py``), in a child started early.

``time.monotonic()`` is the uptime: a component that compares its own monotonic clock
with a neighbour's (or a test's fake clock, which starts at 1,000 s) passes on a machine
up for long and fails on one booted a minute ago. The child runs the unit tier once in a
time namespace whose monotonic clock reads a few seconds (a fresh boot) and once where it
reads ~11.6 days, one after the other (each is one busy core).

The full suite starts the child at its first test (``tests/conftest.py``), so the two
runs use the core the Ray tier leaves idle; the clock-origin tests, in the unit tier,
wait for it. Run alone, the first of them starts it. Each run's exit status and output
are files in the child's directory (``NAME.rc``, ``NAME.out``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from children import Child, session_child

__all__ = ["BOUND_S", "ORIGINS", "RUNS_KEY", "ClockRuns", "runs_for", "why_not"]

# The clock each run reads at its start, by the test's id.
ORIGINS = {"fresh_boot": 3, "long_up": 1_000_000}
# Both runs, from the child's start (each takes 1.5-3.5 minutes on the 2-core box).
BOUND_S = 1800
# Set in the runs' pytest: it must not start the runs again.
CHILD_ENV = "KVTIDE_CLOCK_ORIGIN_CHILD"
_PYTEST_ARGS = (
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
)


def why_not() -> str | None:
    """Why the runs cannot be made here (None: they can)."""
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """One run's exit status and the tail of its output."""

    returncode: int
    tail: str


class ClockRuns:
    """The child that makes every run of ``ORIGINS``, from ``start()`` until ``wait()``."""

    def __init__(self) -> None:
        self._child = Child("clock-origin")

    def start(self) -> None:
        env = {**os.environ, CHILD_ENV: "1"}
        self._child.start([sys.executable, __file__, str(self._child.dir)], env)

    def wait(self, name: str) -> Run:
        """Run ``name``'s outcome, once the child has made both (``BOUND_S`` from its
        start at the latest, else ``subprocess.TimeoutExpired``)."""
        done = self._child.wait(BOUND_S)
        rc = self._child.dir / f"{name}.rc"
        out = self._child.dir / f"{name}.out"
        if not rc.exists():
            why = f"no outcome:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            return Run(returncode=-1, tail=why)
        lines = out.read_text(errors="replace").splitlines()
        return Run(returncode=int(rc.read_text()), tail="\n".join(lines[-30:]))

    @property
    def ran_s(self) -> float | None:
        return self._child.ran_s

    def stop(self) -> None:
        self._child.stop()


RUNS_KEY = pytest.StashKey[ClockRuns]()


def runs_for(config: pytest.Config, started_at: str) -> ClockRuns:
    """The session's runs: the ones started early, else ones started now (at the setup
    of the test ``started_at``); stopped when the session ends."""
    return session_child(config, RUNS_KEY, ClockRuns, "the clock-origin runs' child", started_at)


def _make_runs(into: Path) -> None:
    """The child: each run in turn, its exit status and output into ``into``."""
    for name, clock_at_s in ORIGINS.items():
        offset = int(clock_at_s - time.monotonic())
        argv = ["unshare", "-T", f"--monotonic={offset}", f"--boottime={offset}"]
        with open(into / f"{name}.out", "wb") as out:
            run = subprocess.run(
                [*argv, sys.executable, "-m", "pytest", *_PYTEST_ARGS],
                stdout=out,
                stderr=subprocess.STDOUT,
                check=False,
            )
        (into / f"{name}.rc").write_text(str(run.returncode))


if __name__ == "__main__":
    _make_runs(Path(sys.argv[1]))
