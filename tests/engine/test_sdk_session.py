"""The Python SDK against the running app: sessions, KV sources, close, retries."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
import pytest
from app_calls import pulled

from orchestrator.sdk import AsyncClient, Client, format_turns

pytestmark = pytest.mark.engine

WORDS = "cache token prefill decode engine session rack domain tensor block layer".split()


def _text(num_words: int) -> str:
    """Words no other test sends: a turn 1 that finds nothing in the prefix cache."""
    tag = uuid.uuid4().hex[:8]
    return tag + " " + " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(num_words))


def _record(app: Any, session_id: str) -> dict[str, Any] | None:
    body = httpx.get(f"{app.base_url}/kvtide/sessions/{session_id}", timeout=30).json()
    record: dict[str, Any] | None = body["record"]
    return record


def test_a_three_turn_session_reports_where_its_kv_came_from(kvtide_app: Any) -> None:
    with Client(kvtide_app.base_url) as client, client.session(renew_every_s=None) as s:
        t1 = s.send(_text(900) + "\nSummarise.", max_tokens=12, temperature=0)
        rec1 = _record(kvtide_app, s.id)
        t2 = s.send("Which engine keeps the cache?", max_tokens=12, temperature=0)
        rec2 = _record(kvtide_app, s.id)
        t3 = s.send("And after the TTL?", max_tokens=12, temperature=0)
        sources = [t.kv_source for t in s.turns]
        assert sources[0] == "recomputed", [t.kvtide for t in s.turns]
        for before, turn in zip(s.turns, s.turns[1:], strict=False):
            pulled(turn.kvtide, (before.prompt_tokens, before.completion_tokens))
        # What the SDK reports is what the server booked: turn n+1 reused turn n's record.
        assert rec1 is not None and rec2 is not None
        assert t2.cached_tokens >= rec1["num_tokens"] - 128  # whole blocks
        assert t3.cached_tokens >= rec2["num_tokens"] - 128
        assert t1.prompt_tokens < t2.prompt_tokens < t3.prompt_tokens
        assert len(s.messages) == 6 and all(t.ttft_s and t.ttft_s > 0 for t in s.turns)
        assert sources[-1] in format_turns(s.turns)


def test_closing_a_session_releases_its_kv(kvtide_app: Any) -> None:
    with Client(kvtide_app.base_url) as client:
        session = client.session(renew_every_s=None)
        session.send(_text(200), max_tokens=8, temperature=0)
        record = _record(kvtide_app, session.id)
        assert record is not None
        before = client.stats()["kv"]
        session.close()
        assert _record(kvtide_app, session.id) is None
        after = client.stats()["kv"]
        # Released (and drained back to prefill, so decode frees the blocks now).
        assert after["num_releases"] > before["num_releases"]
        assert after["num_sessions"] < before["num_sessions"]


def test_a_retried_turn_is_not_run_twice(kvtide_app: Any) -> None:
    session_id = f"it-retry-{uuid.uuid4().hex[:8]}"
    key = uuid.uuid4().hex
    body = {
        "model": kvtide_app.model,
        "messages": [{"role": "user", "content": _text(100)}],
        "max_tokens": 8,
        "temperature": 0,
    }
    headers = {"x-session-id": session_id, "idempotency-key": key}
    url = kvtide_app.base_url + "/v1/chat/completions"
    first = httpx.post(url, json=body, headers=headers, timeout=300)
    assert first.status_code == 200, first.text
    record = _record(kvtide_app, session_id)
    # The client lost the answer and sends the same turn again, streamed this time.
    again = httpx.post(url, json={**body, "stream": True}, headers=headers, timeout=300)
    assert again.status_code == 200 and again.headers["x-kvtide-replayed"] == "true"
    chunks = [
        json.loads(line[6:]) for line in again.text.splitlines() if line.startswith("data: {")
    ]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == first.json()["choices"][0]["message"]["content"]
    assert {c["id"] for c in chunks} == {first.json()["id"]}  # the same turn, replayed
    # The session's KV is still the one turn's: nothing ran a second time.
    after = _record(kvtide_app, session_id)
    assert record is not None and after is not None
    assert (after["engine_id"], after["num_tokens"]) == (record["engine_id"], record["num_tokens"])


def test_the_async_client_runs_a_session(kvtide_app: Any) -> None:
    async def run() -> list[Any]:
        async with AsyncClient(kvtide_app.base_url) as client:
            async with client.session(renew_every_s=None) as session:
                await session.send(_text(150), max_tokens=8, temperature=0)
                stream = await session.stream("go on", max_tokens=8, temperature=0)
                deltas = [d async for d in stream]
                assert "".join(deltas) == stream.result.text
                return list(session.turns)

    first, second = asyncio.run(run())
    assert first.kv_source == "recomputed"
    pulled(second.kvtide, (first.prompt_tokens, first.completion_tokens))
