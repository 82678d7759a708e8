"""API keys on the real ingress: 401 without a valid key, 404 for another key's session,
429 over a key's limits, and none of these leaves state behind.

A second ingress with keys configured is deployed as its own Serve application under
``/keys``, in front of the shared app's engine pools (no extra engines).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from app_calls import pulled, usage_of
from ray import serve

from orchestrator.config import ApiKeyConfig
from orchestrator.runtime import APP_NAME
from orchestrator.serve.auth import hash_key
from orchestrator.serve.ingress import Ingress

pytestmark = pytest.mark.engine

ALICE, BOB = "kvt-alice-test-key", "kvt-bob-test-key"
WORDS = "cache token prefill decode engine session rack domain tensor block layer".split()


@pytest.fixture(scope="module")
def keyed(kvtide_app: Any) -> Iterator[str]:
    config = kvtide_app.config
    keys = (
        ApiKeyConfig(
            name="alice",
            sha256=hash_key(ALICE),
            max_prompt_tokens=1000,
            max_tokens=16,
            max_concurrent_requests=1,
        ),
        ApiKeyConfig(name="bob", sha256=hash_key(BOB)),
    )
    keyed_config = config.model_copy(
        update={"server": config.server.model_copy(update={"api_keys": keys})}
    )
    prefill = serve.get_deployment_handle("prefill-pool", app_name=APP_NAME)
    decode = serve.get_deployment_handle("decode-pool", app_name=APP_NAME)
    serve.run(Ingress.bind(keyed_config, prefill, decode), name="kvtide-keys", route_prefix="/keys")
    yield kvtide_app.base_url + "/keys"
    serve.delete("kvtide-keys")


def _chat(
    url: str, key: str | None, session: str | None, words: int = 300, **body: Any
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if session:
        headers["x-session-id"] = session
    payload = {
        "model": "kvtide-tiny",
        "messages": [{"role": "user", "content": " ".join(WORDS[i % 11] for i in range(words))}],
        "max_tokens": 8,
        "temperature": 0,
        **body,
    }
    return httpx.post(url + "/v1/chat/completions", json=payload, headers=headers, timeout=300)


def _session(url: str, key: str, session: str) -> httpx.Response:
    return httpx.get(
        f"{url}/kvtide/sessions/{session}",
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )


def _error(resp: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = resp.json()["error"]
    return error


def test_requests_without_a_valid_key_are_refused(keyed: str) -> None:
    for key, why in [(None, "missing API key"), ("kvt-wrong", "invalid API key")]:
        resp = _chat(keyed, key, "it-keys-nokey")
        assert resp.status_code == 401 and why in _error(resp)["message"]
        assert _error(resp)["code"] == "invalid_api_key"
        assert resp.headers["www-authenticate"].startswith("Bearer")
        assert "kvt-wrong" not in resp.text
    resp = httpx.get(keyed + "/v1/models", timeout=30)
    assert resp.status_code == 401
    # Nothing was started for the session the refused requests named.
    assert _session(keyed, ALICE, "it-keys-nokey").status_code == 404


def test_another_keys_session_is_not_found_and_stays_intact(keyed: str) -> None:
    first = _chat(keyed, ALICE, "it-keys-alice")
    assert first.status_code == 200, first.text
    record = _session(keyed, ALICE, "it-keys-alice").json()["record"]
    assert record is not None

    unknown = _session(keyed, BOB, "it-keys-nobody")
    for resp in (
        _session(keyed, BOB, "it-keys-alice"),
        _chat(keyed, BOB, "it-keys-alice"),
        httpx.delete(
            f"{keyed}/kvtide/sessions/it-keys-alice",
            headers={"authorization": f"Bearer {BOB}"},
            timeout=60,
        ),
    ):
        # Exactly what an unknown session gets: bob learns nothing about alice's.
        assert resp.status_code == 404 == unknown.status_code
        assert _error(resp)["code"] == _error(unknown)["code"] == "session_not_found"
        assert _error(resp)["message"].replace("it-keys-alice", "X") == _error(unknown)[
            "message"
        ].replace("it-keys-nobody", "X")

    after = _session(keyed, ALICE, "it-keys-alice").json()["record"]
    assert after is not None and after["num_tokens"] == record["num_tokens"]
    body = first.json()
    history = [
        {"role": "user", "content": " ".join(WORDS[i % 11] for i in range(300))},
        {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
        {"role": "user", "content": "go on"},
    ]
    second = _chat(keyed, ALICE, "it-keys-alice", messages=history)
    assert second.status_code == 200, second.text
    pulled(second.json()["kvtide"], usage_of(body))


def test_over_a_keys_limits_is_429_and_leaves_nothing_behind(keyed: str) -> None:
    stats = httpx.get(
        keyed + "/kvtide/stats", headers={"authorization": f"Bearer {ALICE}"}, timeout=60
    ).json()["kv"]
    long_prompt = _chat(keyed, ALICE, "it-keys-limits", words=2000)
    assert long_prompt.status_code == 429
    assert _error(long_prompt)["code"] == "prompt_too_long_for_key"
    too_many = _chat(keyed, ALICE, "it-keys-limits", max_tokens=100)
    assert too_many.status_code == 429
    assert _error(too_many)["code"] == "max_tokens_over_key_limit"
    assert _session(keyed, ALICE, "it-keys-limits").status_code == 404  # never started
    after = httpx.get(
        keyed + "/kvtide/stats", headers={"authorization": f"Bearer {ALICE}"}, timeout=60
    ).json()["kv"]
    assert after["num_sessions"] <= stats["num_sessions"]


def test_concurrent_requests_over_the_keys_limit_get_429_and_none_is_lost(keyed: str) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            headers = {"authorization": f"Bearer {ALICE}"}
            payload = {
                "model": "kvtide-tiny",
                "messages": [{"role": "user", "content": " ".join(WORDS * 20)}],
                "max_tokens": 16,
                "ignore_eos": True,
            }
            calls = [
                client.post(keyed + "/v1/chat/completions", json=payload, headers=headers)
                for _ in range(3)
            ]
            return list(await asyncio.gather(*calls))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes[0] == 200 and codes[-1] == 429, [r.text for r in responses]
    for resp in responses:
        if resp.status_code == 429:
            assert _error(resp)["code"] == "concurrency_limit_exceeded"
            assert int(resp.headers["retry-after"]) >= 1
    # Every ticket came back: the next request is admitted.
    assert _chat(keyed, ALICE, None).status_code == 200
