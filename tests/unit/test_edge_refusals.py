"""Refusals at the API edge, through the ingress's own routes (no Ray): what a client
sends that kvtide does not serve gets a 400 naming it, in the client's own text."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ingress_harness import MODEL, bare_ingress, handle

CHAT = "/v1/chat/completions"


def _chat(**fields: object) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return json.dumps({**body, **fields}).encode()


def test_a_non_ascii_session_id_is_refused_naming_it_as_sent(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer, vllm=False)
    # The header's bytes are UTF-8, as any HTTP client sends "café-1"; the ASGI server
    # hands them over read as Latin-1.
    raw = "café-1".encode().decode("latin-1")
    status, body = asyncio.run(handle(ingress, CHAT, _chat(), x_session_id=raw))
    assert status == 400 and body["error"]["param"] == "x-session-id"
    assert "'café-1'" in body["error"]["message"]
    assert "Ã" not in body["error"]["message"]
    assert "ASCII" in body["error"]["message"]
