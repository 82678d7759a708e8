"""Bounds and checks at the edge: a request body that arrives too slowly is a 408 (not a
handler waiting forever); the KV service's per-session state has a bound in bytes from
the config; stop strings are bounded in bytes; the flags of a continued message are
checked as docs/api.md says; config refuses what would crash ``kvtide up`` later; no
route answers without a key."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fastapi import APIRouter
from ingress_harness import MODEL, bare_ingress, http_request
from starlette.requests import Request
from test_kv_service import Cluster

from orchestrator.config import parse_config
from orchestrator.errors import ConfigError, InvalidRequest, RequestTimeout
from orchestrator.kv.messages import TurnDone
from orchestrator.serve.ingress import serving_app
from orchestrator.serve.requests import parse_chat


def test_a_body_that_stops_arriving_is_a_408(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer, request_body_timeout_s=0.05)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})

    async def run() -> None:
        never = asyncio.Event()
        parts = [body.encode()[:10]]

        async def receive() -> dict[str, Any]:
            if parts:  # 10 bytes of the declared body, then nothing more
                return {"type": "http.request", "body": parts.pop(), "more_body": True}
            await never.wait()
            raise AssertionError("unreachable")

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
        with pytest.raises(RequestTimeout) as err:
            await asyncio.wait_for(ingress.routes.own.chat(Request(scope, receive), None), 5.0)
        assert err.value.status_code == 408
        assert "server.request_body_timeout_s" in err.value.message
        assert "10 bytes" in err.value.message

    asyncio.run(run())


def test_the_services_session_state_is_bounded_in_bytes() -> None:
    c = Cluster()
    # Each session's last turn: 200 token ids (800 bytes); room for 5 of them.
    service = c.new_service(session_state_max_bytes=4_000)

    async def run() -> None:
        for n in range(10):
            await service.turn_done(
                TurnDone(session_id=f"s{n}", token_ids=[1], next_token_ids=list(range(200)))
            )
        assert len(service.tokens) == 5
        assert service.tokens.token_ids("s0") is None  # the oldest went first
        assert service.tokens.token_ids("s9") is not None

    asyncio.run(run())


def test_the_bound_is_in_the_config() -> None:
    assert parse_config({}).kv.session_state_max_mib == 1024.0
    assert parse_config({"kv": {"session_state_max_mib": 8}}).kv.session_state_max_mib == 8
    assert parse_config({}).server.request_body_timeout_s == 30.0


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def test_stop_strings_are_bounded_in_bytes() -> None:
    big = "x" * 900_000
    with pytest.raises(InvalidRequest) as err:
        parse_chat(_chat(stop=[big, big, big, big]), MODEL)
    assert err.value.param == "stop" and "4096" in err.value.message
    assert parse_chat(_chat(stop=["x" * 1024] * 4), MODEL).sampling.stop[0] == "x" * 1024
    # Counted in UTF-8 bytes: 2,049 "é" are 4,098 bytes.
    with pytest.raises(InvalidRequest) as err:
        parse_chat(_chat(stop=["é" * 2049]), MODEL)
    assert err.value.param == "stop"


def test_continuing_the_final_message_needs_add_generation_prompt_false() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    body = {"model": MODEL, "messages": messages, "continue_final_message": True}
    with pytest.raises(InvalidRequest) as err:
        parse_chat(body, MODEL)
    assert err.value.param == "add_generation_prompt"
    assert "add_generation_prompt: false" in err.value.message
    assert parse_chat({**body, "add_generation_prompt": False}, MODEL).continue_final_message


def test_config_refuses_a_route_prefix_serve_would_crash_on_and_a_multiline_model_name() -> None:
    for section, field, value in [
        ("server", "route_prefix", "v1"),
        ("server", "route_prefix", "/v1/"),
        ("model", "name", "qwen\nx"),
        ("model", "name", "bell\x07"),
    ]:
        with pytest.raises(ConfigError) as err:
            parse_config({section: {field: value}})
        assert err.value.field == f"{section}.{field}"
    assert parse_config({"server": {"route_prefix": "/kvtide"}}).server.route_prefix == "/kvtide"


ROUTES = {
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/kvtide/stats"),
    ("POST", "/kvtide/integrity/reuse"),
    ("GET", "/kvtide/sessions/{session_id}"),
    ("POST", "/kvtide/sessions/{session_id}/renew"),
    ("DELETE", "/kvtide/sessions/{session_id}"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
}
"""Every route the ingress serves (docs/api.md, sdk.md, auth.md, observability.md), and
no other."""


async def _asgi(app: Any, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """The app's answer to one POST, as Serve's proxy hands it over."""
    sent: list[dict[str, Any]] = []
    request, receive = http_request(path, body)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    try:
        await app(request.scope, receive, send)
    except Exception:
        # Starlette raises an unhandled error again once its handler has answered (for
        # the server's log); the answer is what was sent.
        pass
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(payload)


def test_the_app_serves_the_route_groups_and_no_schema(tiny_tokenizer: Any) -> None:
    app = serving_app(bare_ingress(tiny_tokenizer).routes.routers())
    served = {(m, r.path) for r in app.routes for m in getattr(r, "methods", None) or ()}
    assert served == ROUTES
    # It would answer without a key; the API is described in docs/api.md.
    assert app.openapi_url is None and app.docs_url is None
    # A refusal is the app's OpenAI-style body with its status.
    status, body = asyncio.run(_asgi(app, "/v1/chat/completions", b"{"))
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body


def test_an_unexpected_failure_is_a_500_that_names_nothing_internal() -> None:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def fail() -> None:
        raise RuntimeError("ActorDiedError: actor 4f2a pid=4242 in /opt/kvtide/x.py")

    status, body = asyncio.run(_asgi(serving_app([router]), "/v1/chat/completions", b"{}"))
    assert status == 500
    assert body["error"]["code"] == "internal_error" and body["error"]["type"] == "server_error"
    assert not any(word in json.dumps(body) for word in ("Actor", "4242", "/opt", "RuntimeError"))
