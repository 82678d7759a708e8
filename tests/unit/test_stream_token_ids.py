"""``return_token_ids`` on a stream, as vLLM's server answers it: each chunk carries its
tokens' ids, the first the prompt's; together they are the unstreamed answer's (an
agent that extends its history in token ids can stream). Through kvtide's own layer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from ingress_harness import MODEL, bare_ingress, handle

PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


def _body(kind: str, **fields: Any) -> bytes:
    ask = (
        {"prompt": [5, 6, 7, 8]}
        if kind == "completion"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    return json.dumps({**body, **ask, **fields}).encode()


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_stream_returns_the_token_ids_of_the_unstreamed_answer(
    tiny_tokenizer: Any, kind: str
) -> None:
    ingress = bare_ingress(tiny_tokenizer)

    async def run() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        status, whole = await handle(ingress, PATHS[kind], _body(kind))
        assert status == 200, whole
        status, text = await handle(ingress, PATHS[kind], _body(kind, stream=True))
        assert status == 200, text
        events = [json.loads(line[6:]) for line in text.splitlines() if line[6:7] == "{"]
        return whole, events

    whole, events = asyncio.run(run())
    choices = [e["choices"][0] for e in events if e["choices"]]
    streamed = [i for c in choices for i in c["token_ids"]]
    assert streamed == whole["choices"][0]["token_ids"] and streamed
    first = events[0] if kind == "chat" else choices[0]
    # Where vLLM's server puts them: a chat's at the top, a completion's in its choice.
    assert (
        first["prompt_token_ids"]
        == (whole if kind == "chat" else whole["choices"][0])["prompt_token_ids"]
    )
    later = events[1:] if kind == "chat" else choices[1:]
    assert all("prompt_token_ids" not in e for e in later)


def test_without_return_token_ids_a_stream_carries_no_ids(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer)
    body = json.loads(_body("completion", stream=True))
    del body["return_token_ids"]
    status, text = asyncio.run(handle(ingress, PATHS["completion"], json.dumps(body).encode()))
    assert status == 200
    assert "token_ids" not in text
