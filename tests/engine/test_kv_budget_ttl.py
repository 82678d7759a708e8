"""The KV lifecycle against real engines: budget, draining, TTL.

The shared test app runs with ``decoder_kv_blocks_ttl_s=40``, ``safety_margin_s=8`` and
``idle_budget_mib_per_engine=32`` (see conftest.py) so these run in seconds.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import httpx
import pytest
from app_calls import complete, kvtide_stats, pulled, usage_of
from polling import wait_for
from ray import serve

from engines.base import EngineInfo, EngineStats, GenerateRequest

pytestmark = pytest.mark.engine

TINY_KV_BYTES_PER_TOKEN = 4096


_stats = kvtide_stats


def _decode() -> tuple[EngineInfo, EngineStats]:
    handle = serve.get_deployment_handle("decode-pool", app_name="kvtide")
    return handle.info.remote().result(), handle.stats.remote().result()


def _decode_kv_bytes_in_use() -> float:
    info, stats = _decode()
    return stats.kv_cache_usage * info.num_kv_blocks * info.block_size * TINY_KV_BYTES_PER_TOKEN


_complete = partial(complete, max_tokens=2)


def test_96_idle_sessions_never_hold_more_decode_kv_than_the_budget(kvtide_app: Any) -> None:
    budget = 32 * 2**20  # 32 sessions' KV: three times as many go through
    rng = random.Random(5)
    num_sessions = 96
    prompts = {
        f"idle-{i}": [rng.randrange(10, 1000) for _ in range(150)] for i in range(num_sessions)
    }
    held: list[int] = []
    start = _stats(kvtide_app)["kv"]

    def one(item: tuple[str, list[int]]) -> None:
        _complete(kvtide_app, item[1], item[0])
        held.append(max(_stats(kvtide_app)["kv"]["bytes_held"].values(), default=0))

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, prompts.items()))
    stats = _stats(kvtide_app)["kv"]
    # kvtide's books: never over the budget after any request.
    assert max(held) <= budget
    assert stats["num_evictions"] >= num_sessions - budget // (256 * TINY_KV_BYTES_PER_TOKEN)
    # The engine's truth: evicted sessions were drained, so the decode engine's pinned KV
    # settles under the budget too (plus one session's blocks of slack for rounding).
    wait_for(
        lambda: _decode_kv_bytes_in_use() <= budget + 256 * TINY_KV_BYTES_PER_TOKEN,
        timeout_s=120,
        what="the decode engine to free drained sessions' blocks",
    )
    # Every evicted session went to the host tier (while it had room; a copy whose
    # session moved on meanwhile is released there) or was drained, or (rarely: evicted
    # in the moment between its turn ending and its tokens being recorded) left to
    # expire at the TTL. None failed.
    end = _stats(kvtide_app)["kv"]
    evicted = end["num_evictions"] - start["num_evictions"]

    def handled(kv: dict[str, Any]) -> int:
        drained = kv["num_drains"] + kv["num_drain_failures"] + kv["num_undrainable"]
        return int(drained + kv["num_host_take_ins"] + kv["num_host_unbooked"])

    wait_for(
        lambda: handled(_stats(kvtide_app)["kv"]) - handled(start) >= evicted,
        timeout_s=180,
        what="every evicted session's drain to finish",
    )
    final = _stats(kvtide_app)["kv"]
    assert final["num_drain_failures"] == start["num_drain_failures"], final
    # The first of them went to the shared app's host tier (16 MiB), the rest drained.
    assert final["num_host_take_ins"] > start["num_host_take_ins"], final
    assert final["host_tier"]["num_take_ins"] >= final["num_host_take_ins"], final
    assert final["num_undrainable"] - start["num_undrainable"] <= evicted // 20, final
    # Done with them, as a client is: the tests after this one get the budget back.
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(
            pool.map(
                lambda sid: httpx.delete(
                    f"{kvtide_app.base_url}/kvtide/sessions/{sid}", timeout=30
                ),
                prompts,
            )
        )
    wait_for(
        lambda: _stats(kvtide_app)["kv"]["num_drains_running"] == 0,
        timeout_s=180,
        what="the closed sessions' drains",
    )


def test_closing_a_session_drains_its_kv(kvtide_app: Any) -> None:
    rng = random.Random(7)
    _complete(kvtide_app, [rng.randrange(10, 1000) for _ in range(900)], "to-close")
    before = _stats(kvtide_app)["kv"]
    # Kept (the budget has room): closing it is what drains it.
    assert httpx.get(kvtide_app.base_url + "/kvtide/sessions/to-close", timeout=30).json()["record"]
    resp = httpx.delete(kvtide_app.base_url + "/kvtide/sessions/to-close", timeout=30)
    assert resp.status_code == 200 and resp.json()["deleted"] is True
    wait_for(lambda: _stats(kvtide_app)["kv"]["num_drains"] > before["num_drains"], 60, "the drain")
    assert "to-close" not in str(_stats(kvtide_app)["kv"]["bytes_held"])


def test_a_turn_after_the_ttl_recomputes_and_succeeds(kvtide_app: Any) -> None:
    rng = random.Random(8)
    prompt = [rng.randrange(10, 1000) for _ in range(700)]
    first = _complete(kvtide_app, prompt, "ttl-session", return_token_ids=True)
    url = kvtide_app.base_url + "/kvtide/sessions/ttl-session"
    record = httpx.get(url, timeout=30).json()["record"]
    assert record is not None and 0 < record["expires_in_s"] <= 40
    # kvtide stops offering the blocks at TTL - margin (40 - 8 s); wait for that tick.
    wait_for(lambda: httpx.get(url, timeout=30).json()["record"] is None, 60, "the expiry")
    follow_up = prompt + first["choices"][0]["token_ids"] + [rng.randrange(10, 1000)]
    second = _complete(kvtide_app, follow_up, "ttl-session", return_token_ids=True)
    assert second["kvtide"]["kv_plan"] == "recompute"
    assert second["kvtide"]["kv_plan_reason"] in ("expired", "within_margin", "no_record")
    # Same greedy output as one engine computing it from scratch: no 500, no hang.
    handle = serve.get_deployment_handle("decode-pool", app_name="kvtide").options(stream=True)
    req = GenerateRequest(request_id="ttl-ref", prompt_token_ids=follow_up, max_tokens=2)
    ref = [t for c in handle.generate.remote(req) for t in c.token_ids]
    assert ref == second["choices"][0]["token_ids"]


def test_a_session_heartbeating_past_its_decode_ttl_comes_back_from_the_host_tier(
    kvtide_app: Any,
) -> None:
    # An agent's tool call outlasts the decode engine's TTL (40 s here) while its SDK
    # heartbeats the session: 8 s before the engine frees the blocks, the shared app's
    # host tier (16 MiB) copies them, and the turn after the call pulls from there with
    # the tokens a recompute gives. (The prefill engine's prefix cache, which this
    # shared app cannot reset, may still hold the history, and then the pull reads no
    # bytes: `kv_source: prefix_cache`; test_host_store_nixl.py resets it.)
    rng = random.Random(9)
    prompt = [rng.randrange(10, 1000) for _ in range(300)]
    first = _complete(kvtide_app, prompt, "long-tool-call", return_token_ids=True)
    url = kvtide_app.base_url + "/kvtide/sessions/long-tool-call"
    kept = httpx.get(url, timeout=30).json()["record"]
    assert kept is not None and not kept["engine_id"].startswith("kvtide-host-")

    def on_host() -> bool:
        body = httpx.post(url + "/renew", timeout=30).json()  # the SDK's heartbeat
        return bool(body["record"] and body["record"]["engine_id"].startswith("kvtide-host-"))

    wait_for(on_host, 90, "the copy to the host tier at the decode's offer deadline")
    before = _stats(kvtide_app)["kv"]["host_tier"]
    follow_up = prompt + first["choices"][0]["token_ids"] + [rng.randrange(10, 1000)]
    second = _complete(kvtide_app, follow_up, "long-tool-call", return_token_ids=True)
    how = pulled(second["kvtide"], usage_of(first))
    assert how == "prefix_cache" or second["kvtide"]["kv_source"] == "host_tier", second
    # The prefill engine's pull went to the store: its reader told it so.
    wait_for(
        lambda: (
            _stats(kvtide_app)["kv"]["host_tier"]["num_read_notifs"] > before["num_read_notifs"]
        ),
        30,
        "the store's read notification",
    )
    handle = serve.get_deployment_handle("decode-pool", app_name="kvtide").options(stream=True)
    req = GenerateRequest(request_id="ttl-host-ref", prompt_token_ids=follow_up, max_tokens=2)
    ref = [t for c in handle.generate.remote(req) for t in c.token_ids]
    assert ref == second["choices"][0]["token_ids"]
