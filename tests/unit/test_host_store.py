"""The host store's bookkeeping without engines or NIXL (``engines/host_store.py``):
readers' notifications, lease heartbeats, free-after-read, the TTL on the test's clock.

Entries are planted as ``take_in`` leaves them (the store's private books: a take-in
needs an engine to read from, ``tests/engine/test_host_store_nixl.py``)."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
from fresh_python import printed_by_fresh_python

from engines.host_store import HostStore, TakeInFailed, _Entry, _Peer
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
    store.blocks.take(3)
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
    store.blocks.take(2)
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


# ---- a READ past its take-in's deadline ---------------------------------------------------


@dataclasses.dataclass
class Transfer:
    local_ids: list[int]
    peer: str
    notif: bytes
    state: str


class FakeNixlAgent:
    """The store's NIXL agent: each transfer ends as the test says (``plan``: its state
    when posted; one posted "PROC" stays in flight until ``end``), and what reached the
    engines' agents (``delivered``: a done READ's notification, or one sent alone)."""

    def __init__(self, plan: list[str]) -> None:
        self.plan = plan
        self.transfers: list[Transfer] = []
        self.delivered: list[tuple[str, bytes]] = []
        self.released: list[int] = []
        self.clashes: list[set[int]] = []  # store blocks a transfer in flight still writes

    def make_prepped_xfer(
        self, op: str, local: Any, local_ids: Any, peer: str, *rest: Any, notif_msg: bytes
    ) -> int:
        writing = {b for t in self.transfers if t.state == "PROC" for b in t.local_ids}
        if writing & set(local_ids.tolist()):
            self.clashes.append(writing & set(local_ids.tolist()))
        self.transfers.append(Transfer(local_ids.tolist(), peer, notif_msg, "posted"))
        return len(self.transfers) - 1

    def transfer(self, handle: int) -> str:
        self.end(handle, self.plan.pop(0))
        return self.transfers[handle].state

    def end(self, handle: int, state: str) -> None:
        transfer = self.transfers[handle]
        transfer.state = state
        if state == "DONE":  # NIXL sends the READ's notification once it is done
            self.delivered.append((transfer.peer, transfer.notif))

    def check_xfer_state(self, handle: int) -> str:
        return self.transfers[handle].state

    def get_xfer_telemetry(self, handle: int) -> Any:
        return types.SimpleNamespace(totalBytes=64 * len(self.transfers[handle].local_ids))

    def release_xfer_handle(self, handle: int) -> None:
        assert self.transfers[handle].state != "PROC", "released while NIXL still writes"
        self.released.append(handle)

    def send_notif(self, agent_name: str, notif_msg: bytes) -> None:
        self.delivered.append((agent_name, notif_msg))

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}


def store_reading_from(agent: FakeNixlAgent, engine_ids: list[str], num_blocks: int) -> HostStore:
    """A store whose layout is adopted (one region of 64 B blocks) and that has
    handshaked with ``engine_ids``: what its first take-in from each leaves."""
    store = HostStore(store_id="hs", num_blocks=num_blocks, side_channel_port=1, clock=Clock())
    store._agent, store.block_lens, store._local_dlist = agent, [64], "local"
    meta = types.SimpleNamespace(
        engine_id="",
        physical_blocks_per_logical_kv_block=1,
        ssm_sizes=(),
        region_group_ids=[0],
        dcp_size=1,
        pcp_size=1,
    )
    for engine_id in engine_ids:
        store._peers[engine_id] = _Peer(
            agent_name=engine_id,
            meta=meta,
            dlist=engine_id,
            region_offsets=[0],
            clock_offset_s=0.0,  # type: ignore[arg-type]
        )
    return store


def kept(request_id: str, block_ids: list[int]) -> dict[str, Any]:
    """A decode engine's final params for blocks it kept."""
    return {
        "remote_engine_id": "decode-0",
        "remote_request_id": request_id,
        "remote_block_ids": [block_ids],
        "remote_host": "127.0.0.1",
        "remote_port": 2,
        "tp_size": 1,
    }


@pytest.mark.parametrize("ends", ["DONE", "ERR"])
def test_a_read_past_its_deadline_keeps_its_blocks_until_nixl_reports_it_over(ends: str) -> None:
    agent = FakeNixlAgent(plan=["PROC", "DONE"])
    store = store_reading_from(agent, ["decode-0"], num_blocks=4)
    with pytest.raises(TakeInFailed) as failed:
        store.take_in(kept("r1", [10, 11]), timeout_s=0.02)  # the engine never answers
    assert failed.value.read_in_flight  # the caller must not drain them too
    s = store.stats()
    assert (s.num_free_blocks, s.num_reads_in_flight, s.num_read_timeouts) == (2, 1, 1)
    # The next take-in gets none of the blocks NIXL may still write: no room for 3.
    assert store.take_in(kept("r2", [20, 21, 22]), timeout_s=0.02) is None
    store._end_late_reads()  # the notification poller's round: still in flight
    assert store.stats().num_free_blocks == 2 and agent.released == []
    agent.end(0, ends)
    store._end_late_reads()
    s = store.stats()
    assert (s.num_free_blocks, s.num_reads_in_flight, s.num_entries) == (4, 0, 0)
    # The decode's blocks are let go once: by the READ's own notification when it landed,
    # else by the store's.
    assert agent.delivered == [("decode-0", b"r1:1")] and agent.released == [0]
    copy = store.take_in(kept("r3", [30, 31, 32]), timeout_s=0.02)
    assert copy is not None and agent.clashes == []


def test_a_take_in_that_reads_nothing_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing reads the blocks: the caller may drain them (orchestrator.kv.drains).
    def unreachable(*_: Any, **__: Any) -> Any:
        raise ConnectionError("engine decode-1 does not answer")

    monkeypatch.setattr("engines.host_store.handshake", unreachable)
    agent = FakeNixlAgent(plan=["ERR"])
    store = store_reading_from(agent, ["decode-0"], num_blocks=4)
    for params in ({**kept("r1", [1]), "remote_engine_id": "decode-1"}, kept("r2", [2, 3])):
        with pytest.raises(TakeInFailed) as failed:
            store.take_in(params, timeout_s=0.02)
        assert not failed.value.read_in_flight
    s = store.stats()
    assert (s.num_free_blocks, s.num_reads_in_flight, agent.delivered) == (4, 0, [])
