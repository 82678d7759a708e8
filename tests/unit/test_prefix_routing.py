"""Prefix-aware routing of prefill requests (``policies.prefix_routing``): a
conversation's next turn goes to the replica that computed its history, unless that
replica is overloaded; the index stays bounded and forgets old blocks."""

from __future__ import annotations

import pytest

from policies.prefix_routing import (
    PrefixIndex,
    PrefixRouter,
    PrefixRoutingSettings,
    RouteChoice,
    block_hashes,
    choose_replica,
)

B = 4  # tokens per block in these tests


def test_block_hashes_are_chained_over_full_blocks() -> None:
    # 10 tokens in blocks of 4: two full blocks; the last 2 tokens have no hash.
    assert len(block_hashes(list(range(10)), B)) == 2
    # Same prefix, same hashes; a different first block changes every later hash.
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], B)
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], B)
    c = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], B)
    assert b[:2] == a
    assert c[0] != a[0] and c[1] != a[1]
    with pytest.raises(ValueError, match="block_size_tokens"):
        block_hashes([1], 0)


def test_the_next_turn_goes_to_the_replica_that_computed_the_history() -> None:
    router = PrefixRouter(PrefixRoutingSettings(block_size_tokens=B))
    loads = {"p0": 0, "p1": 0}
    turn1 = list(range(100, 110))  # 2 full blocks
    first = router.choose(router.hashes(turn1), loads, now_s=0.0)
    assert first.reason == "least_loaded" and first.num_matched_tokens == 0
    router.record(router.hashes(turn1), first.replica, now_s=0.0)
    # Turn 2 is turn 1's prompt, the answer and a new message.
    turn2 = [*turn1, 7, 7, 7, 8, 8, 8]
    second = router.choose(router.hashes(turn2), loads, now_s=1.0)
    assert second == RouteChoice(replica=first.replica, reason="prefix_match", num_matched_tokens=8)


def test_a_new_conversation_goes_to_the_replica_holding_fewer_blocks() -> None:
    router = PrefixRouter(PrefixRoutingSettings(block_size_tokens=B))
    router.record(router.hashes(list(range(16))), "p0", now_s=0.0)
    choice = router.choose(router.hashes([9] * 16), {"p0": 0, "p1": 0}, now_s=0.0)
    assert choice == RouteChoice(replica="p1", reason="least_loaded")


def test_load_wins_over_the_match_past_the_threshold() -> None:
    matched = {"p0": 64, "p1": 0}
    # p0's queue is 3 longer than p1's: within a threshold of 3, the match wins.
    assert choose_replica(matched, {"p0": 5, "p1": 2}, imbalance_threshold=3).replica == "p0"
    # 4 longer: past it, the least loaded replica takes the prompt.
    over = choose_replica(matched, {"p0": 6, "p1": 2}, imbalance_threshold=3)
    assert over == RouteChoice(replica="p1", reason="load_imbalance")


def test_the_longest_match_wins_and_ties_go_to_the_less_loaded() -> None:
    loads = {"p0": 1, "p1": 0, "p2": 0}
    assert choose_replica({"p0": 48, "p1": 32}, loads, imbalance_threshold=4).replica == "p0"
    assert choose_replica({"p0": 32, "p1": 32}, loads, imbalance_threshold=4).replica == "p1"
    with pytest.raises(ValueError, match="at least one replica"):
        choose_replica({}, {}, imbalance_threshold=0)


def test_a_match_stops_at_the_first_block_a_replica_lacks() -> None:
    index = PrefixIndex(max_entries=100, ttl_s=60.0)
    h = block_hashes(list(range(16)), B)  # 4 blocks
    index.record(h[:3], "p0", now_s=0.0)
    index.record(h[:1], "p1", now_s=0.0)
    assert index.match(h, ["p0", "p1", "p2"], now_s=0.0) == {"p0": 3, "p1": 1, "p2": 0}


def test_blocks_past_their_ttl_no_longer_match() -> None:
    index = PrefixIndex(max_entries=100, ttl_s=60.0)
    h = block_hashes(list(range(8)), B)
    index.record(h, "p0", now_s=0.0)
    assert index.match(h, ["p0"], now_s=60.0) == {"p0": 2}
    assert index.match(h, ["p0"], now_s=60.5) == {"p0": 0}
    # Recording anything later drops the expired entries.
    index.record(block_hashes([5] * 4, B), "p1", now_s=61.0)
    assert len(index) == 1 and index.num_blocks("p0") == 0


def test_the_index_is_bounded_and_drops_the_least_recently_used() -> None:
    index = PrefixIndex(max_entries=4, ttl_s=600.0)
    old = block_hashes(list(range(8)), B)  # 2 blocks
    index.record(old, "p0", now_s=0.0)
    index.record(block_hashes([1] * 8, B), "p1", now_s=1.0)
    # Using the old conversation again makes it the most recent.
    index.record(old, "p0", now_s=2.0)
    # Two new blocks push out the two least recently used: p1's.
    index.record(block_hashes([2] * 8, B), "p1", now_s=3.0)
    assert len(index) == 4
    assert index.match(old, ["p0"], now_s=3.0) == {"p0": 2}
    assert index.match(block_hashes([1] * 8, B), ["p1"], now_s=3.0) == {"p1": 0}


def test_a_removed_replica_holds_nothing() -> None:
    router = PrefixRouter(PrefixRoutingSettings(block_size_tokens=B))
    h = router.hashes(list(range(8)))
    router.record(h, "p0", now_s=0.0)
    router.record(h, "p1", now_s=0.0)
    router.remove_replica("p0")
    assert router.index.match(h, ["p0", "p1"], now_s=0.0) == {"p0": 0, "p1": 2}
    assert len(router.index) == 2


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="block_size_tokens"):
        PrefixRoutingSettings(block_size_tokens=0)
    with pytest.raises(ValueError, match="imbalance_threshold"):
        PrefixRoutingSettings(imbalance_threshold=-1)
