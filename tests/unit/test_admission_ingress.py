"""Admission control in the ingress (no Ray): a turn whose pool cannot take it is refused
at once, before anything is claimed or queued, and ``/health`` says degraded; both clear
when the engines report progress. The engines' reports are fed as the service gives them
(``engine_loads``), on a fake clock."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import pytest
from ingress_harness import MODEL, bare_ingress, handle, http_request

from orchestrator.errors import EngineUnavailable, Overloaded

CHAT = "/v1/chat/completions"


class Clock:
    def __init__(self) -> None:
        self.now_s = 500.0

    def __call__(self) -> float:
        return self.now_s


def _chat() -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return json.dumps(body).encode()


def report(
    waiting: int, finished: int, running: int = 0, kv_cache_usage: float = 1.0
) -> dict[str, dict[str, float]]:
    """The service's ``engine_loads``: one prefill engine, one decode engine."""
    return {
        "prefill-r1": {"num_running": 0, "num_waiting": 0, "num_requests": 40, "age_s": 0.5},
        "decode-r2": {
            "num_running": running,
            "num_waiting": waiting,
            "kv_cache_usage": kv_cache_usage,
            "num_requests": finished,
            "age_s": 0.5,
        },
    }


def overloaded_ingress(tiny_tokenizer: Any, clock: Clock) -> Any:
    ingress = bare_ingress(tiny_tokenizer)
    ingress.admission.clock = clock
    # The decode engine has had requests waiting and none running for 11 s.
    ingress.admission.observe(report(waiting=3, finished=7))
    clock.now_s += 11.0
    ingress.admission.observe(report(waiting=5, finished=7))
    return ingress


def test_a_turn_for_a_pool_that_makes_no_progress_is_refused_at_once(
    tiny_tokenizer: Any,
) -> None:
    clock = Clock()
    ingress = overloaded_ingress(tiny_tokenizer, clock)

    async def run() -> None:
        status, body = await handle(ingress, CHAT, _chat(), x_session_id="s1")
        assert status == 503 and body["error"]["code"] == "overloaded"
        assert "decode pool makes no progress" in body["error"]["message"]
        # Nothing ran and nothing was claimed: the session's turn may start at once.
        assert ingress.router.prefill.requests == [] and ingress.router.decode.requests == []
        assert (await ingress.kv.stats())["num_turns_running"] == 0
        with pytest.raises(Overloaded) as refused:
            ingress.admission.check(("prefill", "decode"))
        assert refused.value.headers() == {"Retry-After": "2"}
        # The queued work was aborted at its deadline (its blocks freed): the engine
        # reports progress.
        clock.now_s += 1.0
        ingress.admission.observe(report(waiting=0, finished=12, kv_cache_usage=0.2))
        status, _ = await handle(ingress, CHAT, _chat(), x_session_id="s1")
        assert status == 200

    asyncio.run(run())
    refusals = {k: v for k, v in ingress.metrics.snapshot().items() if "admission_refusals" in k}
    assert list(refusals.values()) == [2.0] and 'pool="decode"' in next(iter(refusals))


def test_health_is_degraded_while_a_pool_refuses_turns_and_ok_after(
    tiny_tokenizer: Any,
) -> None:
    clock = Clock()
    ingress = overloaded_ingress(tiny_tokenizer, clock)

    async def run() -> None:
        response = await ingress.routes.operator.health()
        assert response.status_code == 503 and response.headers["Retry-After"] == "2"
        body = json.loads(response.body)
        assert body["status"] == "degraded" and body["refusing_pools"] == ["decode"]
        assert body["engines"]["decode-r2"]["condition"] == "stalled"
        assert body["engines"]["decode-r2"]["num_waiting"] == 5
        clock.now_s += 1.0
        ingress.admission.observe(report(waiting=0, finished=12, running=1))
        response = await ingress.routes.operator.health()
        assert response.status_code == 200 and json.loads(response.body) == {"status": "ok"}

    asyncio.run(run())


class _Hung:
    """A handle method whose replicas never answer."""

    @staticmethod
    def remote() -> Any:
        return asyncio.Event().wait()


class _HungPool:
    """A pool deployment's handle (and its ``HandlePool``'s) that never answers."""

    info = stats = _Hung

    @property
    def handle(self) -> _HungPool:
        return self


def test_health_and_stats_name_a_pool_that_does_not_answer_within_the_service_deadline(
    tiny_tokenizer: Any,
) -> None:
    ingress = bare_ingress(tiny_tokenizer, vllm=False)
    config = ingress.config.model_copy(
        update={"kv": ingress.config.kv.model_copy(update={"service_timeout_s": 0.2})}
    )
    views = dataclasses.replace(
        ingress.routes.operator,
        config=config,
        pools={"decode": _HungPool()},
        pool_handles={"decode": _HungPool()},
    )
    request, _ = http_request("/kvtide/stats", method="GET")

    async def refusal(call: Any) -> tuple[EngineUnavailable, float]:
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable) as err:
            await asyncio.wait_for(call, 30.0)  # a hung route fails here
        return err.value, time.monotonic() - t0

    for call, words in (
        (views.health(), "decode did not answer within 0.2 s"),
        (views.stats(request), "the decode pool did not report its counters within 0.2 s"),
    ):
        err, took_s = asyncio.run(refusal(call))
        assert err.status_code == 503 and err.headers()["Retry-After"] == "1"
        assert words in err.message
        assert took_s < 0.2 + 1.0  # the deadline, and no wait as long as the hang
