"""The OpenAI-compatible ingress: a Ray Serve deployment serving a FastAPI app.

It validates and tokenizes requests (so the router sees token ids and the KV decider can
hash prefixes), runs each turn through the ``Router`` (prefill pool → NIXL → decode pool)
and streams SSE back. Errors are OpenAI-style bodies with 4xx/5xx codes; a failed request
leaves no KV record behind.

``Ingress`` is the composition root: it builds the router, the KV service's client and
the parts that serve HTTP, each with what it uses (``RouteGroups``), and serves the app
that includes their routers (``serving_app``; Serve asks for it once the replica is
built, ``__serve_build_asgi_app__``). It also runs the replica's standing calls to the
service (its metrics every second, its turn leases) and hands over at shutdown.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
(``own_layer``), ``/v1/responses`` (``responses_routes``), ``GET /health``,
``/metrics``, ``/kvtide/stats``, ``/kvtide/sessions/{id}``,
``/kvtide/integrity/reuse`` (``operator_views``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from orchestrator.cluster import route_notes
from orchestrator.cluster.handle_pool import HandlePool
from orchestrator.config import KVTideConfig, step_tokens
from orchestrator.errors import RequestError
from orchestrator.kv.actor import get_or_create_service, service_client
from orchestrator.kv.decider import kv_lifecycle_config
from orchestrator.kv.host_tier import host_tier_spec
from orchestrator.kv.service import KVServiceAPI
from orchestrator.kv.session_tokens import SessionTokens
from orchestrator.observability import tracing as tr
from orchestrator.observability.logs import route_kvtide_logs
from orchestrator.observability.metrics import Metrics, make_metrics
from orchestrator.router import Router, RouterSettings
from orchestrator.router.held_leases import WATCH_WAIT_S, HeldLeases
from orchestrator.router.integrity import IntegritySettings
from orchestrator.serve import vllm_api
from orchestrator.serve.admission import AdmissionGate
from orchestrator.serve.auth import Authenticator, ConcurrencyGate
from orchestrator.serve.model_info import kv_bytes_per_token_of
from orchestrator.serve.operator_views import OperatorViews
from orchestrator.serve.own_layer import OwnLayer
from orchestrator.serve.prompts import PromptEncoder
from orchestrator.serve.request_edge import RequestEdge
from orchestrator.serve.request_guard import RequestGuard
from orchestrator.serve.responses import server_error_body
from orchestrator.serve.responses_api import response_book
from orchestrator.serve.responses_routes import ResponsesRoutes
from orchestrator.serve.tool_turns import ToolTurns
from orchestrator.serve.turn_opening import TurnOpener
from orchestrator.serve.vllm_routes import VLLMLayer, VLLMTurns
from policies.kv_cost import ExtendSettings

__all__ = ["Ingress", "RouteGroups", "route_groups", "serving_app"]

log = logging.getLogger("kvtide.ingress")

# Bounds of an ingress replica's copy of its sessions' last turns: past them the oldest
# go (a session whose copy went costs one more service call on its next turn).
SESSION_TOKENS_MAX = 10_000
SESSION_TOKENS_MAX_BYTES = 256 * 2**20


async def _request_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestError)
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers())


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    # The details go to the log only: a body must not carry actor ids, PIDs or paths.
    log.exception("internal error")
    body = server_error_body("internal error; retry the request", "internal_error")
    return JSONResponse(body, status_code=500)


def serving_app(routers: Iterable[APIRouter]) -> FastAPI:
    """The ingress's FastAPI app: ``routers`` included, a ``RequestError`` answered with
    its OpenAI-style body and status, anything else with a 500 that names nothing
    internal; no docs or OpenAPI schema routes."""
    app = FastAPI(title="kvtide", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(Exception, _internal_error)
    for router in routers:
        app.include_router(router)
    return app


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteGroups:
    """The ingress's parts that serve HTTP, each built with what it uses: the request
    edge (key, body, span), the guard (concurrency, Idempotency-Key), the turn opener,
    vLLM's serving layer over kvtide's turns, and the three route groups
    (``routers``)."""

    edge: RequestEdge
    guard: RequestGuard
    opener: TurnOpener
    vllm: VLLMLayer
    own: OwnLayer
    responses: ResponsesRoutes
    operator: OperatorViews

    def routers(self) -> list[APIRouter]:
        return [self.operator.routes, self.own.routes, self.responses.routes]


def route_groups(
    *,
    config: KVTideConfig,
    router: Router,
    kv: KVServiceAPI,
    prompts: PromptEncoder,
    session_tokens: SessionTokens,
    metrics: Metrics,
    gate: ConcurrencyGate,
    admission: AdmissionGate,
    pools: Mapping[str, HandlePool],
    pool_handles: Mapping[str, DeploymentHandle],
) -> RouteGroups:
    """The parts wired together (loads vLLM's serving classes for ``config.model``:
    seconds, off the event loop in a replica)."""
    edge = RequestEdge(config=config, auth=Authenticator(config.server.api_keys), metrics=metrics)
    opener = TurnOpener(
        config=config,
        kv=kv,
        router=router,
        admission=admission,
        metrics=metrics,
        prompts=prompts,
        session_tokens=session_tokens,
    )
    # vLLM's OpenAI serving layer for what kvtide's own does not serve (tools,
    # structured outputs, logprobs, n, ...): its config and tokenizer, no engine.
    turns = VLLMTurns(config=config, router=router, opener=opener)
    serving = vllm_api.build_serving(config.model, turns.run)
    guard = RequestGuard(kv=kv, gate=gate)
    vllm = VLLMLayer(kv=kv, gate=gate, guard=guard, serving=serving, tool_turns=ToolTurns())
    # What vLLM's Responses API stores, bounded in bytes (``responses_api``).
    book = response_book(config, router.clock)
    book.install(serving.responses)
    return RouteGroups(
        edge=edge,
        guard=guard,
        opener=opener,
        vllm=vllm,
        own=OwnLayer(
            config=config,
            kv=kv,
            router=router,
            gate=gate,
            prompts=prompts,
            edge=edge,
            guard=guard,
            opener=opener,
            vllm=vllm,
        ),
        responses=ResponsesRoutes(kv=kv, router=router, edge=edge, vllm=vllm, book=book),
        operator=OperatorViews(
            config=config,
            kv=kv,
            router=router,
            admission=admission,
            pools=pools,
            pool_handles=pool_handles,
            edge=edge,
        ),
    )


@serve.deployment(name="ingress", max_ongoing_requests=256)
@serve.ingress()
class Ingress:
    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        config: KVTideConfig,
        prefill: DeploymentHandle | Sequence[DeploymentHandle],
        decode: DeploymentHandle | Sequence[DeploymentHandle],
        decode_long: DeploymentHandle | Sequence[DeploymentHandle] | None = None,
        weights: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """Each pool is one deployment handle, or one per NVLink domain it is placed in
        (``weights``: each pool's replicas per deployment, for balancing across them)."""
        from transformers import AutoTokenizer  # heavy; only in the ingress replica

        route_kvtide_logs()
        self.config = config
        self.model_path = config.model.resolved_path()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.prompts = PromptEncoder(self.tokenizer, max_model_len=config.model.max_model_len)
        given = {"prefill": prefill, "decode": decode, "decode_long": decode_long}
        self.pools = {
            name: HandlePool(
                handles,
                (weights or {}).get(name),
                steps=name != "prefill" and config.server.step_streams,
            )
            for name, handles in given.items()
            if handles is not None
        }
        # Where /health and /kvtide/stats look: a pool, or a pool's domain deployment.
        self.pool_handles: dict[str, DeploymentHandle] = {}
        for name, pool in self.pools.items():
            for handle in pool.handles:
                label = name if len(pool.handles) == 1 else handle.deployment_name
                self.pool_handles[label] = handle
        prefill_pool, decode_pool = self.pools["prefill"], self.pools["decode"]
        info = await decode_pool.handle.info.remote()
        kv = config.kv
        lifecycle = kv_lifecycle_config(
            ttl_s=kv.decoder_kv_blocks_ttl_s,
            safety_margin_s=kv.safety_margin_s,
            recompute_threshold_tokens=kv.kv_recompute_threshold_tokens,
            kv_bytes_per_token=kv_bytes_per_token_of(self.model_path, config.model.dtype),
            block_size_tokens=info.block_size,
            idle_budget_bytes_per_engine=(
                None
                if kv.idle_budget_mib_per_engine is None
                else int(kv.idle_budget_mib_per_engine * 2**20)
            ),
            # Where admission calls an engine full or stalled, idle sessions make room.
            room_kv_cache_usage=(
                config.admission.max_kv_cache_usage if config.admission.enabled else None
            ),
            room_stall_s=config.admission.stall_s,
        )
        tr.configure_tracing(config.observability)
        self.metrics = make_metrics(config.observability)
        self._kv_events_seen: dict[str, int] = {}
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.kv = service_client(
            get_or_create_service(
                context.app_name,
                lifecycle,
                prefill_pool.handles,
                drain_timeout_s=kv.pull_timeout_s,
                num_prefill_engines=config.prefill.num_engines,
                observability=config.observability,
                replay_max_bytes=int(kv.replay_max_mib * 2**20),
                session_state_max_bytes=int(kv.session_state_max_mib * 2**20),
                running_grace_s=config.server.request_timeout_s,
                timeout_s=kv.service_start_timeout_s,
                turn_lease_s=kv.turn_lease_s,
                host_tier=host_tier_spec(config),
                call_timeout_s=kv.service_timeout_s,
            ),
            timeout_s=kv.service_timeout_s,
        )
        # This replica's copy of the last turn of each session it served (the service
        # holds all of them): a session's next turn is tokenized without asking.
        self.session_tokens = SessionTokens(
            max_sessions=SESSION_TOKENS_MAX,
            ttl_s=kv.decoder_kv_blocks_ttl_s,
            max_bytes=SESSION_TOKENS_MAX_BYTES,
        )
        self.router = Router(
            prefill=prefill_pool,
            decode=decode_pool,
            kv=self.kv,
            settings=RouterSettings(
                pull_timeout_s=kv.pull_timeout_s,
                eos_token_id=self.tokenizer.eos_token_id,
                long_context_threshold_tokens=config.routing.long_context_threshold_tokens,
                block_size_tokens=info.block_size,
                kv_bytes_per_token=lifecycle.kv_bytes_per_token,
                request_timeout_s=config.server.request_timeout_s,
                integrity=IntegritySettings(
                    sample_fraction=kv.integrity_sample_fraction,
                    logprob_tolerance=kv.integrity_logprob_tolerance,
                    num_tokens=kv.integrity_num_tokens,
                    timeout_s=config.server.request_timeout_s,
                    report_timeout_s=kv.service_timeout_s,
                ),
                extend=ExtendSettings(
                    enabled=kv.extend,
                    max_new_tokens=kv.extend_max_new_tokens,
                    itl_budget_s=kv.extend_itl_budget_ms / 1000,
                    decode_prefill_s_per_token=kv.extend_prefill_ms_per_token / 1000,
                    max_kv_cache_usage=kv.extend_max_kv_cache_usage,
                    prefill_queue_waiting=kv.extend_prefill_queue_waiting,
                ),
                decode_max_running=config.decode.max_num_seqs,
                # The chunk kvtide's config gives a decode pool that may extend in place.
                decode_chunk_tokens=step_tokens(
                    config.decode, config.kv, config.backend, config.device
                )[1],
            ),
            decode_long=self.pools.get("decode_long"),
            metrics=self.metrics,
            prefill_routes=route_notes.take if config.routing.prefix_aware else None,
            session_tokens=self.session_tokens,
            clock=time.monotonic,
            # The engines' latest reports, as the admission gate read them this second.
            engine_loads=lambda: [view.load for view in self.admission.book.views()],
            leases=(
                HeldLeases(
                    self.replica_id, time.monotonic, lifecycle=lifecycle, lasts_s=kv.turn_lease_s
                )
                if kv.turn_lease_s > 0
                else None
            ),
        )
        # Per ingress replica: a key's concurrent requests are counted where they run.
        self.gate = ConcurrencyGate(retry_after_s=1.0)
        # Turns a pool cannot take now are refused at once (``policies.admission``).
        self.admission = AdmissionGate(
            config.admission.settings(), pools=list(self.pools), metrics=self.metrics
        )
        self.routes = await asyncio.to_thread(
            route_groups,
            config=config,
            router=self.router,
            kv=self.kv,
            prompts=self.prompts,
            session_tokens=self.session_tokens,
            metrics=self.metrics,
            gate=self.gate,
            admission=self.admission,
            pools=self.pools,
            pool_handles=self.pool_handles,
        )
        # Every replica's metric book goes to the service, which sums them for stats.
        self._reporter = asyncio.get_running_loop().create_task(self._report_metrics_forever())
        self._lease_watch: asyncio.Task[None] | None = None
        if self.router.leases is not None:
            self._lease_watch = asyncio.get_running_loop().create_task(
                self._watch_leases_forever(self.router.leases)
            )
        # Keep the collector from rescanning start-up objects on every pass.
        gc.collect()
        gc.freeze()

    def _count_kv_events(self) -> None:
        """The prefix routers' counts of engine KV events, into this replica's metrics."""
        seen = self._kv_events_seen
        now = route_notes.event_counts()
        for event, total in now.items():
            if total > seen.get(event, 0):
                self.metrics.inc(
                    "kvtide_prefix_kv_events_total", total - seen.get(event, 0), event=event
                )
        self._kv_events_seen = now

    async def _report_metrics_forever(self) -> None:
        while True:
            self._count_kv_events()
            try:
                await self.kv.report_metrics(self.replica_id, self.metrics.snapshot())
                await self.admission.refresh(self.kv)
            except RequestError:  # the service is restarting: next second
                pass
            await asyncio.sleep(1.0)

    async def _watch_leases_forever(self, leases: HeldLeases) -> None:
        """This replica's standing call to the service for its turn leases
        (``orchestrator.kv.turn_leases``): gives back the unused ones it is asked for or
        that ran out, and learns of a restarted service (whose leases are gone)."""
        wait_s = min(WATCH_WAIT_S, self.config.kv.service_timeout_s / 2)
        answers: dict[str, bool] = {}
        while True:
            leases.expire()
            released = leases.take_released()
            try:
                answer = await self.kv.lease_watch(
                    leases.holder, released, wait_s, leases.held_ids(), answers
                )
            except RequestError:  # the service is restarting: again in a second
                leases.requeue(released)
                await asyncio.sleep(1.0)
                continue
            leases.new_epoch(answer.epoch)
            leases.revoke(answer.revoked)
            leases.reuse_off = frozenset(answer.reuse_off)
            # Is this replica's turn of each still generating? Answered with the next call.
            answers = {sid: self.router.generating(sid) for sid in answer.asked}

    async def __del__(self) -> None:
        """Serve's replica shutdown: the turns that finished here reach the service
        (each hand-over is bounded by the service client's deadline), so do the
        integrity mismatches found here (within ``kv.service_timeout_s``), its
        unused turn leases go back to it, and its step streams end."""
        self._reporter.cancel()
        await self.router.settled()
        # A mismatch an integrity check found here still on its way to the service
        # reaches it before the replica goes (its reuse off here goes with the replica).
        timeout_s = self.config.kv.service_timeout_s
        if not await self.router.integrity.reported(timeout_s):
            log.error(
                "shutting down with KV integrity mismatches the service has not heard of "
                "after %g s; reuse from their engines is on again until one is found again",
                timeout_s,
            )
        leases = self.router.leases
        if self._lease_watch is not None and leases is not None:
            self._lease_watch.cancel()
            leases.revoke([lease.lease_id for lease in leases.unused()])
            with contextlib.suppress(RequestError):
                await self.kv.lease_watch(leases.holder, leases.take_released(), 0.0)
        for pool in self.pools.values():
            await pool.close()

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve's call once the replica is built: the app this replica serves."""
        return serving_app(self.routes.routers())
