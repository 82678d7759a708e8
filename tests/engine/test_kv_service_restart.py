"""The KV lifecycle service dies mid-conversation; Ray restarts it and it rebuilds its
books from the engine hosts' ledgers: the conversation's next turn still pulls its KV
back from decode (nothing leaked), and no block is read twice (nothing double-freed)."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import httpx
import pytest
import ray
from app_calls import complete, kvtide_stats, pulled, usage_of

from orchestrator.kv.actor import SERVICE_NAMESPACE, service_name
from orchestrator.runtime import APP_NAME

pytestmark = pytest.mark.engine


_complete = partial(complete, max_tokens=8)


def _kv_stats(app: Any) -> dict[str, Any]:
    return kvtide_stats(app)["kv"]  # type: ignore[no-any-return]


def _next_prompt(turn: dict[str, Any], new: list[int]) -> list[int]:
    choice = turn["choices"][0]
    return [*choice["prompt_token_ids"], *choice["token_ids"], *new]


def test_a_restarted_service_keeps_the_conversation_reusing_its_kv(kvtide_app: Any) -> None:
    session = "it-service-restart"
    t1 = _complete(kvtide_app, [(7 * i) % 1000 + 3 for i in range(1500)], session)
    t2 = _complete(kvtide_app, _next_prompt(t1, [11, 12, 13]), session)
    pulled(t2["kvtide"], usage_of(t1))
    before = _kv_stats(kvtide_app)
    held_before = sum(before["bytes_held"].values())

    ray.kill(ray.get_actor(service_name(APP_NAME), namespace=SERVICE_NAMESPACE), no_restart=False)

    # Wait for the restarted service (new epoch) to adopt the engines' ledgers. While Ray
    # restarts it, calls past kv.service_timeout_s answer 503 with Retry-After: retry.
    deadline = time.monotonic() + 25  # well inside the TTL's offer window
    stats: dict[str, Any] = {}
    while True:
        resp = httpx.get(kvtide_app.base_url + "/kvtide/stats", timeout=60)
        assert resp.status_code in (200, 503), resp.text
        if resp.status_code == 503:
            assert resp.headers["retry-after"] and "service_unavailable" in resp.text
        else:
            stats = resp.json()["kv"]
            service = stats["service"]
            if service["epoch"] != before["service"]["epoch"] and service.get("adopted", 0):
                break
        assert time.monotonic() < deadline, f"the service did not rebuild: {stats}"
        time.sleep(0.2)
    # Exactly what the engines still hold: turn 2's blocks, not turn 1's (read by turn 2).
    rec = httpx.get(f"{kvtide_app.base_url}/kvtide/sessions/{session}", timeout=30).json()
    assert rec["record"] is not None, rec
    assert rec["record"]["num_tokens"] >= len(t2["choices"][0]["prompt_token_ids"])
    assert sum(stats["bytes_held"].values()) <= held_before, (before, stats)
    assert stats["service"]["adopt_skipped_consumed"] >= 1

    # Turn 2 finished before the restart: the next turn is served at once, no 409 (a
    # finished turn never makes the next one wait, docs/reliability.md), and pulls.
    resp = httpx.post(
        kvtide_app.base_url + "/v1/completions",
        json={
            "model": kvtide_app.model,
            "prompt": _next_prompt(t2, [21, 22]),
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
        },
        headers={"x-session-id": session},
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    t3 = resp.json()
    pulled(t3["kvtide"], usage_of(t2))
    assert _kv_stats(kvtide_app)["num_drain_failures"] == 0
