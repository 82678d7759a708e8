"""The parts the KV lifecycle is built from: prefix hash, cost model, deadline heap, value types."""

from __future__ import annotations

import random
import subprocess
import sys
from array import array

import pytest

from policies.deadline_heap import DeadlineHeap
from policies.kv_cost import decide_turn, estimate_cost, kv_bytes
from policies.kv_lifecycle import (
    KVLifecycleConfig,
    KVRecord,
    RecomputeReason,
    TurnAction,
    TurnDecision,
    prefix_hash,
)


def test_prefix_hash_is_stable_across_processes_and_sequence_types() -> None:
    # Pinned: records survive restarts, so the hash must never change silently.
    assert prefix_hash([1, 2, 3]) == "6b890206e32652a89f2aeb1adb2c4853"
    assert prefix_hash((1, 2, 3)) == prefix_hash(array("q", [1, 2, 3])) == prefix_hash([1, 2, 3])
    # The first num_tokens of a longer prompt hash like the prefix alone.
    assert prefix_hash([1, 2, 3, 4], 3) == prefix_hash([1, 2, 3])
    assert prefix_hash([1, 2, 4]) != prefix_hash([1, 2, 3])
    # Another interpreter (another hash seed) gets the same digest.
    code = "from policies.kv_records import prefix_hash; print(prefix_hash([1, 2, 3]))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "6b890206e32652a89f2aeb1adb2c4853"
    with pytest.raises(ValueError, match=r"num_tokens=5 is outside 0\.\.3"):
        prefix_hash([1, 2, 3], 5)


def test_kv_bytes_counts_whole_blocks_and_linear_state() -> None:
    config = KVLifecycleConfig(kv_bytes_per_token=100, block_size_tokens=16)
    assert kv_bytes(1, config) == 1_600  # one block, pinned whole
    assert kv_bytes(16, config) == 1_600
    assert kv_bytes(17, config) == 3_200
    hybrid = KVLifecycleConfig(
        kv_bytes_per_token=100, block_size_tokens=16, linear_state_bytes_per_sequence=50_000
    )
    assert kv_bytes(17, hybrid) == 53_200


def test_cost_estimate_prices_the_covered_prefix() -> None:
    config = KVLifecycleConfig(
        prefill_tokens_per_s=2_000.0, link_bandwidth_gbps=80.0, transfer_setup_s=0.01
    )
    cost = estimate_cost(num_tokens=4_000, num_bytes=500_000_000, config=config)
    assert cost.recompute_s == pytest.approx(2.0)  # 4,000 tokens at 2,000 tokens/s
    assert cost.transfer_s == pytest.approx(0.06)  # 0.5 GB at 10 GB/s, plus 10 ms
    assert cost.pull_is_cheaper


def test_decide_turn_checks_freshness_before_the_prefix() -> None:
    config = KVLifecycleConfig()
    record = KVRecord(
        session_id="s1",
        engine_id="decode-0",
        pool_id="decode",
        block_ids=(1,),
        num_tokens=100,
        prefix_hash=prefix_hash(list(range(100))),
        expiry_s=480.0,
        last_used_s=0.0,
        bytes_held=kv_bytes(100, config),
    )
    good, bad = list(range(120)), list(range(1, 121))
    assert decide_turn(record, good, 0.0, config).action is TurnAction.PULL_FROM_DECODE
    assert decide_turn(record, bad, 0.0, config).reason is RecomputeReason.PREFIX_MISMATCH
    # However the prompt looks, a stale record is never offered.
    assert decide_turn(record, bad, 465.0, config).reason is RecomputeReason.WITHIN_MARGIN
    assert decide_turn(record, bad, 480.0, config).reason is RecomputeReason.EXPIRED


def test_turn_decision_and_record_refuse_contradictions() -> None:
    with pytest.raises(ValueError, match="a recompute a reason and no record"):
        TurnDecision(session_id="s1", action=TurnAction.RECOMPUTE)
    with pytest.raises(ValueError, match="a pull carries a record"):
        TurnDecision(
            session_id="s1",
            action=TurnAction.PULL_FROM_DECODE,
            reason=RecomputeReason.EXPIRED,
        )
    with pytest.raises(ValueError, match="at least one token"):
        KVRecord(
            session_id="s1",
            engine_id="decode-0",
            pool_id="decode",
            block_ids=(),
            num_tokens=0,
            prefix_hash=prefix_hash([]),
            expiry_s=1.0,
            last_used_s=0.0,
            bytes_held=0,
        )


def test_deadline_heap_orders_updates_and_removes() -> None:
    heap = DeadlineHeap()
    heap.set("a", 30.0)
    heap.set("b", 10.0)
    heap.set("c", 20.0)
    heap.set("b", 40.0)  # moved later: its old entry is stale
    heap.discard("c")
    assert len(heap) == 2
    assert "c" not in heap
    assert heap.peek() == (30.0, "a")
    assert heap.pop_due(29.9) == []
    assert heap.pop_due(40.0) == ["a", "b"]
    assert heap.pop() is None


def test_deadline_heap_stays_small_under_churn() -> None:
    heap = DeadlineHeap()
    # A key moved later 10,000 times, as each turn does: nothing piles up.
    for i in range(10_000):
        heap.set("later", float(i))
    assert len(heap._heap) == 1
    # A key moved earlier 10,000 times: stale entries are compacted away.
    for i in range(10_000):
        heap.set("earlier", float(-i))
    assert len(heap) == 2
    assert len(heap._heap) <= 4 * len(heap) + 1024
    assert heap.pop() == (-9_999.0, "earlier")
    assert heap.pop() == (9_999.0, "later")
    assert heap.pop() is None


@pytest.mark.parametrize("seed", range(10))
def test_deadline_heap_agrees_with_a_plain_dict(seed: int) -> None:
    rng = random.Random(seed)
    heap, model = DeadlineHeap(), {}
    now_s = 0.0
    for _ in range(2_000):
        key = f"k{rng.randrange(50)}"
        op = rng.random()
        if op < 0.5:
            deadline_s = now_s + rng.choice([1.0, 5.0, 30.0, 100.0])
            heap.set(key, deadline_s)
            model[key] = deadline_s
        elif op < 0.7:
            heap.discard(key)
            model.pop(key, None)
        elif op < 0.8 and model:
            # pop takes the earliest deadline (ties: any one of them).
            deadline_s, popped = heap.pop() or (0.0, "")
            assert deadline_s == min(model.values()) == model.pop(popped)
        else:
            now_s += rng.choice([0.0, 1.0, 10.0])
            heap.prune(now_s)  # settles entries, takes nothing
            assert len(heap) == len(model)
            due = heap.pop_due(now_s)
            assert sorted(due) == sorted(k for k, d in model.items() if d <= now_s)
            for k in due:
                del model[k]
        assert len(heap) == len(model)
