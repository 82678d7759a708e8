"""Faults under concurrent multi-turn load, against the whole app on a local Ray.

kvtide's simulated engines (two prefill, two decode; no weights) behind the real Serve
app and HTTP endpoint, two API keys, sessions driven by the Python SDK with its retries
(``benchmarks/faults.py`` is the same load with more sessions, printed as a table).
Killing the KV service actor, a decode replica mid-stream or a prefill replica with
requests loses no turn, runs none twice, hands no session to another key and leaves no
request hanging; the turns cut mid-stream by the decode kill migrate.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.faults import app_config, duplicates, run_load, taken_over

pytestmark = pytest.mark.ray

SESSIONS, TURNS = 6, 3


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str], Any]]:
    from orchestrator import runtime

    config, keys = app_config(tmp_path_factory.mktemp("faults"))
    with runtime.running(config, say=lambda _: None) as base_url:
        yield base_url, keys, config


@pytest.mark.parametrize("fault", ["kv-service", "decode", "prefill"])
def test_a_fault_under_load_loses_no_turn_and_runs_none_twice(
    app: tuple[str, list[str], Any], fault: str
) -> None:
    from orchestrator import runtime

    base_url, keys, config = app
    # The decode replica is picked busy from the engines' heartbeat counters (1 s old at
    # most): its turns stream for several seconds, so it still has them when it is killed.
    tokens = 512 if fault == "decode" else 128
    args = argparse.Namespace(sessions=SESSIONS, turns=TURNS, max_tokens=tokens)
    before = duplicates(base_url, keys[0])
    outcome, owners = run_load(base_url, keys, args, fault, prefix=f"t-{fault}")
    assert outcome.failed == 0, outcome.errors
    assert outcome.completed == SESSIONS * TURNS
    if fault == "decode":
        # The replica died with turns streaming on it: they went on on the other one.
        assert outcome.migrated >= 1
    assert duplicates(base_url, keys[0]) == before
    assert taken_over(base_url, owners, keys) == 0
    # Every turn ended within the request deadline (none hung until the SDK gave up).
    assert max(outcome.latencies_s) < config.server.request_timeout_s
    runtime.deploy(config, say=lambda _: None)  # the replaced replica is up again
