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
import logging
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.serve.handle import DeploymentHandle

from orchestrator.cluster.handle_pool import HandlePool
from orchestrator.cluster.ray_nodes import read_ray_nodes
from orchestrator.config import ObservabilityConfig
from orchestrator.kv.messages import LedgerReport, SessionInfo, SessionPrefix, TurnDone, TurnPlan
from orchestrator.kv.ownership import Principal
from orchestrator.kv.replay import Replay
from orchestrator.kv.service import KVService
from orchestrator.observability.metrics import make_metrics
from policies.kv_lifecycle import KVLifecycleConfig

__all__ = [
    "SERVICE_NAMESPACE",
    "EpochWatcher",
    "KVServiceActor",
    "ServiceClient",
    "get_or_create_service",
    "service_name",
]

log = logging.getLogger("kvtide.kv_service")

SERVICE_NAMESPACE = "kvtide"
TICK_S = 1.0
NODE_CHECK_TICKS = 5
"""The service reads Ray's node table every this many ticks."""


def service_name(app_name: str) -> str:
    return f"kvtide-kv-{app_name or 'default'}"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class KVServiceActor:
    def __init__(
        self,
        config: KVLifecycleConfig,
        prefill: DeploymentHandle | Sequence[DeploymentHandle] | None,
        drain_timeout_s: float,
        num_prefill_engines: int,
        observability: ObservabilityConfig | None = None,
    ) -> None:
        self.metrics = make_metrics(observability)
        self._num_expiries = 0
        self._engines_seen: set[str] = set()
        self.service = KVService(
            config,
            prefill=None if prefill is None else HandlePool(prefill),  # None: no drains
            drain_timeout_s=drain_timeout_s,
            num_prefill_engines=num_prefill_engines,
        )
        self._ticker: asyncio.Task[None] | None = None

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
                    self._check_nodes()
                await self.service.tick()
                self._export_metrics()
            except Exception:  # keep ticking: one bad effect must not stop expiry
                log.exception("KV service tick failed")

    def _check_nodes(self) -> None:
        """Engines on nodes Ray reports dead are lost (sooner than their silence)."""
        nodes = {n for engine_nodes in self.service.engine_nodes().values() for n in engine_nodes}
        if not nodes:
            return
        dead = {n.node_id for n in read_ray_nodes(alive_only=False) if not n.alive} & nodes
        lost = self.service.nodes_lost(dead)
        if lost:
            log.warning("engines lost with nodes %s: %s", sorted(dead), lost)

    def _export_metrics(self) -> None:
        lifecycle = self.service.planner.lifecycle
        self.metrics.set_sessions_live(lifecycle.num_sessions())
        for engine_id in {r.engine_id for r in lifecycle.records()} | self._engines_seen:
            self.metrics.set_bytes_held(engine_id, lifecycle.bytes_held(engine_id))
            self._engines_seen.add(engine_id)
        expiries = lifecycle.stats().num_expiries
        if expiries > self._num_expiries:
            self.metrics.inc("kvtide_kv_expiries_total", expiries - self._num_expiries)
        self._num_expiries = expiries

    async def epoch(self) -> str:
        return self._tick_started().epoch

    async def heartbeat(self, engine_id: str, node_ids: list[str]) -> str:
        return self._tick_started().heartbeat(engine_id, node_ids)

    async def engines_lost(self, engine_ids: list[str]) -> int:
        return self._tick_started().engines_lost(engine_ids)

    async def session_prefix(
        self, session_id: str, principal: Principal | None = None
    ) -> SessionPrefix:
        return await self._tick_started().session_prefix(session_id, principal)

    async def session_owned(self, session_id: str, principal: Principal) -> bool:
        return await self._tick_started().session_owned(session_id, principal)

    async def claim_session(self, session_id: str, principal: Principal) -> bool:
        return await self._tick_started().claim_session(session_id, principal)

    async def plan_turn(self, session_id: str, prompt_token_ids: list[int]) -> TurnPlan:
        return await self._tick_started().plan_turn(session_id, prompt_token_ids)

    async def pull_failed(self, session_id: str) -> None:
        await self._tick_started().pull_failed(session_id)

    async def turn_done(self, done: TurnDone) -> None:
        await self._tick_started().turn_done(done)

    async def turn_abandoned(self, session_id: str | None) -> None:
        await self._tick_started().turn_abandoned(session_id)

    async def session(self, session_id: str) -> SessionInfo:
        return await self._tick_started().session(session_id)

    async def renew(self, session_id: str) -> SessionInfo:
        return await self._tick_started().renew(session_id)

    async def close(self, session_id: str) -> bool:
        return await self._tick_started().close(session_id)

    async def restore(self, report: LedgerReport) -> None:
        await self._tick_started().restore(report)

    async def replay_begin(self, key: str) -> Replay:
        return await self._tick_started().replay_begin(key)

    async def replay_complete(self, key: str, body: dict[str, Any]) -> None:
        await self._tick_started().replay_complete(key, body)

    async def replay_fail(self, key: str) -> None:
        await self._tick_started().replay_fail(key)

    async def stats(self) -> dict[str, Any]:
        return {**await self._tick_started().stats(), "metrics": self.metrics.snapshot()}

    async def wait_drains(self) -> None:
        await self.service.wait_drains()


def get_or_create_service(
    app_name: str,
    config: KVLifecycleConfig,
    prefill: DeploymentHandle | Sequence[DeploymentHandle],
    *,
    drain_timeout_s: float,
    num_prefill_engines: int,
    observability: ObservabilityConfig | None = None,
) -> ActorHandle:
    """The application's service actor; the first caller creates it."""
    return KVServiceActor.options(  # type: ignore[attr-defined,no-any-return]
        name=service_name(app_name),
        namespace=SERVICE_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
    ).remote(config, prefill, drain_timeout_s, num_prefill_engines, observability)


class ServiceClient:
    """The router's side of the service (``KVServiceAPI`` over an actor handle)."""

    def __init__(self, handle: ActorHandle) -> None:
        self.handle = handle

    async def session_prefix(
        self, session_id: str, principal: Principal | None = None
    ) -> SessionPrefix:
        result: SessionPrefix = await self.handle.session_prefix.remote(session_id, principal)
        return result

    async def session_owned(self, session_id: str, principal: Principal) -> bool:
        result: bool = await self.handle.session_owned.remote(session_id, principal)
        return result

    async def claim_session(self, session_id: str, principal: Principal) -> bool:
        result: bool = await self.handle.claim_session.remote(session_id, principal)
        return result

    async def plan_turn(self, session_id: str, prompt_token_ids: list[int]) -> TurnPlan:
        result: TurnPlan = await self.handle.plan_turn.remote(session_id, prompt_token_ids)
        return result

    async def pull_failed(self, session_id: str) -> None:
        await self.handle.pull_failed.remote(session_id)

    async def turn_done(self, done: TurnDone) -> None:
        await self.handle.turn_done.remote(done)

    async def turn_abandoned(self, session_id: str | None) -> None:
        await self.handle.turn_abandoned.remote(session_id)

    async def session(self, session_id: str) -> SessionInfo:
        result: SessionInfo = await self.handle.session.remote(session_id)
        return result

    async def renew(self, session_id: str) -> SessionInfo:
        result: SessionInfo = await self.handle.renew.remote(session_id)
        return result

    async def close(self, session_id: str) -> bool:
        result: bool = await self.handle.close.remote(session_id)
        return result

    async def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.handle.stats.remote()
        return result

    async def replay_begin(self, key: str) -> Replay:
        result: Replay = await self.handle.replay_begin.remote(key)
        return result

    async def replay_complete(self, key: str, body: dict[str, Any]) -> None:
        await self.handle.replay_complete.remote(key, body)

    async def replay_fail(self, key: str) -> None:
        await self.handle.replay_fail.remote(key)


class EpochWatcher:
    """An engine host's link to the service: sends its ledger to each new epoch.

    ``lookup`` finds the service (None until an ingress created it); ``report`` is the
    host's ledger report.
    """

    def __init__(
        self,
        lookup: Callable[[], ActorHandle | None],
        report: Callable[[], LedgerReport],
        *,
        period_s: float = TICK_S,
        engine_id: str | None = None,
        node_ids: Sequence[str] = (),
    ) -> None:
        self.lookup = lookup
        self.report = report
        self.period_s = period_s
        self.engine_id = engine_id
        self.node_ids = list(node_ids)
        self.reported_epoch: str | None = None

    async def check_once(self) -> bool:
        """Report if the service has a new epoch; True when a report was sent. With
        ``engine_id`` the check is also the engine's heartbeat."""
        handle = self.lookup()
        if handle is None:
            return False
        if self.engine_id is None:
            epoch = await handle.epoch.remote()
        else:
            epoch = await handle.heartbeat.remote(self.engine_id, self.node_ids)
        if epoch == self.reported_epoch:
            return False
        await handle.restore.remote(self.report())
        self.reported_epoch = epoch
        return True

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
