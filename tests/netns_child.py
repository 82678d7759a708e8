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
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from children import Child, session_child

__all__ = ["CHILD_KEY", "NETNS_CHILD_ENV", "NetnsChild", "Outcome", "child_for"]

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
        self._child = Child("netns")
        self.report = self._child.dir / "netns.xml"

    @property
    def ran_s(self) -> float | None:
        """From ``start()`` to the child's exit, once waited for."""
        return self._child.ran_s

    def start(self) -> None:
        args = [*self._paths, "-p", "no:cacheprovider", "-rfEs", f"--junitxml={self.report}"]
        self._child.start(
            [sys.executable, "-m", "pytest", *args, "--durations=5"],
            {**os.environ, NETNS_CHILD_ENV: "1"},
        )

    def wait(self, timeout_s: float) -> Outcome:
        """The child's outcome, ``timeout_s`` after its start at the latest (then the
        group is killed and ``subprocess.TimeoutExpired`` raised)."""
        done = self._child.wait(timeout_s)
        return Outcome(
            returncode=done.returncode, stdout=done.stdout, stderr=done.stderr, report=self.report
        )

    def stop(self) -> None:
        """Kill the child's group if it still runs; remove its files."""
        self._child.stop()


# The session's child, once started (by conftest's early start or by ``child_for``).
CHILD_KEY = pytest.StashKey[NetnsChild]()


def child_for(config: pytest.Config, started_at: str) -> NetnsChild:
    """The session's child: the one started early, else one started now. The session's
    end stops it (``tests/conftest.py``)."""
    what = "the fake-host tier's child pytest"
    return session_child(config, CHILD_KEY, NetnsChild, what, started_at)
