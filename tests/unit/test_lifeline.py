"""``engines/lifeline.py`` with real processes: the watched child of a SIGKILLed parent
ends; a process whose parent is not the named engine host watches nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from procs import alive

from engines import lifeline

REPO = Path(__file__).resolve().parents[2]

# The engine host: names itself, starts a child that calls the plugin hook as vLLM's
# engine core would, prints the child's pid and the hook's answer, then waits.
PARENT = textwrap.dedent(
    f"""
    import os, subprocess, sys, time
    os.environ[{lifeline.ENV_VAR!r}] = sys.argv[1] or str(os.getpid())
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import time; from engines.lifeline import register; "
         "print(register(), flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )
    print(child.pid, child.stdout.readline().strip(), flush=True)
    time.sleep(600)
    """
)


def start_parent(named_pid: str) -> tuple[subprocess.Popen[str], int, str]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, named_pid],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert parent.stdout is not None
    child_pid, answer = parent.stdout.readline().split()
    return parent, int(child_pid), answer


def kill_parent_and_wait(parent: subprocess.Popen[str], child: int, timeout_s: float) -> bool:
    """SIGKILL the parent; whether the child ended within ``timeout_s``."""
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + timeout_s
    while alive(child):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_engine_core_ends_when_its_engine_host_is_killed() -> None:
    parent, child, answer = start_parent("")
    try:
        assert answer == "True"  # its parent is the named engine host: it watches
        assert kill_parent_and_wait(parent, child, timeout_s=30)
    finally:
        parent.kill()
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_process_whose_parent_is_not_the_engine_host_watches_nothing() -> None:
    # A vLLM worker (its parent is the engine core) or a process under Ray's raylet sees
    # another pid in the variable: it starts no watch and outlives the parent here.
    parent, child, answer = start_parent("1")
    try:
        assert answer == "False"
        assert not kill_parent_and_wait(parent, child, timeout_s=3 * lifeline.CHECK_INTERVAL_S)
    finally:
        parent.kill()
        if alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("value", ["", "not-a-pid"])
def test_without_a_named_engine_host_register_does_nothing(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(lifeline.ENV_VAR, value)
    assert lifeline.register() is False
