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
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from opentelemetry.trace import Span
from ray import serve
from ray.serve.handle import DeploymentHandle

from engines.base import GenerateChunk
from orchestrator.cluster import route_notes
from orchestrator.cluster.handle_pool import HandlePool
from orchestrator.config import KVTideConfig
from orchestrator.errors import (
    ContextLengthExceeded,
    EngineUnavailable,
    LimitExceeded,
    NotFound,
    RequestError,
    TurnInProgress,
    UnsupportedParameter,
)
from orchestrator.kv.actor import get_or_create_service, service_client
from orchestrator.kv.decider import kv_lifecycle_config
from orchestrator.kv.messages import KVDecision
from orchestrator.kv.ownership import Principal, session_not_found
from orchestrator.kv.service import engine_pool
from orchestrator.kv.session_tokens import SessionTokens, prefix_digest
from orchestrator.kv.turn_leases import WATCH_WAIT_S, HeldLeases
from orchestrator.observability import tracing as tr
from orchestrator.observability.metrics import http_status, make_metrics, render_prometheus
from orchestrator.router import LeaseRefused, Router, TurnReport
from orchestrator.serve import openai_api as api
from orchestrator.serve import vllm_api
from orchestrator.serve.admission import AdmissionGate
from orchestrator.serve.auth import Authenticator, ConcurrencyGate, Ticket, check_request
from orchestrator.serve.model_info import kv_bytes_per_token_of
from orchestrator.serve.prompts import PromptEncoder
from orchestrator.serve.responses import (
    Output,
    begin_replay,
    ending,
    final_body,
    pool_stats,
    raise_unclaimed,
    replay_key_of,
    replay_sse,
    request_fingerprints,
    server_error_body,
    session_body,
    stream_error,
    usage_of,
)
from orchestrator.serve.tool_turns import ToolTurns
from orchestrator.serve.turns import OpenedTurn, OpenTurn
from orchestrator.serve.vllm_routes import VLLMRoutes

__all__ = ["Ingress", "fastapi_app"]

log = logging.getLogger("kvtide.ingress")

REQUEST_ID_HEADER = "x-kvtide-request-id"
"""The response header naming kvtide's request id (the completion's ``id``)."""
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Bounds of an ingress replica's copy of its sessions' last turns: past them the oldest
# go (a session whose copy went costs one more service call on its next turn).
SESSION_TOKENS_MAX = 10_000
SESSION_TOKENS_MAX_BYTES = 256 * 2**20

INLINE_MAX_CHARS = 8192
"""Text up to this many characters is rendered or tokenized on the event loop: it takes
well under a millisecond, less than the hop to a worker thread and back."""

_T = TypeVar("_T")


async def _maybe_in_thread(size: int, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)``: inline for ``size`` up to ``INLINE_MAX_CHARS``, else in a
    worker thread (off the event loop)."""
    if size <= INLINE_MAX_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


# No schema route: it would answer without a key (the API is docs/api.md).
fastapi_app = FastAPI(title="kvtide", docs_url=None, redoc_url=None, openapi_url=None)


def _extends(ids: Sequence[int], prefix: Sequence[int]) -> bool:
    """Whether ``ids`` start with ``prefix`` (a non-empty one)."""
    n = len(prefix)
    return 0 < n <= len(ids) and list(ids[:n]) == list(prefix)


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
class Ingress(VLLMRoutes):
    async def __init__(
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
            leases=HeldLeases(self.replica_id, time.monotonic) if kv.turn_lease_s > 0 else None,
        )
        # vLLM's OpenAI serving layer for what kvtide's own does not serve (tools,
        # structured outputs, logprobs, n, ...): its config and tokenizer, no engine.
        self.vllm = await asyncio.to_thread(vllm_api.build_serving, config.model, self._vllm_turn)
        self.tool_turns = ToolTurns()
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
        while True:
            leases.expire()
            released = leases.take_released()
            try:
                answer = await self.kv.lease_watch(
                    leases.holder, released, wait_s, leases.held_ids()
                )
            except RequestError:  # the service is restarting: again in a second
                leases.requeue(released)
                await asyncio.sleep(1.0)
                continue
            leases.new_epoch(answer.epoch)
            leases.revoke(answer.revoked)

    async def __del__(self) -> None:
        """Serve's replica shutdown: the turns that finished here reach the service
        (each hand-over is bounded by the service client's deadline), and its unused
        turn leases go back to it."""
        self._reporter.cancel()
        await self.router.settled()
        leases = self.router.leases
        if self._lease_watch is not None and leases is not None:
            self._lease_watch.cancel()
            leases.revoke([lease.lease_id for lease in leases.unused()])
            with contextlib.suppress(RequestError):
                await self.kv.lease_watch(leases.holder, leases.take_released(), 0.0)

    # ---- routes ----------------------------------------------------------------------

    @fastapi_app.get("/health")
    async def health(self) -> JSONResponse:
        """200 ``ok`` when every pool and the KV service answer within their deadlines;
        503 naming what did not (each check bounded: /health never hangs). ``degraded``
        when an engine makes no progress or a pool refuses turns (admission control):
        503 with Retry-After while turns are refused, 200 while they are still admitted
        (docs/reliability.md#overload)."""
        timeout_s = self.config.kv.service_timeout_s
        names = list(self.pool_handles)
        checks = [asyncio.wait_for(self.pool_handles[n].info.remote(), timeout_s) for n in names]
        results = await asyncio.gather(*checks, self.kv.stats(), return_exceptions=True)
        failed = [
            n
            for n, r in zip([*names, "kv_service"], results, strict=True)
            if isinstance(r, BaseException)
        ]
        if failed:
            for name, result in zip([*names, "kv_service"], results, strict=True):
                if isinstance(result, BaseException):
                    log.warning("health: %s: %s: %s", name, type(result).__name__, result)
            raise EngineUnavailable(
                f"not ready: {', '.join(failed)} did not answer within {timeout_s:g} s"
            )
        state = self.admission.health()
        if state.status == "ok":
            return JSONResponse({"status": "ok"})
        body = {
            "status": state.status,
            "admits": state.admits,
            "refusing_pools": list(state.refusing_pools),
            "engines": state.engines,
        }
        if state.admits:
            return JSONResponse(body)
        retry = {"Retry-After": str(max(1, math.ceil(self.config.admission.retry_after_s)))}
        return JSONResponse(body, status_code=503, headers=retry)

    def _principal(self, http: Request) -> Principal:
        return self.auth.authenticate(http.headers.get("authorization"))

    async def _session_of(self, session_id: str, http: Request) -> tuple[str, Principal]:
        """The session a ``/kvtide/sessions/{id}`` route names, if the caller may see it.
        With API keys, an unknown session and another key's look the same: 404."""
        principal = self._principal(http)
        sid = api.parse_session_id(session_id)
        assert sid is not None
        if not await self.kv.session_owned(sid, principal):
            raise session_not_found(sid)
        return sid, principal

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
        """kvtide's metrics in Prometheus's text format: every ingress replica's book and
        the KV service's, summed (each replica reports its book every second). Behind
        the API keys like every route; 404 with ``observability.metrics`` off."""
        self._principal(request)
        if not self.config.observability.metrics:
            raise NotFound("metrics are off (observability.metrics: false)")
        await self.router.settled()
        kv = await self.kv.stats()
        return PlainTextResponse(
            render_prometheus(kv.get("metrics", {})), media_type=PROMETHEUS_CONTENT_TYPE
        )

    @fastapi_app.get("/kvtide/stats")
    async def stats(self, request: Request) -> dict[str, Any]:
        """The service's books with every engine's counters (each engine host reports its
        own with its heartbeat; summed per pool) and every ingress replica's metrics
        (summed, with the service's). A pool none of whose engines has reported yet (just
        deployed) is asked directly, one replica, within the service deadline."""
        self._principal(request)
        await self.router.settled()  # the turns finished here are in the books
        kv = await self.kv.stats()
        engines: dict[str, dict[str, Any]] = kv.pop("engines", {})
        kv.pop("ingress_metrics", None)
        metrics = kv.pop("metrics", {})
        by_pool: dict[str, list[dict[str, Any]]] = {name: [] for name in self.pools}
        for engine_id, counters in engines.items():
            by_pool.setdefault(engine_pool(engine_id), []).append(counters)
        for name, books in by_pool.items():
            if not books and name in self.pools:
                timeout_s = self.config.kv.service_timeout_s
                try:
                    stats = await asyncio.wait_for(
                        self.pools[name].handle.stats.remote(), timeout_s
                    )
                except Exception as exc:
                    log.warning("stats: %s pool: %s: %s", name, type(exc).__name__, exc)
                    raise EngineUnavailable(
                        f"the {name} pool did not report its counters within {timeout_s:g} s"
                    ) from None
                books.append(msgspec.to_builtins(stats))
        return {
            "kv": kv,
            "engines": {pool: pool_stats(pool, books) for pool, books in by_pool.items()},
            "engine_replicas": engines,
            "metrics": metrics,
        }

    @fastapi_app.get("/kvtide/sessions/{session_id}")
    async def get_session(self, session_id: str, request: Request) -> dict[str, Any]:
        """Where kvtide holds the session's KV now (``record`` is null when nothing is
        offered: never recorded, expired, evicted or closed)."""
        sid, principal = await self._session_of(session_id, request)
        await self.router.settled()
        info = await self.kv.session(sid)
        if not info.known and not principal.is_anonymous:
            raise session_not_found(sid)
        return session_body(info)

    @fastapi_app.post("/kvtide/sessions/{session_id}/renew")
    async def renew_session(self, session_id: str, request: Request) -> dict[str, Any]:
        """Extend the session's KV lease (the SDK's heartbeat while a conversation idles)."""
        sid, principal = await self._session_of(session_id, request)
        await self.router.settled()
        info = await self.kv.renew(sid, principal)
        if not info.known:
            raise session_not_found(sid)
        return session_body(info)

    @fastapi_app.delete("/kvtide/sessions/{session_id}")
    async def close_session(self, session_id: str, request: Request) -> dict[str, Any]:
        """End a session: its kept KV is drained back to prefill (freed on decode now)."""
        sid, principal = await self._session_of(session_id, request)
        await self.router.settled()
        if not await self.kv.close(sid) and not principal.is_anonymous:
            raise session_not_found(sid)
        return {"id": sid, "object": "session.deleted", "deleted": True}

    @fastapi_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Any:
        return await self._traced(request, "chat", self._chat)

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

    async def _chat(self, request: Request, root: Span) -> Any:
        principal = self._principal(request)
        body = await self._body(request)
        t_in = time.monotonic()
        try:
            req = api.parse_chat(body, self.config.model.name)
        except UnsupportedParameter:
            vllm_api.check_fields("chat", body)
            return await self._vllm_request("chat", body, request, principal, root, t_in)
        self.prompts.check_length(req)
        # A long history takes a while to render: off the event loop, as tokenizing is.
        # A short one costs less than the thread hop.
        size = sum(len(content) for _, content in req.messages)
        t_render = time.monotonic()
        text = await _maybe_in_thread(
            size,
            self.prompts.render_chat,
            req.messages,
            continue_final_message=req.continue_final_message,
        )
        render_s = time.monotonic() - t_render
        return await self._serve(req, text, None, request, principal, root, t_in, render_s)

    async def _completion(self, request: Request, root: Span) -> Any:
        principal = self._principal(request)
        body = await self._body(request)
        t_in = time.monotonic()
        try:
            req = api.parse_completion(body, self.config.model.name)
        except UnsupportedParameter:
            vllm_api.check_fields("completion", body)
            return await self._vllm_request("completion", body, request, principal, root, t_in)
        if req.prompt_token_ids is not None:
            ids: list[int] | None = list(req.prompt_token_ids)
            self.prompts.check_token_ids(req.prompt_token_ids)
            return await self._serve(req, None, ids, request, principal, root, t_in)
        assert req.prompt_text is not None
        self.prompts.check_length(req)
        return await self._serve(req, req.prompt_text, None, request, principal, root, t_in)

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

    def _max_tokens(self, req: api.ApiRequest, num_prompt: int) -> int:
        limit = self.config.model.max_model_len
        if num_prompt >= limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt has {num_prompt} tokens. Shorten the prompt or the history.",
                param="messages" if req.kind == "chat" else "prompt",
            )
        if req.max_tokens is None:
            return min(api.DEFAULT_MAX_TOKENS, limit - num_prompt)
        if num_prompt + req.max_tokens > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt + req.max_tokens} tokens ({num_prompt} in the prompt, "
                f"{req.max_tokens} for the completion). Reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        return req.max_tokens

    async def _tokenize(
        self, text: str, last_text: str | None = None, last_ids: Sequence[int] = ()
    ) -> list[int]:
        """``text``: a ``RenderedChat`` (its messages' contents stay text) or a
        completion's raw prompt; continuing a session's last turn when given."""
        # Off the event loop: a long prompt takes seconds, and /v1/models must not wait.
        # What is tokenized is the text after the last turn's where it continues one.
        continues = last_text is not None and text.startswith(last_text)
        size = len(text) - (len(last_text) if continues and last_text is not None else 0)
        return await _maybe_in_thread(size, self.prompts.encode, text, last_text, list(last_ids))

    async def _begin_turn(
        self,
        session_id: str,
        principal: Principal,
        text: str | None,
        ids: list[int],
        max_tokens: int,
        digest: int | None,
        last_ids: Sequence[int],
        limits: Callable[[list[int]], int],
    ) -> tuple[list[int], int, KVDecision | None, float, float]:
        """The turn's one service call before it runs (``begin_turn``: the session
        claimed, the KV plan made), with the prompt tokenized from this replica's copy of
        the session's last turn (``digest`` names it, ``last_ids`` are its ids). The call
        carries only the ids the prompt adds to that last turn. When the service's last
        turn is another one (the previous turn ran on another replica), tokenize again
        from it, check ``limits`` again (the prompt's max_tokens), and ask again.

        Returns the prompt's ids, its max_tokens, the plan, the seconds spent waiting
        for the service and those spent tokenizing again."""
        waited = tokenized = 0.0
        for attempt in range(3):
            # A third try (another replica finished a turn between ours) skips the check:
            # the plan then compares the ids with the kept record itself.
            checked = digest if attempt < 2 else None
            skip = len(last_ids) if checked is not None and _extends(ids, last_ids) else 0
            t0 = time.monotonic()
            claim = await self.kv.begin_turn(session_id, principal, ids[skip:], checked, skip)
            waited += time.monotonic() - t0
            if claim.outcome != "retokenize":
                break
            assert claim.prefix is not None
            prefix = claim.prefix
            # This replica's copy is now the service's (the turn's hand-over sends only
            # what it adds to it).
            self.session_tokens.remember(
                session_id, prefix.text, prefix.token_ids, self.router.clock()
            )
            digest, last_ids = prefix_digest(prefix.token_ids), prefix.token_ids
            if text is not None:  # a prompt sent as token ids is as it is
                t0 = time.monotonic()
                ids = await self._tokenize(text, prefix.text, prefix.token_ids)
                tokenized += time.monotonic() - t0
                max_tokens = limits(ids)
        raise_unclaimed(claim, session_id)
        return ids, max_tokens, claim.decision, waited, tokenized

    async def _serve(
        self,
        req: api.ApiRequest,
        text: str | None,
        ids: list[int] | None,
        http: Request,
        principal: Principal,
        root: Span,
        t_in: float,
        render_s: float = 0.0,
    ) -> Any:
        """``t_in``: when the body was read (the ingress's own time on the turn's path
        starts there: ``TurnReport.ingress_s``); ``render_s``: the time the chat template
        took (``TurnReport.tokenize_s`` adds tokenizing).

        Checks in order, each refusal leaving nothing behind: the key's concurrency
        (429), an Idempotency-Key's earlier run (replayed, or 409 while it runs), the
        key's limits and the context (429/400); then one service call claims the
        session for the key (404 for another key's, 409 while a turn runs, 429 at a
        session limit) and plans the turn's KV (``_open_turn``). The turn runs once per
        Idempotency-Key and releases its concurrency ticket when the response (or
        stream) ends."""

        def limits(prompt_ids: list[int]) -> int:
            check_request(
                principal,
                num_prompt_tokens=len(prompt_ids),
                max_tokens=req.max_tokens,
                prompt_param="messages" if req.kind == "chat" else "prompt",
            )
            return principal.cap_max_tokens(self._max_tokens(req, len(prompt_ids)))

        async def run(ticket: Ticket, replay_key: str | None) -> Any:
            rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex
            opened = await self._open_turn(
                OpenTurn(
                    principal=principal,
                    session_header=api.parse_session_id(http.headers.get("x-session-id")),
                    has_history=any(role == "assistant" for role, _ in req.messages),
                    text=text,
                    ids=ids,
                    limits=limits,
                    t_in=t_in,
                    render_s=render_s,
                    root=root,
                    request_id=rid,
                    run_args={
                        "temperature": req.temperature,
                        "top_p": req.top_p,
                        "seed": req.seed,
                        "stop": req.stop,
                        "ignore_eos": req.ignore_eos,
                        "sampling_options": req.sampling_options(),
                    },
                )
            )
            return await self._respond(req, opened, replay_key, ticket)

        return await self._guarded(
            http,
            principal,
            run,
            lambda key: begin_replay(self.kv, key, req.kind, request_fingerprints(req)),
            lambda body: self._replayed(req, body),
        )

    async def _guarded(
        self,
        http: Request,
        principal: Principal,
        run: Callable[[Ticket, str | None], Awaitable[Any]],
        begin: Callable[[str], Awaitable[dict[str, Any] | None]],
        replayed: Callable[[dict[str, Any]], Any],
    ) -> Any:
        """``run(ticket, replay_key)`` under the key's concurrency ticket, once per
        Idempotency-Key: ``begin(replay_key)`` looks the key up (the stored response of
        an earlier run, which is ``replayed``; 409 while it runs, 422 when the key came
        with another request; None: run now, as after a failed run). The ticket is
        released when the response ends (a stream's own end releases it)."""
        replay_key = replay_key_of(
            http.headers.get("idempotency-key"),
            principal.name,
            api.parse_session_id(http.headers.get("x-session-id")),
        )
        ticket = self.gate.acquire(principal)
        streaming = False
        try:
            if replay_key is not None:
                stored = await begin(replay_key)
                if stored is not None:
                    return replayed(stored)
            try:
                response = await run(ticket, replay_key)
            except BaseException:
                if replay_key is not None:
                    await asyncio.shield(self.kv.replay_fail(replay_key))
                raise
            streaming = isinstance(response, StreamingResponse)
            return response
        finally:
            if not streaming:  # a stream releases its ticket when it ends
                self.gate.release(ticket)

    async def _open_turn(self, turn: OpenTurn) -> OpenedTurn:
        """The turn started: its session found (by header, or the unnamed one its text
        continues), its prompt tokenized from this replica's copy of the session's last
        turn, checked against ``turn.limits``, claimed and planned (under the session's
        turn lease here, or by the KV service's ``begin_turn``), and run to its first
        item, so that a failure before the first token is the response's status."""
        principal, text = turn.principal, turn.text
        session_id = turn.session_header
        # A conversation without the header: the unnamed session its text extends, or a
        # new one when it carries history (``orchestrator.kv.conversations``).
        conversation: str | None = None
        if session_id is None and text is not None and self.config.routing.reuse_without_session:
            now = self.router.clock()
            session_id = self.session_tokens.find_conversation(principal.name, text, now)
            if session_id is not None:
                conversation = "continued"
            elif turn.has_history:
                session_id = self.session_tokens.conversations.new_session_id(principal.name)
                conversation = "started"
        digest: int | None = None  # the last turn the prompt was tokenized from
        last_text: str | None = None
        last_ids: Sequence[int] = ()
        if session_id is not None:  # this replica's copy; checked by begin_turn
            now = self.router.clock()
            last_text, last_ids = self.session_tokens.last_turn(session_id, now)
            digest = self.session_tokens.last_digest(session_id, now)
        tokenize_s = turn.render_s
        ids = turn.ids
        if ids is None or (turn.retokenize and last_text is not None):
            assert text is not None
            t_tokenize = time.monotonic()
            ids = await self._tokenize(text, last_text, last_ids)
            tokenize_s += time.monotonic() - t_tokenize
        max_tokens = turn.limits(ids)
        # Refused now (503 overloaded) rather than queued past its deadline.
        self.admission.check(("prefill", self.router.decode_pool_for(len(ids))[0]))
        decision, service_s = None, 0.0
        lease, lease_used = None, None
        if session_id is not None and self.router.leases is not None:
            # Held for this replica since its last turn here: claimed and planned
            # without a service call on the path (``orchestrator.kv.turn_leases``).
            service_s = await self.router.handed_over(session_id)
            lease = self.router.leases.take(session_id, principal, digest)
        if lease is not None:
            assert session_id is not None
            decision = self.router.leases.decide(lease, ids)
            reason = None if decision.kind == "pull" else decision.reason
            self.metrics.inc("kvtide_turn_leases_total", outcome="used")
            lease_used = asyncio.get_running_loop().create_task(
                self.kv.lease_used(session_id, lease.lease_id, reason)
            )
        elif session_id is not None:
            try:
                ids, max_tokens, decision, begun_s, again_s = await self._begin_turn(
                    session_id, principal, text, ids, max_tokens, digest, last_ids, turn.limits
                )
                service_s += begun_s
                tokenize_s += again_s
            except (TurnInProgress, LimitExceeded, NotFound):
                if conversation is None:
                    raise
                # The conversation's session is busy (the same history sent twice at
                # once) or over a limit: served as a request without one, which keeps
                # nothing. Never a refusal the client did not ask for.
                session_id, conversation = None, "unmatched"
                self.metrics.inc("kvtide_conversation_turns_total", outcome="unmatched")
        if conversation in ("continued", "started"):
            self.metrics.inc("kvtide_conversation_turns_total", outcome=conversation)
        tr.set_attrs(turn.root, {tr.GEN_AI_REQUEST_MAX_TOKENS: max_tokens})

        def start(
            ids: list[int], max_tokens: int, decision: KVDecision | None, lease_id: int | None
        ) -> AsyncGenerator[tuple[GenerateChunk, TurnReport], None]:
            return self.router.run_turn(
                prompt_token_ids=ids,
                max_tokens=max_tokens,
                session_id=session_id,
                request_id=turn.request_id,
                prompt_text=text,
                trace_parent=turn.root,
                owner=None if principal.is_anonymous else principal.name,
                decision=decision,
                lease_id=lease_id,
                lease_used=lease_used if lease_id is not None else None,
                **turn.run_args,
            )

        # Wait for the first item so that prefill failures become a proper status code.
        t_router = time.monotonic()
        running = start(ids, max_tokens, decision, None if lease is None else lease.lease_id)
        try:
            first = await running.__anext__()
        except StopAsyncIteration:
            raise EngineUnavailable("the decode engine returned no output") from None
        except LeaseRefused:
            # The service gave the lease up (revoked meanwhile, or it restarted): the
            # turn ended unseen; ask the service as any turn does.
            assert session_id is not None
            self.metrics.inc("kvtide_turn_leases_total", outcome="refused")
            ids, max_tokens, decision, service_s, again_s = await self._begin_turn(
                session_id, principal, text, ids, max_tokens, digest, last_ids, turn.limits
            )
            tokenize_s += again_s
            t_router = time.monotonic()
            running = start(ids, max_tokens, decision, None)
            try:
                first = await running.__anext__()
            except StopAsyncIteration:
                raise EngineUnavailable("the decode engine returned no output") from None
        report = first[1]
        report.conversation = conversation
        report.ingress_s = t_router - turn.t_in
        report.service_s = service_s
        report.tokenize_s = tokenize_s
        # Serve sets its own x-request-id (its request id); kvtide's is the completion id.
        headers = {REQUEST_ID_HEADER: turn.request_id}
        if session_id is not None and conversation is None:  # an unnamed one stays unnamed
            headers["x-session-id"] = session_id
        return OpenedTurn(ids=ids, first=first, turn=running, headers=headers)

    async def _respond(
        self,
        req: api.ApiRequest,
        opened: OpenedTurn,
        replay_key: str | None,
        ticket: Ticket,
    ) -> Any:
        """kvtide's own OpenAI layer's response to a turn opened by ``_open_turn``."""
        rid, ids, first, turn = opened.request_id, opened.ids, opened.first, opened.turn
        if req.stream:
            return StreamingResponse(
                self._sse(req, rid, ids, first, turn, replay_key, ticket),
                media_type="text/event-stream",
                headers=opened.headers,
            )
        out = Output()
        out.add(first[0])
        report = first[1]  # the router updates this one report as the turn goes
        try:
            async for chunk, _ in turn:
                out.add(chunk)
        finally:
            await turn.aclose()  # a cancelled request ends its turn now, not at GC
        body = final_body(req, rid, ids, out, report)
        if replay_key is not None:
            await self.kv.replay_complete(replay_key, body)
        return JSONResponse(body, headers=opened.headers)

    def _replayed(self, req: api.ApiRequest, body: dict[str, Any]) -> Any:
        """A completed turn's stored response, in the shape this request asked for."""
        headers = {REQUEST_ID_HEADER: str(body["id"]), "x-kvtide-replayed": "true"}
        if body.get("kvtide", {}).get("session_id"):
            headers["x-session-id"] = body["kvtide"]["session_id"]
        if not req.stream:
            return JSONResponse(body, headers=headers)
        return StreamingResponse(
            replay_sse(req, body), media_type="text/event-stream", headers=headers
        )

    async def _sse(
        self,
        req: api.ApiRequest,
        rid: str,
        ids: list[int],
        first: tuple[GenerateChunk, TurnReport],
        turn: AsyncGenerator[tuple[GenerateChunk, TurnReport], None],
        replay_key: str | None,
        ticket: Ticket,
    ) -> AsyncIterator[str]:
        item, is_first = first, True
        report = first[1]
        out = Output()
        completed = False
        try:
            while True:
                chunk, report = item
                out.add(chunk)
                if chunk.text or is_first or chunk.finished:
                    yield api.stream_chunk(
                        req.kind,
                        rid,
                        req.model,
                        text=chunk.text,
                        first=is_first,
                        finish=chunk.finish_reason if chunk.finished else None,
                        ext=report.as_dict() if chunk.finished else None,
                        use_so_far=(
                            api.usage(len(ids), len(out.token_ids), report.num_cached_tokens)
                            if req.continuous_usage
                            else None
                        ),
                    )
                    is_first = False
                if chunk.finished:
                    break
                item = await turn.__anext__()
            if replay_key is not None:
                await self.kv.replay_complete(replay_key, final_body(req, rid, ids, out, report))
            completed = True
        except RequestError as exc:
            yield stream_error(exc.body(), out)
        except Exception:
            log.exception("stream %s failed", rid)  # details in the log, not the stream
            body = server_error_body("the stream failed; retry the request", "stream_failed")
            yield stream_error(body, out)
        else:
            if req.include_usage:
                yield api.stream_chunk(
                    req.kind, rid, req.model, use=usage_of(report), ext=report.as_dict()
                )
        finally:
            self.gate.release(ticket)
            await turn.aclose()
            if replay_key is not None and not completed:
                # Failed or the client went away mid-stream: a retry runs the turn.
                await asyncio.shield(self.kv.replay_fail(replay_key))
        yield "data: [DONE]\n\n"
