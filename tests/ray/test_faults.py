"""Faults under concurrent multi-turn load, against the whole app on a local Ray.

kvtide's simulated engines (two prefill, two decode; no weights) behind the real Serve
app and HTTP endpoint, two API keys, sessions driven by the Python SDK with its retries
(``benchmarks/faults.py`` is the same load with more sessions, printed as a table).
Killing the KV service actor, a decode replica mid-stream or a prefill replica with
requests loses no turn, runs none twice, hands no session to another key and leaves no
request hanging; the turns cut mid-stream by the decode kill migrate. A redeploy that
replaces the decode engines (a changed decode setting) lets their running turns finish
there and moves their sessions' KV off them before they stop.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.faults import app_config, busy_replica, duplicates, run_load, taken_over

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


def turn(base_url: str, key: str, model: str, sid: str, max_tokens: int) -> tuple[int, Any]:
    import httpx

    resp = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": f"{sid}: " + "lorem ipsum " * 20, "max_tokens": max_tokens},
        headers={"authorization": f"Bearer {key}", "x-session-id": sid},
        timeout=120,
    )
    return resp.status_code, resp.json()


def record_engine(base_url: str, key: str, sid: str) -> str | None:
    """The engine holding the session's KV (``/kvtide/sessions``), None when none."""
    import httpx

    body = httpx.get(
        f"{base_url}/kvtide/sessions/{sid}",
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    ).json()
    return None if body["record"] is None else str(body["record"]["engine_id"])


def decode_replica_states() -> dict[str, int]:
    from ray import serve

    from orchestrator.runtime import APP_NAME
    from orchestrator.serve.engine_host import deployment_name

    app = serve.status().applications[APP_NAME]
    return dict(app.deployments[deployment_name("decode")].replica_states)


def redeploy(config: Any) -> None:
    """Deploy ``config`` over the running app: ``runtime.deploy`` returns once Serve has
    replaced what changed, the old replicas stopped too. Each old decode replica's drain
    ends with its requests (its turns', and the step streams its ingresses end) and its
    sessions' KV moved, well before Serve's force-kill (``graceful_shutdown_timeout_s``,
    the turns' deadline: 155 s here), after which nothing would have moved."""
    from orchestrator import runtime

    started = time.monotonic()
    runtime.deploy(config, say=lambda _: None)
    took_s = time.monotonic() - started
    assert took_s < config.kv.service_timeout_s + 30, took_s
    assert decode_replica_states() == {"RUNNING": 2}


def test_a_redeploy_that_replaces_the_decode_engines_moves_their_sessions_kv_first(
    app: tuple[str, list[str], Any],
) -> None:
    base_url, keys, config = app
    key, model = keys[0], config.model.name
    sessions = [f"upgrade-{i}" for i in range(4)]
    for sid in sessions:  # each session's KV kept on a decode engine
        assert turn(base_url, key, model, sid, 16)[0] == 200
    before = {sid: record_engine(base_url, key, sid) for sid in sessions}
    assert all(engine and engine.startswith("decode-") for engine in before.values()), before

    # A long turn (4,000 tokens, ~13 s on an idle simulated decode) streams on a decode
    # engine while the redeploy replaces it: past Serve's 5 s it must go on there.
    long: dict[str, Any] = {}

    def long_turn() -> None:
        long["status"], long["body"] = turn(base_url, key, model, "long", 4000)

    running = threading.Thread(target=long_turn)
    running.start()
    deadline = time.monotonic() + 30
    while busy_replica(base_url, key, "decode") is None:
        assert time.monotonic() < deadline, "the long turn never ran"
        time.sleep(0.05)  # polling the engines' load, not waiting out a race
    # A changed decode setting: Serve starts new decode replicas and stops the old ones.
    changed = config.model_copy(
        update={"decode": config.decode.model_copy(update={"max_num_seqs": 32})}
    )
    redeploy(changed)
    running.join(timeout=config.server.request_timeout_s)
    # The running turn finished on the engine it started on (no migration, no error).
    assert long.get("status") == 200, long
    assert long["body"]["kvtide"]["migrations"] == 0, long["body"]["kvtide"]
    # No session's record names a stopped engine: each was moved off it before it
    # stopped (to the host tier; with none, as here, dropped for its next turn to
    # recompute with reason replaced), none left to a pull that fails.
    after = {sid: record_engine(base_url, key, sid) for sid in sessions}
    assert not set(before.values()) & set(after.values()), (before, after)
    for sid in [*sessions, "long"]:
        status, body = turn(base_url, key, model, sid, 16)
        assert status == 200, body
        report = body["kvtide"]
        assert report["kv_source"] == "host_tier" or report["kv_plan_reason"] == "replaced", (
            sid,
            report,
        )
    # The app as the other tests found it: the replicas replaced again, with the step
    # streams to them of the ingress replicas this replaces, which may stop before them.
    redeploy(config)
