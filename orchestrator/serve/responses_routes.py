"""The Responses API (``/v1/responses``) in the ingress: vLLM's ``OpenAIServingResponses``
over kvtide's turn, with what it stores bounded, owned by API keys and tied to kvtide
sessions (``orchestrator.serve.responses_api``). Its turns go through vLLM's layer
(``vllm_routes.VLLMLayer``); its routes (``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``) are an ``APIRouter`` that ``Ingress`` includes.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from orchestrator.errors import (
    LimitExceeded,
    RequestError,
    ResponseNotFound,
    UnsupportedParameter,
)
from orchestrator.kv.service import KVServiceAPI
from orchestrator.router import Router
from orchestrator.serve import openai_api as api
from orchestrator.serve import vllm_api
from orchestrator.serve.request_edge import RequestEdge
from orchestrator.serve.responses_api import ResponseBook
from orchestrator.serve.vllm_routes import VLLMLayer

__all__ = ["ResponsesRoutes", "nulls_as_defaults"]

log = logging.getLogger("kvtide.ingress")


def _not_found(response_id: str, param: str | None = None) -> ResponseNotFound:
    shown = response_id if response_id.isprintable() and len(response_id) <= 128 else "?"
    return ResponseNotFound(
        f"Response with id '{shown}' not found: never stored by this API key, deleted, "
        "expired, or dropped to keep the store within its bounds (a response sent with "
        "store: false is never stored).",
        param,
    )


def nulls_as_defaults(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` without the nulls of fields whose default is not null: a null is the
    field's default (``"truncation": null`` is ``"disabled"``), as OpenAI reads it.
    vLLM's request model takes the null and its response model then refuses it."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    fields = ResponsesRequest.model_fields
    return {
        name: value
        for name, value in body.items()
        if value is not None or name not in fields or fields[name].default is None
    }


@dataclass(slots=True, kw_only=True, eq=False)
class ResponsesRoutes:
    """The ingress's Responses API (see the module); ``book`` holds what vLLM's
    Responses serving class stores."""

    kv: KVServiceAPI
    router: Router
    edge: RequestEdge
    vllm: VLLMLayer
    book: ResponseBook
    routes: APIRouter = field(init=False)

    def __post_init__(self) -> None:
        self.routes = APIRouter()
        self.routes.add_api_route("/v1/responses", self._post, methods=["POST"])
        self.routes.add_api_route("/v1/responses/{response_id}", self.get, methods=["GET"])
        self.routes.add_api_route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])

    async def _post(self, request: Request) -> Any:
        return await self.edge.traced(request, "responses", self.create)

    def _owner(self, http: Request) -> str | None:
        principal = self.edge.principal(http)
        return None if principal.is_anonymous else principal.name

    def _check_owned(self, response_id: str, http: Request, param: str | None = None) -> None:
        """404 unless the caller has a stored response ``response_id``."""
        if not self.book.owns(response_id, self._owner(http)):
            raise _not_found(response_id, param)

    async def _close_dropped_sessions(self) -> None:
        """Close the sessions whose last response the book dropped (their KV freed); a
        service that does not answer leaves them to expire at the KV TTL."""
        for session_id in self.book.take_sessions_to_close():
            try:
                await self.kv.close(session_id)
            except RequestError as exc:
                log.warning("responses: session %s not closed: %s", session_id, exc)

    async def create(self, http: Request, root: Any) -> Any:
        """``POST /v1/responses``: a new response, stored by default (OpenAI's ``store``),
        continuing ``previous_response_id``'s conversation when given: the input items
        sent are only the new ones, the history is the server's, and the turn runs in
        the session the book gives it (``ResponseBook.begin``)."""
        principal = self.edge.principal(http)
        body = nulls_as_defaults(await self.edge.body(http))
        t_in = self.router.clock()
        vllm_api.check_fields("responses", body)
        owner = None if principal.is_anonymous else principal.name
        previous = body.get("previous_response_id")
        if isinstance(previous, str):
            self._check_owned(previous, http, "previous_response_id")
        else:
            previous = None
        store = body.get("store", True) is not False
        header = api.session_header(http.headers.get("x-session-id"))
        response_id = f"resp_{uuid.uuid4().hex}"
        session = self.book.begin(
            response_id, owner, previous=previous, store=store, named_session=header
        )
        completed = False

        def on_done() -> None:
            nonlocal completed
            completed = True

        async def settle() -> None:
            self.book.settle(response_id, completed)
            await self._close_dropped_sessions()

        try:
            response = await self.vllm.request(
                "responses",
                body,
                http,
                principal,
                root,
                t_in,
                session_id=session,
                sessionless=session is None,
                on_done=on_done,
                fields={"request_id": response_id},
            )
        except LimitExceeded as exc:
            await settle()
            if exc.code != "session_limit_exceeded" or header is not None:
                raise
            # A stored response's chain is a session of the key's: say how to free one.
            raise LimitExceeded(
                "this API key already owns its max_sessions sessions, one per stored "
                "chain of responses: delete a chain's last response (DELETE "
                "/v1/responses/{id}) to close its session, let one expire, or send "
                "store: false, which keeps no session",
                code=exc.code,
                param="store",
            ) from None
        except BaseException:
            await settle()
            raise
        if not isinstance(response, StreamingResponse):
            await settle()
            return response

        async def settled_at_end(events: AsyncIterable[Any]) -> AsyncIterator[Any]:
            try:
                async for event in events:
                    yield event
            finally:
                await settle()

        response.body_iterator = settled_at_end(response.body_iterator)
        return response

    async def get(
        self,
        response_id: str,
        request: Request,
        stream: bool = False,
        starting_after: int | None = None,
    ) -> Any:
        """``GET /v1/responses/{id}``: the caller's stored response (as vLLM keeps it)."""
        self._check_owned(response_id, request)
        if stream:
            # vLLM replays the events of background responses only, which kvtide does
            # not run: a stored response is read whole.
            raise UnsupportedParameter(
                "stream=true replays the events of background responses, which kvtide "
                "does not run; GET the stored response without stream",
                param="stream",
            )
        result = await self.vllm.serving.responses.retrieve_responses(
            response_id, starting_after=starting_after, stream=False
        )
        if hasattr(result, "error"):
            raise vllm_api.error_of(result)
        return JSONResponse(result.model_dump(mode="json", by_alias=True))

    async def delete(self, response_id: str, request: Request) -> dict[str, Any]:
        """``DELETE /v1/responses/{id}``: the stored response and its messages are
        forgotten (a later ``previous_response_id`` naming it is 404) and, when nothing
        continued it, its session is closed (the KV kept for it freed)."""
        self._check_owned(response_id, request)
        self.book.drop(response_id)
        await self.router.settled()  # its turn's hand-over booked before the close
        await self._close_dropped_sessions()
        return {"id": response_id, "object": "response", "deleted": True}
