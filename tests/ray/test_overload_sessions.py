"""Overload with sessions heals, against the whole app on a local Ray.

As ``test_overload.py`` (simulated engines, a decode engine of 20 KV blocks, a 4 s
deadline), but every turn of the burst is a session's: a finished session turn keeps
its decode KV for the session's next turn, and two such turns fill the decode engine's
KV cache. Before, the burst left that cache full of kept blocks with nothing running:
every later turn waited behind them until its deadline (for the decode TTL, 480 s),
even after the sessions were deleted (the drains that should free the blocks could not
read them across processes), while ``/health`` said ok. Now idle sessions' KV makes
room on an engine short of KV (``KVLifecycle.make_room``), drains free the decode's
blocks, and ``/health`` says degraded while nothing can be admitted.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_overload import health, wait_for_health

from benchmarks.overload import DECODE_KV_BLOCKS, TURN_PROMPT, TurnResult, send_turn

pytestmark = pytest.mark.ray

BLOCK_TOKENS = 128  # the simulated engine's block on CPU
TURN_BLOCKS = DECODE_KV_BLOCKS // 2  # two session turns fill the decode's KV cache
BURST = 8  # session turns at once: four times what the decode engine runs together
POLL_S = 0.2
KEPT_CHECK_GRACE_S = 2.0


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    from benchmarks.overload import overload_config
    from orchestrator import runtime

    config = overload_config(
        tmp_path_factory.mktemp("ovs"), kv={"kept_check_grace_s": KEPT_CHECK_GRACE_S}
    )
    with runtime.running(config, say=lambda _: None) as base_url:
        yield base_url, config


def get(base_url: str, path: str) -> dict[str, Any]:
    import httpx

    resp = httpx.get(f"{base_url}{path}", timeout=30)
    resp.raise_for_status()
    body: dict[str, Any] = resp.json()
    return body


def decode_blocks_used(base_url: str) -> int:
    """The decode engine's KV blocks filled or kept, as its last report says."""
    engines = get(base_url, "/kvtide/stats")["engines"]
    (usage,) = [e["kv_cache_usage"] for name, e in engines.items() if name.startswith("decode")]
    return round(usage * DECODE_KV_BLOCKS)


def blocks_owned(base_url: str, sessions: list[str]) -> int:
    """The decode KV blocks the service books for ``sessions`` (their records)."""
    owned = 0
    for sid in sessions:
        record = get(base_url, f"/kvtide/sessions/{sid}")["record"]
        if record is not None and str(record["engine_id"]).startswith("decode"):
            owned += math.ceil(record["num_tokens"] / BLOCK_TOKENS)
    return owned


def kv_state(base_url: str) -> dict[str, Any]:
    """The engines' loads and the service's KV counters, for a failure's message."""
    stats = get(base_url, "/kvtide/stats")
    keys = ("num_running", "num_waiting", "kv_cache_usage", "num_requests")
    return {
        "engines": {n: {k: e.get(k) for k in keys} for n, e in stats["engines"].items()},
        **{k: v for k, v in stats.items() if k.startswith(("num_", "drain", "evict"))},
    }


def wait_until(what: str, check: Any, within_s: float) -> None:
    """Poll ``check`` (the engines report every second) until it holds; fails past
    ``within_s`` with ``what`` and the last value."""
    t0 = time.monotonic()
    while True:
        ok, seen = check()
        if ok:
            return
        assert time.monotonic() - t0 < within_s, f"{what}: {seen}"
        time.sleep(POLL_S)  # polling a condition, not waiting out a race


def test_a_burst_of_session_turns_that_fills_the_decode_kv_heals(app: tuple[str, Any]) -> None:
    import httpx

    base_url, config = app
    model, deadline_s = config.model.name, config.server.request_timeout_s
    warm = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": TURN_PROMPT, "max_tokens": 4},
        timeout=60,
    )
    assert warm.status_code == 200
    # Each burst turn's decode reserves, then keeps, exactly TURN_BLOCKS blocks.
    prompt_tokens = warm.json()["usage"]["prompt_tokens"]
    max_tokens = TURN_BLOCKS * BLOCK_TOKENS + 1 - prompt_tokens

    sessions = [f"burst-{i}" for i in range(BURST)]
    results: list[TurnResult] = []
    lock = threading.Lock()

    def one(sid: str) -> None:
        result = send_turn(base_url, model, session_id=sid, max_tokens=max_tokens)
        with lock:
            results.append(result)

    burst = [threading.Thread(target=one, args=(sid,)) for sid in sessions]
    for thread in burst:
        thread.start()
    # The decode engine's KV cache fills (two turns run, then their kept KV): degraded.
    wait_for_health(base_url, "degraded", within_s=deadline_s)
    for thread in burst:
        thread.join()
    codes = sorted(str(r.code) for r in results)
    assert len(results) == BURST and all(r.elapsed_s < deadline_s + 2.0 for r in results)
    assert set(codes) <= {"None", "deadline_exceeded", "overloaded"}, codes
    assert codes.count("None") < BURST  # the burst did pass what fits in a deadline

    # (c) Once the kept KV has made room, /health says ok again ...
    try:
        wait_for_health(base_url, "ok", within_s=3 * deadline_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {kv_state(base_url)}") from None
    status, body = health(base_url)
    assert (status, body["status"]) == (200, "ok")
    # (a) ... and single turns, without a session and in a new one, finish in time.
    for headers in ({}, {"x-session-id": "after-burst"}):
        t0 = time.monotonic()
        single = httpx.post(
            f"{base_url}/v1/completions",
            json={"model": model, "prompt": TURN_PROMPT, "max_tokens": 4},
            headers=headers,
            timeout=60,
        )
        elapsed_s = time.monotonic() - t0
        why = f"{headers}: {single.text} after {elapsed_s:.1f} s; {kv_state(base_url)}"
        assert single.status_code == 200 and elapsed_s < deadline_s, why
    live = [*sessions, "after-burst"]

    # (b) The decode engine keeps what live sessions own, nothing more ...
    def owned_only() -> tuple[bool, tuple[int, int]]:
        used, owned = decode_blocks_used(base_url), blocks_owned(base_url, live)
        return used == owned, (used, owned, kv_state(base_url))

    wait_until("decode blocks used, owned by sessions", owned_only, within_s=2 * deadline_s)
    # ... and nothing once they are deleted.
    for sid in live:
        assert httpx.delete(f"{base_url}/kvtide/sessions/{sid}", timeout=30).status_code < 300
    wait_until(
        "decode blocks used after every session was deleted",
        lambda: (decode_blocks_used(base_url) == 0, decode_blocks_used(base_url)),
        within_s=2 * deadline_s,
    )
    status, body = health(base_url)
    assert (status, body["status"]) == (200, "ok")


def test_a_decode_whose_turn_never_hands_over_has_its_kept_blocks_freed(
    app: tuple[str, Any],
) -> None:
    """An ingress that dies between its decode's last token and the hand-over (or whose
    deadline passes right then): the decode engine keeps the session's blocks and the
    service never hears of them. Before, they stayed pinned for the decode TTL (480 s);
    now the decode host's check finds them unbooked after ``kv.kept_check_grace_s`` and
    the service drains them (``orchestrator.kv.kept_check``). The turn is run here as
    the router runs one, straight on the pools' Serve handles, with no hand-over."""
    import asyncio

    from ray import serve

    from engines.base import GenerateRequest, final_chunk
    from engines.kv_params import KVTransferParams
    from orchestrator import runtime
    from orchestrator.serve.engine_host import deployment_name

    base_url, _ = app
    assert decode_blocks_used(base_url) == 0  # the previous test left nothing kept
    drained_before = get(base_url, "/kvtide/stats")["kv"]["kept_orphans_drained"]

    def pool(name: str) -> Any:
        handle = serve.get_deployment_handle(deployment_name(name), runtime.APP_NAME)
        return handle.options(stream=True)

    async def turn_without_hand_over() -> None:
        prompt = list(range(1, 3 * BLOCK_TOKENS))
        pre = await final_chunk(
            pool("prefill").generate.remote(
                GenerateRequest(
                    request_id="lost-1-p",
                    prompt_token_ids=prompt,
                    max_tokens=1,
                    kv_transfer_params=KVTransferParams.keep_for_decode(),
                    session_id="lost",
                )
            )
        )
        assert pre.kv_transfer_params is not None
        last = await final_chunk(
            pool("decode").generate.remote(
                GenerateRequest(
                    request_id="lost-1-d",
                    prompt_token_ids=[*prompt, *pre.token_ids],
                    max_tokens=8,
                    kv_transfer_params=pre.kv_transfer_params.for_decode(keep=True),
                    session_id="lost",
                )
            )
        )
        assert last.kv_transfer_params is not None
        assert last.kv_transfer_params.kept_blocks() is not None  # the decode kept them

    asyncio.run(turn_without_hand_over())

    def drained() -> tuple[bool, Any]:
        kv = get(base_url, "/kvtide/stats")["kv"]
        return kv["kept_orphans_drained"] - drained_before >= 1, kv_state(base_url)

    wait_until("the unbooked blocks' drain", drained, within_s=KEPT_CHECK_GRACE_S + 10.0)
    wait_until(
        "decode blocks used after a turn that never handed over",
        lambda: (decode_blocks_used(base_url) == 0, kv_state(base_url)),
        within_s=10.0,
    )
    time.sleep(2 * KEPT_CHECK_GRACE_S)  # checks that ask again must not drain it again
    kv = get(base_url, "/kvtide/stats")["kv"]
    assert kv["kept_orphans_drained"] - drained_before == 1, kv
