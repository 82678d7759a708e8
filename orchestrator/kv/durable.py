"""The part of the KV service's books that must outlive the service: session owners and
idempotent turns.

The KV books themselves are rebuilt after a restart from the engines' ledgers (the
engines hold the blocks). Two facts no engine holds: which API key owns each session,
and which turns already ran (their stored responses, and which are running now). Lost
with the actor, another key could take a session over and a retried turn would run a
second time. So the service writes them through to a ``DurableStore`` as they change
and reads them back when it starts.

Under Ray the store is the GCS's key-value table (``RayKVStore``): it outlives every
actor and worker, and lives as long as the cluster (with GCS fault tolerance, longer).
A write is one GCS round trip (about 0.5 ms on a 2-core box); the service writes on a
session's first turn and its end, and an idempotent turn's start and end, before it
answers. The marks of a session's running turn (written as the turn begins and ends) go
through ``WriteBehind`` instead: in order, off the turn's path; the price is that a
service that dies within a write's round trip of a turn's start may not know after its
restart that the turn is running (a concurrent turn of that session then runs beside
it instead of getting 409). ``MemoryStore`` is the same contract in a dict, for tests
and in-process use.

Every call to the GCS has a deadline (``BoundedStore``, ``GCS_TIMEOUT_S``): past it the
caller gets ``CallTimedOut`` (the service's call fails, and its client gets 503
``service_unavailable``) instead of waiting as long as the GCS does not answer. A
write-behind write past its deadline is counted (``WriteBehind.num_failed``) and logged,
and the writes after it go on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from typing import Protocol

from orchestrator.cluster.deadlines import GCS_TIMEOUT_S, call_within, call_within_async

__all__ = ["BoundedStore", "DurableStore", "MemoryStore", "RayKVStore", "WriteBehind"]

log = logging.getLogger("kvtide.kv_service")


class DurableStore(Protocol):
    """Bytes by string key. Every call is synchronous and short; ``keys`` lists the keys
    that start with ``prefix``."""

    def put(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def delete(self, key: str) -> None: ...

    def keys(self, prefix: str) -> list[str]: ...


class MemoryStore:
    """A ``DurableStore`` in a dict: durable only as long as the object lives."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def put(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def keys(self, prefix: str) -> list[str]:
        return [k for k in self.data if k.startswith(prefix)]


class RayKVStore:
    """A ``DurableStore`` in Ray's GCS key-value table, one namespace per application."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace

    def put(self, key: str, value: bytes) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=self.namespace)

    def get(self, key: str) -> bytes | None:
        from ray.experimental import internal_kv

        value = internal_kv._internal_kv_get(key, namespace=self.namespace)
        return None if value is None else bytes(value)

    def delete(self, key: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(key, namespace=self.namespace)

    def keys(self, prefix: str) -> list[str]:
        from ray.experimental import internal_kv

        found = internal_kv._internal_kv_list(prefix, namespace=self.namespace)
        return [k.decode() if isinstance(k, bytes) else str(k) for k in found]


class BoundedStore:
    """``store``'s calls, each bounded by ``timeout_s`` (``CallTimedOut`` past it)."""

    def __init__(self, store: DurableStore, *, timeout_s: float = GCS_TIMEOUT_S) -> None:
        self.store = store
        self.timeout_s = timeout_s

    def put(self, key: str, value: bytes) -> None:
        call_within(lambda: self.store.put(key, value), self.timeout_s, f"the store's put of {key}")

    def get(self, key: str) -> bytes | None:
        return call_within(lambda: self.store.get(key), self.timeout_s, f"the store's get of {key}")

    def delete(self, key: str) -> None:
        call_within(lambda: self.store.delete(key), self.timeout_s, f"the store's delete of {key}")

    def keys(self, prefix: str) -> list[str]:
        return call_within(
            lambda: self.store.keys(prefix), self.timeout_s, f"the store's keys under {prefix}"
        )


class WriteBehind:
    """A ``DurableStore``'s writes (``put``, ``delete``) applied in the order made, by one
    task in a worker thread, so that the caller's event loop does not wait for them.
    Outside an event loop a write is made at once. ``flush`` waits for the writes made so
    far. A write that fails or takes longer than ``timeout_s`` is counted
    (``num_failed``) and logged, and the next one goes on: a hung write holds no later
    mark (its key's mark is stale until written again)."""

    def __init__(self, store: DurableStore, *, timeout_s: float = GCS_TIMEOUT_S) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.num_failed = 0
        self._queue: deque[tuple[str, bytes | None]] = deque()  # value None: delete
        self._task: asyncio.Task[None] | None = None

    def put(self, key: str, value: bytes) -> None:
        self._write(key, value)

    def delete(self, key: str) -> None:
        self._write(key, None)

    def _write(self, key: str, value: bytes | None) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._apply(key, value)
            return
        self._queue.append((key, value))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._drain())

    def _apply(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.store.delete(key)
        else:
            self.store.put(key, value)

    async def _drain(self) -> None:
        while self._queue:
            key, value = self._queue.popleft()
            try:
                await call_within_async(
                    functools.partial(self._apply, key, value),
                    self.timeout_s,
                    f"the durable write of {key}",
                )
            except Exception:  # the next write goes on; the mark is stale until then
                self.num_failed += 1
                log.exception("durable write of %s failed", key)

    async def flush(self) -> None:
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)
