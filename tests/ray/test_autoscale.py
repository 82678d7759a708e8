"""The decode pool sizes itself to its load, against the whole app on a local Ray.

kvtide's simulated engines behind the real Serve app and HTTP endpoint, with
``autoscaling`` on: the decode pool between 1 and 2 engines, each running 2 sequences
(``max_num_seqs``), the engines reporting their load every second and a 5 s scale-down
window. Six sessions in a loop of turns need 6 / (2 x 0.8) = 4 engines: Serve's
autoscaler, asking kvtide's policy, starts the second; the load over, it stops it once
the reports and the window have passed, its sessions' KV moved off first. Every
session's next turn is then served, none recomputing for KV lost with the engine, and
``GET /metrics`` shows the policy's decisions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.ray

NUM_SESSIONS = 6
MAX_TOKENS = 600
POLL_S = 0.5


def autoscale_config(tmp: Path) -> Any:
    from engines.tiny_model import generate_tiny_model
    from orchestrator.cluster.ports import free_port
    from orchestrator.config import parse_config

    config = parse_config(
        {
            "backend": "simulated",
            "model": {"path": str(tmp / "tiny"), "max_model_len": 4096},
            "prefill": {"num_engines": 1, "cpu_threads_bind": None},
            "decode": {"num_engines": 1, "cpu_threads_bind": None, "max_num_seqs": 2},
            # Simulated engines in two processes cannot read each other's blocks: the
            # decode computes the prompt itself.
            "kv": {"kv_load_failure_policy": "recompute", "prefill_lease_s": 5},
            # Each request's tokens on its own Serve call: a stopping decode replica's
            # drain then ends with its requests, and its __del__ moves its sessions' KV
            # (docs/autoscaling.md#scale-in; with step streams it does not).
            "server": {"port": free_port(), "request_timeout_s": 60, "step_streams": False},
            # Turns past what the pool runs queue (the autoscaler's load), not refused.
            "admission": {"enabled": False},
            "autoscaling": {
                "enabled": True,
                "prefill": {"min_replicas": 1, "max_replicas": 1},
                "decode": {"min_replicas": 1, "max_replicas": 2},
                "interval_s": 1,
                "scale_down_window_s": 5,
            },
            "ray": {"temp_dir": str(tmp / "ray"), "num_cpus": 16},
        }
    )
    generate_tiny_model(config.model.resolved_path())
    return config


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    from orchestrator import runtime

    config = autoscale_config(tmp_path_factory.mktemp("autoscale"))
    with runtime.running(config, say=lambda _: None) as base_url:
        yield base_url, config


def turn(base_url: str, model: str, session_id: str) -> tuple[int, dict[str, Any]]:
    import httpx

    resp = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": "lorem ipsum " * 20, "max_tokens": MAX_TOKENS},
        headers={"x-session-id": session_id},
        timeout=90,
    )
    return resp.status_code, resp.json()


def running_decode_replicas() -> int:
    from ray import serve
    from ray.serve._private.common import ReplicaState

    from orchestrator.runtime import APP_NAME
    from orchestrator.serve.engine_host import deployment_name

    app = serve.status().applications[APP_NAME]
    return app.deployments[deployment_name("decode")].replica_states.get(ReplicaState.RUNNING, 0)


def wait_for_replicas(count: int, within_s: float) -> float:
    """Poll Serve's status until the decode pool runs ``count`` replicas (and no other
    count in between); the seconds it took."""
    t0 = time.monotonic()
    while running_decode_replicas() != count:
        assert time.monotonic() - t0 < within_s, f"decode has {running_decode_replicas()}"
        time.sleep(POLL_S)  # polling a condition, not waiting out a race
    return time.monotonic() - t0


def test_decode_scales_out_under_load_and_back_in_after_with_every_session_served(
    app: tuple[str, Any],
) -> None:
    import httpx

    base_url, config = app
    model = config.model.name
    sessions = [f"autoscale-{i}" for i in range(NUM_SESSIONS)]
    assert running_decode_replicas() == 1
    for sid in sessions:  # each session's first turn, one at a time: no load yet
        status, _ = turn(base_url, model, sid)
        assert status == 200

    stop = threading.Event()
    statuses: list[int] = []
    lock = threading.Lock()

    def session_loop(sid: str) -> None:
        while not stop.is_set():
            status, _ = turn(base_url, model, sid)
            with lock:
                statuses.append(status)

    threads = [threading.Thread(target=session_loop, args=(sid,)) for sid in sessions]
    for thread in threads:
        thread.start()
    try:
        wait_for_replicas(2, within_s=90)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    # Every turn of the load was served, the scale-out's included.
    assert statuses and set(statuses) == {200}, statuses

    metrics = httpx.get(f"{base_url}/metrics", timeout=30).text
    assert 'kvtide_autoscale_decisions_total{pool="decode",action="up"}' in metrics
    assert 'kvtide_autoscale_desired_replicas{pool="decode"}' in metrics

    # The load over: the reports' window (11 s) and the scale-down window (5 s) pass,
    # and the pool goes back to one engine.
    wait_for_replicas(1, within_s=90)
    # Every session's next turn is served. Those whose KV the stopped replica kept had
    # it moved off before the engine stopped (to the host tier, or dropped with reason
    # scaled_in where none took it), not lost with the engine (reason evicted).
    reasons = []
    for sid in sessions:
        status, body = turn(base_url, model, sid)
        assert status == 200, body
        reasons.append(body["kvtide"]["kv_plan_reason"])
    assert "evicted" not in reasons, reasons
    metrics = httpx.get(f"{base_url}/metrics", timeout=30).text
    assert 'kvtide_autoscale_decisions_total{pool="decode",action="down"}' in metrics
