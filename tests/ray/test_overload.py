"""Overload that heals, against the whole app on a local Ray.

kvtide's simulated engines behind the real Serve app and HTTP endpoint: one prefill
engine, one decode engine whose small KV cache runs two turns at once, a 4 s deadline
(``benchmarks/overload.py``). A burst of turns far past that capacity: the turns past
their deadline get 503 and their engine requests are aborted; while the burst lasts,
``/health`` says degraded and a new turn is refused at once (503 ``overloaded``, with
Retry-After) instead of queueing. Once the burst is over the pool recovers by itself and
single turns complete within their deadline again. (Before, the timed-out turns stayed
queued in the engine, so every later turn waited behind them and timed out too.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.overload import TurnResult, overload_config, send_turn

pytestmark = pytest.mark.ray

BURST = 12  # turns at once: six times what the decode engine runs together
POLL_S = 0.2


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    from orchestrator import runtime

    config = overload_config(tmp_path_factory.mktemp("overload"))
    with runtime.running(config, say=lambda _: None) as base_url:
        yield base_url, config


def health(base_url: str) -> tuple[int, dict[str, Any]]:
    import httpx

    resp = httpx.get(f"{base_url}/health", timeout=30)
    return resp.status_code, resp.json()


def wait_for_health(base_url: str, status: str, within_s: float) -> float:
    """Poll ``/health`` (the engines report every second) until it says ``status``;
    the seconds it took. Fails past ``within_s``."""
    t0 = time.monotonic()
    while True:
        _, body = health(base_url)
        if body.get("status") == status:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within_s, f"/health still says {body}"
        time.sleep(POLL_S)  # polling a condition, not waiting out a race


def test_a_burst_past_capacity_is_refused_fast_and_the_pool_recovers(
    app: tuple[str, Any],
) -> None:
    base_url, config = app
    model, deadline_s = config.model.name, config.server.request_timeout_s
    assert send_turn(base_url, model).status == 200  # warm: the app answers

    results: list[TurnResult] = []
    lock = threading.Lock()

    def one() -> None:
        result = send_turn(base_url, model)
        with lock:
            results.append(result)

    burst = [threading.Thread(target=one) for _ in range(BURST)]
    for thread in burst:
        thread.start()
    # While the burst waits in the decode engine's queue, the engines' reports reach the
    # ingress: the pool is degraded and refuses new turns at once.
    wait_for_health(base_url, "degraded", within_s=deadline_s)
    status, body = health(base_url)
    assert body["status"] == "degraded", body
    if status == 503:  # turns are being refused: the body says which pool
        assert body["refusing_pools"] == ["decode"] and not body["admits"]
    refused = send_turn(base_url, model)
    assert (refused.status, refused.code) == (503, "overloaded")
    assert refused.retry_after == "1" and refused.elapsed_s < 1.0
    for thread in burst:
        thread.join()

    # Every burst turn ended by its deadline: completed, refused, or 503 past it.
    codes = sorted(str(r.code) for r in results)
    assert len(results) == BURST and all(r.elapsed_s < deadline_s + 2.0 for r in results)
    assert set(codes) <= {"None", "deadline_exceeded", "overloaded"}, codes
    assert "deadline_exceeded" in codes  # the burst did pass what fits in a deadline

    # The timed-out turns' engine requests were aborted: the pool recovers by itself,
    # and single turns complete within their deadline again.
    wait_for_health(base_url, "ok", within_s=2 * deadline_s)
    for _ in range(3):
        single = send_turn(base_url, model)
        assert (single.status, single.code) == (200, None)
        assert single.elapsed_s < deadline_s
