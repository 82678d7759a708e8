"""The decode pool sizes itself to its load, against the whole app on a local Ray.

kvtide's simulated engines behind the real Serve app and HTTP endpoint, with
``autoscaling`` on: the decode pool between 1 and 2 engines, each running 2 sequences
(``max_num_seqs``), the engines reporting their load every second and a 5 s scale-down
window. Six sessions in a loop of turns need 6 / (2 x 0.8) = 4 engines: Serve's
autoscaler, asking kvtide's policy, starts the second; the load over, it stops it once
the reports and the window have passed, its sessions' KV moved off first. Every
session's next turn is then served, none recomputing for KV lost with the engine, and
``GET /metrics`` and Serve's controller log show the policy's decisions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
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
            # Step streams on (the default): the ingress ends its standing stream to a
            # replica Serve stops, so the drain ends with its requests and its __del__
            # moves its sessions' KV (docs/autoscaling.md#scale-in).
            "server": {"port": free_port(), "request_timeout_s": 60},
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


def record_engine(base_url: str, session_id: str) -> str | None:
    """The engine holding the session's KV (``/kvtide/sessions``), None when none."""
    import httpx

    body = httpx.get(f"{base_url}/kvtide/sessions/{session_id}", timeout=30).json()
    return None if body["record"] is None else str(body["record"]["engine_id"])


def kept_on(base_url: str, sessions: list[str]) -> set[str]:
    """The engines keeping the sessions' KV."""
    return {e for e in (record_engine(base_url, sid) for sid in sessions) if e is not None}


def wait_until(condition: Callable[[], bool], within_s: float) -> None:
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < within_s, "condition not met"
        time.sleep(POLL_S)  # polling a condition, not waiting out a race


def surviving_decode_engine() -> str:
    """The engine id of the decode pool's one replica."""
    from ray import serve

    from orchestrator.runtime import APP_NAME
    from orchestrator.serve.engine_host import deployment_name

    handle = serve.get_deployment_handle(deployment_name("decode"), APP_NAME)
    return str(handle.info.remote().result(timeout_s=30).engine_id)


def controller_log(config: Any) -> str:
    """What Serve's controller logged (its log files under the run's Ray temp dir)."""
    paths = Path(config.ray.temp_dir).glob("session_2*/logs/serve/controller_*.log")
    return "".join(path.read_text() for path in sorted(paths))


def decode_replicas(state: str | None = "RUNNING") -> int:
    """The decode pool's replicas in ``state`` (None: in any state, stopping too)."""
    from ray import serve

    from orchestrator.runtime import APP_NAME
    from orchestrator.serve.engine_host import deployment_name

    app = serve.status().applications[APP_NAME]
    states = app.deployments[deployment_name("decode")].replica_states
    return sum(n for s, n in states.items() if state is None or s == state)


def running_decode_replicas() -> int:
    return decode_replicas()


def wait_for_replicas(count: int, within_s: float, state: str | None = "RUNNING") -> None:
    """Poll Serve's status until the decode pool has ``count`` replicas in ``state``."""
    t0 = time.monotonic()
    while decode_replicas(state) != count:
        assert time.monotonic() - t0 < within_s, f"decode has {decode_replicas(state)}"
        time.sleep(POLL_S)  # polling a condition, not waiting out a race


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
        # The load goes on until the new engine keeps some sessions' KV too.
        wait_until(lambda: len(kept_on(base_url, sessions)) == 2, within_s=60)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    # Every turn of the load was served, the scale-out's included.
    assert statuses and set(statuses) == {200}, statuses
    # The sessions' last turns may all have landed on one engine: more turns, one at a
    # time, until each engine keeps some (each lands on either: Serve's pow2).
    for sid in sessions * 4:
        if len(kept_on(base_url, sessions)) == 2:
            break
        assert turn(base_url, model, sid)[0] == 200

    metrics = httpx.get(f"{base_url}/metrics", timeout=30).text
    assert 'kvtide_autoscale_decisions_total{pool="decode",action="up"}' in metrics
    assert 'kvtide_autoscale_desired_replicas{pool="decode"}' in metrics

    # Where each session's KV is kept now: on both decode engines.
    before = {sid: record_engine(base_url, sid) for sid in sessions}
    assert all(before.values()) and len(set(before.values())) == 2, before

    # The load over: the reports' window (11 s) and the scale-down window (5 s) pass,
    # and the pool goes back to one engine.
    wait_for_replicas(1, within_s=90)
    wait_for_replicas(1, within_s=90, state=None)  # the other one stopped, not stopping
    survivor = surviving_decode_engine()
    stopped = {sid for sid, engine in before.items() if engine != survivor}
    assert stopped, (before, survivor)
    # The stopped engine's sessions had their KV moved off it before it stopped: no
    # session's record names it any more (to the host tier, or dropped where none took it).
    after = {sid: record_engine(base_url, sid) for sid in sessions}
    assert not (set(before.values()) - {survivor}) & set(after.values()), (before, after)
    # Every session's next turn is served: the stopped engine's sessions from the host
    # tier or recomputed with reason scaled_in, none for KV lost with its engine.
    for sid in sessions:
        status, body = turn(base_url, model, sid)
        assert status == 200, body
        report = body["kvtide"]
        assert report["kv_plan_reason"] != "evicted", report
        if sid in stopped:
            assert report["kv_source"] == "host_tier" or report["kv_plan_reason"] == "scaled_in"
    metrics = httpx.get(f"{base_url}/metrics", timeout=30).text
    assert 'kvtide_autoscale_decisions_total{pool="decode",action="down"}' in metrics
    # Serve's controller logged both decisions with their inputs.
    logged = controller_log(config)
    assert "autoscale decode: 1 -> 2 (up; " in logged, logged[-2000:]
    assert "autoscale decode: 2 -> 1 (down; " in logged and "PoolSignals(" in logged
    # The stopped replica logged its sessions' move in its own Serve log file.
    replicas_logged = "".join(
        path.read_text()
        for path in Path(config.ray.temp_dir).glob("session_2*/logs/serve/replica_*.log")
    )
    for engine in set(before.values()) - {survivor}:
        assert f"engine {engine} scaled in: " in replicas_logged, replicas_logged[-2000:]
