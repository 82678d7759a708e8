"""A host-memory KV store that vLLM engines reach as if it were a NIXL peer engine.

The store holds idle sessions' KV in its own NIXL-registered DRAM and speaks vLLM
0.32's ``NixlConnector`` protocol (``engines.nixl_wire``), so the engines run unchanged:

* **take in** (``take_in``): given a decode engine's final ``kv_transfer_params``
  (blocks kept with ``bidirectional_kv_xfer``), the store handshakes with that engine as
  a prefill would and READs the kept blocks. The READ carries the notification a reading
  peer sends (``f"{remote_request_id}:{expected_consumers}"``, vLLM's ``_read_blocks``),
  so the decode's worker counts the request done (``_get_new_notifs``) and frees them.
* **serve**: the store answers vLLM's handshake with the decode's own
  ``NixlAgentMetadata`` and compatibility hash, but its own agent, base addresses,
  strides, ``num_blocks`` and all-DRAM regions (vLLM's pull takes one memory type per
  producer). A prefill given the params ``take_in`` returns (kvtide's
  ``KVTransferParams.pull_back`` takes them as they are) pulls the KV through vLLM's
  turn-2 pull path (``pull_scheduler.get_num_new_matched_tokens``), whose checks
  (``_validate_remote_agent_handshake``) want its own per-region ``block_lens``,
  ``region_names`` and ``kv_cache_layout`` but not its strides or ``num_blocks``.

Invariants: the layout is learned from the first engine the store handshakes with;
a later engine of another geometry (model, dtype, block size, attention backend,
compatibility hash) is refused (``LayoutMismatch``). Block ids are the store's own.
Every NIXL call holds ``_nixl_lock`` (the caller's ``take_in`` and the notification
poller share the agent). One clock (``clock``, default ``time.perf_counter``) stamps
expiries, measures handshake offsets and is what the listener reports, as vLLM's does,
so a prefill's expiry check (``_is_turn2_read_expired``) reads it right. A store block is
reused only after its entry's expiry or ``release``: NIXL targets see no reads, only the
notification after one, so a prefill reading reused blocks would get another session's
KV without an error (``free_after_read`` is for single-use params only).

A READ still in flight at its take-in's deadline may yet write the store's blocks and,
when it lands, its notification frees the decode's blocks. So its blocks rest (no
take-in gets them) until NIXL reports the transfer over, polled with the notifications:
done, the notification went with it and the blocks are free again; failed, no READ
touches the decode's blocks any more and the store sends the notification itself, so the
decode frees them. Either way the store, not its caller, ends the decode's hold on them:
the take-in raises ``TakeInFailed`` with ``read_in_flight`` set, and the caller must not
drain the blocks as well (``orchestrator.kv.drains``). The handle is not released early:
NIXL may fail to cancel an active transfer.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from engines.host_blocks import BlockPool
from engines.nixl_wire import (
    UnsupportedEngine,
    advertised_meta,
    check_supported,
    encode_payload,
    handshake,
    peer_descs,
    region_descs,
    serve_handshakes,
)

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

__all__ = [
    "EXPIRY_MARGIN_S",
    "HostStore",
    "LayoutMismatch",
    "StoreStats",
    "TakeInFailed",
    "UnsupportedEngine",
]

log = logging.getLogger("kvtide.host_store")

_LAYOUT_FIELDS = "block_lens region_names kv_cache_layout block_size attn_backend_name".split()
"""What every engine must share with the one whose layout the store adopted."""

EXPIRY_MARGIN_S = 5.0
"""vLLM's ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN`` (``pull_worker.py``): no READ of blocks
that expire sooner than this (the engine may reuse them before the READ lands)."""


class LayoutMismatch(ValueError):
    """An engine's KV layout differs from the one the store adopted."""


class TakeInFailed(RuntimeError):
    """The store did not take an engine's kept blocks in (too close to their expiry, or
    the READ failed or timed out). ``read_in_flight`` False: nothing reads them and no
    notification was sent; the engine keeps them until its own TTL or a drain.
    ``read_in_flight`` True: the READ timed out in flight and may still land; the store
    ends the engine's hold on the blocks when it is over (see the module)."""

    def __init__(self, message: str, *, read_in_flight: bool = False) -> None:
        super().__init__(message)
        self.read_in_flight = read_in_flight


@dataclasses.dataclass(slots=True, kw_only=True)
class StoreStats:
    """The store's counters; bytes are NIXL's telemetry of the store's own READs."""

    num_take_ins: int = 0
    bytes_taken_in: int = 0
    take_in_s: float = 0.0  # wall time of the take-ins, handshakes included
    read_s: float = 0.0  # of it, the READs: from posting to done
    num_read_notifs: int = 0  # a reader said it finished reading an entry
    num_unknown_notifs: int = 0  # a notification for no entry the store holds
    num_heartbeats: int = 0
    num_expired: int = 0
    num_free_blocks: int = 0
    num_entries: int = 0
    num_read_timeouts: int = 0  # READs in flight at their take-in's deadline
    num_reads_in_flight: int = 0  # of them, not over yet: their blocks rest


@dataclasses.dataclass(slots=True, kw_only=True)
class _Entry:
    block_ids: list[int]
    source_engine_id: str
    num_tokens: int
    expires_at: float
    num_notifs: int = 0
    params: dict[str, Any] = dataclasses.field(default_factory=dict)  # the copy's, as returned
    tag: dict[str, Any] = dataclasses.field(default_factory=dict)  # the caller's, kept as is


@dataclasses.dataclass(slots=True, kw_only=True)
class _LateRead:
    """A READ in flight past its take-in's deadline, and the store blocks it writes."""

    handle: Any
    block_ids: list[int]
    agent_name: str  # the engine it reads from
    notif: bytes  # the notification that frees the engine's blocks
    where: str


@dataclasses.dataclass(slots=True, kw_only=True)
class _Peer:
    agent_name: str
    meta: NixlAgentMetadata
    dlist: Any  # prepped remote descriptor list, one descriptor per (region, block)
    region_offsets: list[int]  # descriptor id of each region's block 0
    clock_offset_s: float  # the engine's perf_counter minus the store's clock


class HostStore:
    """The store, in-process. ``start()`` makes its NIXL agent and notification poller;
    the first ``take_in`` sizes its buffer and opens its handshake
    listener; ``close()`` stops both threads. The capacity: ``num_blocks`` blocks (each
    holds one block of every region, as an engine's block does), or as many as
    ``capacity_bytes`` holds, counted when the first engine's layout is known.
    ``reuse_after_s``: a block freed by ``release`` or expiry (not by its reader's
    notification) is handed out again only this much later; a reader the store cannot
    see may still hold params naming it."""

    def __init__(
        self,
        *,
        store_id: str,
        side_channel_port: int,
        num_blocks: int | None = None,
        capacity_bytes: int | None = None,
        reuse_after_s: float = 0.0,
        side_channel_host: str = "127.0.0.1",
        ttl_s: float = 600.0,
        free_after_read: bool = False,
        progress_wait_ms: float = 10.0,
        poll_s: float = 0.01,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if (num_blocks is None) == (capacity_bytes is None):
            raise ValueError("give the store's capacity as num_blocks or capacity_bytes")
        self.store_id = store_id
        self.num_blocks = num_blocks or 0  # sized at the first take-in from capacity_bytes
        self.capacity_bytes = capacity_bytes
        self.host, self.port = side_channel_host, side_channel_port
        self.ttl_s, self.free_after_read = ttl_s, free_after_read
        self.progress_wait_ms, self.poll_s, self.clock = progress_wait_ms, poll_s, clock
        self._nixl_lock = threading.Lock()  # every call on self._agent
        self._lock = threading.Lock()  # entries, free list, stats
        self._peers_lock = threading.Lock()  # self._peers, the layout
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._agent: Any = None
        self._peers: dict[str, _Peer] = {}
        self._entries: dict[str, _Entry] = {}
        self.blocks = BlockPool(self.num_blocks, reuse_after_s=reuse_after_s, clock=clock)
        self._late: list[_LateRead] = []  # READs past their deadline, not over yet
        self._next_id = 0
        self._stats = StoreStats(num_free_blocks=self.num_blocks)
        # Set by the first take_in, from the engine it reads.
        self.block_lens: list[int] = []
        self.buffer: npt.NDArray[np.uint8] | None = None
        self._region_bases: list[int] = []
        self._local_dlist: Any = None
        self._compat_hash: str | None = None
        self._engine_meta: NixlAgentMetadata | None = None

    @property
    def reuse_after_s(self) -> float:
        """How long a released or expired block rests before reuse (``BlockPool``)."""
        return self.blocks.reuse_after_s

    @reuse_after_s.setter
    def reuse_after_s(self, seconds: float) -> None:
        self.blocks.reuse_after_s = seconds

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        # The handshake's message types, now: importing vLLM takes seconds, which the
        # first take-in would otherwise wait.
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata  # noqa: F401

        from engines.kv_connector import progress_wait

        # NIXL's progress thread sleeps between rounds instead of spinning a core.
        with progress_wait(self.progress_wait_ms):
            self._agent = nixl_agent(
                f"{self.store_id}-{uuid.uuid4().hex[:8]}",
                nixl_agent_config(capture_telemetry=True),
            )
        self._spawn(self._notif_loop, "host-store-notifs")

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # ---- layout ---------------------------------------------------------------------------
    def _adopt(self, compat_hash: str, meta: NixlAgentMetadata) -> None:
        """One DRAM region per engine region, each ``num_blocks`` blocks of that region's
        ``block_len``, packed (stride = block_len); the listener advertises it."""
        check_supported(meta)
        lens = list(meta.block_lens)
        num_regions = len(lens)
        if self.capacity_bytes is not None:
            self.num_blocks = self.capacity_bytes // sum(lens)
            if self.num_blocks < 1:
                raise LayoutMismatch(
                    f"a block of engine {meta.engine_id} takes {sum(lens)} bytes, more than "
                    f"the store's capacity ({self.capacity_bytes} bytes)"
                )
            with self._lock:
                self.blocks.resize(self.num_blocks)
        self.buffer = np.zeros(self.num_blocks * sum(lens), dtype=np.uint8)
        base = self.buffer.ctypes.data
        offsets = np.cumsum([0, *lens[:-1]]) * self.num_blocks
        self._region_bases = [base + int(o) for o in offsets]
        self.block_lens = lens
        descs = region_descs(self._region_bases, lens, lens, [self.num_blocks] * num_regions, 0)
        with self._nixl_lock:
            reg = self._agent.get_reg_descs([(base, self.buffer.nbytes, 0, "")], "DRAM")
            self._agent.register_memory(reg)
            self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, "DRAM")
            agent_md = self._agent.get_agent_metadata()
        advertised = advertised_meta(
            meta, self.store_id, agent_md, self._region_bases, self.num_blocks
        )
        self._compat_hash, self._engine_meta = compat_hash, meta
        payload = encode_payload(compat_hash, advertised)
        ready = threading.Event()
        self._spawn(
            lambda: serve_handshakes(payload, self.host, self.port, self.clock, self._stop, ready),
            "host-store-handshakes",
        )
        if not ready.wait(10):
            raise RuntimeError(f"host store side channel {self.host}:{self.port} did not open")
        log.info(
            "host store %s: %d regions x %d blocks (%.1f MiB), layout of engine %s",
            self.store_id,
            num_regions,
            self.num_blocks,
            self.buffer.nbytes / 2**20,
            meta.engine_id,
        )

    def _check_layout(self, compat_hash: str, meta: NixlAgentMetadata) -> None:
        ref = self._engine_meta
        assert ref is not None
        diff = [f for f in _LAYOUT_FIELDS if getattr(meta, f) != getattr(ref, f)]
        if compat_hash != self._compat_hash:
            diff.append("compatibility_hash")
        if diff:
            raise LayoutMismatch(
                f"engine {meta.engine_id} differs from the store's layout (adopted from "
                f"{ref.engine_id}) in {diff}: one store serves one model configuration"
            )

    def _peer(self, meta: NixlAgentMetadata, offset_s: float) -> _Peer:
        """The engine's agent loaded and its blocks' descriptors prepared."""
        descs, mem_type, offsets = peer_descs(meta)
        with self._nixl_lock:
            name = self._agent.add_remote_agent(meta.agent_metadata)
            dlist = self._agent.prep_xfer_dlist(name, descs, mem_type)
        return _Peer(
            agent_name=name, meta=meta, dlist=dlist, region_offsets=offsets, clock_offset_s=offset_s
        )

    def _peer_for(self, params: dict[str, Any]) -> _Peer:
        engine_id = params["remote_engine_id"]
        with self._peers_lock:  # one handshake per engine, one layout adopted
            peer = self._peers.get(engine_id)
            if peer is None:
                peer = self._peers[engine_id] = self._new_peer(params)
        check_supported(peer.meta, params)
        return peer

    def _new_peer(self, params: dict[str, Any]) -> _Peer:
        """Handshake with the engine that kept the blocks; the first one shapes the store."""
        host, port = params["remote_host"], int(params["remote_port"])
        compat_hash, meta, offset_s = handshake(host, port, self.clock)
        if self.buffer is None:
            self._adopt(compat_hash, meta)
        else:
            self._check_layout(compat_hash, meta)
        return self._peer(meta, offset_s)

    # ---- take in ------------------------------------------------------------------------
    def take_in(
        self, params: dict[str, Any], timeout_s: float = 30.0, tag: dict[str, Any] | None = None
    ) -> dict[str, Any] | None:
        """Move the blocks a decode engine kept (its final ``kv_transfer_params``, vLLM's
        dict) into the store; the decode frees them when the READ lands. Returns the
        params naming the store's copy, in the decode's shape, or None when the store
        has no room (nothing moved). Raises ``TakeInFailed`` when the blocks expire
        within ``EXPIRY_MARGIN_S`` or the READ fails."""
        t0 = time.perf_counter()
        try:
            peer = self._peer_for(params)
        except (LayoutMismatch, UnsupportedEngine):
            raise
        except Exception as exc:  # the handshake failed: nothing was read
            raise TakeInFailed(
                f"handshake with {params['remote_engine_id']} failed: {exc!r}"
            ) from exc
        where = f"{params['remote_engine_id']}'s blocks for {params['remote_request_id']}"
        expiry = params.get("remote_blocks_expiry_time")
        if expiry is not None:
            # As a reading prefill does (_is_turn2_read_expired).
            left_s = expiry - peer.clock_offset_s - self.clock()
            if left_s <= EXPIRY_MARGIN_S:
                raise TakeInFailed(
                    f"{where} expire in {left_s:.1f} s (margin {EXPIRY_MARGIN_S} s): "
                    "too late to take them in"
                )
        [source_blocks] = params["remote_block_ids"]
        with self._lock:
            taken = self.blocks.take(len(source_blocks))
            if taken is None:
                return None
            mine = taken
            store_rid = f"{self.store_id}-{self._next_id}"
            self._next_id += 1
        # The notification a reading peer sends (vLLM's _read_blocks): one consumer.
        notif = f"{params['remote_request_id']}:1".encode()
        t_read = time.perf_counter()
        state, moved, handle = self._read(peer, source_blocks, mine, notif, timeout_s)
        read_s = time.perf_counter() - t_read
        if state == "PROC":
            with self._lock:  # its blocks rest until it is over (_end_late_reads)
                self._late.append(
                    _LateRead(
                        handle=handle,
                        block_ids=mine,
                        agent_name=peer.agent_name,
                        notif=notif,
                        where=where,
                    )
                )
                self._stats.num_read_timeouts += 1
            raise TakeInFailed(
                f"READ of {where}: still in flight after {timeout_s} s; the store frees "
                "the engine's blocks when it is over",
                read_in_flight=True,
            )
        if state != "DONE":
            with self._lock:
                self.blocks.give_back(mine)
            raise TakeInFailed(f"READ of {where}: {state}")
        expires_at = self.clock() + self.ttl_s
        copy = {
            **params,
            "remote_block_ids": [list(mine)],
            "remote_engine_id": self.store_id,
            "remote_request_id": store_rid,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_blocks_expiry_time": expires_at,
            "tp_size": 1,
        }
        with self._lock:
            self._entries[store_rid] = _Entry(
                block_ids=mine,
                source_engine_id=params["remote_engine_id"],
                num_tokens=int(params.get("remote_num_tokens") or 0),
                expires_at=expires_at,
                params=copy,
                tag=dict(tag or {}),
            )
            s = self._stats
            s.num_take_ins += 1
            s.bytes_taken_in += moved
            s.take_in_s += time.perf_counter() - t0
            s.read_s += read_s
        return copy

    def _read(
        self, peer: _Peer, source: list[int], mine: list[int], notif: bytes, timeout_s: float
    ) -> tuple[str, int, Any]:
        """READ the peer's ``source`` blocks into the store's ``mine``, every region; the
        transfer's state, NIXL's count of the bytes it moved and, still in flight
        ("PROC"), its handle (released otherwise)."""
        src = np.array(source, dtype=np.int64)
        dst = np.array(mine, dtype=np.int64)
        num_regions = len(self.block_lens)
        remote_ids = np.concatenate([peer.region_offsets[r] + src for r in range(num_regions)])
        local_ids = np.concatenate([r * self.num_blocks + dst for r in range(num_regions)])
        with self._nixl_lock:
            try:
                handle = self._agent.make_prepped_xfer(
                    "READ",
                    self._local_dlist,
                    local_ids.astype(np.int32),
                    peer.dlist,
                    remote_ids.astype(np.int32),
                    notif_msg=notif,
                )
            except Exception as exc:  # nothing posted
                log.warning("host store: preparing a READ failed: %s", exc)
                return "ERR", 0, None
            try:
                state: str = self._agent.transfer(handle)
            except Exception as exc:  # NIXL refused to post it
                log.warning("host store: posting a READ failed: %s", exc)
                self._release(handle)
                return "ERR", 0, None
        deadline = time.perf_counter() + timeout_s
        while state == "PROC" and time.perf_counter() < deadline:
            time.sleep(0.0005)
            with self._nixl_lock:
                state = self._state(handle)
        with self._nixl_lock:
            moved = int(self._agent.get_xfer_telemetry(handle).totalBytes) if state == "DONE" else 0
            if state != "PROC":  # a transfer still in flight keeps its handle
                self._release(handle)
        return state, moved, handle

    def _state(self, handle: Any) -> str:
        """A transfer's state; "ERR" where NIXL raises its error instead (under
        ``_nixl_lock``)."""
        try:
            state: str = self._agent.check_xfer_state(handle)
        except Exception as exc:
            log.warning("host store: transfer failed: %s", exc)
            return "ERR"
        return state

    def _release(self, handle: Any) -> None:
        """Release an ended transfer's handle (under ``_nixl_lock``)."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # NIXL keeps it: nothing more to do with it
            log.warning("host store: releasing a transfer handle failed: %s", exc)

    # ---- serving ------------------------------------------------------------------------
    def _notif_loop(self) -> None:
        """Readers' "done reading" notifications, and the TTL."""
        while not self._stop.wait(self.poll_s):
            with self._nixl_lock:
                notifs = self._agent.get_new_notifs()
            for messages in notifs.values():
                for raw in messages:
                    self._on_notif(raw.decode("utf-8"))
            self._end_late_reads()
            self._expire(self.clock())

    def _end_late_reads(self) -> None:
        """Free the blocks of each READ past its deadline that NIXL reports over; one
        that failed gets its notification from the store (see the module)."""
        with self._lock:
            late = list(self._late)
        for read in late:
            with self._nixl_lock:
                state = self._state(read.handle)
                if state == "PROC":
                    continue
                self._release(read.handle)
                if state != "DONE":  # no notification went with it
                    try:
                        self._agent.send_notif(read.agent_name, read.notif)
                    except Exception as exc:  # the engine is gone: so is its hold
                        log.warning("host store: notification after %s failed: %s", read.where, exc)
            log.info("host store: the late READ of %s ended %s", read.where, state)
            with self._lock:
                self._late.remove(read)
                self.blocks.give_back(read.block_ids)  # no entry, no reader names them

    def _on_notif(self, msg: str) -> None:
        """``f"{request_id}:{consumers}"`` after a reader's READ; ``HB:...`` a reader's
        lease heartbeat (the store keeps entries by its TTL, not by leases)."""
        with self._lock:
            if msg.startswith("HB:"):
                self._stats.num_heartbeats += 1
                return
            rid, _, consumers = msg.rpartition(":")
            entry = self._entries.get(rid)
            if entry is None:
                self._stats.num_unknown_notifs += 1
                log.warning("host store: notification %r for no entry", msg)
                return
            entry.num_notifs += 1
            self._stats.num_read_notifs += 1
            if self.free_after_read and entry.num_notifs >= int(consumers or 1):
                self._drop(rid, rest=False)  # its reader is done with it

    def _expire(self, now: float) -> None:
        with self._lock:
            for rid in [r for r, e in self._entries.items() if e.expires_at <= now]:
                self._drop(rid)
                self._stats.num_expired += 1
            self.blocks.wake(now)

    def _drop(self, rid: str, *, rest: bool = True) -> None:
        """Free an entry's blocks: at once, or (``rest``) after ``reuse_after_s``."""
        self.blocks.give_back(self._entries.pop(rid).block_ids, rest=rest)

    # ---- queries and operator calls -------------------------------------------------------
    def release(self, store_request_id: str) -> bool:
        """Free an entry now (its session closed); False when there is none."""
        with self._lock:
            if store_request_id not in self._entries:
                return False
            self._drop(store_request_id)
            return True

    def entries(self) -> list[tuple[dict[str, Any], float, dict[str, Any]]]:
        """Every copy held and unread: its params, the seconds it is still kept, and the
        tag its take-in gave (what a restarted caller rebuilds its books from)."""
        now = self.clock()
        with self._lock:
            return [
                (dict(e.params), e.expires_at - now, dict(e.tag))
                for e in self._entries.values()
                if e.num_notifs == 0 and e.expires_at > now
            ]

    def entry_notifs(self, store_request_id: str) -> int | None:
        """How many reads of an entry readers reported; None when there is no entry."""
        with self._lock:
            entry = self._entries.get(store_request_id)
            return None if entry is None else entry.num_notifs

    def block_view(self, region: int, block_id: int) -> npt.NDArray[np.uint8]:
        """The bytes of one store block in one region (a view: writes land in the store)."""
        assert self.buffer is not None
        start = self._region_bases[region] - self.buffer.ctypes.data
        start += block_id * self.block_lens[region]
        return self.buffer[start : start + self.block_lens[region]]

    def stats(self) -> StoreStats:
        with self._lock:
            s = dataclasses.replace(self._stats)
            s.num_free_blocks, s.num_entries = self.blocks.num_free, len(self._entries)
            s.num_reads_in_flight = len(self._late)
            return s
