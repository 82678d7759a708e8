"""A multi-turn session reuses its KV: the decode engine sends it back to prefill."""

from __future__ import annotations

import random
from functools import partial
from typing import Any

import pytest
from app_calls import chat, pulled, usage_of
from ray import serve

from engines.base import EngineStats, GenerateRequest

pytestmark = pytest.mark.engine

WORDS = "cache token prefill decode engine session rack domain tensor block layer".split()


def _stats(pool: str) -> EngineStats:
    handle = serve.get_deployment_handle(f"{pool}-pool", app_name="kvtide")
    stats: EngineStats = handle.stats.remote().result()
    return stats


_chat = partial(chat, max_tokens=16)


def _single_engine(prompt_ids: list[int], max_tokens: int) -> list[int]:
    handle = serve.get_deployment_handle("decode-pool", app_name="kvtide").options(stream=True)
    req = GenerateRequest(
        request_id=f"ref-{random.random()}", prompt_token_ids=prompt_ids, max_tokens=max_tokens
    )
    return [t for chunk in handle.generate.remote(req) for t in chunk.token_ids]


def test_three_turn_session_pulls_kv_back_from_decode(kvtide_app: Any) -> None:
    rng = random.Random(42)
    document = " ".join(rng.choice(WORDS) for _ in range(2600))
    messages = [{"role": "user", "content": document + "\nSummarise."}]
    session = "it-three-turns"

    # Turn 1: nothing to reuse; the prompt is long (>= 2,000 tokens).
    t1 = _chat(kvtide_app, messages, session)
    assert t1["usage"]["prompt_tokens"] >= 2000
    assert t1["kvtide"]["kv_plan_reason"] == "no_record"

    # Turn 2: history + answer + a new question. The decode engine kept turn 1's KV
    # (prompt + answer); the prefill engine pulls it back over NIXL.
    prefill_before = _stats("prefill")
    messages += [
        {"role": "assistant", "content": t1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Which engine keeps the cache?"},
    ]
    t2 = _chat(kvtide_app, messages, session)
    prefill_after = _stats("prefill")
    # Read back over NIXL: the chat template's closing tokens and the answer end a block
    # the prefill engine never computed.
    assert pulled(t2["kvtide"], usage_of(t1)) == "moved"
    # The turn's prompt extends turn 1's tokens exactly (the model's own answer tokens).
    covered = t1["prompt_token_ids"] + t1["choices"][0]["token_ids"]
    assert t2["prompt_token_ids"][: len(covered)] == covered
    # Everything turn 1 covered was reused, short of the last token (never computed).
    assert t2["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(covered) - 1 - 128
    assert prefill_after.kv_transfer_bytes > prefill_before.kv_transfer_bytes
    assert prefill_after.num_kv_transfers > prefill_before.num_kv_transfers
    # Same output as recomputing the same tokens on one engine.
    assert _single_engine(t2["prompt_token_ids"], 16) == t2["choices"][0]["token_ids"]

    # Turn 3 reuses turn 2's KV the same way.
    messages += [
        {"role": "assistant", "content": t2["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And after the TTL?"},
    ]
    t3 = _chat(kvtide_app, messages, session)
    pulled(t3["kvtide"], usage_of(t2))
    cached = t3["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > t2["usage"]["prompt_tokens"] - 129


def test_rewritten_history_is_recomputed_not_reused(kvtide_app: Any) -> None:
    session = "it-rewritten"
    messages = [{"role": "user", "content": " ".join(WORDS * 30)}]
    t1 = _chat(kvtide_app, messages, session)
    # The client drops its first message and rewrites the answer (as agents that strip
    # reasoning do): the recorded KV no longer matches the prompt's prefix.
    rewritten = [
        {"role": "user", "content": " ".join(reversed(WORDS * 30))},
        {"role": "assistant", "content": "a shorter answer"},
        {"role": "user", "content": "go on"},
    ]
    t2 = _chat(kvtide_app, rewritten, session)
    assert t1["kvtide"]["kv_plan_reason"] == "no_record"
    assert t2["kvtide"]["kv_plan"] == "recompute"
    assert t2["kvtide"]["kv_plan_reason"] == "prefix_mismatch"
    assert _single_engine(t2["prompt_token_ids"], 16) == t2["choices"][0]["token_ids"]
