"""An engine pool as a Ray Serve deployment: each replica hosts one engine in-process.

The replica is the engine's Ray actor (as in Ray Serve LLM). It picks a free NIXL
side-channel port for its engine (several replicas can share a host), starts the engine
in its async constructor, and exposes the engine interface as deployment methods:
``generate`` streams (call it with ``handle.options(stream=True)``), the rest are unary.
Serve calls ``check_health`` periodically and replaces a replica whose engine died.

A new vLLM decode replica first runs one throw-away turn, and its send-back, with each
prefill deployment (``orchestrator.serve.warm_up``), so that NIXL's handshakes are made
before users' turns need them. With ``kv.extend`` on it then times its own prefill
(``measure_prefill``), follows it as it serves (``orchestrator.serve.prefill_meter``)
and reports the time per token with its load each second.

Each host also keeps its half of the KV ledger (``orchestrator.serve.ledger``: the blocks a
decode engine kept, the kept blocks a prefill engine read) and sends it to the KV
lifecycle service whenever the service (re)starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from engines.base import EngineInfo, EngineSpec, EngineStats, GenerateChunk, GenerateRequest
from engines.registry import create_engine
from orchestrator.autoscale.load_meter import LoadMeter
from orchestrator.autoscale.options import autoscaling_options
from orchestrator.cluster.deadlines import GCS_TIMEOUT_S, call_within_async
from orchestrator.cluster.kv_events import forget_endpoint, register_endpoint
from orchestrator.cluster.placed_engine import ray_executor_spec, with_cluster_address
from orchestrator.cluster.pool_layout import PoolDeployment, pool_deployment_name
from orchestrator.cluster.ports import free_port
from orchestrator.cluster.prefix_router import prefill_router_config
from orchestrator.cluster.step_router import step_router_config
from orchestrator.cluster.step_streams import StepOutboxes, StepsOpen
from orchestrator.config import KVTideConfig
from orchestrator.config.server import internal_address
from orchestrator.kv.actor import EpochWatcher, lookup_service, service_client
from orchestrator.observability.logs import route_kvtide_logs
from orchestrator.serve.coalesce import coalesce
from orchestrator.serve.hand_offs import hand_offs_read
from orchestrator.serve.ledger import EngineLedger
from orchestrator.serve.prefill_meter import ChunkSetter, PrefillMeter
from orchestrator.serve.warm_up import (
    WarmUp,
    measure_prefill,
    warm_up_prompt_tokens,
    warm_up_transfers,
)

__all__ = ["EngineHost", "deployment_name", "engine_deployment_options", "heartbeat_stats"]

log = logging.getLogger("kvtide.engine")


def engine_deployment_options(
    config: KVTideConfig, pool_name: str, deployment: PoolDeployment | None = None
) -> dict[str, Any]:
    """Serve deployment options of a pool, or of one of its domain deployments (pure;
    tested without a cluster). Pinned to a domain, the replica sits in bundle 0 of its
    placement group (see ``orchestrator.cluster.pool_layout``)."""
    pool = config.pool(pool_name)
    pinned = deployment is not None and deployment.domain_id is not None
    actor: dict[str, Any]
    if pinned:
        assert deployment is not None
        placement = deployment.serve_options(pool, config.placement.num_cpus_per_shard)
        gpus = 1.0 if pool.tensor_parallel_size == 1 else 0.0
        actor = {"num_cpus": pool.num_cpus, "num_gpus": gpus}
        if uses_ray_executor(config, pool_name, deployment.domain_id):
            # vLLM hands the host's runtime env to its TP workers, which need the
            # engine's variables (on CPU, the platform plugin's) before vLLM starts.
            spec = host_engine_spec(config, pool_name, deployment.domain_id, "env", 0)
            if spec.env:
                actor["runtime_env"] = {"env_vars": dict(spec.env)}
    else:
        placement = {}
        actor = {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus}
    routing: dict[str, Any] = {}
    if pool.role == "prefill" and config.routing.prefix_aware:
        # Each handle's router sends a prompt where its prefix was computed.
        routing["request_router_config"] = prefill_router_config(
            config.routing.prefix_settings(), kv_events=publishes_kv_events(config, pool_name)
        )
    elif pool.role == "decode" and config.server.step_streams:
        # Each ingress's step stream reaches the replica it names.
        routing["request_router_config"] = step_router_config()
    scaling = autoscaling_options(config, pool_name)
    size: dict[str, Any] = (
        {"autoscaling_config": scaling}
        if scaling is not None
        else {
            "num_replicas": deployment.num_replicas if deployment is not None else pool.num_engines
        }
    )
    return {
        "name": deployment.name if deployment is not None else deployment_name(pool_name),
        **size,
        # (A step stream takes one of these per ingress replica: twice the engine's
        # batch leaves room.)
        "max_ongoing_requests": max(8, pool.max_num_seqs * 2),
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
        "graceful_shutdown_timeout_s": _graceful_shutdown_s(config, pool_name),
        "ray_actor_options": actor,
        **placement,
        **routing,
    }


def _graceful_shutdown_s(config: KVTideConfig, pool_name: str) -> float:
    """How long Serve gives a stopping replica: 5 s; a decode replica (a scale-in, a
    redeploy, a removal), its in-flight turns' deadline and the move of its sessions' KV
    to the host tier (``EngineHost.__del__``). The ingresses end their standing step
    streams to it once their requests there are done (``step_streams.replicas_gone``),
    so the drain ends with them. An autoscaled prefill replica: 5 s and the lease of the
    prompts' KV it keeps for decode, which it waits for decode to read
    (``orchestrator.serve.hand_offs``)."""
    pool = config.pool(pool_name)
    if pool.role == "prefill" and autoscaling_options(config, pool_name) is None:
        return 5.0
    if pool.role != "decode":
        return 5.0 + config.kv.prefill_lease_s
    return config.server.request_timeout_s + config.kv.service_timeout_s + 5.0


def uses_ray_executor(config: KVTideConfig, pool_name: str, domain_id: str | None) -> bool:
    """Whether an engine of the pool runs its TP workers as Ray actors in its replica's
    placement group: vLLM engines with TP > 1 in a domain-pinned deployment."""
    pool = config.pool(pool_name)
    return domain_id is not None and pool.tensor_parallel_size > 1 and config.backend == "vllm"


def publishes_kv_events(config: KVTideConfig, pool_name: str) -> bool:
    """Whether the pool's engines publish their KV cache events for the prefix router:
    vLLM prefill engines with prefix-aware routing and ``routing.prefix_kv_events``."""
    pool = config.pool(pool_name)
    routing = config.routing
    return (
        pool.role == "prefill"
        and config.backend == "vllm"
        and routing.prefix_aware
        and routing.prefix_kv_events
    )


def host_engine_spec(
    config: KVTideConfig,
    pool_name: str,
    domain_id: str | None,
    engine_id: str,
    port: int,
    host: str = "127.0.0.1",
    gcs_address: str | None = None,
    kv_events_port: int | None = None,
) -> EngineSpec:
    """The spec of the engine a replica of the pool's deployment hosts (pure): its NIXL
    side channel on ``host:port``; with TP workers as Ray actors, the cluster at
    ``gcs_address`` for vLLM's engine core to join; its KV cache events published on
    ``host:kv_events_port`` when given."""
    pool = config.pool(pool_name)
    spec = config.engine_spec(pool, engine_id, side_channel_port=port, side_channel_host=host)
    if kv_events_port is not None:
        spec = dataclasses.replace(spec, kv_events_host=host, kv_events_port=kv_events_port)
    if uses_ray_executor(config, pool_name, domain_id):
        # vLLM takes this replica's placement group and puts a worker in each GPU bundle.
        spec = ray_executor_spec(spec, spec.tensor_parallel_size)
        if gcs_address is not None:
            spec = with_cluster_address(spec, gcs_address)
    return spec


def heartbeat_stats(
    stats: EngineStats, prefill_s_per_token: float | None, prefill_chunk_tokens: int | None = None
) -> dict[str, Any]:
    """What a host's heartbeat tells the KV service: the engine's counters, its prefill
    time per token, if it measured one (``measure_prefill`` at start, followed as it
    serves: ``orchestrator.serve.prefill_meter``), and the prefill chunk it runs, if any."""
    beat: dict[str, Any] = msgspec.to_builtins(stats)
    if prefill_s_per_token is not None:
        beat["prefill_s_per_token"] = prefill_s_per_token
    if prefill_chunk_tokens is not None:
        beat["prefill_chunk_tokens"] = prefill_chunk_tokens
    return beat


def deployment_name(pool_name: str) -> str:
    """``prefill-pool``, ``decode-pool``, ``decode-long-pool``."""
    return pool_deployment_name(pool_name)


@serve.deployment
class EngineHost:
    """One engine of a pool. Constructed by Serve with the kvtide config, the pool's
    config section name (``prefill``, ``decode`` or ``decode_long``) and the NVLink
    domain its deployment is pinned to (``None``: placed by Serve alone)."""

    async def __init__(
        self,
        config: KVTideConfig,
        pool_name: str,
        domain_id: str | None = None,
        warm_with: Sequence[DeploymentHandle] = (),
    ) -> None:
        route_kvtide_logs()
        started_s = time.monotonic()
        pool = config.pool(pool_name)
        role = pool.role
        ctx = serve.get_replica_context()
        engine_id = f"{pool_name}-{ctx.replica_id.unique_id}"
        # The engine's NIXL side channel and KV-event publisher listen on
        # server.internal_host: loopback on one node; with 'node', the address Ray knows
        # this host by, which peers on other hosts dial.
        host = internal_address(config.server.internal_host, ray.util.get_node_ip_address())
        gcs_address = ray.get_runtime_context().gcs_address
        port = free_port(host)
        events_port = None
        while publishes_kv_events(config, pool_name) and events_port in (None, port):
            events_port = free_port(host)
        self._events_replica = None if events_port is None else ctx.replica_id.unique_id
        self._retire: tuple[str, float, str] | None = None  # set once the engine runs
        self._hand_offs_within_s: float | None = None
        spec = host_engine_spec(
            config, pool_name, domain_id, engine_id, port, host, gcs_address, events_port
        )
        if events_port is not None:
            # The prefix routers find the engine's events here (a SUB socket may connect
            # before the engine binds: ZMQ retries).
            register_endpoint(ctx.replica_id.unique_id, f"tcp://{host}:{events_port}")
        self.domain_id = domain_id
        self._chunk_tokens = config.server.stream_chunk_tokens
        self._chunk_window_s = config.server.stream_chunk_window_ms / 1000
        self._warm_ups: dict[str, WarmUp] = {}
        # Chunks no step stream read wait at most a request's deadline.
        self._outboxes = StepOutboxes(
            ctx.replica_id.unique_id, unread_ttl_s=config.server.request_timeout_s
        )
        self.engine = create_engine(spec)
        self._info: EngineInfo = await self.engine.start()
        log.info("engine %s ready: %s", engine_id, self._info)
        self._role = role
        self.load = LoadMeter(clock=time.monotonic, engine_start_s=time.monotonic() - started_s)
        if role == "decode":
            # However Serve stops it (a scale-in, a redeploy, a removal), this host has
            # the KV service move its sessions' KV to the host tier before the engine
            # stops (``__del__``); only an autoscaled pool's replica is scaled in.
            scaled = autoscaling_options(config, pool_name) is not None
            reason = "scaled_in" if scaled else "replaced"
            self._retire = (ctx.app_name, config.kv.service_timeout_s, reason)
        if role == "prefill" and autoscaling_options(config, pool_name) is not None:
            # Stopped by a scale-in, this host keeps its engine until decode has read
            # the prompts' KV it keeps, within their lease (``__del__``).
            self._hand_offs_within_s = float(config.kv.prefill_lease_s)
        if warm_with and role == "decode" and config.kv.warm_up and config.backend == "vllm":
            tokens = warm_up_prompt_tokens(
                self._info.block_size, config.kv.kv_recompute_threshold_tokens
            )
            await self._warm_up(
                engine_id,
                warm_with,
                tokens,
                config.kv.pull_timeout_s,
                prompt_logprobs=config.kv.integrity_sample_fraction > 0,
            )
        # Its own prefill time per token, for the cost of extending a turn here:
        # measured now, then followed as it serves (``PrefillMeter``).
        calibrated: float | None = None
        kv = config.kv
        if role == "decode" and config.backend == "vllm" and kv.extend and kv.per_request_keep:
            calibrated = await measure_prefill(
                self.engine.generate,
                name=engine_id,
                num_prompt_tokens=warm_up_prompt_tokens(
                    self._info.block_size, kv.kv_recompute_threshold_tokens
                ),
                vocab_size=self._info.vocab_size,
                timeout_s=kv.pull_timeout_s,
            )
            log.info("engine %s prefills %s s per token", engine_id, calibrated)
        # The chunk of its in-place prefills, fitted to the ITL budget at its own cost.
        self._prefill = PrefillMeter(
            calibrated,
            chunk_tokens=dict(spec.extra_engine_args).get("long_prefill_token_threshold"),
            itl_budget_s=kv.extend_itl_budget_ms / 1000,
            setter=ChunkSetter(self.engine.generate, name=engine_id, timeout_s=kv.pull_timeout_s),
        )
        await self._prefill.fit()
        self.ledger = EngineLedger(
            engine_id=engine_id,
            role=role,
            ttl_s=config.kv.decoder_kv_blocks_ttl_s,
            clock=time.monotonic,
            check_grace_s=config.kv.kept_check_grace_s if role == "decode" else None,
        )
        app = ctx.app_name
        where = self.placement()
        shard_nodes = {b["node_id"] for b in where["bundles"] if b["node_id"]}
        watcher = EpochWatcher(
            lambda: lookup_service(app),
            self.ledger.report,
            engine_id=self._info.engine_id,
            node_ids=sorted(shard_nodes | {where["node_id"]}),
            stats=self._heartbeat_stats,
            timeout_s=config.kv.service_timeout_s,
            # Simulated engines see no reads of their kept blocks from other processes:
            # the reader's host passes them on through the service.
            reads=self.ledger.take_reads if config.backend == "simulated" else None,
            peers_read=self.engine.peers_read,
            kept=self.ledger if role == "decode" else None,
            booked=self.ledger.booked if role == "decode" else None,
        )
        self._watcher = asyncio.get_running_loop().create_task(watcher.run_forever())

    def _heartbeat_stats(self) -> dict[str, Any]:
        meter = self._prefill
        return heartbeat_stats(self.engine.stats(), meter.s_per_token, meter.chunk_tokens)

    async def _warm_up(
        self,
        engine_id: str,
        prefill: Sequence[DeploymentHandle],
        num_prompt_tokens: int,
        step_timeout_s: float,
        *,
        prompt_logprobs: bool,
    ) -> None:
        """One turn and its send-back with each prefill deployment before this decode
        engine takes traffic (``orchestrator.serve.warm_up``), all at once: a pool placed
        over many domains has a prefill deployment per domain. ``prompt_logprobs``: the
        prefill's prompt log probabilities too (the KV integrity check's request)."""
        streams = [handle.options(stream=True) for handle in prefill]
        results = await asyncio.gather(
            *(
                warm_up_transfers(
                    self.engine.generate,
                    stream.generate.remote,
                    name=f"{engine_id}-{index}",
                    num_prompt_tokens=num_prompt_tokens,
                    vocab_size=self._info.vocab_size,
                    step_timeout_s=step_timeout_s,
                    prompt_logprobs=prompt_logprobs,
                )
                for index, stream in enumerate(streams)
            )
        )
        for handle, result in zip(prefill, results, strict=True):
            self._warm_ups[handle.deployment_name] = result
            (log.info if result.sent_back else log.warning)(
                "engine %s warm-up with %s: %s", engine_id, handle.deployment_name, result
            )

    def warm_ups(self) -> dict[str, dict[str, Any]]:
        """How this decode engine's warm-up went with each prefill deployment (empty
        when it ran none: a prefill engine, ``kv.warm_up`` off, simulated engines)."""
        return {name: dataclasses.asdict(result) for name, result in self._warm_ups.items()}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The request's stream: each engine output as it is made, or, with
        ``server.stream_chunk_window_ms`` above 0, tokens held back into chunks of up to
        ``stream_chunk_tokens`` (``orchestrator.serve.coalesce``)."""
        async with contextlib.aclosing(self._stream(request)) as stream:
            async for chunk in stream:
                yield chunk

    async def generate_stepped(self, request: GenerateRequest, caller: str) -> AsyncIterator[str]:
        """The request runs as with ``generate``, but its chunks travel on ``caller``'s
        step stream to this replica (``steps``); this call answers with the replica's
        id and ends with the request (``orchestrator.cluster.step_streams``)."""
        run = self._outboxes.run_request(caller, self._stream(request))
        async with contextlib.aclosing(run):  # closed with this call: the request ends
            async for replica in run:
                yield replica

    async def steps(self, opened: StepsOpen) -> AsyncIterator[str | bytes]:
        """``opened.caller``'s step stream: this replica's id, then one message per
        engine step with the new chunks of every request of that caller."""
        async with contextlib.aclosing(self._outboxes.run_steps(opened)) as steps:
            async for item in steps:
                yield item

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        prompt = len(request.prompt_token_ids) if self._role == "prefill" else 0
        self.load.prompt_taken(prompt)
        try:
            async with contextlib.aclosing(self._engine_stream(request)) as stream:
                async for chunk in stream:
                    yield chunk
        finally:
            self.load.prompt_done(prompt)

    async def _engine_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        stream = coalesce(
            self.ledger.watch(request, self.engine.generate(request)),
            max_tokens=self._chunk_tokens,
            window_s=self._chunk_window_s,
        )
        try:
            async for chunk in stream:
                if chunk.finished:  # which engine ran it, for the turn's report
                    chunk = msgspec.structs.replace(chunk, engine_id=self._info.engine_id)
                    self._prefill.record(request, chunk)
                yield chunk
        finally:
            await stream.aclose()  # a caller gone mid-stream: the engine's request ends

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def info(self) -> EngineInfo:
        return self._info

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """This engine's load for Serve's autoscaler (``orchestrator.autoscale``); on the
        replica's event loop, where the ledger and the meter are kept."""
        kept = self.ledger.num_kept_blocks() if self._role == "decode" else 0
        return self.load.report(
            self.engine.stats(), num_kv_blocks=self._info.num_kv_blocks, kv_blocks_kept=kept
        )

    def placement(self) -> dict[str, Any]:
        """Where this engine runs, from Ray's own tables: the replica's node and each
        bundle of its placement group (bundle 0 is the host; with TP > 1 the others are
        the TP ranks' GPUs). ``bundles`` is empty when the replica has no group."""
        from ray.util.placement_group import get_current_placement_group, placement_group_table

        group = get_current_placement_group()
        bundles: list[dict[str, Any]] = []
        if group is not None:
            table = placement_group_table(group)
            for index, resources in sorted(table["bundles"].items()):
                node_id = table["bundles_to_node_id"].get(index)
                bundles.append({"index": index, "node_id": node_id, "resources": resources})
        return {
            "engine_id": self._info.engine_id,
            "pid": os.getpid(),  # the host's process (vLLM's engine core is its child)
            "domain_id": self.domain_id,
            "node_id": ray.get_runtime_context().get_node_id(),
            "group_id": None if group is None else group.id.hex(),
            "bundles": bundles,
        }

    async def _move_sessions(self, app: str, timeout_s: float, reason: str) -> None:
        """Before the engine stops: the KV service moves the KV of the sessions it kept
        to the host tier (``KVService.retire_engine``), within ``timeout_s``; the
        sessions it could not move recompute their next turn (``reason``: ``scaled_in``
        or ``replaced``)."""
        engine_id = self._info.engine_id
        try:
            handle = await call_within_async(
                lambda: lookup_service(app), GCS_TIMEOUT_S, "the KV service's lookup"
            )
            if handle is None:
                return
            service = service_client(handle, timeout_s=timeout_s)
            moved = await service.retire_engine(engine_id, reason)
            log.info("engine %s %s: %s", engine_id, reason.replace("_", " "), moved)
        except Exception as exc:  # the engine stops anyway: its sessions recompute
            how = reason.replace("_", " ")
            log.warning("engine %s %s without moving its sessions: %s", engine_id, how, exc)

    async def check_health(self) -> None:
        health = await self.engine.health()
        if not health.healthy:
            raise RuntimeError(f"engine {health.engine_id} unhealthy: {health.detail}")

    async def _wait_hand_offs(self, within_s: float) -> None:
        """Before the engine stops: decode engines read the prompts' KV it keeps for
        them (``orchestrator.serve.hand_offs``), within ``within_s``."""
        engine_id = self.engine.info().engine_id
        started_s = time.monotonic()
        read = await hand_offs_read(
            self.engine.stats, within_s=within_s, clock=time.monotonic, sleep=asyncio.sleep
        )
        waited_s = time.monotonic() - started_s
        if read:
            log.info("engine %s scaled in: its KV read by decode in %.1f s", engine_id, waited_s)
        else:
            log.warning("engine %s scaled in with KV unread after %.1f s", engine_id, waited_s)

    async def __del__(self) -> None:
        if self._retire is not None:
            await self._move_sessions(*self._retire)
        if self._hand_offs_within_s is not None:
            await self._wait_hand_offs(self._hand_offs_within_s)
        if self._events_replica is not None:
            with contextlib.suppress(Exception):  # the cluster may be going down too
                forget_endpoint(self._events_replica)
        await self.engine.shutdown()
