"""Refusals at the API edge, through the ingress's own routes (no Ray): what a client
sends that kvtide does not serve gets a 400 naming it, in the client's own text."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from ingress_harness import MODEL, bare_ingress, handle

from orchestrator.serve.openai_api import may_extend

CHAT = "/v1/chat/completions"


def _chat(**fields: object) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return json.dumps({**body, **fields}).encode()


def test_a_non_ascii_session_id_is_refused_naming_it_as_sent(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer)
    # The header's bytes are UTF-8, as any HTTP client sends "café-1"; the ASGI server
    # hands them over read as Latin-1.
    raw = "café-1".encode().decode("latin-1")
    status, body = asyncio.run(handle(ingress, CHAT, _chat(), x_session_id=raw))
    assert status == 400 and body["error"]["param"] == "x-session-id"
    assert "'café-1'" in body["error"]["message"]
    assert "Ã" not in body["error"]["message"]
    assert "ASCII" in body["error"]["message"]


def test_an_unknown_kv_plan_header_is_refused_naming_it(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer)
    status, body = asyncio.run(handle(ingress, CHAT, _chat(), x_kvtide_kv_plan="extend"))
    assert status == 400 and body["error"]["param"] == "x-kvtide-kv-plan"
    assert "must be auto or pull; got 'extend'" in body["error"]["message"]
    # The values it takes run the turn.
    for value in ("auto", "pull"):
        status, body = asyncio.run(handle(ingress, CHAT, _chat(), x_kvtide_kv_plan=value))
        assert status == 200, body
    # pull: the turn may not extend (test_router_extend::test_a_turn_that_may_not_extend_pulls).
    assert [may_extend(v) for v in (None, "auto", "pull")] == [True, True, False]


ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
}


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize(
    "field,value", [("cache_salt", "tenant-a"), ("priority", 5), ("priority", -1)]
)
def test_fields_the_pd_path_would_drop_are_refused_naming_them(
    tiny_tokenizer: Any, path: str, field: str, value: object
) -> None:
    """On every route, whether kvtide's own layer or vLLM's would serve the rest of the
    request (``logprobs`` sends a chat or completion to vLLM's)."""
    ingress = bare_ingress(tiny_tokenizer)
    extras: list[dict[str, object]] = [{}]
    if path != "/v1/responses":
        extras.append({"logprobs": True if path == "/v1/chat/completions" else 1})
    for extra in extras:
        body = {"model": MODEL, **ROUTES[path], "max_tokens": 2, **extra, field: value}
        if path == "/v1/responses":
            body["max_output_tokens"] = body.pop("max_tokens")
        status, reply = asyncio.run(handle(ingress, path, json.dumps(body).encode()))
        assert status == 400, reply
        assert reply["error"]["param"] == field
        assert f"{field} is not supported" in reply["error"]["message"]
    assert ingress.router.decode.requests == []  # nothing ran


@pytest.mark.parametrize("path", list(ROUTES))
def test_their_defaults_ask_for_nothing_and_are_served(tiny_tokenizer: Any, path: str) -> None:
    ingress = bare_ingress(tiny_tokenizer)
    body = {"model": MODEL, **ROUTES[path], "priority": 0, "cache_salt": None}
    status, reply = asyncio.run(handle(ingress, path, json.dumps(body).encode()))
    assert status == 200, reply
