"""The OpenAI-compatible ingress: a Ray Serve deployment with a FastAPI app.

It validates and tokenizes requests (so the router sees token ids and the KV decider can
hash prefixes), runs each turn through the ``Router`` (prefill pool → NIXL → decode pool)
and streams SSE back. Errors are OpenAI-style bodies with 4xx/5xx codes; a failed request
leaves no KV record behind.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /kvtide/stats`` (KV lifecycle counters and engine counters).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from opentelemetry.trace import Span
from ray import serve
from ray.serve.handle import DeploymentHandle

from orchestrator.cluster import route_notes
from orchestrator.cluster.handle_pool import HandlePool
from orchestrator.config import KVTideConfig
from orchestrator.errors import (
    RequestError,
)
from orchestrator.kv.actor import get_or_create_service, service_client
from orchestrator.kv.decider import kv_lifecycle_config
from orchestrator.kv.host_tier import host_tier_spec
from orchestrator.kv.ownership import Principal
from orchestrator.kv.session_tokens import SessionTokens
from orchestrator.observability import tracing as tr
from orchestrator.observability.metrics import http_status, make_metrics
from orchestrator.router import Router
from orchestrator.router.held_leases import WATCH_WAIT_S, HeldLeases
from orchestrator.router.integrity import IntegritySettings
from orchestrator.serve import openai_api as api
from orchestrator.serve import vllm_api
from orchestrator.serve.admission import AdmissionGate
from orchestrator.serve.auth import Authenticator, ConcurrencyGate
from orchestrator.serve.model_info import kv_bytes_per_token_of
from orchestrator.serve.operator_views import OperatorViews
from orchestrator.serve.own_layer import OwnLayer
from orchestrator.serve.prompts import PromptEncoder
from orchestrator.serve.responses import (
    ending,
    server_error_body,
)
from orchestrator.serve.responses_api import response_book
from orchestrator.serve.responses_routes import ResponsesRoutes
from orchestrator.serve.tool_turns import ToolTurns
from orchestrator.serve.turn_opening import TurnOpening

__all__ = ["Ingress", "fastapi_app"]

log = logging.getLogger("kvtide.ingress")

# Bounds of an ingress replica's copy of its sessions' last turns: past them the oldest
# go (a session whose copy went costs one more service call on its next turn).
SESSION_TOKENS_MAX = 10_000
SESSION_TOKENS_MAX_BYTES = 256 * 2**20

fastapi_app = FastAPI(title="kvtide", docs_url=None, redoc_url=None, openapi_url=None)


@fastapi_app.exception_handler(RequestError)
async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers())


@fastapi_app.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    # The details go to the log only: a body must not carry actor ids, PIDs or paths.
    log.exception("internal error")
    body = server_error_body("internal error; retry the request", "internal_error")
    return JSONResponse(body, status_code=500)


@serve.deployment(name="ingress", max_ongoing_requests=256)
@serve.ingress(fastapi_app)
class Ingress(TurnOpening, OwnLayer, ResponsesRoutes, OperatorViews):
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
            pull_timeout_s=kv.pull_timeout_s,
            eos_token_id=self.tokenizer.eos_token_id,
            decode_long=self.pools.get("decode_long"),
            long_context_threshold_tokens=config.routing.long_context_threshold_tokens,
            metrics=self.metrics,
            block_size_tokens=info.block_size,
            kv_bytes_per_token=lifecycle.kv_bytes_per_token,
            request_timeout_s=config.server.request_timeout_s,
            prefill_routes=route_notes.take if config.routing.prefix_aware else None,
            session_tokens=self.session_tokens,
            clock=time.monotonic,
            leases=(
                HeldLeases(
                    self.replica_id, time.monotonic, lifecycle=lifecycle, lasts_s=kv.turn_lease_s
                )
                if kv.turn_lease_s > 0
                else None
            ),
            integrity=IntegritySettings(
                sample_fraction=kv.integrity_sample_fraction,
                logprob_tolerance=kv.integrity_logprob_tolerance,
                num_tokens=kv.integrity_num_tokens,
                timeout_s=config.server.request_timeout_s,
                report_timeout_s=kv.service_timeout_s,
            ),
        )
        # vLLM's OpenAI serving layer for what kvtide's own does not serve (tools,
        # structured outputs, logprobs, n, ...): its config and tokenizer, no engine.
        self.vllm = await asyncio.to_thread(vllm_api.build_serving, config.model, self._vllm_turn)
        self.tool_turns = ToolTurns()
        # What vLLM's Responses API stores, bounded in bytes (``responses_api``).
        self.response_book = response_book(config, time.monotonic)
        self.response_book.install(self.vllm.responses)
        self.auth = Authenticator(config.server.api_keys)
        # Per ingress replica: a key's concurrent requests are counted where they run.
        self.gate = ConcurrencyGate(retry_after_s=1.0)
        # Turns a pool cannot take now are refused at once (``policies.admission``).
        self.admission = AdmissionGate(
            config.admission.settings(), pools=list(self.pools), metrics=self.metrics
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
        integrity mismatches found here (within ``kv.service_timeout_s``), and its
        unused turn leases go back to it."""
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

    # ---- routes ----------------------------------------------------------------------

    @fastapi_app.get("/health")
    async def health(self) -> JSONResponse:
        return await self._health()

    def _principal(self, http: Request) -> Principal:
        return self.auth.authenticate(http.headers.get("authorization"))

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        self._principal(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": self.config.model.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kvtide",
                    "max_model_len": self.config.model.max_model_len,
                }
            ],
        }

    @fastapi_app.get("/metrics")
    async def prometheus_metrics(self, request: Request) -> PlainTextResponse:
        return await self._prometheus_metrics(request)

    @fastapi_app.get("/kvtide/stats")
    async def stats(self, request: Request) -> dict[str, Any]:
        return await self._stats(request)

    @fastapi_app.post("/kvtide/integrity/reuse")
    async def reuse_on(self, request: Request) -> dict[str, Any]:
        return await self._reuse_on(request)

    @fastapi_app.get("/kvtide/sessions/{session_id}")
    async def get_session(self, session_id: str, request: Request) -> dict[str, Any]:
        return await self._get_session(session_id, request)

    @fastapi_app.post("/kvtide/sessions/{session_id}/renew")
    async def renew_session(self, session_id: str, request: Request) -> dict[str, Any]:
        return await self._renew_session(session_id, request)

    @fastapi_app.delete("/kvtide/sessions/{session_id}")
    async def close_session(self, session_id: str, request: Request) -> dict[str, Any]:
        return await self._close_session(session_id, request)

    @fastapi_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Any:
        return await self._traced(request, "chat", self._chat)

    @fastapi_app.post("/v1/responses")
    async def responses(self, request: Request) -> Any:
        return await self._traced(request, "responses", self._responses_create)

    @fastapi_app.get("/v1/responses/{response_id}")
    async def get_response(
        self,
        response_id: str,
        request: Request,
        stream: bool = False,
        starting_after: int | None = None,
    ) -> Any:
        return await self._responses_get(response_id, request, stream, starting_after)

    @fastapi_app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request) -> dict[str, Any]:
        return await self._responses_delete(response_id, request)

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._traced(request, "text_completion", self._completion)

    async def _body(self, request: Request) -> dict[str, Any]:
        """The JSON body, refused (413) past ``server.max_request_bytes`` before it is
        read whole."""
        raw = await api.read_body(
            request.stream(),
            request.headers.get("content-length"),
            self.config.server.max_request_bytes,
            self.config.server.request_body_timeout_s,
        )
        return api.parse_body(raw, request.headers.get("content-type"))

    async def _traced(
        self,
        request: Request,
        operation: str,
        handler: Callable[[Request, Span], Awaitable[Any]],
    ) -> Any:
        """One request's root span (continuing the caller's ``traceparent``) and its
        request metrics; a stream ends them when it ends."""
        root = tr.start_ingress_span(
            request.headers,
            method=request.method,
            route=request.url.path,
            operation=operation,
            model=self.config.model.name,
        )
        self.metrics.request_started()
        try:
            response = await handler(request, root)
        except BaseException as exc:
            code = exc.status_code if isinstance(exc, RequestError) else 500
            if isinstance(exc, Exception):
                tr.record_error(root, exc)
            self._finish(root, code if isinstance(exc, Exception) else None)
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = ending(response.body_iterator, partial(self._finish, root))
        else:
            self._finish(root, response.status_code)
        return response

    def _finish(self, root: Span, status_code: int | None) -> None:
        """``status_code`` None: the client went away."""
        tr.set_attrs(root, {tr.HTTP_RESPONSE_STATUS_CODE: status_code})
        if status_code is None:
            root.set_attribute(tr.CANCELLED, True)
        root.end()
        self.metrics.request_finished(
            "cancelled" if status_code is None else http_status(status_code)
        )

    # ---- the turn ------------------------------------------------------------------
