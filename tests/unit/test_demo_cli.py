"""`kvtide demo` reads a streamed turn with the SDK's SSE reader (against a fake server)."""

from __future__ import annotations

import json

import httpx
import pytest

from orchestrator.cli.demo import TurnRow, format_turns, stream_chat


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


def _row(turn: str, source: str, ttft_s: float) -> TurnRow:
    return TurnRow(
        turn=turn,
        num_prompt_tokens=300,
        num_cached_tokens=0 if source == "recomputed" else 256,
        num_completion_tokens=8,
        ttft_s=ttft_s,
        tokens_per_s=100.0,
        kv_source=source,
        answer="",
    )


def test_a_later_turn_whose_pull_found_the_prefix_cache_still_shows_its_reuse() -> None:
    # Turn 3 pulled turn 2's KV, but the prefill engine had every block (0 bytes read).
    rows = [
        _row("1", "recomputed", 0.5),
        _row("2", "sent_back", 0.2),
        _row("3", "prefix_cache", 0.1),
        _row("fresh", "recomputed", 0.4),
    ]
    assert "turn 3 reused 256 prompt tokens: TTFT 4.0x lower" in format_turns(rows)


def test_a_later_turn_extended_on_decode_shows_its_reuse_and_where_its_kv_stayed() -> None:
    # kv.extend on (the default): turn 3's short increment ran where decode kept turn 2.
    rows = [
        _row("1", "recomputed", 0.5),
        _row("2", "sent_back", 0.2),
        _row("3", "extended", 0.05),
        _row("fresh", "recomputed", 0.4),
    ]
    table = format_turns(rows)
    assert "turn 3 reused 256 prompt tokens: TTFT 8.0x lower" in table
    assert "kept on decode, only the new tokens prefilled there" in table
