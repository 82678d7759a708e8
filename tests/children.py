"""Child processes a test session starts early and a later test waits for.

The suite runs one test at a time, but the 2-core box has room beside some tiers (the
Ray tier leaves most of a core idle; the unit tests end well before the fake-host
tier's child): work that needs a process of its own starts there and a later test
waits for its outcome (docs/testing.md#what-runs-beside-what). A child writes to files,
not to a pipe nobody reads while other tests run (a full pipe would stop it); it runs in
a session of its own, and its whole process group is killed at its deadline or when the
test session ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import pytest

__all__ = ["Child", "Finished", "ran_lines", "session_child", "stop_all"]

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True, kw_only=True)
class Finished:
    """A child's exit status and output."""

    returncode: int
    stdout: str
    stderr: str


class Child:
    """One child process from ``start()`` until ``wait()``; its files are in ``dir``."""

    def __init__(self, name: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvt-{name}-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_s = 0.0
        self.ran_s: float | None = None  # from start() to the child's exit, once waited for

    @property
    def started(self) -> bool:
        return self._proc is not None

    def start(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        """Run ``argv`` from the repository root with exactly ``env``."""
        with open(self.dir / "stdout", "wb") as out, open(self.dir / "stderr", "wb") as err:
            self._proc = subprocess.Popen(
                list(argv),
                cwd=REPO,
                env=dict(env),
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        self._started_s = time.monotonic()

    def wait(self, timeout_s: float) -> Finished:
        """The child's exit, ``timeout_s`` after its start at the latest (then its group
        is killed and ``subprocess.TimeoutExpired`` raised)."""
        assert self._proc is not None, "start() the child first"
        left_s = timeout_s - (time.monotonic() - self._started_s)
        try:
            returncode = self._proc.wait(timeout=max(left_s, 0.0))
        except subprocess.TimeoutExpired:
            self._kill()
            raise
        self.ran_s = time.monotonic() - self._started_s
        return Finished(
            returncode=returncode,
            stdout=(self.dir / "stdout").read_text(errors="replace"),
            stderr=(self.dir / "stderr").read_text(errors="replace"),
        )

    def stop(self) -> None:
        """Kill the child's group if it still runs; remove its files."""
        self._kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()


class _Tracked(Protocol):
    @property
    def ran_s(self) -> float | None: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


T = TypeVar("T", bound=_Tracked)


@dataclass(frozen=True, slots=True)
class _Entry:
    what: str
    started_at: str  # the test at whose setup it started
    child: _Tracked


_TRACKED = pytest.StashKey[list[_Entry]]()


def session_child(
    config: pytest.Config,
    key: pytest.StashKey[T],
    make: Callable[[], T],
    what: str,
    started_at: str,
) -> T:
    """The session's child under ``key``: the one started early, else one ``make``s and
    starts now (at the setup of the test ``started_at``). Its run time is reported at the
    session's end, and it is stopped then (``ran_lines``, ``stop_all``, from
    ``tests/conftest.py``)."""
    child = config.stash.get(key, None)
    if child is None:
        child = config.stash[key] = make()
        config.stash.setdefault(_TRACKED, []).append(_Entry(what, started_at, child))
        child.start()
    return child


def ran_lines(config: pytest.Config) -> list[str]:
    """For each child the session waited for: how long it ran, and where it started."""
    return [
        f"{e.what} ran {e.child.ran_s:.1f}s"
        + (f", started at {e.started_at}" if e.started_at else "")
        for e in config.stash.get(_TRACKED, [])
        if e.child.ran_s is not None
    ]


def stop_all(config: pytest.Config) -> None:
    """Stop every child the session tracked, killing those that still run."""
    for entry in config.stash.get(_TRACKED, []):
        entry.child.stop()
