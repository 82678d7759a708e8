"""kvtide's own OpenAI layer in the ingress: the plain text requests it serves itself
(``requests.py`` parses them strictly; a request asking for more goes to vLLM's serving
layer, ``vllm_routes``), their responses and streams, and the replay of a stored one.
Its routes (``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``)
are an ``APIRouter`` that ``Ingress`` includes.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry.trace import Span

from engines.base import GenerateChunk
from orchestrator.config import KVTideConfig
from orchestrator.errors import ContextLengthExceeded, RequestError, UnsupportedParameter
from orchestrator.kv.ownership import Principal
from orchestrator.kv.service import KVServiceAPI
from orchestrator.router import Router, TurnReport, TurnSampling
from orchestrator.serve import openai_api as api
from orchestrator.serve import vllm_api
from orchestrator.serve.auth import ConcurrencyGate, Ticket, check_request
from orchestrator.serve.prompts import PromptEncoder
from orchestrator.serve.request_edge import RequestEdge
from orchestrator.serve.request_guard import RequestGuard
from orchestrator.serve.responses import (
    Output,
    begin_replay,
    final_body,
    replay_sse,
    request_fingerprints,
    server_error_body,
    stream_error,
    usage_of,
)
from orchestrator.serve.turn_opening import REQUEST_ID_HEADER, TurnOpener, maybe_in_thread
from orchestrator.serve.turns import OpenedTurn, OpenTurn
from orchestrator.serve.vllm_routes import VLLMLayer

__all__ = ["OwnLayer"]

log = logging.getLogger("kvtide.ingress")


OwnHandler = Callable[[api.ApiRequest, Request, Principal, Span, float], Awaitable[Any]]
"""kvtide's own layer's work on a parsed request: ``(request, http, principal, root,
t_in)``."""


@dataclass(slots=True, kw_only=True, eq=False)
class OwnLayer:
    """kvtide's own OpenAI layer (see the module); what it does not serve goes to vLLM's
    (``vllm``)."""

    config: KVTideConfig
    kv: KVServiceAPI
    router: Router
    gate: ConcurrencyGate
    prompts: PromptEncoder
    edge: RequestEdge
    guard: RequestGuard
    opener: TurnOpener
    vllm: VLLMLayer
    routes: APIRouter = field(init=False)

    def __post_init__(self) -> None:
        self.routes = APIRouter()
        self.routes.add_api_route("/v1/chat/completions", self._post_chat, methods=["POST"])
        self.routes.add_api_route("/v1/completions", self._post_completion, methods=["POST"])
        self.routes.add_api_route("/v1/models", self.models, methods=["GET"])

    async def _post_chat(self, request: Request) -> Any:
        return await self.edge.traced(request, "chat", self.chat)

    async def _post_completion(self, request: Request) -> Any:
        return await self.edge.traced(request, "text_completion", self.completion)

    async def models(self, request: Request) -> dict[str, Any]:
        self.edge.principal(request)
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

    async def _layer_for(
        self,
        kind: Literal["chat", "completion"],
        request: Request,
        root: Span,
        own: OwnHandler,
    ) -> Any:
        """A request for kvtide's own layer (``own``) when its parser takes it; one that
        asks for more of what vLLM's server honours goes to vLLM's layer."""
        principal = self.edge.principal(request)
        body = await self.edge.body(request)
        t_in = self.router.clock()
        parse = api.parse_chat if kind == "chat" else api.parse_completion
        try:
            req = parse(body, self.config.model.name)
        except UnsupportedParameter:
            vllm_api.check_fields(kind, body)
            return await self.vllm.request(kind, body, request, principal, root, t_in)
        return await own(req, request, principal, root, t_in)

    async def chat(self, request: Request, root: Span) -> Any:
        return await self._layer_for("chat", request, root, self._own_chat)

    async def completion(self, request: Request, root: Span) -> Any:
        return await self._layer_for("completion", request, root, self._own_completion)

    async def _own_chat(
        self, req: api.ApiRequest, request: Request, principal: Principal, root: Span, t_in: float
    ) -> Any:
        self.prompts.check_length(req)
        # A long history takes a while to render: off the event loop, as tokenizing is.
        # A short one costs less than the thread hop.
        size = sum(len(content) for _, content in req.messages)
        t_render = self.router.clock()
        text = await maybe_in_thread(
            size,
            self.prompts.render_chat,
            req.messages,
            continue_final_message=req.continue_final_message,
        )
        render_s = self.router.clock() - t_render
        return await self._serve(req, text, None, request, principal, root, t_in, render_s)

    async def _own_completion(
        self, req: api.ApiRequest, request: Request, principal: Principal, root: Span, t_in: float
    ) -> Any:
        if req.prompt_token_ids is not None:
            ids: list[int] | None = list(req.prompt_token_ids)
            self.prompts.check_token_ids(req.prompt_token_ids)
            return await self._serve(req, None, ids, request, principal, root, t_in)
        assert req.prompt_text is not None
        self.prompts.check_length(req)
        return await self._serve(req, req.prompt_text, None, request, principal, root, t_in)

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
        session limit) and plans the turn's KV (``TurnOpener.open``). The turn runs once per
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
            opened = await self.opener.open(
                OpenTurn(
                    principal=principal,
                    session_header=api.session_header(http.headers.get("x-session-id")),
                    may_extend=api.may_extend(http.headers.get("x-kvtide-kv-plan")),
                    has_history=any(role == "assistant" for role, _ in req.messages),
                    text=text,
                    ids=ids,
                    limits=limits,
                    t_in=t_in,
                    render_s=render_s,
                    root=root,
                    request_id=rid,
                    run_args=TurnSampling(sampling=req.sampling),
                )
            )
            return await self._respond(req, opened, replay_key, ticket)

        return await self.guard.guarded(
            http,
            principal,
            run,
            lambda key, attempt: begin_replay(
                self.kv, key, attempt, req.kind, request_fingerprints(req)
            ),
            lambda body: self._replayed(req, body),
        )

    async def _respond(
        self,
        req: api.ApiRequest,
        opened: OpenedTurn,
        replay_key: str | None,
        ticket: Ticket,
    ) -> Any:
        """kvtide's own OpenAI layer's response to a turn opened by ``TurnOpener.open``."""
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
        body = final_body(req, rid, ids, out, report, self._fingerprint())
        if replay_key is not None:
            await self.kv.replay_complete(replay_key, body)
        return JSONResponse(body, headers=opened.headers)

    def _fingerprint(self) -> str | None:
        """vLLM's ``system_fingerprint`` for this model, as kvtide's vLLM layer gives it."""
        fingerprint: str | None = self.vllm.serving.chat.system_fingerprint
        return fingerprint

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
                # With return_token_ids a chunk whose tokens made no text yet (part of a
                # UTF-8 character) still goes, for its ids (as vLLM's server sends it).
                with_ids = req.return_token_ids and bool(chunk.token_ids)
                if chunk.text or is_first or chunk.finished or with_ids:
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
                        token_ids=list(chunk.token_ids) if req.return_token_ids else None,
                        prompt_token_ids=ids if req.return_token_ids and is_first else None,
                    )
                    is_first = False
                if chunk.finished:
                    break
                item = await turn.__anext__()
            if replay_key is not None:
                await self.kv.replay_complete(
                    replay_key, final_body(req, rid, ids, out, report, self._fingerprint())
                )
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
