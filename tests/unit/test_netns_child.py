"""The children a test session starts early and waits for later (``tests/children.py``;
the fake-host tier's child pytest, ``tests/netns_child.py``): output goes to files, so a
child that writes more than a pipe holds still finishes; one past its deadline is killed
with its process group, and what it wrote is kept until it is stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from children import Child
from netns_child import NetnsChild
from polling import wait_for
from procs import alive

LOUD = """
def test_loud():
    print("x" * 300_000)  # more than a pipe's 64 KiB
"""

HANGS = """
import os, time
from pathlib import Path

def test_hangs():
    Path(os.environ["PID_FILE"]).write_text(str(os.getpid()))
    time.sleep(3600)
"""

SAYS_THEN_HANGS = "import time; print('started', flush=True); time.sleep(3600)"


def test_a_child_that_writes_more_than_a_pipe_holds_finishes_and_reports(tmp_path: Path) -> None:
    (tmp_path / "test_loud.py").write_text(LOUD)
    child = NetnsChild((str(tmp_path), "-s"))
    child.start()
    try:
        outcome = child.wait(timeout_s=120)
        assert outcome.returncode == 0, outcome.stderr[-2000:]
        assert len(outcome.stdout) > 300_000
        cases = ET.parse(outcome.report).getroot().iter("testcase")
        assert [c.get("name") for c in cases] == ["test_loud"]
    finally:
        child.stop()


def test_a_child_past_its_deadline_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "test_hangs.py").write_text(HANGS)
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("PID_FILE", str(pid_file))
    child = NetnsChild((str(tmp_path),))
    child.start()
    try:
        wait_for(pid_file.exists, timeout_s=60, what="the child to reach its test")
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout_s=0)  # its deadline has passed
        assert not alive(int(pid_file.read_text()))
    finally:
        child.stop()


def test_a_child_killed_at_its_deadline_keeps_what_it_wrote_until_stopped() -> None:
    # The own-engines child's report of a timeout shows what its engines printed.
    child = Child("deadline")
    child.start([sys.executable, "-c", SAYS_THEN_HANGS], dict(os.environ))
    try:
        wait_for(lambda: "started" in (child.dir / "stdout").read_text(), 60, "its first line")
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout_s=0)
        assert (child.dir / "stdout").read_text() == "started\n"
    finally:
        child.stop()
    assert not child.dir.exists()
