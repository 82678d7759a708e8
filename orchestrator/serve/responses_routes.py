"""The Responses API (``/v1/responses``) in the ingress: vLLM's ``OpenAIServingResponses``
over kvtide's turn, with stored responses owned by API keys and a chain of them run as
one kvtide session (``orchestrator.serve.responses_api``).

A mixin of ``Ingress``, beside ``VLLMRoutes`` (whose guarded turn it uses).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from orchestrator.errors import ResponseNotFound
from orchestrator.kv.ownership import Principal
from orchestrator.serve import vllm_api
from orchestrator.serve.responses_api import ResponseBook

__all__ = ["ResponsesRoutes"]


def _not_found(response_id: str, param: str | None = None) -> ResponseNotFound:
    shown = response_id if response_id.isprintable() and len(response_id) <= 128 else "?"
    return ResponseNotFound(f"Response with id '{shown}' not found.", param)


class ResponsesRoutes:
    """``Ingress``'s Responses API (the attributes used are the ingress's)."""

    vllm: vllm_api.VLLMServing
    response_book: ResponseBook
    _principal: Callable[[Request], Principal]
    _body: Callable[[Request], Awaitable[dict[str, Any]]]
    _vllm_request: Callable[..., Awaitable[Any]]

    def _owned(self, response_id: str, http: Request, param: str | None = None) -> str:
        """The session of the caller's stored response ``response_id`` (404 if none)."""
        principal = self._principal(http)
        owner = None if principal.is_anonymous else principal.name
        session = self.response_book.session_of(response_id, owner)
        if session is None:
            raise _not_found(response_id, param)
        return session

    async def _responses_create(self, http: Request, root: Any) -> Any:
        """``POST /v1/responses``: a new response, stored by default (OpenAI's ``store``),
        continuing ``previous_response_id``'s conversation when given: the input items
        sent are only the new ones, the history is the server's, and the turn runs in
        that chain's kvtide session (its KV pulled back)."""
        principal = self._principal(http)
        body = await self._body(http)
        t_in = time.monotonic()
        vllm_api.check_fields("responses", body)
        owner = None if principal.is_anonymous else principal.name
        previous = body.get("previous_response_id")
        session = None
        if isinstance(previous, str):
            session = self._owned(previous, http, "previous_response_id")
        response_id = f"resp_{uuid.uuid4().hex}"
        chain = session or response_id  # a chain's session is named by its first response
        on_done = None
        if body.get("store", True) is not False:

            def on_done() -> None:
                self.response_book.keep(response_id, owner, chain)

        return await self._vllm_request(
            "responses",
            body,
            http,
            principal,
            root,
            t_in,
            session_id=chain,
            on_done=on_done,
            fields={"request_id": response_id},
        )

    async def _responses_get(
        self, response_id: str, http: Request, stream: bool, starting_after: int | None
    ) -> Any:
        """``GET /v1/responses/{id}``: the caller's stored response (as vLLM keeps it)."""
        self._owned(response_id, http)
        result = await self.vllm.responses.retrieve_responses(
            response_id, starting_after=starting_after, stream=stream
        )
        if hasattr(result, "error"):
            raise vllm_api.error_of(result)
        if hasattr(result, "model_dump"):
            return JSONResponse(result.model_dump(mode="json", by_alias=True))
        return StreamingResponse(vllm_api.sse_events(result), media_type="text/event-stream")

    async def _responses_delete(self, response_id: str, http: Request) -> dict[str, Any]:
        """``DELETE /v1/responses/{id}``: the stored response and its messages are
        forgotten (a later ``previous_response_id`` naming it is 404)."""
        self._owned(response_id, http)
        self.response_book.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
