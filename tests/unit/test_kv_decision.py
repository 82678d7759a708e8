"""One KV decision: the KV service's plan (``policies.kv_cost.decide_turn``) and a turn
lease's plan made at the ingress (``orchestrator.router.held_leases.leased_decision``) run
the same checks in the same order (``policies.kv_cost.offer_refused``), so a turn is
pulled or recomputed, and for the same reason, wherever it is planned."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kv_stories import CONFIG, tokens

from engines.kv_params import KVTransferParams
from orchestrator.kv.decider import kv_decision
from orchestrator.kv.messages import KVDecision, LeasedRecord
from orchestrator.router.held_leases import leased_decision
from policies.kv_cost import decide_turn, worth_pulling
from policies.kv_records import KVRecord, RecomputeReason, TurnAction, prefix_hash

EXPIRY_S = 480.0


def record_of(num_tokens: int) -> KVRecord:
    return KVRecord(
        session_id="s",
        engine_id="D",
        pool_id="decode",
        block_ids=tuple(range(-(-num_tokens // 16))),
        num_tokens=num_tokens,
        prefix_hash=prefix_hash(tokens(num_tokens), num_tokens),
        expiry_s=EXPIRY_S,
        last_used_s=0.0,
        bytes_held=-(-num_tokens // 16) * 16 * CONFIG.kv_bytes_per_token,
    )


def leased(record: KVRecord, granted_s: float) -> tuple[LeasedRecord, float]:
    """The record as a lease granted at ``granted_s`` carries it (no grace), and the
    lessee's offer deadline."""
    not_worth = worth_pulling(record, CONFIG)
    offer_in_s = record.expiry_s - CONFIG.safety_margin_s - granted_s
    lease = LeasedRecord(
        kv_transfer_params=KVTransferParams(),
        num_tokens=record.num_tokens,
        prefix_hash=record.prefix_hash,
        offer_in_s=offer_in_s,
        not_worth=None if not_worth is None else not_worth.value,
    )
    return lease, granted_s + offer_in_s


@given(
    num_tokens=st.sampled_from([3, 40, 150, 1100]),
    prompt=st.sampled_from(["extends", "same", "short", "rewritten"]),
    now_s=st.floats(0.0, EXPIRY_S - 0.001),
    threshold=st.sampled_from([1, 64]),
)
def test_the_service_and_a_lease_decide_a_turn_alike(
    num_tokens: int, prompt: str, now_s: float, threshold: int
) -> None:
    config = replace(CONFIG, recompute_threshold_tokens=threshold)
    record = record_of(num_tokens)
    ids = {
        "extends": tokens(num_tokens + 20),
        "same": tokens(num_tokens),
        "short": tokens(max(1, num_tokens - 1)),
        "rewritten": [7, *tokens(num_tokens + 5, first=2)],
    }[prompt]
    by_service = decide_turn(record, ids, now_s, config)
    not_worth = worth_pulling(record, config)
    lease = LeasedRecord(
        kv_transfer_params=KVTransferParams(),
        num_tokens=record.num_tokens,
        prefix_hash=record.prefix_hash,
        offer_in_s=record.expiry_s - config.safety_margin_s,
        not_worth=None if not_worth is None else not_worth.value,
    )
    by_lease = leased_decision(lease, lease.offer_in_s, ids, now_s)
    pulls = by_service.action is TurnAction.PULL_FROM_DECODE
    assert (by_lease.kind == "pull") == pulls, (by_service, by_lease)
    if not pulls:
        assert by_service.reason is not None
        assert by_lease.reason is by_service.reason, (by_service, by_lease)
    else:
        assert by_lease.num_reusable_tokens == by_service.num_reusable_tokens


def test_a_lease_plans_nothing_past_its_offer() -> None:
    lease, deadline = leased(record_of(1100), granted_s=100.0)
    assert leased_decision(lease, deadline, tokens(1200), deadline - 0.01).kind == "pull"
    late = leased_decision(lease, deadline, tokens(1200), deadline)
    assert (late.kind, late.reason) == ("recompute", "within_margin")


def test_a_decision_says_why_it_recomputes_in_its_type_and_a_pull_has_no_reason() -> None:
    params = KVTransferParams(remote_engine_id="D")
    pull = kv_decision(None, params, num_tokens=256, source_pool="host")
    assert (pull.kind, pull.reason, pull.reason_text) == ("pull", None, "reuse")
    assert (pull.num_reusable_tokens, pull.source_pool) == (256, "host")
    why = kv_decision(RecomputeReason.PREFIX_MISMATCH, params)
    assert (why.kind, why.reason, why.kv_transfer_params) == (
        "recompute",
        RecomputeReason.PREFIX_MISMATCH,
        None,
    )
    # The types hold across the wire: the reason decodes as the enum, and a decision that
    # breaks the invariant is refused wherever it is made or read.
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(why), type=KVDecision)
    assert again.reason is RecomputeReason.PREFIX_MISMATCH
    for bad in (
        {"kind": "pull", "reason": "prefix_mismatch"},
        {"kind": "recompute", "reason": None},
        {"kind": "recompute", "reason": "no_such_reason"},
    ):
        with pytest.raises((ValueError, msgspec.ValidationError)):
            msgspec.msgpack.decode(msgspec.msgpack.encode(bad), type=KVDecision)
    with pytest.raises(ValueError, match="kv_transfer_params"):
        kv_decision(None)
