"""What every ingress route does with its HTTP request around its own work: the caller's
API key (``principal``), the JSON body read within its bounds (``body``), and one root
span and the request metrics per request (``traced``; a stream ends them when it ends).
Built by ``Ingress`` and held by each route group."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from opentelemetry.trace import Span

from orchestrator.config import KVTideConfig
from orchestrator.errors import RequestError
from orchestrator.kv.ownership import Principal
from orchestrator.observability import tracing as tr
from orchestrator.observability.metrics import Metrics, http_status
from orchestrator.serve import openai_api as api
from orchestrator.serve.auth import Authenticator
from orchestrator.serve.responses import ending

__all__ = ["Handler", "RequestEdge"]

Handler = Callable[[Request, Span], Awaitable[Any]]
"""A route's own work on a request, under the request's root span."""


@dataclass(slots=True, kw_only=True, eq=False)
class RequestEdge:
    """The ingress's handling of a request's key, body, span and metrics (see the module)."""

    config: KVTideConfig
    auth: Authenticator
    metrics: Metrics

    def principal(self, http: Request) -> Principal:
        return self.auth.authenticate(http.headers.get("authorization"))

    async def body(self, request: Request) -> dict[str, Any]:
        """The JSON body, refused (413) past ``server.max_request_bytes`` before it is
        read whole."""
        raw = await api.read_body(
            request.stream(),
            request.headers.get("content-length"),
            self.config.server.max_request_bytes,
            self.config.server.request_body_timeout_s,
        )
        return api.parse_body(raw, request.headers.get("content-type"))

    async def traced(self, request: Request, operation: str, handler: Handler) -> Any:
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
