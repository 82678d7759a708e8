"""Headers Ray Serve decodes itself are checked before it does: a byte that is not UTF-8
in ``x-session-id`` is kvtide's 400 naming the header, not Serve's plain-text 500.

The app under the guard decodes the header exactly as Serve's direct-ingress replica
does (``ray.serve._private.http_util.parse_session_id_header``), and the guard is
applied by Serve's own middleware hook from the import path kvtide configures."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest
from ray.serve._private.http_util import (
    _apply_middlewares,
    parse_session_id_header,
    validate_http_proxy_callback_return,
)
from ray.serve._private.utils import call_function_from_import_path

from orchestrator.config import parse_config
from orchestrator.runtime import local_ray_env
from orchestrator.serve.http_guard import MIDDLEWARE_ENV


async def serve_entry(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """What a direct-ingress replica does first with a request's headers."""
    session_id = parse_session_id_header(dict(scope["headers"]))
    body = json.dumps({"session_id": session_id}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def call(app: Any, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


def guarded() -> Any:
    (path,) = MIDDLEWARE_ENV.values()
    found = validate_http_proxy_callback_return(call_function_from_import_path(path))
    return _apply_middlewares(serve_entry, found)


def test_serve_itself_fails_on_a_non_utf8_session_id() -> None:
    with pytest.raises(UnicodeDecodeError):
        call(serve_entry, [(b"x-session-id", b"s\xff1")])


def test_a_non_utf8_session_id_is_a_400_naming_the_header() -> None:
    status, body = call(guarded(), [(b"x-session-id", b"s\xff1")])
    assert status == 400
    assert body["error"]["param"] == "x-session-id"
    assert "x-session-id" in body["error"]["message"] and "UTF-8" in body["error"]["message"]
    # Serve's other decoded headers too, whatever the spelling Serve matches.
    status, body = call(guarded(), [(b"serve-multiplexed-model-id", b"\xc3(")])
    assert status == 400 and body["error"]["param"] == "serve-multiplexed-model-id"
    status, body = call(guarded(), [(b"x-request-id", b"r\xff")])
    assert status == 400 and body["error"]["param"] == "x-request-id"


def test_good_headers_pass_through_untouched() -> None:
    status, body = call(guarded(), [(b"x-session-id", b"s1"), (b"x-other", b"\xff")])
    assert (status, body) == (200, {"session_id": "s1"})


def test_a_local_ray_applies_the_guard() -> None:
    env = local_ray_env(parse_config({"ray": {"direct_ingress": False}}))
    assert all(env[k] == v for k, v in MIDDLEWARE_ENV.items())
    assert "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH" not in os.environ
