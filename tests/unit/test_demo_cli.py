"""`kvtide demo` reads a streamed turn with the SDK's SSE reader (against a fake server)."""

from __future__ import annotations

import json

import httpx
import pytest

from orchestrator.cli.demo import stream_chat


def _sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def _client(body: bytes) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["x-session-id"] == "s1"
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return httpx.Client(base_url="http://kvtide", transport=httpx.MockTransport(handler))


def test_a_streamed_turn_becomes_one_row() -> None:
    body = _sse(
        {"choices": [{"delta": {"content": "Hello"}}]},
        {"choices": [{"delta": {"content": " there"}, "finish_reason": "stop"}]},
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 100,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 96},
            },
            "kvtide": {"kv_source": "sent_back"},
        },
    )
    with _client(body) as client:
        row = stream_chat(client, "m", [], max_tokens=3, session_id="s1", turn="2")
    assert row.answer == "Hello there" and row.kv_source == "sent_back"
    assert (row.num_prompt_tokens, row.num_cached_tokens, row.num_completion_tokens) == (
        100,
        96,
        3,
    )


def test_an_error_event_names_the_turn() -> None:
    body = _sse({"error": {"message": "deadline exceeded", "code": "deadline_exceeded"}})
    with _client(body) as client, pytest.raises(RuntimeError, match=r"turn 3: .*deadline"):
        stream_chat(client, "m", [], max_tokens=3, session_id="s1", turn="3")
