"""Reading processes from /proc, for tests that kill one and watch what it leaves; and
running a test's child script to one result line, bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def _stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (state first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = _stat(entry)
        except OSError:
            continue
        if stat[0] != "Z":
            children.setdefault(int(stat[1]), []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def run_bounded(
    script: str, args: list[str], env: dict[str, str], timeout_s: float
) -> tuple[int | None, str, str]:
    """Run ``script`` (a test file's child) in its own session from the repository root:
    its exit status (None when it ran past ``timeout_s``, its whole group then killed),
    stdout and stderr."""
    proc = subprocess.Popen(
        [sys.executable, script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return None, stdout, stderr
    return proc.returncode, stdout, stderr


def child_result(
    script: str, args: list[str], env: dict[str, str], marker: str, timeout_s: float, what: str
) -> dict[str, Any]:
    """Run ``script`` with ``run_bounded`` and return the JSON on its one stdout line
    starting with ``marker``; fail, saying ``what`` ran, on a timeout or another exit."""
    returncode, stdout, stderr = run_bounded(script, args, env, timeout_s)
    if returncode is None:
        pytest.fail(f"the {what} child ran past {timeout_s} s:\n{stderr[-6000:]}")
    lines = [line for line in stdout.splitlines() if line.startswith(marker)]
    if returncode != 0 or len(lines) != 1:
        pytest.fail(f"the {what} child failed (exit {returncode}):\n{stderr[-6000:]}")
    parsed: dict[str, Any] = json.loads(lines[0][len(marker) :])
    return parsed
