"""A request's ``n`` choices under its key's limits and admission, through the ingress's
real routes and vLLM's serving layer (``ingress_harness``): each choice is a sequence on
the pools, so ``n`` counts ``n`` against ``max_concurrent_requests`` and admission, and
every choice is capped at the key's ``max_tokens``, not only the one that carries the
session. Batched prompts, which vLLM's layer would run as requests of their own, are
refused as on kvtide's own layer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ingress_harness import MODEL, bare_ingress, handle
from test_admission_ingress import Clock

from orchestrator.serve.auth import hash_key

KEY = "kvt-team-a-key"
BEARER = {"authorization": f"Bearer {KEY}"}


def keyed(tiny_tokenizer: Any, **limits: int) -> Any:
    entry = {"name": "team-a", "sha256": hash_key(KEY), **limits}
    return bare_ingress(tiny_tokenizer, max_model_len=1024, api_keys=[entry])


def chat(**fields: Any) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


def test_every_choice_is_capped_at_the_keys_max_tokens(tiny_tokenizer: Any) -> None:
    ingress = keyed(tiny_tokenizer, max_tokens=2)
    status, body = asyncio.run(
        handle(ingress, "/v1/chat/completions", chat(n=4), x_session_id="s1", **BEARER)
    )
    assert status == 200, body
    assert len(body["choices"]) == 4
    decodes = ingress.router.decode.requests
    assert len(decodes) == 4
    # The session's choice and the three others alike (they once ran to the context).
    assert sorted(r.max_tokens for r in decodes) == [2, 2, 2, 2]


def test_n_counts_n_against_the_keys_concurrency(tiny_tokenizer: Any) -> None:
    ingress = keyed(tiny_tokenizer, max_concurrent_requests=2)
    principal = ingress.routes.edge.auth.authenticate(BEARER["authorization"])

    async def run() -> None:
        # More choices than the key may ever run: refused for good, naming n.
        status, body = await handle(ingress, "/v1/chat/completions", chat(n=3), **BEARER)
        assert status == 429, body
        assert (body["error"]["code"], body["error"]["param"]) == ("n_over_key_limit", "n")
        assert "n is 3" in body["error"]["message"]
        assert "max_concurrent_requests" in body["error"]["message"]
        # One request of the key in flight: one of two choices is one too many.
        held = ingress.gate.acquire(principal)
        status, body = await handle(ingress, "/v1/chat/completions", chat(n=2), **BEARER)
        assert status == 429 and body["error"]["code"] == "concurrency_limit_exceeded"
        assert ingress.router.decode.requests == []  # nothing ran
        assert ingress.gate.num_in_flight(principal) == 1  # the refusals hold nothing
        ingress.gate.release(held)
        status, body = await handle(ingress, "/v1/chat/completions", chat(n=2), **BEARER)
        assert status == 200 and len(body["choices"]) == 2
        assert ingress.gate.num_in_flight(principal) == 0

    asyncio.run(run())


def test_admission_counts_every_choice(tiny_tokenizer: Any) -> None:
    ingress = keyed(tiny_tokenizer)
    clock = Clock()
    ingress.admission.clock = clock
    # The decode engine has 61 requests waiting of the 64 it is allowed, and runs.
    decode = {"num_running": 4, "num_waiting": 61, "kv_cache_usage": 0.5, "age_s": 0.5}
    ingress.admission.observe({"decode-r2": {**decode, "num_requests": 7}})

    async def run() -> None:
        status, body = await handle(ingress, "/v1/chat/completions", chat(n=4), **BEARER)
        assert status == 503 and body["error"]["code"] == "overloaded", body
        assert "decode pool is full for 4 more sequences" in body["error"]["message"]
        assert ingress.router.decode.requests == []
        status, body = await handle(ingress, "/v1/chat/completions", chat(n=3), **BEARER)
        assert status == 200 and len(body["choices"]) == 3
        # More choices than an engine ever queues: a 400 naming n, not a 503 to retry.
        status, body = await handle(ingress, "/v1/chat/completions", chat(n=65), **BEARER)
        assert status == 400 and body["error"]["param"] == "n", body
        assert "admission.max_waiting_per_engine" in body["error"]["message"]

    asyncio.run(run())


def test_batched_prompts_with_n_are_refused_naming_the_prompt(tiny_tokenizer: Any) -> None:
    ingress = keyed(tiny_tokenizer)
    for prompt in (["one", "two"], [[5, 6], [7, 8]]):
        body = json.dumps({"model": MODEL, "prompt": prompt, "n": 2, "max_tokens": 2})
        status, reply = asyncio.run(handle(ingress, "/v1/completions", body.encode(), **BEARER))
        assert status == 400, reply
        assert reply["error"]["param"] == "prompt"
        assert "batched prompts are not supported" in reply["error"]["message"]
    assert ingress.router.decode.requests == []
    # One prompt (also in a one-item list) with n is served.
    body = json.dumps({"model": MODEL, "prompt": ["one"], "n": 2, "max_tokens": 2})
    status, reply = asyncio.run(handle(ingress, "/v1/completions", body.encode(), **BEARER))
    assert status == 200 and len(reply["choices"]) == 2
