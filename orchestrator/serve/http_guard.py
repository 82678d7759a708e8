"""Checks on a request's headers made before any framework code reads them.

Ray Serve decodes some headers itself before the app sees the request: the session id
(``x-session-id``, Serve's ``RAY_SERVE_SESSION_ID_HEADER_KEY``), the multiplexed model
id and the request id, with ``bytes.decode()``, in its proxy and in a direct-ingress
replica's ASGI entry (``ray.serve._private.replica``/``proxy``). A byte that is not
UTF-8 there raises, and the client gets Serve's plain-text ``500 Internal Server
Error`` instead of kvtide's answer. ``HeaderGuard`` sits outside Serve's ASGI app and
answers such a request with kvtide's 400 naming the header.

Serve applies the middlewares that ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names
(a function returning Starlette ``Middleware``) around its proxy's app and around every
direct-ingress replica's: ``orchestrator.runtime`` sets it to ``middlewares`` below for
the processes a local Ray starts (``MIDDLEWARE_ENV``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from orchestrator.errors import InvalidRequest

__all__ = ["MIDDLEWARE_ENV", "HeaderGuard", "bad_header", "middlewares"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]
]

MIDDLEWARE_ENV = {
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "orchestrator.serve.http_guard.middlewares"
}
"""What makes Serve wrap its HTTP entry points in ``HeaderGuard``."""


def _decoded_names() -> frozenset[bytes]:
    """The headers Serve decodes, by their name as it matches them (lowercase, ``-`` and
    ``_`` alike)."""
    session = os.environ.get("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id")
    names = (session, "serve_multiplexed_model_id", "x-request-id")
    return frozenset(n.lower().replace("-", "_").encode() for n in names)


def bad_header(headers: list[tuple[bytes, bytes]], names: frozenset[bytes]) -> str | None:
    """The name of the first header among ``names`` whose value is not UTF-8, or None."""
    for key, value in headers:
        if key.lower().replace(b"-", b"_") in names:
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                return key.decode("latin-1").lower()
    return None


class HeaderGuard:
    """ASGI middleware: a request whose Serve-decoded headers are not UTF-8 gets a 400
    OpenAI-style body naming the header; anything else passes through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.names = _decoded_names()

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope.get("type") == "http":
            name = bad_header(list(scope.get("headers") or ()), self.names)
            if name is not None:
                await _refuse(send, name)
                return
        await self.app(scope, receive, send)


async def _refuse(send: Callable[[Message], Awaitable[None]], name: str) -> None:
    error = InvalidRequest(
        f"the {name} header holds a byte that is not UTF-8; "
        + (
            "send 1-128 characters of letters, digits and ._:-"
            if name.replace("_", "-") == "x-session-id"
            else "send it as ASCII text"
        ),
        param=name,
    )
    body = json.dumps(error.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status_code,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def middlewares() -> list[Any]:
    """Serve's middleware callback (``MIDDLEWARE_ENV``)."""
    from starlette.middleware import Middleware

    return [Middleware(HeaderGuard)]
