"""The host-memory tier: idle sessions' KV in host memory instead of dropped.

With ``kv.host_tier_mib`` above 0 the KV service starts stores (``HostStoreActor``, a
Ray actor on each node whose decode engines evict: ``orchestrator.kv.host_nodes``)
around ``engines.host_store.HostStore``: host memory registered with NIXL, reached by
the engines as if it were a peer engine. When the idle budget evicts a session's kept
KV from a decode engine, the service asks the store to take it in
(``HostTierClient.take_in``: the store reads the blocks over NIXL, and the decode
engine frees them when the read lands) and books the copy as the session's record
(``orchestrator.kv.drains``); the session's next turn pulls it from the store exactly
as from a decode engine, and reports ``kv_source: host_tier``. The store frees a copy
when its reader says it finished reading (a record is handed to one pull), when the
service releases it (closed, superseded) or at its TTL (``kv.host_tier_ttl_s``), and
reuses freed blocks only ``REUSE_AFTER_S`` later: a store never sees a read start, so a
reader that held the params longer must not find another session's KV there.

A store is a detached actor named after the application and its node: a restarted
service finds it, and books the copies it holds again from the tags their take-ins left
with them (``KVService.adopt_host_copies``); ``kvtide``'s shutdown stops it with the
service.

A take-in that fails has one owner of the decode's blocks: the service drains them only
when the store answers that nothing reads them (no room, refused, the handshake or the
READ failed). A READ in flight at the store's deadline is the store's to end
(``HostReadPending``: ``engines.host_store``), and so is one whose answer never came:
the client gives the store its READ's deadline and a margin (``ANSWER_MARGIN_S``), and
past that it cannot tell whether the READ still runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import ray

from engines.kv_params import KVTransferParams
from orchestrator.cluster.ports import free_port
from orchestrator.config import KVTideConfig
from orchestrator.config.server import internal_address, nixl_transport_env
from orchestrator.kv.drains import HostCopy, HostReadPending

__all__ = [
    "REUSE_AFTER_S",
    "HostStoreActor",
    "HostTierClient",
    "HostTierSpec",
    "host_tier_spec",
    "lookup_host_store",
    "runs_spec",
    "start_host_tier",
]

log = logging.getLogger("kvtide.kv_service")

REUSE_AFTER_S = 60.0
"""How long a freed store block stays unused: past any pull's deadline
(``kv.pull_timeout_s``) with room to spare."""


ANSWER_MARGIN_S = 5.0
"""How much longer than its READ's deadline a take-in's answer may take: the
handshake with an engine the store has not read from yet, and Ray's call."""


START_TIMEOUT_S = 120.0
"""How long a new store may take to answer: its NIXL agent and vLLM's imports."""


@dataclass(frozen=True, slots=True)
class HostTierSpec:
    """The tier as configured: its capacity, how long it keeps a copy, and the
    deadline of one call to it."""

    capacity_bytes: int
    ttl_s: float
    timeout_s: float = 30.0
    internal_host: str = "127.0.0.1"
    """``server.internal_host``: where a store's NIXL handshake listens (``internal_address``)."""


class HostStoreActor:
    """The store in its own process (NIXL agent, handshake listener, notification
    poller), its calls answered from Ray's thread pool (a take-in blocks on its read)."""

    def __init__(
        self, store_id: str, capacity_bytes: int, ttl_s: float, internal_host: str = "127.0.0.1"
    ) -> None:
        from engines.host_store import HostStore

        # Engines reach it as they reach each other: on server.internal_host (its NIXL
        # agent's own listeners too; this process holds nothing else of UCX's).
        host = internal_address(internal_host, ray.util.get_node_ip_address())
        os.environ.update(nixl_transport_env(internal_host))
        self.internal_host = internal_host
        self.store = HostStore(
            store_id=store_id,
            capacity_bytes=capacity_bytes,
            side_channel_host=host,
            side_channel_port=free_port(host),
            ttl_s=ttl_s,
            free_after_read=True,
            reuse_after_s=REUSE_AFTER_S,
        )
        self.store.start()

    def take_in(
        self, params: dict[str, Any], timeout_s: float, tag: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], float] | str | None:
        """The copy's params and how long it is kept; None when the store has no room
        or the read failed (nothing reads the blocks: they stay on their engine); the
        error, as text, when the READ is still in flight (the store ends the engine's
        hold on the blocks). ``tag``: kept with the copy for a restarted service
        (``entries``)."""
        from engines.host_store import LayoutMismatch, TakeInFailed, UnsupportedEngine

        try:
            copy = self.store.take_in(params, timeout_s=timeout_s, tag=tag)
        except (TakeInFailed, LayoutMismatch, UnsupportedEngine) as exc:
            log.warning("host store: %s", exc)
            return str(exc) if getattr(exc, "read_in_flight", False) else None
        return None if copy is None else (copy, self.store.ttl_s)

    def release(self, store_request_id: str) -> bool:
        return self.store.release(store_request_id)

    def entries(self) -> list[tuple[dict[str, Any], float, dict[str, Any]]]:
        return self.store.entries()

    def spec(self) -> tuple[int | None, float, str]:
        return self.store.capacity_bytes, self.store.ttl_s, self.internal_host

    def stats(self) -> dict[str, Any]:
        """The store's counters, and the node it runs on."""
        stats = self.store.stats()
        own = {f: getattr(stats, f) for f in stats.__dataclass_fields__}
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        return own | {"node_id": node}


def host_tier_spec(config: KVTideConfig) -> HostTierSpec | None:
    """The host tier ``config`` asks for (None: ``kv.host_tier_mib`` 0, no tier)."""
    kv = config.kv
    if kv.host_tier_mib <= 0:
        return None
    return HostTierSpec(
        capacity_bytes=int(kv.host_tier_mib * 2**20),
        ttl_s=kv.host_tier_ttl_s,
        timeout_s=kv.pull_timeout_s,
        internal_host=config.server.internal_host,
    )


def runs_spec(actor: Any, spec: HostTierSpec, timeout_s: float) -> bool:
    """Whether a store has ``spec``'s capacity, TTL and listening address (a deployment
    with another left it otherwise), asked within ``timeout_s`` (a store just created
    answers once started)."""
    return tuple(ray.get(actor.spec.remote(), timeout=timeout_s)) == (
        spec.capacity_bytes,
        spec.ttl_s,
        spec.internal_host,
    )


def start_host_tier(
    spec: HostTierSpec, store_id: str, namespace: str, node_id: str | None = None
) -> HostTierClient:
    """The store named ``store_id`` in ``namespace``, started on ``node_id`` (default:
    this node) unless it runs already: a detached actor, so that a restarted service
    finds it and books its copies again (``KVService.adopt_host_copies``). One left by a
    deployment with another capacity, TTL or address is replaced (its copies are dropped)."""
    remote = ray.remote(num_cpus=0, max_concurrency=4, max_restarts=0)(HostStoreActor)
    node = node_id or ray.get_runtime_context().get_node_id()
    options = {
        "name": store_id,
        "namespace": namespace,
        "lifetime": "detached",
        "get_if_exists": True,
        "scheduling_strategy": ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
            node_id=node, soft=False
        ),
    }
    actor = remote.options(**options).remote(
        store_id, spec.capacity_bytes, spec.ttl_s, spec.internal_host
    )
    if not runs_spec(actor, spec, START_TIMEOUT_S):
        log.warning("host store %s runs another capacity, TTL or address: replacing it", store_id)
        ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + 60
        while lookup_host_store(store_id, namespace) is not None:  # its name is freed once dead
            if time.monotonic() > deadline:
                raise RuntimeError(f"the previous host store {store_id} did not stop in time")
            time.sleep(0.1)
        actor = remote.options(**options).remote(
            store_id, spec.capacity_bytes, spec.ttl_s, spec.internal_host
        )
    return HostTierClient.of_actor(actor, timeout_s=spec.timeout_s)


def lookup_host_store(store_id: str, namespace: str) -> Any:
    """The running store's handle, or None."""
    try:
        return ray.get_actor(store_id, namespace=namespace)
    except ValueError:
        return None


class HostTierClient:
    """The service's side of the tier (``orchestrator.kv.drains.HostTier``): each call
    one call of a ``HostStoreActor`` method, bounded by ``timeout_s`` (a take-in: its
    READ's deadline, ``answer_margin_s`` more for the answer); ``call(name, *args)``
    makes it (a Ray actor call, or in a process without Ray a thread)."""

    def __init__(
        self,
        call: Callable[..., Awaitable[Any]],
        *,
        timeout_s: float,
        answer_margin_s: float = ANSWER_MARGIN_S,
    ) -> None:
        self.call = call
        self.timeout_s = timeout_s
        self.answer_margin_s = answer_margin_s

    @classmethod
    def of_actor(cls, actor: Any, *, timeout_s: float) -> HostTierClient:
        async def call(name: str, *args: Any) -> Any:
            return await getattr(actor, name).remote(*args)

        return cls(call, timeout_s=timeout_s)

    @classmethod
    def in_process(cls, store: HostStoreActor, *, timeout_s: float) -> HostTierClient:
        async def call(name: str, *args: Any) -> Any:
            return await asyncio.to_thread(getattr(store, name), *args)

        return cls(call, timeout_s=timeout_s)

    async def take_in(
        self, params: KVTransferParams, tag: dict[str, Any] | None = None
    ) -> HostCopy | None:
        try:
            answer = await asyncio.wait_for(
                self.call("take_in", params.to_vllm(), self.timeout_s, tag),
                self.timeout_s + self.answer_margin_s,
            )
        except Exception as exc:  # asked, and no answer: its READ may run
            raise HostReadPending(
                f"no answer to the take-in of {params.remote_request_id}: {exc!r}"
            ) from exc
        if answer is None:
            return None
        if isinstance(answer, str):
            raise HostReadPending(answer)
        copy, kept_for_s = answer
        return HostCopy(params=KVTransferParams.from_vllm(copy), expires_in_s=kept_for_s)

    async def release(self, params: KVTransferParams) -> None:
        if params.remote_request_id:
            await asyncio.wait_for(self.call("release", params.remote_request_id), self.timeout_s)

    async def entries(self) -> list[tuple[HostCopy, dict[str, Any]]]:
        """Every copy the store holds unread, with the tag its take-in gave."""
        held = await asyncio.wait_for(self.call("entries"), self.timeout_s)
        return [
            (HostCopy(params=KVTransferParams.from_vllm(p), expires_in_s=left), tag)
            for p, left, tag in held
        ]

    async def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = await asyncio.wait_for(self.call("stats"), self.timeout_s)
        return stats
