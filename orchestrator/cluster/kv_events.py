"""The prefill engines' KV cache events, brought to the prefix router.

With ``routing.prefix_kv_events`` (and prefix-aware routing) each vLLM prefill engine
publishes what its prefix cache stores and evicts (``engines.kv_events``) on a port of
its host; its engine host registers that endpoint in Ray's GCS key-value table under its
replica's id (``register_endpoint``). The prefix router in each ingress replica looks the
endpoint up when the replica joins (``lookup_endpoint``) and subscribes
(``KVEventsSubscriber``): one thread, one ZMQ SUB socket per engine, each batch handed to
the router's callback with the replica it came from. So the router's index learns the
blocks an engine holds that kvtide's own record of its prompts misses (a read-back from
decode, another ingress replica's prompts) and forgets those the engine evicted.

Best effort, as the index is: a batch lost (ZMQ drops past its high-water mark, or one
sent before the subscription) leaves the index a guess for those blocks (counted as a
gap). Engines without the events (another backend, the option off) are routed by
kvtide's own record alone.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from engines.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    decode_seq,
    is_primary,
)
from orchestrator.cluster.deadlines import GCS_TIMEOUT_S, call_within
from policies.prefix_routing import EngineBlocks, PrefixRouter

__all__ = [
    "KVEventsSubscriber",
    "apply_kv_events",
    "forget_endpoint",
    "lookup_endpoint",
    "register_endpoint",
]

log = logging.getLogger("kvtide.kv_events")

NAMESPACE = "kvtide-kv-events"
"""The GCS key-value namespace of the engines' event endpoints, keyed by replica id."""
LOOKUP_TIMEOUT_S = 1.0
"""The deadline of a lookup of an engine's endpoint (a GCS call on a turn's routing)."""
POLL_MS = 100
"""How long the subscriber thread waits for a batch before it looks for new engines."""


def register_endpoint(replica_id: str, endpoint: str) -> None:
    """The engine of replica ``replica_id`` publishes its events at ``endpoint`` (a GCS
    call within ``GCS_TIMEOUT_S``, as the two below)."""
    from ray.experimental import internal_kv

    call_within(
        lambda: internal_kv._internal_kv_put(
            replica_id, endpoint.encode(), overwrite=True, namespace=NAMESPACE
        ),
        GCS_TIMEOUT_S,
        "the GCS put of an engine's KV events endpoint",
    )


def lookup_endpoint(replica_id: str) -> str | None:
    """Where the engine of ``replica_id`` publishes its events; None when it does not
    (within ``LOOKUP_TIMEOUT_S``: the prefix router looks up while it routes a turn)."""
    from ray.experimental import internal_kv

    value = call_within(
        lambda: internal_kv._internal_kv_get(replica_id, namespace=NAMESPACE),
        LOOKUP_TIMEOUT_S,
        "the GCS lookup of an engine's KV events endpoint",
    )
    return None if value is None else bytes(value).decode()


def forget_endpoint(replica_id: str) -> None:
    from ray.experimental import internal_kv

    call_within(
        lambda: internal_kv._internal_kv_del(replica_id, namespace=NAMESPACE),
        GCS_TIMEOUT_S,
        "the GCS delete of an engine's KV events endpoint",
    )


def apply_kv_events(
    prefix: PrefixRouter,
    engines: dict[str, EngineBlocks],
    replica: str,
    batch: EventBatch,
    now_s: float,
) -> dict[str, int]:
    """``replica``'s engine's events of ``batch`` into ``prefix``'s index (``engines``:
    each replica's block map, made here on its first batch). Returns the engine blocks
    stored, removed, and stored after a block never heard of (``unchained``). Not
    thread-safe: the caller holds the index's lock."""
    blocks = engines.get(replica)
    if blocks is None:
        settings = prefix.settings
        blocks = engines[replica] = EngineBlocks(
            settings.block_size_tokens, max_blocks=settings.max_index_entries
        )
    counts = {"stored": 0, "removed": 0, "unchained": 0}
    for event in batch.events:
        if isinstance(event, BlockStored) and is_primary(event):
            hashes = blocks.stored(
                event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size
            )
            if hashes is None:
                counts["unchained"] += len(event.block_hashes)
            else:
                prefix.record(hashes, replica, now_s)
                counts["stored"] += len(event.block_hashes)
        elif isinstance(event, BlockRemoved) and is_primary(event):
            prefix.index.forget(blocks.removed(event.block_hashes), replica)
            counts["removed"] += len(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            blocks.cleared()
            prefix.remove_replica(replica)
    return counts


class KVEventsSubscriber:
    """Subscribes to engines' event endpoints on a thread of its own and calls
    ``apply(replica_id, batch)`` for each batch, on that thread. ``subscribe`` and
    ``unsubscribe`` may be called from any thread. ``counts``: batches, gaps (batches
    missed, by their sequence numbers) and undecodable messages."""

    def __init__(self, apply: Callable[[str, EventBatch], None]) -> None:
        self._apply = apply
        self._commands: queue.SimpleQueue[tuple[str, str, str | None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._subscribed: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtide-kv-events", daemon=True)
        self._thread.start()

    def subscribe(self, replica_id: str, endpoint: str) -> None:
        with self._lock:
            self._subscribed.add(replica_id)
        self._commands.put(("sub", replica_id, endpoint))

    def unsubscribe(self, replica_id: str) -> None:
        with self._lock:
            self._subscribed.discard(replica_id)
        self._commands.put(("unsub", replica_id, None))

    def subscribed(self, replica_id: str) -> bool:
        with self._lock:
            return replica_id in self._subscribed

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * POLL_MS / 1000)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        poller = zmq.Poller()
        sockets: dict[str, Any] = {}
        replica_of: dict[Any, str] = {}
        last_seq: dict[str, int] = {}
        try:
            while not self._stop.is_set():
                while True:
                    try:
                        op, replica, endpoint = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    old = sockets.pop(replica, None)
                    if old is not None:
                        poller.unregister(old)
                        replica_of.pop(old, None)
                        old.close(linger=0)
                        last_seq.pop(replica, None)
                    if op == "sub" and endpoint is not None:
                        sock = ctx.socket(zmq.SUB)
                        sock.setsockopt(zmq.SUBSCRIBE, b"")
                        sock.connect(endpoint)
                        poller.register(sock, zmq.POLLIN)
                        sockets[replica] = sock
                        replica_of[sock] = replica
                for sock, _ in poller.poll(POLL_MS) if sockets else ():
                    replica = replica_of[sock]
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._receive(replica, frames, last_seq)
                if not sockets:
                    self._stop.wait(POLL_MS / 1000)
        finally:
            for sock in sockets.values():
                sock.close(linger=0)
            ctx.term()

    def _receive(self, replica: str, frames: list[bytes], last_seq: dict[str, int]) -> None:
        try:
            seq = decode_seq(frames[-2]) if len(frames) >= 2 else None
            batch = decode_batch(frames[-1])
        except (ValueError, IndexError):
            self._count("undecodable")
            return
        if seq is not None:
            before = last_seq.get(replica)
            if before is not None and seq > before + 1:
                self._count("gaps", seq - before - 1)
            last_seq[replica] = seq
        self._count("batches")
        try:
            self._apply(replica, batch)
        except Exception:  # one bad batch must not end the subscription
            log.exception("KV events of %s: a batch could not be applied", replica)
