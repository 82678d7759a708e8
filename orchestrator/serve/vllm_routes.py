"""The ingress's requests served by vLLM's OpenAI serving layer (``vllm_api``).

The same guard (concurrency ticket, Idempotency-Key) and the same turn
(``TurnOpener.open``: session, token continuity, limits, lease or ``begin_turn``) as
kvtide's own layer; vLLM's classes parse the request, render it and shape the response.
Two parts, each built with what it uses: ``VLLMTurns`` runs the turns vLLM's serving
layer asks for (its ``TurnRunner``), ``VLLMLayer`` takes a request through that layer.
Neither has routes of its own: kvtide's own layer and the Responses routes hand it what
they do not serve. See ``orchestrator.serve.vllm_api``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engines.base import GenerateChunk
from orchestrator.config import KVTideConfig
from orchestrator.errors import ContextLengthExceeded, EngineUnavailable, IdempotencyKeyReused
from orchestrator.kv.ownership import Principal
from orchestrator.kv.service import KVServiceAPI
from orchestrator.router import Router, Turn, TurnReport, TurnSampling
from orchestrator.serve import openai_api as api
from orchestrator.serve import vllm_api
from orchestrator.serve.auth import ConcurrencyGate, Ticket, check_request
from orchestrator.serve.request_guard import RequestGuard
from orchestrator.serve.responses import begin_replay, body_fingerprints
from orchestrator.serve.tool_turns import ToolTurns, tool_calls_of
from orchestrator.serve.turn_client import CURRENT_TURN, TurnContext
from orchestrator.serve.turn_opening import TurnOpener
from orchestrator.serve.turns import OpenTurn

__all__ = ["VLLMLayer", "VLLMTurns"]

log = logging.getLogger("kvtide.ingress")

# How a stream's response is kept for an Idempotency-Key's replay: its events.
_EVENTS = "kvtide_events"
_PROMPT_PARAM = {"chat": "messages", "completion": "prompt", "responses": "input"}


@dataclass(slots=True, kw_only=True, eq=False)
class VLLMTurns:
    """The turns vLLM's serving layer asks for (its ``TurnRunner``: ``run``), opened as
    every turn is."""

    config: KVTideConfig
    router: Router
    opener: TurnOpener

    async def run(
        self,
        ctx: TurnContext,
        ids: list[int],
        text: str | None,
        params: Any,
        request_id: str,
        is_turn: bool,
    ) -> AsyncGenerator[tuple[GenerateChunk, TurnReport], None]:
        """The turn vLLM's serving layer asked for (``TurnRunner``); ``is_turn`` False:
        a further choice of the turn's prompt, without its session, capped as the turn
        (the key's max_tokens)."""
        if not is_turn:
            # Started once choice 0 is open: its limits have set the cap.
            assert ctx.max_tokens is not None
            async for item in self.router.run_turn(
                Turn(
                    prompt_token_ids=ids,
                    max_tokens=ctx.max_tokens,
                    request_id=request_id,
                    trace_parent=ctx.root,
                    engine_sampling=params,
                )
            ):
                yield item
            return
        # The prompt's log probabilities need every prompt position computed: such a
        # turn runs outside its session (nothing pulled back, nothing kept), as does
        # one that asked to keep nothing.
        whole = params.prompt_logprobs is not None or ctx.sessionless
        principal = ctx.principal
        max_model_len = self.config.model.max_model_len

        def limits(prompt_ids: list[int]) -> int:
            check_request(
                principal,
                num_prompt_tokens=len(prompt_ids),
                max_tokens=ctx.requested_max_tokens,
                prompt_param=ctx.prompt_param,
            )
            room = max_model_len - len(prompt_ids)
            if room < 1:
                raise ContextLengthExceeded(
                    f"This model's maximum context length is {max_model_len} tokens. However, "
                    f"your prompt has {len(prompt_ids)} tokens. Shorten the prompt or the "
                    "history.",
                    param=ctx.prompt_param,
                )
            ctx.max_tokens = principal.cap_max_tokens(min(params.max_tokens, room))
            return ctx.max_tokens

        opened = await self.opener.open(
            OpenTurn(
                principal=principal,
                session_header=None if whole else ctx.session_header,
                has_history=ctx.has_history and not whole,
                text=None if whole else text,  # no conversation found by it either
                ids=ids,
                limits=limits,
                t_in=ctx.t_in,
                root=ctx.root,
                request_id=request_id,
                retokenize=True,
                run_args=TurnSampling(
                    engine_sampling=params, prompt_logprobs=params.prompt_logprobs
                ),
                num_sequences=ctx.num_choices,
                may_extend=ctx.may_extend,
            )
        )
        ctx.prompt_token_ids = opened.ids
        ctx.headers = opened.headers
        try:
            yield opened.first
            async for item in opened.turn:
                yield item
        finally:
            await opened.turn.aclose()


@dataclass(slots=True, kw_only=True, eq=False)
class VLLMLayer:
    """A request through vLLM's serving layer (``serving``, whose turns ``VLLMTurns``
    runs), guarded as every turn is; its response with kvtide's object and headers."""

    kv: KVServiceAPI
    gate: ConcurrencyGate
    guard: RequestGuard
    serving: vllm_api.VLLMServing
    tool_turns: ToolTurns

    async def request(
        self,
        kind: vllm_api.Kind,
        body: dict[str, Any],
        http: Request,
        principal: Principal,
        root: Any,
        t_in: float,
        *,
        session_id: str | None = None,
        sessionless: bool = False,
        on_done: Callable[[], None] | None = None,
        fields: dict[str, Any] | None = None,
    ) -> Any:
        """``body``, which kvtide's own layer does not serve, through vLLM's.
        ``session_id``: the turn's session when the request names none in its header
        (a Responses API chain's); ``sessionless``: without a header, the turn runs in
        no session (none found by its text either: it keeps nothing); ``on_done``:
        called once the response is complete; ``fields``: set by kvtide (the response's
        id), not part of the request's identity for an Idempotency-Key."""
        messages = body.get("messages") if kind == "chat" else None
        sent = body
        body = {**body, **(fields or {})}
        if isinstance(messages, list):
            # Tool-calling turns answered here render as the decode wrote them.
            generated = self.tool_turns.as_generated(messages)
            if generated is not None:
                body = {**body, "messages": generated}
        req = vllm_api.parse_request(kind, body)
        max_tokens = body.get(
            "max_output_tokens", body.get("max_completion_tokens", body.get("max_tokens"))
        )
        header = api.session_header(http.headers.get("x-session-id"))
        # Each of the n choices is a sequence on the pools: the key's concurrency and
        # admission count them all (``VLLMTurns`` caps each at the key's max_tokens).
        num_choices = max(1, int(getattr(req, "n", None) or 1))
        ctx = TurnContext(
            kind=kind,
            principal=principal,
            session_header=header or session_id,
            may_extend=api.may_extend(http.headers.get("x-kvtide-kv-plan")),
            sessionless=sessionless and header is None,
            has_history=body.get("previous_response_id") is not None
            or any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages or ()),
            requested_max_tokens=max_tokens if isinstance(max_tokens, int) else None,
            prompt_param=_PROMPT_PARAM[kind],
            num_choices=num_choices,
            on_done=on_done,
            root=root,
            t_in=t_in,
        )
        stream = bool(body.get("stream"))

        async def run(ticket: Ticket, replay_key: str | None) -> Any:
            # Set for the rest of this request's task (each request has its own): vLLM
            # may call the engine lazily, while its stream is read (the Responses API).
            CURRENT_TURN.set(ctx)
            result = await self.serving.create(kind, req, http)
            return await self._respond(ctx, result, stream, replay_key, ticket)

        return await self.guard.guarded(
            http,
            principal,
            run,
            lambda key, attempt: begin_replay(
                self.kv, key, attempt, kind, body_fingerprints(kind, sent)
            ),
            lambda stored: _replayed(stored, stream),
            num_choices,
        )

    async def _respond(
        self,
        ctx: TurnContext,
        result: Any,
        stream: bool,
        replay_key: str | None,
        ticket: Ticket,
    ) -> Any:
        """vLLM's answer as the HTTP response, with kvtide's object and headers; a turn
        that failed before its first token answers with its own status."""
        if ctx.error is not None:
            raise ctx.error
        if hasattr(result, "error") and not isinstance(result, AsyncIterator):
            raise vllm_api.error_of(result)
        kind = ctx.kind
        if not stream:
            body = result.model_dump(mode="json", by_alias=kind == "responses")
            assert ctx.report is not None  # the turn answered: its first token came
            body["kvtide"] = ctx.report.as_dict()
            if kind == "chat":
                self._remember_tool_turn(ctx, body["choices"][0].get("message") or {})
            if replay_key is not None:
                await self.kv.replay_complete(replay_key, body)
            if ctx.on_done is not None:
                ctx.on_done()
            return JSONResponse(body, headers=ctx.headers)
        if kind == "responses":
            result = vllm_api.sse_events(result)
        # Read until the turn has its first token (the Responses API announces the
        # response before the turn starts): a turn that fails before it answers with
        # its own status, not an error event.
        leading: list[str] = []
        while ctx.report is None and ctx.error is None:
            try:
                leading.append(await result.__anext__())
            except StopAsyncIteration:
                break
        if ctx.error is not None or ctx.report is None:
            await result.aclose()
            raise ctx.error or EngineUnavailable("the decode engine returned no output")
        return StreamingResponse(
            self._sse(ctx, leading, result, replay_key, ticket),
            media_type="text/event-stream",
            headers=ctx.headers,
        )

    async def _sse(
        self,
        ctx: TurnContext,
        leading: list[str],
        rest: AsyncGenerator[str, None],
        replay_key: str | None,
        ticket: Ticket,
    ) -> AsyncIterator[str]:
        events: list[str] = []
        completed = False
        calls = vllm_api.StreamedToolCalls()
        try:
            assert ctx.report is not None  # ``_respond`` read up to the first token
            async for event in vllm_api.prepend(leading, rest):
                event = vllm_api.with_kvtide(event, ctx.report.as_dict)
                calls.add(event)
                events.append(event)
                yield event
            completed = not any(e.startswith(('data: {"error"', "event: error")) for e in events)
            if completed:
                self._remember_tool_turn(ctx, calls.message())
                if ctx.on_done is not None:
                    ctx.on_done()
            if replay_key is not None and completed:
                stored = {"object": api.RESPONSE_OBJECT[ctx.kind], _EVENTS: events}
                await self.kv.replay_complete(replay_key, stored)
        finally:
            self.gate.release(ticket)
            with contextlib.suppress(Exception):
                await rest.aclose()
            if replay_key is not None and not completed:
                # Failed or the client went away mid-stream: a retry runs the turn.
                await asyncio.shield(self.kv.replay_fail(replay_key))

    def _remember_tool_turn(self, ctx: TurnContext, message: dict[str, Any]) -> None:
        """A tool-calling answer's calls and the raw text behind them (``tool_turns``)."""
        calls = tool_calls_of(message)
        if calls is not None and ctx.raw_text:
            self.tool_turns.remember(calls, "".join(ctx.raw_text))


def _replayed(stored: dict[str, Any], stream: bool) -> Any:
    """A completed turn's stored response, in the shape it was first sent in."""
    events = stored.get(_EVENTS)
    if (events is not None) != stream:
        raise IdempotencyKeyReused(
            "this Idempotency-Key's turn was first answered "
            + ("as a stream" if events is not None else "without streaming")
            + "; retry it the same way to get its result",
            param="Idempotency-Key",
        )
    headers = {"x-kvtide-replayed": "true"}
    if events is None:
        return JSONResponse(stored, headers=headers)

    async def replay() -> AsyncIterator[str]:
        for event in events:
            yield event

    return StreamingResponse(replay(), media_type="text/event-stream", headers=headers)
