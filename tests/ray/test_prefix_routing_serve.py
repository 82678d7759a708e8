"""Prefix-aware prefill routing, against the whole app on a local Ray.

kvtide's simulated engines (two prefill replicas with a prefix cache, one decode; no
weights) behind the real Serve app and HTTP endpoint, driven by the official `openai`
client. Conversations are sent as most OpenAI clients send them: the whole history
every turn and no `x-session-id`, so a turn reuses KV only if its prefill lands on the
replica that computed the earlier turns (``benchmarks/prefix_routing.py`` is the same
load, measured against Serve's load balancing).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.prefix_routing import app_config, converse

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, int]]:
    from orchestrator import runtime
    from orchestrator.cluster.ports import free_port

    tmp, port = tmp_path_factory.mktemp("prefix"), free_port()
    with runtime.running(app_config(tmp, prefix_aware=True, port=port), say=lambda _: None) as url:
        yield url, tmp, port


def test_every_later_turn_lands_on_the_replica_that_computed_the_history(
    app: tuple[str, Path, int],
) -> None:
    base_url, _, _ = app
    # Two conversations, turns interleaved: with Serve's random pick of two replicas a
    # conversation's four turns would all meet one replica once in eight.
    conversations = converse(base_url, conversations=2, turns=4, max_tokens=8)
    firsts = [turns[0].kvtide for turns in conversations]
    # New conversations (nothing matches) spread over the idle replicas.
    assert [k["prefill_route_reason"] for k in firsts] == ["least_loaded", "least_loaded"]
    assert firsts[0]["prefill_replica"] != firsts[1]["prefill_replica"]
    for turns, first in zip(conversations, firsts, strict=True):
        assert turns[0].cached_tokens == 0
        for n, turn in enumerate(turns[1:], start=2):
            k: dict[str, Any] = turn.kvtide
            where = f"turn {n}: {k}"
            assert k["prefill_replica"] == first["prefill_replica"], where
            assert k["prefill_route_reason"] == "prefix_match", where
            # The router expected at least the previous prompt's full blocks ...
            previous = turns[n - 2]
            assert k["prefill_matched_tokens"] >= previous.prompt_tokens // 128 * 128, where
            # ... and the engine found them in its prefix cache (128-token blocks).
            assert turn.cached_tokens >= previous.prompt_tokens // 128 * 128 > 0, where
            assert k["kv_source"] == "prefix_cache", where


def test_with_the_switch_off_serve_balances_by_load(app: tuple[str, Path, int]) -> None:
    from orchestrator import runtime

    _, tmp, port = app
    config = app_config(tmp, prefix_aware=False, port=port)
    runtime.deploy(config, say=lambda _: None)
    [turns] = converse(
        f"http://{config.server.host}:{port}", conversations=1, turns=2, max_tokens=8
    )
    for turn in turns:
        assert turn.kvtide["prefill_route_reason"] == "pow2"
        assert turn.kvtide["prefill_matched_tokens"] == 0
        assert str(turn.kvtide["prefill_replica"]).startswith("prefill-")
