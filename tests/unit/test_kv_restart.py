"""Restarting the KV lifecycle service, and the policy's public surface.

Same round-number config (``kv_stories.CONFIG``) as the stories in test_kv_lifecycle.py:
a record of 1,100 tokens holds 69 blocks of 16 x 1,000 bytes, and is offered until 15 s
before expiry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest
from kv_stories import BYTES_1100, CONFIG, recompute, tokens

import policies.kv_lifecycle as kv_lifecycle_module
from policies.errors import InvalidPolicyConfig, InvalidTurn
from policies.kv_lifecycle import (
    Evict,
    EvictReason,
    Expire,
    KVLifecycle,
    KVLifecycleConfig,
    KVRecord,
    RecomputeReason,
    Release,
    ReleaseReason,
    prefix_hash,
)


def finish(
    kv: KVLifecycle,
    covered: Sequence[int],
    *,
    engine_id: str = "decode-0",
    transfer_params: Mapping[str, object] | None = None,
) -> None:
    kv.on_turn_finished(
        "s1",
        engine_id=engine_id,
        token_ids_covered=covered,
        block_ids=(0,),
        transfer_params=transfer_params or {},
        expiry_s=None,
        now_s=0.0,
    )


def rebuilt_record(
    session_id: str, engine_id: str, block_ids: tuple[int, ...], last_used_s: float
) -> KVRecord:
    return KVRecord(
        session_id=session_id,
        engine_id=engine_id,
        pool_id="decode",
        block_ids=block_ids,
        num_tokens=1_100,
        prefix_hash=prefix_hash(tokens(1_100)),
        expiry_s=last_used_s + 480.0,
        last_used_s=last_used_s,
        bytes_held=BYTES_1100,
    )


def test_restart_rebuilds_the_books_without_double_counting() -> None:
    # After a restart, the decode engines and the routers report what they know.
    s1 = rebuilt_record("s1", "decode-0", (1, 2), last_used_s=50.0)
    s2_old = rebuilt_record("s2", "decode-0", (3, 4), last_used_s=50.0)
    s2_new = rebuilt_record("s2", "decode-1", (5, 6), last_used_s=90.0)
    s3 = rebuilt_record("s3", "decode-1", (7,), last_used_s=-380.0)  # expires at 100
    reports = [s1, s2_old, s3, s1, s2_new]  # s1 from its engine and from a router
    kv, effects = KVLifecycle.rebuild(reports, now_s=95.0, config=CONFIG)
    # s1 is booked once. s2 keeps its newest record; the older one holds other blocks
    # and is released. s3 is inside its margin at 95 and expires.
    assert effects == [
        Release(record=s2_old, reason=ReleaseReason.SUPERSEDED),
        Expire(record=s3),
    ]
    assert kv.bytes_held("decode-0") == BYTES_1100
    assert kv.bytes_held("decode-1") == BYTES_1100
    assert sorted(kv.records(), key=lambda r: r.session_id) == [s1, s2_new]
    # The rebuilt books work as before: s1 pulls, s3 knows why it cannot.
    assert kv.on_turn_start("s1", tokens(1_200), 100.0).record == s1
    assert kv.on_turn_start("s3", tokens(1_200), 100.0) == recompute("s3", RecomputeReason.EXPIRED)
    # Rebuilding from the rebuilt books changes nothing and frees nothing.
    again, effects = KVLifecycle.rebuild(kv.records(), now_s=100.0, config=CONFIG)
    assert effects == []
    assert again.records() == kv.records()
    assert again.bytes_held("decode-1") == kv.bytes_held("decode-1")


def test_rebuild_enforces_the_budget() -> None:
    config = replace(CONFIG, idle_budget_bytes_per_engine=BYTES_1100)
    reports = [rebuilt_record(f"s{i}", "decode-0", (i,), last_used_s=float(i)) for i in range(3)]
    kv, effects = KVLifecycle.rebuild(reports, now_s=10.0, config=config)
    assert effects == [
        Evict(record=reports[0], reason=EvictReason.BUDGET),
        Evict(record=reports[1], reason=EvictReason.BUDGET),
    ]
    assert kv.records() == [reports[2]]


def test_config_keeps_the_margin_outside_the_engines_decline_window() -> None:
    assert KVLifecycleConfig().safety_margin_s == 15.0
    with pytest.raises(InvalidPolicyConfig, match=r"safety_margin_s=5\.0 .*more than"):
        KVLifecycleConfig(safety_margin_s=5.0)
    with pytest.raises(InvalidPolicyConfig, match="link_bandwidth_gbps=0"):
        KVLifecycleConfig(link_bandwidth_gbps=0)
    # An engine without a decline window may use a small margin.
    assert KVLifecycleConfig(prefill_decline_window_s=0.0, safety_margin_s=1.0).ttl_s == 480.0


def test_public_names_are_pinned() -> None:
    assert sorted(kv_lifecycle_module.__all__) == [
        "Effect",
        "Evict",
        "EvictReason",
        "Expire",
        "HOST_POOL",
        "KVLifecycle",
        "KVLifecycleConfig",
        "KVRecord",
        "KVStats",
        "RecomputeReason",
        "Release",
        "ReleaseReason",
        "TurnAction",
        "TurnDecision",
        "kept_record",
        "prefix_hash",
    ]


def test_transfer_params_pass_through_read_only() -> None:
    kv = KVLifecycle(CONFIG)
    params: dict[str, object] = {"remote_block_ids": [1, 2], "remote_engine_id": "decode-0"}
    finish(kv, tokens(1_100), transfer_params=params)
    # The caller's dict changing later does not change the record, nor can the
    # record's copy be changed.
    params["remote_engine_id"] = "changed after the report"
    record = kv.record("s1")
    assert record is not None
    assert record.transfer_params["remote_engine_id"] == "decode-0"
    with pytest.raises(TypeError):
        record.transfer_params["remote_engine_id"] = "x"  # type: ignore[index]


def test_reports_that_can_never_be_valid_are_rejected() -> None:
    kv = KVLifecycle(CONFIG)
    with pytest.raises(InvalidTurn, match="call on_turn_abandoned"):
        finish(kv, [])
    with pytest.raises(InvalidTurn, match="engine_id is empty"):
        finish(kv, tokens(10), engine_id="")
