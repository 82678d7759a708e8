"""An engine pool as a Ray Serve deployment: each replica hosts one engine in-process.

The replica is the engine's Ray actor (as in Ray Serve LLM). It picks a free NIXL
side-channel port for its engine (several replicas can share a host), starts the engine
in its async constructor, and exposes the engine interface as deployment methods:
``generate`` streams (call it with ``handle.options(stream=True)``), the rest are unary.
Serve calls ``check_health`` periodically and replaces a replica whose engine died.

Each host also keeps its half of the KV ledger (``orchestrator.kv_ledger``: the blocks a
decode engine kept, the kept blocks a prefill engine read) and sends it to the KV
lifecycle service whenever the service (re)starts.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from engines.base import EngineInfo, EngineStats, GenerateChunk, GenerateRequest
from engines.registry import create_engine
from orchestrator.config import KVTideConfig
from orchestrator.kv_ledger import EngineLedger
from orchestrator.kv_service_actor import EpochWatcher, lookup_service

__all__ = ["EngineHost", "deployment_name", "engine_deployment_options", "free_port"]

log = logging.getLogger("kvtide.engine")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now on ``host`` (the engine binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def engine_deployment_options(config: KVTideConfig, pool_name: str) -> dict[str, Any]:
    """Serve deployment options of a pool (pure; tested without a cluster)."""
    pool = config.pool(pool_name)
    return {
        "name": deployment_name(pool_name),
        "num_replicas": pool.num_engines,
        "max_ongoing_requests": max(8, pool.max_num_seqs * 2),
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
        "graceful_shutdown_timeout_s": 5,
        "ray_actor_options": {
            "num_cpus": pool.num_cpus,
            "num_gpus": pool.num_gpus,
        },
    }


def deployment_name(pool_name: str) -> str:
    """``prefill-pool``, ``decode-pool``, ``decode-long-pool``."""
    return f"{pool_name.replace('_', '-')}-pool"


@serve.deployment
class EngineHost:
    """One engine of a pool. Constructed by Serve with the kvtide config and the pool's
    config section name (``prefill``, ``decode`` or ``decode_long``)."""

    async def __init__(self, config: KVTideConfig, pool_name: str) -> None:
        pool = config.pool(pool_name)
        role = pool.role
        ctx = serve.get_replica_context()
        engine_id = f"{pool_name}-{ctx.replica_id.unique_id}"
        spec = config.engine_spec(pool, engine_id, side_channel_port=free_port())
        self.engine = create_engine(spec)
        self._info: EngineInfo = await self.engine.start()
        log.info("engine %s ready: %s", engine_id, self._info)
        self.ledger = EngineLedger(
            engine_id=engine_id,
            role=role,
            ttl_s=config.kv.decoder_kv_blocks_ttl_s,
            clock=time.monotonic,
        )
        app = ctx.app_name
        watcher = EpochWatcher(lambda: lookup_service(app), self.ledger.report)
        self._watcher = asyncio.get_running_loop().create_task(watcher.run_forever())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        async for chunk in self.ledger.watch(request, self.engine.generate(request)):
            yield chunk

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def info(self) -> EngineInfo:
        return self._info

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def check_health(self) -> None:
        health = await self.engine.health()
        if not health.healthy:
            raise RuntimeError(f"engine {health.engine_id} unhealthy: {health.detail}")

    async def __del__(self) -> None:
        await self.engine.shutdown()
