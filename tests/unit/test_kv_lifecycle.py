"""Stories of the KV lifecycle policy, told with a moved clock (nothing sleeps).

The config (``kv_stories.CONFIG``) prices things in round numbers: 1 ms to prefill a
token, 1 GB/s link (8 Gb/s), 100 ms to set a pull up, 1,000 KV bytes per token in
16-token blocks. So a record of N tokens holds ceil(N / 16) * 16,000 bytes, and with the
default TTL (480 s) and margin (15 s) a record kept at t=0 is offered until t=465.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pytest
from kv_stories import BYTES_1100, CONFIG, recompute, tokens

from policies.kv_lifecycle import (
    HOST_POOL,
    Effect,
    Evict,
    EvictReason,
    Expire,
    KVLifecycle,
    KVRecord,
    RecomputeReason,
    Release,
    ReleaseReason,
    TurnAction,
    prefix_hash,
)


def keep(
    kv: KVLifecycle,
    session_id: str,
    covered: list[int],
    *,
    now_s: float,
    engine_id: str = "decode-0",
    block_ids: tuple[int, ...] = (0, 1, 2),
    expiry_s: float | None = None,
    transfer_params: Mapping[str, object] | None = None,
) -> list[Effect]:
    """End a turn whose decode engine kept the KV of ``covered``."""
    return kv.on_turn_finished(
        session_id,
        engine_id=engine_id,
        token_ids_covered=covered,
        block_ids=block_ids,
        transfer_params=transfer_params or {"remote_engine_id": engine_id},
        expiry_s=expiry_s,
        now_s=now_s,
    )


def current(kv: KVLifecycle, session_id: str) -> KVRecord:
    """The session's current record, which the story expects to exist."""
    record = kv.record(session_id)
    assert record is not None
    return record


def test_second_turn_pulls_back_the_kv_that_decode_kept() -> None:
    kv = KVLifecycle(CONFIG)
    # Turn 1: a new session has nothing to reuse; its prefill computes everything.
    assert kv.on_turn_start("s1", tokens(2_000), 0.0) == recompute("s1", RecomputeReason.NO_RECORD)
    # Decode answered and kept the KV of the first 2,604 tokens (163 blocks), pinned
    # on its clock until t=490. Its kv_transfer_params are kept verbatim.
    covered = tokens(2_604)
    params = {"remote_engine_id": "decode-0", "remote_block_ids": [7, 8, 9]}
    effects = keep(
        kv, "s1", covered, now_s=10.0, block_ids=(7, 8, 9), expiry_s=490.0, transfer_params=params
    )
    assert effects == []
    record = current(kv, "s1")
    assert record == KVRecord(
        session_id="s1",
        engine_id="decode-0",
        pool_id="decode",
        block_ids=(7, 8, 9),
        num_tokens=2_604,
        prefix_hash=prefix_hash(covered),
        expiry_s=490.0,
        last_used_s=10.0,
        bytes_held=163 * 16_000,
    )
    assert dict(record.transfer_params) == params
    assert kv.bytes_held("decode-0") == kv.idle_bytes("decode-0") == 2_608_000

    # Turn 2 extends turn 1. Recomputing 2,604 tokens costs 2.604 s; pulling 2.608 MB
    # costs 2.6 ms plus 100 ms setup: pull.
    decision = kv.on_turn_start("s1", covered + tokens(100, first=50_000), 60.0)
    assert decision.action is TurnAction.PULL_FROM_DECODE
    assert decision.record == record
    assert decision.num_reusable_tokens == 2_604
    assert decision.estimated_recompute_s == pytest.approx(2.604)
    assert decision.estimated_transfer_s == pytest.approx(0.102608)
    # The record now belongs to that prefill: not offered again, still on decode-0
    # until the read completes, and not idle (a turn is in flight).
    assert kv.record("s1") is None
    assert kv.pulls_in_flight() == [record]
    assert (kv.bytes_held("decode-0"), kv.idle_bytes("decode-0")) == (2_608_000, 0)

    # Turn 2 ends on decode-1 with 2,764 tokens kept (173 blocks). The read freed the
    # old blocks, so nothing is left to release.
    assert keep(kv, "s1", tokens(2_764), now_s=70.0, engine_id="decode-1") == []
    assert kv.pulls_in_flight() == []
    assert kv.bytes_held("decode-0") == 0
    assert kv.bytes_held("decode-1") == kv.idle_bytes("decode-1") == 173 * 16_000
    stats = kv.stats()
    assert (stats.num_sessions, stats.num_records, stats.num_pulls) == (1, 1, 1)
    assert stats.num_recomputes == stats.num_recomputes_for(RecomputeReason.NO_RECORD) == 1


def test_blocks_are_offered_until_the_safety_margin_then_expire() -> None:
    kv = KVLifecycle(CONFIG)
    kv.on_turn_start("s1", tokens(1_000), 0.0)
    keep(kv, "s1", tokens(1_100), now_s=0.0, expiry_s=480.0)
    record = current(kv, "s1")
    # Before the offer deadline (480 - 15 = 465) a tick has nothing to do.
    assert kv.on_tick(464.9) == []
    # A turn at 470 is inside the margin: the prefill engine declines reads within
    # 5 s of expiry, and a pull started now could still be reading then.
    prompt = tokens(1_100) + tokens(20, first=9_000)
    assert kv.on_turn_start("s1", prompt, 470.0) == recompute("s1", RecomputeReason.WITHIN_MARGIN)
    # The next tick stops booking it. The engine frees the blocks itself at 480;
    # there is nothing to drain.
    effects = kv.on_tick(470.0)
    assert effects == [Expire(record=record)]
    assert effects[0].drainable is False
    assert kv.bytes_held("decode-0") == 0
    # The turn still ends normally: no release for the expired record.
    assert keep(kv, "s1", tokens(1_200), now_s=475.0, expiry_s=955.0) == []
    assert kv.stats().num_expiries == 1


def test_expired_record_is_never_offered_even_before_the_tick() -> None:
    kv = KVLifecycle(CONFIG)
    keep(kv, "s1", tokens(1_100), now_s=0.0, expiry_s=480.0)
    # No tick ran since; the turn itself sees the record is past its engine expiry.
    assert kv.on_turn_start("s1", tokens(1_200), 481.0) == recompute("s1", RecomputeReason.EXPIRED)


def test_heartbeats_keep_the_session_but_never_the_blocks() -> None:
    kv = KVLifecycle(CONFIG)
    keep(kv, "s1", tokens(1_100), now_s=0.0)  # no expiry reported: 0 + ttl_s = 480
    # The SDK heartbeats every minute for ten minutes.
    for minute in range(1, 11):
        assert kv.renew("s1", 60.0 * minute)
        if minute == 8:  # at 480 the blocks are gone whatever the lease says
            assert [type(e) for e in kv.on_tick(480.0)] == [Expire]
    assert kv.on_tick(600.0) == []
    assert kv.num_sessions() == 1
    # The session is alive, its KV is not: the next turn recomputes, saying why.
    assert kv.on_turn_start("s1", tokens(1_200), 610.0) == recompute("s1", RecomputeReason.EXPIRED)
    assert kv.on_turn_abandoned("s1", now_s=610.0) == []
    # Then silence: the lease runs out 480 s after the last use.
    assert kv.on_tick(1_089.9) == []
    assert kv.on_tick(1_090.0) == []  # nothing to release: the record already expired
    assert kv.num_sessions() == 0
    assert kv.renew("s1", 1_100.0) is False
    assert kv.on_turn_start("s1", tokens(1_200), 1_100.0) == recompute(
        "s1", RecomputeReason.NO_RECORD
    )


def test_idle_lease_ending_releases_the_record_before_its_expiry() -> None:
    kv = KVLifecycle(replace(CONFIG, lease_ttl_s=120.0))
    keep(kv, "s1", tokens(1_100), now_s=0.0)
    record = current(kv, "s1")
    # Nobody used or renewed the session for 120 s: kvtide lets the KV go at once,
    # and the orchestrator may drain the blocks rather than wait for t=480.
    assert kv.on_tick(119.9) == []
    effects = kv.on_tick(120.0)
    assert effects == [Release(record=record, reason=ReleaseReason.LEASE_EXPIRED)]
    assert effects[0].drainable is True
    assert (kv.num_sessions(), kv.bytes_held("decode-0")) == (0, 0)


def test_a_turn_in_flight_holds_its_session_past_the_lease() -> None:
    kv = KVLifecycle(replace(CONFIG, lease_ttl_s=120.0))
    # A long turn: started at 0, still generating at 500.
    kv.on_turn_start("s1", tokens(1_000), 0.0)
    assert kv.on_tick(500.0) == []
    assert kv.num_sessions() == 1
    # It ends at 500; the lease counts from there.
    keep(kv, "s1", tokens(1_100), now_s=500.0)
    assert kv.on_tick(619.9) == []
    assert [type(e) for e in kv.on_tick(620.0)] == [Release]


def test_a_client_that_rewrites_history_gets_a_recompute_not_wrong_kv() -> None:
    kv = KVLifecycle(CONFIG)
    keep(kv, "s1", tokens(1_100), now_s=0.0)
    old = current(kv, "s1")
    # The client stripped reasoning text from the last answer: token 600 differs.
    rewritten = tokens(1_100) + tokens(50, first=9_000)
    rewritten[600] = 77_777
    assert kv.on_turn_start("s1", rewritten, 10.0) == recompute(
        "s1", RecomputeReason.PREFIX_MISMATCH
    )
    kv.on_turn_abandoned("s1", now_s=11.0)
    # The client dropped the last answer: the prompt is shorter than the record.
    assert kv.on_turn_start("s1", tokens(1_000), 12.0) == recompute(
        "s1", RecomputeReason.PREFIX_MISMATCH
    )
    kv.on_turn_abandoned("s1", now_s=13.0)
    # Neither turn used the record, so it is still offered to a prompt that extends it.
    assert kv.record("s1") == old
    decision = kv.on_turn_start("s1", [*tokens(1_100), 5], 14.0)
    assert decision.action is TurnAction.PULL_FROM_DECODE
    assert kv.stats().num_recomputes_for(RecomputeReason.PREFIX_MISMATCH) == 2


def test_after_a_mismatch_the_new_kv_supersedes_the_old_record() -> None:
    kv = KVLifecycle(CONFIG)
    keep(kv, "s1", tokens(1_100), now_s=0.0, block_ids=(1, 2))
    old = current(kv, "s1")
    assert old is not None
    kv.on_turn_start("s1", tokens(900, first=5_000), 10.0)  # a different history
    # The turn kept new blocks; the old ones stay pinned until t=480 unless drained.
    effects = keep(kv, "s1", tokens(1_000, first=5_000), now_s=20.0, block_ids=(3, 4))
    assert effects == [Release(record=old, reason=ReleaseReason.SUPERSEDED)]
    assert effects[0].drainable is True
    assert kv.bytes_held("decode-0") == 63 * 16_000


def test_reusable_tokens_below_the_threshold_are_recomputed() -> None:
    # With a cheap setup, any prefix at or above the threshold would be pulled.
    kv = KVLifecycle(replace(CONFIG, transfer_setup_s=0.001))
    keep(kv, "short", tokens(63), now_s=0.0)
    keep(kv, "enough", tokens(64), now_s=0.0)
    # 63 tokens: under vLLM's kv_recompute_threshold the prefill engine would
    # recompute silently anyway, so kvtide does not book a pull.
    assert kv.on_turn_start("short", tokens(80), 1.0) == recompute(
        "short", RecomputeReason.BELOW_THRESHOLD
    )
    # 64 tokens: 64 ms to recompute against 1.064 ms to pull.
    assert kv.on_turn_start("enough", tokens(80), 1.0).action is TurnAction.PULL_FROM_DECODE


def test_cost_model_recomputes_short_prefixes_and_pulls_long_contexts() -> None:
    kv = KVLifecycle(CONFIG)
    keep(kv, "short", tokens(100), now_s=0.0)
    keep(kv, "long", tokens(2_604), now_s=0.0)
    # 100 tokens: 100 ms to recompute, 112 KB + 100 ms setup to pull: recompute.
    decision = kv.on_turn_start("short", tokens(150), 1.0)
    assert decision.reason is RecomputeReason.CHEAPER_TO_RECOMPUTE
    assert decision.num_reusable_tokens == 100
    assert decision.estimated_recompute_s == pytest.approx(0.1)
    assert decision.estimated_transfer_s == pytest.approx(0.100112)
    # 2,604 tokens: 2.604 s to recompute, about 0.103 s to pull: pull.
    decision = kv.on_turn_start("long", tokens(2_700), 1.0)
    assert decision.action is TurnAction.PULL_FROM_DECODE
    assert decision.estimated_transfer_s == pytest.approx(0.102608)


def test_a_failed_pull_falls_back_to_recompute_and_is_never_offered_again() -> None:
    kv = KVLifecycle(CONFIG)
    keep(kv, "s1", tokens(1_100), now_s=0.0)
    record = current(kv, "s1")
    assert kv.on_turn_start("s1", tokens(1_200), 100.0).action is TurnAction.PULL_FROM_DECODE
    # The read failed (or the orchestrator timed it out). The turn is not lost: the
    # orchestrator reruns the prefill without params. The record is unusable, and
    # reads of it fail, so it is not drainable either.
    effects = kv.on_pull_result("s1", ok=False, now_s=101.0)
    assert effects == [Release(record=record, reason=ReleaseReason.FAILED_PULL)]
    assert effects[0].drainable is False
    assert kv.on_pull_result("s1", ok=False, now_s=102.0) == []  # reported twice: ignored
    stats = kv.stats()
    assert (stats.num_declines, stats.num_recomputes_for(RecomputeReason.FAILED_PULL)) == (1, 1)
    assert kv.bytes_held("decode-0") == 0
    # The rerun failed too; the next turn knows why there is nothing to pull.
    assert kv.on_turn_abandoned("s1", now_s=103.0) == []
    assert kv.on_turn_start("s1", tokens(1_200), 110.0) == recompute(
        "s1", RecomputeReason.FAILED_PULL
    )


def test_a_pull_that_never_resolves_is_unbooked() -> None:
    kv = KVLifecycle(CONFIG)
    keep(kv, "a", tokens(1_100), now_s=0.0, expiry_s=480.0)
    keep(kv, "b", tokens(1_100), now_s=0.0, expiry_s=480.0)
    a, b = current(kv, "a"), current(kv, "b")
    kv.on_turn_start("a", tokens(1_200), 400.0)
    kv.on_turn_start("b", tokens(1_200), 400.0)
    # a's turn is abandoned without a pull result: count the pull as failed.
    assert kv.on_turn_abandoned("a", now_s=410.0) == [
        Release(record=a, reason=ReleaseReason.FAILED_PULL)
    ]
    # b's orchestrator never reports anything: at engine expiry the blocks are gone.
    assert kv.on_tick(479.9) == []
    assert kv.on_tick(480.0) == [Expire(record=b)]
    assert kv.pulls_in_flight() == []
    assert kv.bytes_held("decode-0") == 0


def test_a_record_being_pulled_is_not_offered_to_a_concurrent_turn() -> None:
    kv = KVLifecycle(CONFIG)
    keep(kv, "s1", tokens(1_100), now_s=0.0)
    assert kv.on_turn_start("s1", tokens(1_200), 10.0).action is TurnAction.PULL_FROM_DECODE
    # The first read frees the blocks, so a second reader could find them gone.
    assert kv.on_turn_start("s1", tokens(1_200), 10.5) == recompute(
        "s1", RecomputeReason.PULL_IN_FLIGHT
    )


def test_budget_evicts_idle_sessions_nearest_expiry_first() -> None:
    kv = KVLifecycle(replace(CONFIG, idle_budget_bytes_per_engine=2 * BYTES_1100))
    # a, b and c finish 10 s apart on decode-0; d on decode-1 has its own budget.
    assert keep(kv, "a", tokens(1_100), now_s=0.0) == []
    assert keep(kv, "b", tokens(1_100), now_s=10.0) == []
    assert keep(kv, "d", tokens(1_100), now_s=15.0, engine_id="decode-1") == []
    a = current(kv, "a")
    # The third idle record on decode-0 is one too many: a expires first, so it goes.
    effects = keep(kv, "c", tokens(1_100), now_s=20.0)
    assert effects == [Evict(record=a, reason=EvictReason.BUDGET)]
    assert effects[0].drainable is True
    assert kv.idle_bytes("decode-0") == 2 * BYTES_1100
    assert kv.idle_bytes("decode-1") == BYTES_1100
    assert kv.on_turn_start("a", tokens(1_200), 30.0) == recompute("a", RecomputeReason.EVICTED)


def host_copy(record: KVRecord, now_s: float, expiry_s: float = 900.0) -> KVRecord:
    """``record``'s KV as a host-memory tier holds it after taking it in."""
    return replace(
        record,
        engine_id="host-0",
        pool_id=HOST_POOL,
        block_ids=(40, 41, 42),
        expiry_s=expiry_s,
        last_used_s=now_s,
        transfer_params={"remote_engine_id": "host-0", "remote_block_ids": [40, 41, 42]},
    )


def test_an_evicted_sessions_kv_copied_to_the_host_tier_is_pulled_from_there() -> None:
    kv = KVLifecycle(replace(CONFIG, idle_budget_bytes_per_engine=BYTES_1100))
    keep(kv, "a", tokens(1_100), now_s=0.0)
    a = current(kv, "a")
    [evicted] = keep(kv, "b", tokens(1_100), now_s=10.0)
    assert evicted == Evict(record=a, reason=EvictReason.BUDGET)
    # The service copied a's blocks to the host tier before the decode freed them.
    assert kv.demote(a, host_copy(a, 11.0), 11.0)
    assert kv.record("a") == host_copy(a, 11.0)
    # The host tier is bounded by its own capacity: the decode's idle budget, which
    # one record fills, does not evict it, however many it holds.
    keep(kv, "c", tokens(1_100), now_s=12.0, engine_id="decode-1")
    assert kv.idle_bytes("host-0") == BYTES_1100 and kv.on_tick(13.0) == []
    decision = kv.on_turn_start("a", tokens(1_200), 20.0)
    assert decision.action is TurnAction.PULL_FROM_DECODE
    assert decision.record == host_copy(a, 11.0)
    assert kv.stats().num_demotions == 1


def test_a_copy_is_booked_for_a_session_held_for_an_ingress() -> None:
    # An ingress holds a's next turn (a turn lease granted after the eviction, planned
    # without a record): the copy is booked all the same, for the turn after the lease.
    kv = KVLifecycle(replace(CONFIG, idle_budget_bytes_per_engine=BYTES_1100))
    keep(kv, "a", tokens(1_100), now_s=0.0)
    a = current(kv, "a")
    keep(kv, "b", tokens(1_100), now_s=10.0)
    assert kv.hold("a", 10.5) is None
    assert kv.demote(a, host_copy(a, 11.0), 11.0)
    assert kv.unhold("a", 12.0) == []
    assert kv.on_turn_start("a", tokens(1_200), 13.0).action is TurnAction.PULL_FROM_DECODE


def test_a_record_reaching_its_ttl_unpulled_can_still_be_copied_to_the_host_tier() -> None:
    # An agent's tool call outlasts the decode's TTL (480 s), its SDK session kept alive
    # by heartbeats: at the offer deadline the blocks are still intact for 15 s, long
    # enough for a host tier to copy them.
    kv = KVLifecycle(CONFIG)
    keep(kv, "a", tokens(1_100), now_s=0.0, expiry_s=480.0)
    a = current(kv, "a")
    assert kv.renew("a", 400.0)
    [expired] = kv.on_tick(465.0)
    assert expired == Expire(record=a, unread=True) and not expired.drainable
    assert kv.demote(a, host_copy(a, 466.0, expiry_s=1_066.0), 466.0)
    on_host = host_copy(a, 466.0, expiry_s=1_066.0)
    assert kv.renew("a", 700.0) and kv.on_tick(700.0) == []  # past the decode's TTL
    assert kv.record("a") == on_host
    # The copy's own TTL ends like any record's, and a host copy is never copied again.
    assert kv.on_tick(1_051.0) == [Expire(record=on_host, unread=False)]
    assert kv.on_turn_start("a", tokens(1_200), 1_052.0) == recompute("a", RecomputeReason.EXPIRED)


@pytest.mark.parametrize("case", ["turn_running", "too_late", "lease_ends_first"])
def test_an_expiring_record_is_not_offered_for_a_copy_it_cannot_make(case: str) -> None:
    kv = KVLifecycle(CONFIG)
    keep(kv, "a", tokens(1_100), now_s=0.0, expiry_s=480.0)
    a = current(kv, "a")
    if case != "lease_ends_first":  # no heartbeat: the session ends with its blocks
        assert kv.renew("a", 400.0)
    if case == "turn_running":  # the turn keeps a newer record; a copy would be stale
        kv.on_turn_start("a", tokens(1_200), 470.0)
        [expired] = kv.on_tick(470.0)
    elif case == "too_late":  # ticks stalled (a restart) until within the engine's margin
        [expired] = kv.on_tick(476.0)
    else:
        [expired] = kv.on_tick(465.0)
    assert expired == Expire(record=a, unread=False)
    assert not kv.demote(a, host_copy(a, 477.0), 477.0)


@pytest.mark.parametrize(
    "case", ["turn_started", "record_again", "closed", "within_margin", "other_tokens"]
)
def test_a_host_copy_is_not_booked_once_the_session_moved_on(case: str) -> None:
    kv = KVLifecycle(replace(CONFIG, idle_budget_bytes_per_engine=BYTES_1100))
    keep(kv, "a", tokens(1_100), now_s=0.0)
    a = current(kv, "a")
    keep(kv, "b", tokens(1_100), now_s=10.0)  # a evicted
    copy = host_copy(a, 11.0)
    if case == "turn_started":  # a's next turn recomputed while the copy was made
        kv.on_turn_start("a", tokens(1_200), 10.5)
    elif case == "record_again":  # ... and finished
        kv.on_turn_start("a", tokens(1_200), 10.5)
        keep(kv, "a", tokens(1_210), now_s=10.8, engine_id="decode-1")
    elif case == "closed":
        kv.close("a", 10.5)
    elif case == "other_tokens":  # not a copy of the evicted record's KV
        copy = replace(copy, num_tokens=1_000, prefix_hash=prefix_hash(tokens(1_000)))
    else:  # the copy would be offered for less than the safety margin
        copy = host_copy(a, 11.0, expiry_s=11.0 + CONFIG.safety_margin_s)
    before = kv.record("a")
    assert not kv.demote(a, copy, 11.0)  # the caller frees the copy
    assert kv.record("a") == before and kv.stats().num_demotions == 0


def test_a_session_with_a_turn_in_flight_is_never_evicted() -> None:
    kv = KVLifecycle(replace(CONFIG, idle_budget_bytes_per_engine=2 * BYTES_1100))
    keep(kv, "a", tokens(1_100), now_s=0.0)  # expires first
    keep(kv, "b", tokens(1_100), now_s=10.0)
    # a starts a turn that will not use its record (different history): a's record
    # stays booked, but a is active, so it is not idle.
    kv.on_turn_start("a", tokens(500, first=7_000), 20.0)
    assert keep(kv, "c", tokens(1_100), now_s=30.0) == []  # idle: b, c
    a_old, b, c = current(kv, "a"), current(kv, "b"), current(kv, "c")
    # A third idle record: b goes, although a's record expires sooner.
    assert keep(kv, "d", tokens(1_100), now_s=40.0) == [Evict(record=b, reason=EvictReason.BUDGET)]
    assert kv.record("a") == a_old
    # a's turn ends: its old record is superseded, and its new one makes three idle
    # records again, so c (now the nearest expiry) goes.
    assert keep(kv, "a", tokens(520, first=7_000), now_s=50.0, block_ids=(9,)) == [
        Release(record=a_old, reason=ReleaseReason.SUPERSEDED),
        Evict(record=c, reason=EvictReason.BUDGET),
    ]
    assert kv.idle_bytes("decode-0") == BYTES_1100 + 33 * 16_000


def test_two_hundred_idle_sessions_never_exceed_the_budget() -> None:
    budget = 10 * BYTES_1100
    kv = KVLifecycle(replace(CONFIG, idle_budget_bytes_per_engine=budget))
    evicted: list[str] = []
    # 200 sessions finish one second apart, alternately on two decode engines.
    for i in range(200):
        engine_id = f"decode-{i % 2}"
        effects = keep(kv, f"s{i:03d}", tokens(1_100), now_s=float(i), engine_id=engine_id)
        evicted += [e.session_id for e in effects if isinstance(e, Evict)]
        assert kv.idle_bytes("decode-0") <= budget
        assert kv.idle_bytes("decode-1") <= budget
    # Each engine keeps its ten newest sessions; the rest went oldest first.
    assert evicted == [f"s{i:03d}" for i in range(180)]
    assert sorted(r.session_id for r in kv.records()) == [f"s{i:03d}" for i in range(180, 200)]
    assert kv.bytes_held("decode-0") == kv.bytes_held("decode-1") == budget
    assert kv.stats().num_evictions == 180


def test_held_turns_count_toward_the_budget_and_are_evicted_once_given_back() -> None:
    budget = 2 * BYTES_1100
    kv = KVLifecycle(replace(CONFIG, idle_budget_bytes_per_engine=budget))
    # a and b finish and their next turns are held for an ingress (turn leases).
    for i, sid in enumerate("ab"):
        kv.on_turn_start(sid, tokens(1_100), float(i))
        keep(kv, sid, tokens(1_100), now_s=float(i) + 0.5)
        assert kv.hold(sid, float(i) + 0.5) == current(kv, sid)
    assert kv.idle_bytes("decode-0") == budget  # held records are counted...
    # ...and never evicted: a newer idle record goes instead, so the budget holds.
    c_effects = keep(kv, "c", tokens(1_100), now_s=10.0)
    assert [e.session_id for e in c_effects if isinstance(e, Evict)] == ["c"]
    assert kv.idle_bytes("decode-0") == budget
    assert kv.bytes_held("decode-0") == budget
    # b's held turn runs and pulls: its record leaves the idle bytes with it.
    record_b = current(kv, "b")
    assert kv.use_held("b", record=record_b, reason=None, now_s=11.0)
    assert kv.idle_bytes("decode-0") == BYTES_1100
    # A turn used or given back is no longer held: a second use is refused.
    assert not kv.use_held("b", record=record_b, reason=None, now_s=11.5)
    # a is given back unused and is an ordinary idle record, evicted in its turn.
    assert kv.unhold("a", 12.0) == []
    assert kv.idle_bytes("decode-0") == BYTES_1100
    assert keep(kv, "b", tokens(1_100), now_s=13.0, block_ids=(4, 5)) == []
    d_effects = keep(kv, "d", tokens(1_100), now_s=14.0, block_ids=(6,))
    assert [e.session_id for e in d_effects if isinstance(e, Evict)] == ["a"]
    assert kv.idle_bytes("decode-0") <= budget


def test_hybrid_models_book_the_linear_state_of_each_sequence() -> None:
    kv = KVLifecycle(replace(CONFIG, linear_state_bytes_per_sequence=2_000_000))
    keep(kv, "s1", tokens(1_100), now_s=0.0)
    # 69 blocks of attention KV plus one sequence's linear-attention state.
    assert kv.bytes_held("decode-0") == BYTES_1100 + 2_000_000
    # The state travels with a pull, so it is priced too.
    decision = kv.on_turn_start("s1", tokens(1_200), 1.0)
    assert decision.estimated_transfer_s == pytest.approx((BYTES_1100 + 2_000_000) / 1e9 + 0.1)


def test_close_releases_the_record_and_is_idempotent() -> None:
    kv = KVLifecycle(CONFIG)
    keep(kv, "s1", tokens(1_100), now_s=0.0)
    record = current(kv, "s1")
    assert kv.close("s1", 5.0) == [Release(record=record, reason=ReleaseReason.CLOSED)]
    assert (kv.num_sessions(), kv.bytes_held("decode-0")) == (0, 0)
    assert kv.close("s1", 6.0) == []
    assert kv.renew("s1", 6.0) is False


def test_a_lost_engine_takes_its_records_with_it() -> None:
    kv = KVLifecycle(CONFIG)
    keep(kv, "a", tokens(1_100), now_s=0.0)
    keep(kv, "b", tokens(1_100), now_s=0.0)
    keep(kv, "c", tokens(1_100), now_s=0.0, engine_id="decode-1")
    a, b = current(kv, "a"), current(kv, "b")
    effects = kv.on_engine_lost("decode-0", 10.0)
    # The blocks died with the engine: nothing to drain.
    assert effects == [
        Evict(record=a, reason=EvictReason.ENGINE_LOST),
        Evict(record=b, reason=EvictReason.ENGINE_LOST),
    ]
    assert not any(e.drainable for e in effects)
    assert (kv.bytes_held("decode-0"), kv.bytes_held("decode-1")) == (0, BYTES_1100)
    assert kv.on_turn_start("a", tokens(1_200), 11.0) == recompute("a", RecomputeReason.EVICTED)


def test_kv_kept_too_close_to_its_expiry_is_expired_at_once() -> None:
    kv = KVLifecycle(CONFIG)
    # The engine reports an expiry 10 s away: already inside the 15 s margin.
    effects = keep(kv, "s1", tokens(1_100), now_s=100.0, expiry_s=110.0)
    assert [type(e) for e in effects] == [Expire]
    assert kv.record("s1") is None
    assert kv.bytes_held("decode-0") == 0


def test_an_engine_short_of_kv_evicts_its_idle_sessions_one_at_a_time() -> None:
    kv = KVLifecycle(replace(CONFIG, room_wait_s=3.0))
    keep(kv, "a", tokens(1_100), now_s=0.0)  # expires first
    keep(kv, "b", tokens(1_100), now_s=10.0)
    kv.on_turn_start("c", tokens(1_100, first=7_000), 12.0)  # a turn in flight: no record
    a, b = current(kv, "a"), current(kv, "b")
    # The idle session nearest expiry goes, drained.
    assert kv.make_room("decode-0", 20.0) == [Evict(record=a, reason=EvictReason.PRESSURE)]
    assert Evict(record=a, reason=EvictReason.PRESSURE).drainable
    # Its drain has not shown in the engine's report yet: no second eviction so soon.
    assert kv.make_room("decode-0", 21.0) == []
    assert kv.make_room("decode-0", 23.0) == [Evict(record=b, reason=EvictReason.PRESSURE)]
    assert kv.on_turn_start("a", tokens(1_200), 30.0) == recompute("a", RecomputeReason.EVICTED)
    # Nothing idle left (a session's turn in flight keeps its KV): nothing to evict.
    assert kv.make_room("decode-0", 40.0) == []
    assert kv.idle_bytes("decode-0") == 0
