"""The host-memory tier as one store per node: a session's copy stays on its decode
engine's node.

``NodeStores`` is what the KV service's actor gives the service as its tier
(``orchestrator.kv.drains.HostTier``). A take-in goes to the store on the node of the
decode engine that kept the blocks (the node its host reports in its heartbeats; the
service's own node when it has not reported one), started there on first use: the
store's read of the decode's blocks stays inside the node, the prefill engine later
reads the copy from the node it would have read the decode from, and the tier's
capacity (``kv.host_tier_mib`` per store) grows with the nodes, as llm-d's per-node CPU
tier and Mooncake's store do. Each store is a detached actor named
``<prefix>.<node id, 12 characters>`` (also its NIXL engine id, so a copy's params name
its store); a restarted service finds every store of the application by that prefix.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

import ray

from engines.kv_params import KVTransferParams
from orchestrator.cluster.deadlines import call_within_async
from orchestrator.kv.drains import HostCopy
from orchestrator.kv.host_tier import (
    START_TIMEOUT_S,
    HostTierClient,
    HostTierSpec,
    runs_spec,
    start_host_tier,
)

__all__ = ["NODE_ID_CHARS", "STORE_START_TIMEOUT_S", "NodeStores", "app_store_names", "store_name"]

log = logging.getLogger("kvtide.kv_service")

NODE_ID_CHARS = 12
"""Characters of a node's id in its store's name: Ray's node ids are 56 hex characters,
distinct in their first 12 for any real cluster."""


def store_name(prefix: str, node_id: str) -> str:
    """The store of ``node_id`` (its actor's name and NIXL engine id)."""
    return f"{prefix}.{node_id[:NODE_ID_CHARS]}"


def app_store_names(prefix: str, namespace: str) -> list[str]:
    """The stores named under ``prefix`` that run in ``namespace`` (a GCS call)."""
    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        a["name"]
        for a in named
        if a["namespace"] == namespace and a["name"].startswith(prefix + ".")
    )


STORE_START_TIMEOUT_S = START_TIMEOUT_S + 10
"""How long a store's start may take in all: the GCS calls that create or find it, and
the new store's first answer (``START_TIMEOUT_S``)."""

StartStore = Callable[[HostTierSpec, str, str, str], HostTierClient]
"""(spec, store name, namespace, node id) -> the store's client, started if need be."""
FindStores = Callable[[], dict[str, HostTierClient]]
"""The application's running stores by name (a restarted service's view)."""


class NodeStores:
    """One host store per node (``orchestrator.kv.drains.HostTier``). ``node_of``: the
    node an engine's host last reported (None: unknown); ``home_node``: the service's
    node, for engines not reported yet."""

    def __init__(
        self,
        spec: HostTierSpec,
        prefix: str,
        namespace: str,
        *,
        node_of: Callable[[str], str | None],
        home_node: str,
        start: StartStore | None = None,
        find: FindStores | None = None,
        start_timeout_s: float = STORE_START_TIMEOUT_S,
    ) -> None:
        self.spec = spec
        self.prefix = prefix
        self.namespace = namespace
        self.node_of = node_of
        self.home_node = home_node
        self._start: StartStore = start or start_host_tier
        self._find: FindStores = find or (lambda: _find_stores(prefix, namespace, spec))
        self._clients: dict[str, HostTierClient] = {}
        self._starting: dict[str, asyncio.Lock] = {}
        self.start_timeout_s = start_timeout_s
        self._found = False
        self._preparing: set[asyncio.Task[tuple[str, HostTierClient]]] = set()

    async def store_for(self, engine_id: str) -> tuple[str, HostTierClient]:
        """The store (name, client) a take-in from ``engine_id`` goes to: its node's,
        started there if it does not run yet. A start (GCS calls and the new store's
        first answer) past ``start_timeout_s`` raises ``CallTimedOut`` and frees the node
        for the next take-in to try again."""
        node = self.node_of(engine_id) or self.home_node
        name = store_name(self.prefix, node)
        async with self._starting.setdefault(name, asyncio.Lock()):
            client = self._clients.get(name)
            if client is None:
                client = await call_within_async(
                    functools.partial(self._start, self.spec, name, self.namespace, node),
                    self.start_timeout_s,
                    f"the start of host store {name}",
                )
                self._clients[name] = client
        return name, client

    def prepare(self, engine_id: str) -> None:
        """Start ``engine_id``'s store in the background unless it runs (a call from
        within the service's event loop)."""
        node = self.node_of(engine_id)
        if node is None or store_name(self.prefix, node) in self._clients:
            return
        task = asyncio.get_running_loop().create_task(self.store_for(engine_id))
        self._preparing.add(task)
        task.add_done_callback(self._prepared)

    def _prepared(self, task: asyncio.Task[tuple[str, HostTierClient]]) -> None:
        self._preparing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("host store start failed: %s", task.exception())

    async def _all(self) -> dict[str, HostTierClient]:
        """Every store of the application: the ones this service started, and once
        those a previous instance left (found by name)."""
        if not self._found:
            found = await call_within_async(
                self._find, self.spec.timeout_s, "the search for the host stores"
            )
            for name, client in found.items():
                self._clients.setdefault(name, client)
            self._found = True
        return dict(self._clients)

    async def take_in(
        self, params: KVTransferParams, tag: dict[str, Any] | None = None
    ) -> HostCopy | None:
        _, store = await self.store_for(params.remote_engine_id or "")
        return await store.take_in(params, tag)

    async def release(self, params: KVTransferParams) -> None:
        name = params.remote_engine_id or ""
        client = self._clients.get(name) or (await self._all()).get(name)
        if client is None:
            log.warning("host tier: no store %s to release %s in", name, params.remote_request_id)
            return
        await client.release(params)

    async def entries(self) -> list[tuple[HostCopy, dict[str, Any]]]:
        held: list[tuple[HostCopy, dict[str, Any]]] = []
        for name, client in sorted((await self._all()).items()):
            try:
                held += await client.entries()
            except Exception as exc:  # that store's copies stay unbooked until its TTL
                log.warning("host store %s not reachable for its copies: %s", name, exc)
        return held

    async def stats(self) -> dict[str, Any]:
        """The stores' counters summed, with ``num_stores`` and each store's own."""
        stores = await self._all()
        each = dict(
            zip(stores, await asyncio.gather(*(c.stats() for c in stores.values())), strict=True)
        )
        total: dict[str, Any] = {"num_stores": len(each), "stores": each}
        for stats in each.values():
            for key, value in stats.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
        return total


def _find_stores(prefix: str, namespace: str, spec: HostTierSpec) -> dict[str, HostTierClient]:
    found: dict[str, HostTierClient] = {}
    for name in app_store_names(prefix, namespace):
        try:
            actor = ray.get_actor(name, namespace=namespace)
        except ValueError:
            continue  # stopped meanwhile
        if not runs_spec(actor, spec, spec.timeout_s):
            log.warning("host store %s runs another capacity, TTL or address: stopping it", name)
            ray.kill(actor, no_restart=True)  # started again, as configured, on first use
            continue
        found[name] = HostTierClient.of_actor(actor, timeout_s=spec.timeout_s)
    return found
