"""The KV lifecycle service as a Ray actor, and the clients that talk to it.

One named, detached actor per Serve application (``kvtide-kv-<app>`` in namespace
``kvtide``): every ingress replica gets or creates it with the same arguments, and every
engine host finds it by name. Ray restarts it when it dies (``max_restarts=-1``); calls
in flight are retried on the new instance (``max_task_retries=-1``), which starts with
empty books and a new ``epoch``. Engine hosts poll the epoch every second and send
their ledgers when it changes (``EpochWatcher``), and the service rebuilds from them
(see ``orchestrator.kv.service``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import ray
from ray._common.constants import HEAD_NODE_RESOURCE_NAME
from ray.actor import ActorHandle
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle

from orchestrator.cluster.deadlines import GCS_TIMEOUT_S, call_within_async
from orchestrator.cluster.handle_pool import HandlePool
from orchestrator.cluster.ray_nodes import read_ray_nodes
from orchestrator.config import ObservabilityConfig
from orchestrator.errors import ServiceUnavailable
from orchestrator.kv.durable import BoundedStore, RayKVStore
from orchestrator.kv.envelope import decode_result, dispatch, encode_call
from orchestrator.kv.host_nodes import NodeStores, app_store_names
from orchestrator.kv.host_tier import HostTierSpec, lookup_host_store
from orchestrator.kv.kept_check import KeptLedger, check_kept
from orchestrator.kv.messages import Beat, LedgerReport
from orchestrator.kv.service import (
    API_METHODS,
    KVService,
    KVServiceAPI,
    ServiceSettings,
    merge_counters,
)
from orchestrator.observability.logs import route_kvtide_logs
from orchestrator.observability.metrics import make_metrics
from policies.kv_lifecycle import KVLifecycleConfig

__all__ = [
    "SERVICE_NAMESPACE",
    "EpochWatcher",
    "KVServiceActor",
    "ServiceClient",
    "ServiceSetup",
    "get_or_create_service",
    "service_client",
    "service_name",
]

log = logging.getLogger("kvtide.kv_service")

SERVICE_NAMESPACE = "kvtide"
TICK_S = 1.0
NODE_CHECK_TICKS = 5
"""The service reads Ray's node table every this many ticks."""


def service_name(app_name: str) -> str:
    return f"kvtide-kv-{app_name or 'default'}"


def host_store_prefix(app_name: str) -> str:
    """The start of the names of the host tier's stores, one per node
    (``orchestrator.kv.host_nodes.store_name``)."""
    return f"kvtide-host-{app_name or 'default'}"


@dataclasses.dataclass(frozen=True)
class ServiceSetup:
    """What a service actor was started with, but the prefill pool's handles and the
    app's name: an actor found running with another setup (a redeploy that changed any
    of these) is replaced."""

    config: KVLifecycleConfig
    drain_timeout_s: float
    num_prefill_engines: int
    observability: ObservabilityConfig | None = None
    replay_max_bytes: int = 64 * 2**20
    running_grace_s: float = 600.0
    turn_lease_s: float = 0.0
    session_state_max_bytes: int | None = None
    host_tier: HostTierSpec | None = None
    call_timeout_s: float = 30.0


class _ServiceActor:
    """The Ray actor around ``KVService``. Its API methods are not written here: they are
    added from ``API_METHODS`` below, each forwarding to the service (and starting the
    tick on first use), so the service, the actor and the client cannot drift apart."""

    def __init__(
        self,
        setup: ServiceSetup,
        prefill: DeploymentHandle | Sequence[DeploymentHandle] | None,
        app_name: str = "",
    ) -> None:
        route_kvtide_logs()
        self.setup = setup
        host_tier = setup.host_tier
        self.metrics = make_metrics(setup.observability)
        self.host_tier = host_tier
        if host_tier is None:
            # Stores a deployment with a tier left (detached) hold copies nobody books.
            for stale in lookup_app_host_stores(app_name):
                log.warning("the host tier is off: stopping %s's host stores", app_name)
                ray.kill(stale, no_restart=True)
        self._num_expiries = 0
        self._engines_seen: set[str] = set()
        self.stores = (
            None
            if host_tier is None
            else NodeStores(
                host_tier,
                host_store_prefix(app_name),
                SERVICE_NAMESPACE,
                node_of=self._node_of,
                home_node=ray.get_runtime_context().get_node_id(),
            )
        )
        self.service = KVService(
            setup.config,
            prefill=None if prefill is None else HandlePool(prefill),  # None: no drains
            settings=ServiceSettings(
                drain_timeout_s=setup.drain_timeout_s,
                num_prefill_engines=setup.num_prefill_engines,
                replay_max_bytes=setup.replay_max_bytes,
                running_grace_s=setup.running_grace_s,
                turn_lease_s=setup.turn_lease_s,
                session_state_max_bytes=setup.session_state_max_bytes,
                # A host's kept-blocks check arrives within its call deadline.
                kept_check_margin_s=setup.call_timeout_s,
            ),
            store=BoundedStore(RayKVStore(f"{SERVICE_NAMESPACE}-{service_name(app_name)}")),
            host=self.stores,
        )
        self._ticker: asyncio.Task[None] | None = None

    def _node_of(self, engine_id: str) -> str | None:
        """The node of an engine's first shard, as its host last reported it."""
        nodes = self.service.engine_nodes().get(engine_id)
        return nodes[0] if nodes else None

    def _tick_started(self) -> KVService:
        # Async actors have no running loop in __init__: start the tick on first use.
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())
        return self.service

    async def _tick_forever(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(TICK_S)
            ticks += 1
            try:
                if ticks % NODE_CHECK_TICKS == 0:
                    await self._check_nodes()
                    self._start_stores()
                await self.service.tick()
                self._export_metrics()
            except Exception:  # keep ticking: one bad effect must not stop expiry
                log.exception("KV service tick failed")

    async def _check_nodes(self) -> None:
        """Engines on nodes Ray reports dead are lost (sooner than their silence). Ray's
        node table is read off the actor's event loop, within ``GCS_TIMEOUT_S``."""
        nodes = {n for engine_nodes in self.service.engine_nodes().values() for n in engine_nodes}
        if not nodes:
            return
        rows = await call_within_async(
            functools.partial(read_ray_nodes, alive_only=False), GCS_TIMEOUT_S, "Ray's node table"
        )
        dead = {n.node_id for n in rows if not n.alive} & nodes
        lost = self.service.nodes_lost(dead)
        if lost:
            log.warning("engines lost with nodes %s: %s", sorted(dead), lost)

    def _start_stores(self) -> None:
        """Start the host tier's store on the node of every engine keeping session KV
        (the engines that may evict), in the background: a first eviction there need
        not wait for its store's start (NIXL's agent, vLLM's imports: seconds)."""
        if self.stores is None:
            return
        for engine_id in self.service.decider.lifecycle.engines_with_records():
            self.stores.prepare(engine_id)

    def _export_metrics(self) -> None:
        lifecycle = self.service.decider.lifecycle
        self.metrics.set_sessions_live(lifecycle.num_sessions())
        for engine_id in lifecycle.engines_with_records() | self._engines_seen:
            self.metrics.set_bytes_held(engine_id, lifecycle.bytes_held(engine_id))
            self._engines_seen.add(engine_id)
        self.metrics.set_engines_by_decode_path(self.service.engines_by_decode_path())
        expiries = lifecycle.stats().num_expiries
        if expiries > self._num_expiries:
            self.metrics.inc("kvtide_kv_expiries_total", expiries - self._num_expiries)
        self._num_expiries = expiries

    async def epoch(self) -> str:
        return self._tick_started().epoch

    async def invoke(self, message: bytes) -> bytes:
        """Any ``API_METHODS`` call as one message (``orchestrator.kv.envelope``), run by
        this actor's own entry point for it (which starts the tick)."""
        return await dispatch(self, message)

    async def config(self) -> ServiceSetup:
        """What this instance was started with."""
        return self.setup

    async def wait_drains(self) -> None:
        await self.service.wait_drains()


def _forward(name: str) -> Callable[..., Any]:
    async def method(self: _ServiceActor, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self._tick_started(), name)(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    method.__name__ = method.__qualname__ = name
    return method


for _name in API_METHODS:
    setattr(_ServiceActor, _name, _forward(_name))


async def _stats_with_metrics(self: _ServiceActor) -> dict[str, Any]:
    # The service actor's own book (KV gauges, expiries) joins the ingress replicas'.
    stats = await self._tick_started().stats()
    books = [*self.service.recent_metrics(), self.metrics.snapshot()]
    return {**stats, "metrics": merge_counters(books)}


_ServiceActor.stats = _stats_with_metrics  # type: ignore[attr-defined]

KVServiceActor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(_ServiceActor)


def get_or_create_service(
    app_name: str,
    config: KVLifecycleConfig,
    prefill: DeploymentHandle | Sequence[DeploymentHandle] | None,
    *,
    drain_timeout_s: float,
    num_prefill_engines: int,
    observability: ObservabilityConfig | None = None,
    replay_max_bytes: int = 64 * 2**20,
    running_grace_s: float = 600.0,
    timeout_s: float = 120.0,
    turn_lease_s: float = 0.0,
    session_state_max_bytes: int | None = None,
    host_tier: HostTierSpec | None = None,
    call_timeout_s: float = 30.0,
) -> ActorHandle:
    """The application's service actor; the first caller creates it, and waits for it
    to answer at most ``timeout_s`` (a new actor starts a Ray worker process: on a host
    busy loading engines that can take tens of seconds).

    An actor left by an earlier deployment of the app that runs another setup (a
    redeploy with a changed ``kv`` section, request deadline, prefill pool size or
    observability: every ``ServiceSetup`` field) is replaced: it is killed, and the new one
    rebuilds its books as after any restart (the engines' ledgers, the owners and replays
    in Ray's GCS), so nothing it booked is lost."""
    setup = ServiceSetup(
        config=config,
        drain_timeout_s=drain_timeout_s,
        num_prefill_engines=num_prefill_engines,
        observability=observability,
        replay_max_bytes=replay_max_bytes,
        running_grace_s=running_grace_s,
        turn_lease_s=turn_lease_s,
        session_state_max_bytes=session_state_max_bytes,
        host_tier=host_tier,
        call_timeout_s=call_timeout_s,
    )
    options = {
        "name": service_name(app_name),
        "namespace": SERVICE_NAMESPACE,
        "lifetime": "detached",
        "get_if_exists": True,
        # On the head host, as Serve's controller: a lost GPU host does not take it (and
        # every session's next turn) through a restart.
        "resources": {HEAD_NODE_RESOURCE_NAME: 0.001},
    }
    handle = KVServiceActor.options(**options).remote(setup, prefill, app_name)  # type: ignore[attr-defined]
    if ray.get(handle.config.remote(), timeout=timeout_s) != setup:
        log.warning("KV service %s runs another config: replacing it", service_name(app_name))
        ray.kill(handle, no_restart=True)
        deadline = time.monotonic() + timeout_s
        while lookup_service(app_name) is not None:  # the name is freed once it is dead
            if time.monotonic() > deadline:
                raise ServiceUnavailable("the previous KV service did not stop in time")
            time.sleep(0.1)
        handle = KVServiceActor.options(**options).remote(setup, prefill, app_name)  # type: ignore[attr-defined]
    return handle  # type: ignore[no-any-return]


class ServiceClient:
    """The service through its actor handle, every call bounded by ``timeout_s``.

    Its methods are the service's (``API_METHODS``; typed by ``KVServiceAPI``), made
    from that list: each is one actor call, its arguments and answer each one msgpack
    message (``orchestrator.kv.envelope``). A call past its deadline, or to an actor that
    cannot be reached, raises ``ServiceUnavailable`` (HTTP 503 with Retry-After); the
    details go to the log, not to the caller. Ray retries a call that was in flight
    when the actor died on the restarted instance (``max_task_retries=-1``), within the
    same deadline.
    """

    def __init__(self, handle: ActorHandle, *, timeout_s: float = 10.0) -> None:
        self.handle = handle
        self.timeout_s = timeout_s

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        message = encode_call(name, args, kwargs)
        try:
            answer = await asyncio.wait_for(self.handle.invoke.remote(message), self.timeout_s)
        except TimeoutError:
            log.warning("KV service call %s timed out after %.1f s", name, self.timeout_s)
        except RayError as exc:
            log.warning("KV service call %s failed: %s", name, exc)
        else:
            return decode_result(name, answer)
        raise ServiceUnavailable(
            "the KV lifecycle service did not answer in time; retry the request",
            retry_after_s=1.0,
        )

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        if name not in API_METHODS:
            raise AttributeError(name)

        async def method(*args: Any, **kwargs: Any) -> Any:
            return await self.call(name, *args, **kwargs)

        return method


def service_client(handle: ActorHandle, *, timeout_s: float) -> KVServiceAPI:
    """A ``KVServiceAPI`` over the actor (see ``ServiceClient``)."""
    return cast(KVServiceAPI, ServiceClient(handle, timeout_s=timeout_s))


class EpochWatcher:
    """An engine host's link to the service: sends its ledger to each new epoch.

    ``lookup`` finds the service (None until an ingress created it); ``report`` is the
    host's ledger report; ``stats`` the engine's counters, sent with each heartbeat so
    that the service can sum every replica's (a deployment handle reaches one replica).
    Each call is bounded by ``timeout_s``; the ledger goes in pages of about
    ``page_bytes``. With ``reads`` (the kept blocks its engine read since the last call)
    and ``peers_read`` (its engine frees blocks peers read), each beat also passes reads
    to their holders (``peer_reads``): for engines that cannot see their peers' reads.
    With ``kept`` (a decode host's ledger), each beat then asks about the entries past
    their grace and sends those no hand-over booked to be drained (``check_kept``).
    ``booked`` is told, with each beat of an epoch this host has reported to, the blocks
    the service books on its engine (``Beat.kept_blocks``).
    """

    def __init__(
        self,
        lookup: Callable[[], ActorHandle | None],
        report: Callable[[], LedgerReport],
        *,
        period_s: float = TICK_S,
        engine_id: str | None = None,
        node_ids: Sequence[str] = (),
        stats: Callable[[], dict[str, Any]] | None = None,
        timeout_s: float = 10.0,
        page_bytes: int = 4 * 2**20,
        reads: Callable[[], list[tuple[str, str]]] | None = None,
        peers_read: Callable[[list[str]], Awaitable[None]] | None = None,
        kept: KeptLedger | None = None,
        booked: Callable[[int], None] | None = None,
    ) -> None:
        self.kept = kept
        self.booked = booked
        self.reads = reads
        self.peers_read = peers_read
        self._unsent_reads: list[tuple[str, str]] = []
        self.page_bytes = page_bytes
        self.stats = stats
        self.timeout_s = timeout_s
        self.lookup = lookup
        self.report = report
        self.period_s = period_s
        self.engine_id = engine_id
        self.node_ids = list(node_ids)
        self.reported_epoch: str | None = None

    async def check_once(self) -> bool:
        """Report if the service has a new epoch; True when a report was sent. With
        ``engine_id`` the check is also the engine's heartbeat. The lookup (a GCS call)
        runs off the host's event loop, within ``timeout_s`` (``CallTimedOut`` past it)."""
        handle = await call_within_async(self.lookup, self.timeout_s, "the KV service's lookup")
        if handle is None:
            return False
        if self.engine_id is None:
            epoch = await asyncio.wait_for(handle.epoch.remote(), self.timeout_s)
        else:
            stats = None if self.stats is None else self.stats()
            call = handle.heartbeat.remote(self.engine_id, self.node_ids, stats)
            beat: Beat = await asyncio.wait_for(call, self.timeout_s)
            epoch = beat.epoch
            if self.booked is not None and epoch == self.reported_epoch:
                # (A new epoch books this engine's KV from the ledger reported below.)
                self.booked(beat.kept_blocks)
        if self.engine_id is not None and self.reads is not None and self.peers_read:
            self._unsent_reads += self.reads()
            freed = await asyncio.wait_for(
                handle.peer_reads.remote(self.engine_id, self._unsent_reads), self.timeout_s
            )
            self._unsent_reads = []  # sent: not again (a failed call keeps them)
            if freed:
                await self.peers_read(freed)
        reported = bool(epoch != self.reported_epoch)
        if reported:
            for page in self.report().pages(self.page_bytes):
                await asyncio.wait_for(handle.restore.remote(page), self.timeout_s)
            self.reported_epoch = epoch
        if self.kept is not None:
            await check_kept(handle, self.kept, self.timeout_s)
        return reported

    async def run_forever(self) -> None:
        while True:
            try:
                await self.check_once()
            except Exception as exc:  # the service is restarting: try again next period
                log.info("KV service not reachable: %s", exc)
            await asyncio.sleep(self.period_s)


def lookup_service(app_name: str) -> ActorHandle | None:
    try:
        return ray.get_actor(service_name(app_name), namespace=SERVICE_NAMESPACE)
    except ValueError:
        return None


def lookup_app_host_stores(app_name: str) -> list[ActorHandle]:
    """The application's host-tier stores that run (one per node that evicted)."""
    names = app_store_names(host_store_prefix(app_name), SERVICE_NAMESPACE)
    handles = (lookup_host_store(name, SERVICE_NAMESPACE) for name in names)
    return [h for h in handles if h is not None]
