"""The operator role (``server.api_keys[].operator``), through the ingress's own routes
(no Ray): an ordinary key cannot turn KV reuse back on after an integrity mismatch, and
sees only its own turns' ids in ``/kvtide/stats``; an operator's key does both; with no
keys configured at all every request may, as before."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ingress_harness import bare_ingress, http_request

from orchestrator.errors import RequestError
from orchestrator.kv.messages import IntegrityMismatch
from orchestrator.serve.auth import hash_key

KEYS = {"alice": "kvt-alice-key", "bob": "kvt-bob-key", "ops": "kvt-ops-key"}
PAIR = {"prefill_engine_id": "P", "source_engine_id": "D"}


def keyed_ingress(tokenizer: Any) -> Any:
    keys = [
        {"name": name, "sha256": hash_key(key), "operator": name == "ops"}
        for name, key in KEYS.items()
    ]
    ingress = bare_ingress(tokenizer, vllm=False, api_keys=keys)
    return ingress


def mismatch(prefill: str, owner: str | None) -> IntegrityMismatch:
    return IntegrityMismatch(
        prefill_engine_id=prefill,
        source_engine_id="D",
        session_id=f"{owner}-session",
        request_id=f"{owner}-request",
        owner=owner,
        max_abs_diff=1.0,
    )


async def reuse_on(ingress: Any, key: str | None) -> tuple[int, dict[str, Any]]:
    headers = {} if key is None else {"authorization": f"Bearer {KEYS.get(key, key)}"}
    request, _ = http_request("/kvtide/integrity/reuse", json.dumps(PAIR).encode(), headers)
    try:
        return 200, await ingress.routes.operator.reuse_on(request)
    except RequestError as exc:
        return exc.status_code, exc.body()


async def stats(ingress: Any, key: str) -> list[dict[str, Any]]:
    headers = {"authorization": f"Bearer {KEYS[key]}"}
    request, _ = http_request("/kvtide/stats", headers=headers, method="GET")
    pairs: list[dict[str, Any]] = (await ingress.routes.operator.stats(request))["kv"]["reuse_off"]
    return pairs


def test_an_ordinary_key_cannot_turn_reuse_back_on_and_an_operators_can(
    tiny_tokenizer: Any,
) -> None:
    ingress = keyed_ingress(tiny_tokenizer)

    async def run() -> None:
        assert await ingress.kv.integrity_mismatch(mismatch("P", "alice"))
        status, body = await reuse_on(ingress, "alice")
        assert status == 403
        assert body["error"]["code"] == "operator_key_required"
        assert body["error"]["type"] == "permission_error"
        message = body["error"]["message"]
        assert "POST /kvtide/integrity/reuse" in message and "operator: true" in message
        assert "'alice'" in message and KEYS["alice"] not in message
        # Refused: the pair is still off.
        assert [p["source_engine_id"] for p in await stats(ingress, "ops")] == ["D"]
        assert ingress.kv.decider.lifecycle.reuse_off == frozenset({"D"})
        assert await reuse_on(ingress, "ops") == (200, {**PAIR, "reuse": "on"})
        assert ingress.kv.decider.lifecycle.reuse_off == frozenset()
        # A key that is no key is still 401, not 403.
        assert (await reuse_on(ingress, "kvt-unknown"))[0] == 401

    asyncio.run(run())


def test_stats_show_a_tenant_only_its_own_ids_and_an_operator_all(
    tiny_tokenizer: Any,
) -> None:
    ingress = keyed_ingress(tiny_tokenizer)

    async def run() -> None:
        assert await ingress.kv.integrity_mismatch(mismatch("P1", "alice"))
        assert await ingress.kv.integrity_mismatch(mismatch("P2", "bob"))
        seen = {
            key: [(p["prefill_engine_id"], p["session_id"], p["request_id"]) for p in pairs]
            for key in ("alice", "bob", "ops")
            for pairs in [await stats(ingress, key)]
        }
        assert seen["alice"] == [("P1", "alice-session", "alice-request"), ("P2", None, None)]
        assert seen["bob"] == [("P1", None, None), ("P2", "bob-session", "bob-request")]
        assert seen["ops"] == [
            ("P1", "alice-session", "alice-request"),
            ("P2", "bob-session", "bob-request"),
        ]
        text = json.dumps(await stats(ingress, "alice"))
        assert "bob-session" not in text and "bob-request" not in text

    asyncio.run(run())


def test_without_keys_every_request_may_operate_as_before(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer, vllm=False)

    async def run() -> None:
        assert await ingress.kv.integrity_mismatch(mismatch("P", None))
        assert await reuse_on(ingress, None) == (200, {**PAIR, "reuse": "on"})

    asyncio.run(run())
