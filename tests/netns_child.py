"""The fake-host tier's child pytest (``tests/test_netns_tier.py``), started early.

The full suite starts the child as its unit tier begins (``tests/conftest.py``): the
unit tests use little of two cores while the child's cluster and TP=2 engines start, so
the two overlap, and the tier's test waits for the child's outcome after the unit tier.
Run alone, the tier's test starts the child itself. Output goes to files (a pipe nobody
reads would stop the child once full); an unfinished child is killed, with its whole
process group, when the session ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["CHILD_KEY", "NETNS_CHILD_ENV", "NetnsChild", "Outcome", "child_for"]

REPO = Path(__file__).resolve().parent.parent
# Set in the child pytest, which then collects tests/netns (``tests/conftest.py``).
NETNS_CHILD_ENV = "KVTIDE_NETNS_CHILD"


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What the child left: its exit status, output and JUnit report."""

    returncode: int
    stdout: str
    stderr: str
    report: Path


class NetnsChild:
    """One child pytest on ``paths`` (``tests/netns``), from ``start()`` until ``wait()``."""

    def __init__(self, paths: tuple[str, ...] = ("tests/netns",)) -> None:
        self._paths = paths
        self._dir = Path(tempfile.mkdtemp(prefix="kvt-netns-"))
        self.report = self._dir / "netns.xml"
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_s = 0.0
        self.ran_s: float | None = None  # from start() to the child's exit, once waited for

    def start(self) -> None:
        args = [*self._paths, "-p", "no:cacheprovider", "-rfEs", f"--junitxml={self.report}"]
        with open(self._dir / "stdout", "wb") as out, open(self._dir / "stderr", "wb") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", *args, "--durations=5"],
                cwd=REPO,
                env={**os.environ, NETNS_CHILD_ENV: "1"},
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        self._started_s = time.monotonic()

    def wait(self, timeout_s: float) -> Outcome:
        """The child's outcome, ``timeout_s`` after its start at the latest (then the
        group is killed and ``subprocess.TimeoutExpired`` raised)."""
        assert self._proc is not None, "start() the child first"
        left_s = timeout_s - (time.monotonic() - self._started_s)
        try:
            returncode = self._proc.wait(timeout=max(left_s, 0.0))
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        self.ran_s = time.monotonic() - self._started_s
        return Outcome(
            returncode=returncode,
            stdout=(self._dir / "stdout").read_text(errors="replace"),
            stderr=(self._dir / "stderr").read_text(errors="replace"),
            report=self.report,
        )

    def stop(self) -> None:
        """Kill the child's group if it still runs; remove its files."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


# The session's child, once started (by conftest's early start or by ``child_for``).
CHILD_KEY = pytest.StashKey[NetnsChild]()


def child_for(config: pytest.Config) -> NetnsChild:
    """The session's child: the one started early, else one started now. The session's
    end stops it (``tests/conftest.py``)."""
    child = config.stash.get(CHILD_KEY, None)
    if child is None:
        child = config.stash[CHILD_KEY] = NetnsChild()
        child.start()
    return child
