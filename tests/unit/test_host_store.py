"""The host store's bookkeeping without engines or NIXL (``engines/host_store.py``):
readers' notifications, lease heartbeats, free-after-read, the TTL on the test's clock.

Entries are planted as ``take_in`` leaves them (the store's private books: a take-in
needs an engine to read from, ``tests/engine/test_host_store_nixl.py``)."""

from __future__ import annotations

import types

import pytest
from fresh_python import printed_by_fresh_python

from engines.host_store import HostStore, _Entry
from engines.nixl_wire import UnsupportedEngine, check_supported, region_descs, region_offsets


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _store(clock: Clock, *, free_after_read: bool) -> HostStore:
    store = HostStore(
        store_id="hs",
        num_blocks=8,
        side_channel_port=1,
        ttl_s=60,
        free_after_read=free_after_read,
        clock=clock,
    )
    # What take_in leaves: blocks 0-2 taken, one entry expiring ttl_s from now.
    store._free = store._free[3:]
    store._entries["hs-0"] = _Entry(
        block_ids=[0, 1, 2], source_engine_id="d", num_tokens=90, expires_at=clock() + 60
    )
    return store


def test_a_read_keeps_the_entry_by_default_and_heartbeats_change_nothing() -> None:
    store = _store(Clock(), free_after_read=False)
    store._on_notif("HB:hs-0,other")
    store._on_notif("hs-0:1")
    store._on_notif("hs-0:1")  # a second turn's prefill read the same entry
    s = store.stats()
    assert (s.num_heartbeats, s.num_read_notifs, s.num_entries, s.num_free_blocks) == (1, 2, 1, 5)
    assert store.entry_notifs("hs-0") == 2


def test_free_after_read_waits_for_every_consumer() -> None:
    store = _store(Clock(), free_after_read=True)
    store._on_notif("hs-0:2")  # two reader ranks (a TP 2 prefill): the first is done
    assert store.stats().num_entries == 1
    store._on_notif("hs-0:2")
    s = store.stats()
    assert (s.num_entries, s.num_free_blocks) == (0, 8)
    store._on_notif("hs-0:2")  # late: no entry any more
    assert store.stats().num_unknown_notifs == 1


def test_the_ttl_frees_an_entry_nobody_read() -> None:
    clock = Clock()
    store = _store(clock, free_after_read=False)
    clock.now_s += 59.9
    store._expire(clock())
    assert store.stats().num_entries == 1
    clock.now_s += 0.1
    store._expire(clock())
    s = store.stats()
    assert (s.num_entries, s.num_expired, s.num_free_blocks) == (0, 1, 8)
    assert store.release("hs-0") is False


def test_descriptors_are_region_major_as_vllm_lays_out_a_peer() -> None:
    # Two regions of 3 blocks; the second is strided (a block of 64 B every 100 B).
    descs = region_descs([1000, 5000], [64, 100], [64, 64], [3, 3], device_id=0)
    assert descs.tolist() == [
        [1000, 64, 0],
        [1064, 64, 0],
        [1128, 64, 0],
        [5000, 64, 0],
        [5100, 64, 0],
        [5200, 64, 0],
    ]
    # Block 2 of region 1 is descriptor 3 + 2.
    assert region_offsets([3, 3]) == [0, 3]


def test_importing_the_store_imports_neither_vllm_nor_nixl() -> None:
    code = "import sys, engines.host_store; print('vllm' in sys.modules, 'nixl' in sys.modules)"
    assert printed_by_fresh_python(code) == ["False", "False"]


def test_released_blocks_rest_before_reuse_blocks_a_reader_freed_do_not() -> None:
    # A store never sees a read start: a reader still holding a released entry's params
    # must not find another session's KV in its blocks.
    clock = Clock()
    store = _store(clock, free_after_read=True)
    store.reuse_after_s = 60.0
    assert store.release("hs-0")
    assert store.stats().num_free_blocks == 5  # resting, not free
    clock.now_s += 59.0
    store._expire(clock())
    assert store.stats().num_free_blocks == 5
    clock.now_s += 1.0
    store._expire(clock())
    assert store.stats().num_free_blocks == 8
    # Read to the end by its reader (its notification): free at once.
    store._entries["hs-1"] = _Entry(
        block_ids=[0, 1], source_engine_id="d", num_tokens=40, expires_at=clock() + 60
    )
    store._free = store._free[2:]
    store._on_notif("hs-1:1")
    assert store.stats().num_free_blocks == 8


def test_a_store_is_given_one_capacity() -> None:
    for both_or_none in ({}, {"num_blocks": 8, "capacity_bytes": 2**20}):
        with pytest.raises(ValueError, match="num_blocks or capacity_bytes"):
            HostStore(store_id="hs", side_channel_port=1, **both_or_none)  # type: ignore[arg-type]


def test_an_engine_the_store_does_not_serve_is_refused_by_name() -> None:
    meta = types.SimpleNamespace(
        engine_id="decode-tp2",
        physical_blocks_per_logical_kv_block=1,
        ssm_sizes=(0, 0),
        region_group_ids=[0, 1],
        dcp_size=1,
        pcp_size=1,
    )
    with pytest.raises(
        UnsupportedEngine, match=r"decode-tp2.*several KV-cache groups.*tp/pp 2/None"
    ):
        check_supported(meta, {"tp_size": 2, "remote_block_ids": [[1]]})  # type: ignore[arg-type]
