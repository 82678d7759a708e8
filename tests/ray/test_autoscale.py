"""The decode pool sizes itself to its load, against the whole app on a local Ray.

kvtide's simulated engines behind the real Serve app and HTTP endpoint, with
``autoscaling`` on: the decode pool between 1 and 2 engines, each running 4 sequences
(``max_num_seqs``), the engines reporting their load every second, a 5 s scale-down
window and no headroom. Six sessions in a loop of turns need 6 / (4 x 0.8) = 2 engines:
Serve's autoscaler, asking kvtide's policy, starts the second; the load over, it stops
it once the reports and the window have passed, while a long turn streams on it (two
sequences fit one engine at the scale-down utilization: 4 x 0.6), its sessions' KV
moved off once that turn is done. The long turn finishes whole; every session's next
turn is then served, none recomputing for KV lost with the engine, and ``GET /metrics``
and Serve's controller log show the policy's decisions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.ray

NUM_SESSIONS = 6
MAX_TOKENS = 600
# A long turn (about 10 s on the simulated engine here): two sessions run them one
# after another through the scale-in, one on each decode replica.
LONG_TOKENS = 4000
POLL_S = 0.5


def autoscale_config(tmp: Path) -> Any:
    from engines.tiny_model import generate_tiny_model
    from orchestrator.cluster.ports import free_port
    from orchestrator.config import parse_config

    config = parse_config(
        {
            "backend": "simulated",
            "model": {"path": str(tmp / "tiny"), "max_model_len": 8192},
            "prefill": {"num_engines": 1, "cpu_threads_bind": None},
            "decode": {"num_engines": 1, "cpu_threads_bind": None, "max_num_seqs": 4},
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
                "headroom": 0,  # the counts above size the load alone
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


@dataclass
class LongTurn:
    """One streamed turn of ``LONG_TOKENS``: when it started and ended, its status, its
    stream's events (the last with the usage and the turn's report)."""

    started_s: float
    ended_s: float = 0.0
    status: int = 0
    chunks: list[dict[str, Any]] = field(default_factory=list)

    def finish_reason(self) -> str | None:
        reasons = [c["choices"][0]["finish_reason"] for c in self.chunks if c.get("choices")]
        return next((r for r in reversed(reasons) if r is not None), None)

    def completion_tokens(self) -> int:
        return int(self.chunks[-1]["usage"]["completion_tokens"])


class LongSession:
    """A session's long streamed turns, one after another on its own thread, until
    ``stop`` is set; ``placed`` is set at its first turn's first chunk (its decode has
    started)."""

    def __init__(self, base_url: str, model: str, session_id: str, stop: threading.Event) -> None:
        self.session_id = session_id
        self.placed = threading.Event()
        self.turns: list[LongTurn] = []
        self.thread = threading.Thread(target=self._run, args=(base_url, model, stop), daemon=True)
        self.thread.start()

    def _run(self, base_url: str, model: str, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                self.turns.append(self._turn(base_url, model))
        finally:
            self.placed.set()

    def _turn(self, base_url: str, model: str) -> LongTurn:
        import json

        import httpx

        body = {
            "model": model,
            "prompt": "lorem ipsum " * 20,
            "max_tokens": LONG_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        turn = LongTurn(started_s=time.monotonic())
        try:
            with httpx.stream(
                "POST",
                f"{base_url}/v1/completions",
                json=body,
                headers={"x-session-id": self.session_id},
                timeout=90,
            ) as resp:
                turn.status = resp.status_code
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        turn.chunks.append(json.loads(line[len("data: ") :]))
                        self.placed.set()
        finally:
            turn.ended_s = time.monotonic()
        return turn


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
    # The load over, two new sessions run long turns one after another, the second
    # starting once the first's decode has: both decode replicas idle then, it goes
    # where the first is not (Serve's pow2 counts the request it sent), and each next
    # turn where its session's last one was (the other replica runs the other's). So a
    # long turn streams on the replica Serve stops, whenever it stops it.
    stopping = threading.Event()
    stop_seen: list[float] = []

    def watch_stops() -> None:  # when Serve first stops a decode replica
        while not stopping.is_set():
            if decode_replicas("STOPPING"):
                stop_seen.append(time.monotonic())
                stopping.set()
            # Polling Serve's status, not waiting out a race; often, so that no long turn
            # starts (on the other replica) between the stop and its sight.
            stopping.wait(0.1)

    watcher = threading.Thread(target=watch_stops, daemon=True)  # ends with the test at most
    watcher.start()
    long_sessions: list[LongSession] = []
    for sid in ("autoscale-long-0", "autoscale-long-1"):
        long_sessions.append(LongSession(base_url, model, sid, stopping))
        assert long_sessions[-1].placed.wait(timeout=60)
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

    try:
        # The reports' look-back (11 s) and the scale-down window (5 s) pass, and the
        # pool goes back to one engine.
        wait_for_replicas(1, within_s=90)
        wait_for_replicas(1, within_s=90, state=None)  # the other one stopped, not stopping
    finally:
        stopping.set()
        for long_session in long_sessions:
            long_session.thread.join()
    # Every long turn finished whole, the one streaming on the stopping replica too: it
    # ran to its length within Serve's drain.
    for long_session in long_sessions:
        for long_turn in long_session.turns:
            assert long_turn.status == 200, (long_turn.status, long_turn.chunks[-3:])
            assert long_turn.finish_reason() == "length", long_turn.chunks[-3:]
            assert long_turn.completion_tokens() == LONG_TOKENS
    survivor = surviving_decode_engine()
    # The session whose last long turn ran on the stopped replica: that turn streamed
    # while Serve stopped it, handed its KV over there, and the scale-in moved it off.
    long_stopped = [
        ls for ls in long_sessions if record_engine(base_url, ls.session_id) != survivor
    ]
    assert len(long_stopped) == 1, [record_engine(base_url, ls.session_id) for ls in long_sessions]
    last = long_stopped[0].turns[-1]
    assert stop_seen and last.started_s < stop_seen[0] < last.ended_s, (
        stop_seen,
        [(t.started_s, t.ended_s) for t in long_stopped[0].turns],
    )
    stopped = {sid for sid, engine in before.items() if engine != survivor}
    assert stopped, (before, survivor)
    # The stopped engine's sessions had their KV moved off it before it stopped: no
    # session's record names it any more (to the host tier, or dropped where none took it).
    after = {sid: record_engine(base_url, sid) for sid in sessions}
    assert not (set(before.values()) - {survivor}) & set(after.values()), (before, after)
    # Every session's next turn is served: the stopped engine's sessions from the host
    # tier or recomputed with reason scaled_in, none for KV lost with its engine.
    # The long turn's session too, whose turn streamed through the stop: its KV source
    # reported, nothing lost.
    for sid in [*sessions, *(ls.session_id for ls in long_sessions)]:
        status, body = turn(base_url, model, sid)
        assert status == 200, body
        report = body["kvtide"]
        assert report["kv_plan_reason"] != "evicted", report
        if sid in stopped or sid == long_stopped[0].session_id:
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
