"""The stateful Responses API on kvtide's turn: vLLM's ``OpenAIServingResponses`` with
its real request models, renderer and event shapes, over the ingress's real routes and a
scripted decode engine (``ingress_harness``, ``test_vllm_layer.scripted``).

What a user relies on: a later turn sends only its new input (``previous_response_id``)
and runs in the chain's kvtide session, so the previous turn's KV is pulled back; a
stored response is its key's alone; ``GET`` and ``DELETE`` work on it; the book is
bounded and expires with the session's TTL, and what it forgets, vLLM's store forgets.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from ingress_harness import MODEL, bare_ingress, handle, http_request
from test_auth import KEY_A, KEY_B, _key_entry
from test_vllm_layer import scripted

from orchestrator.errors import RequestError


@pytest.fixture
def ingress(tiny_tokenizer: Any) -> Any:
    ingress = bare_ingress(
        tiny_tokenizer,
        max_model_len=1024,
        api_keys=[_key_entry("team-a", KEY_A), _key_entry("team-b", KEY_B)],
    )
    ingress.router.decode.script = scripted("sure", finish="length")
    return ingress


def create(ingress: Any, key: str = KEY_A, **fields: Any) -> tuple[int, Any]:
    body = json.dumps({"model": MODEL, "max_output_tokens": 4, **fields}).encode()
    return asyncio.run(handle(ingress, "/v1/responses", body, authorization=f"Bearer {key}"))


def test_a_later_turn_sends_only_its_new_input_and_pulls_the_kv_back(ingress: Any) -> None:
    # Long enough that pulling it back is cheaper than recomputing it.
    log = " ".join(["cache engine rack token"] * 60)
    status, first = create(ingress, input=f"{log}\nSummarise the incident log.")
    assert status == 200, first
    # The script stops at the token budget (as its session's continuity needs).
    assert first["object"] == "response" and first["status"] == "incomplete"
    assert first["output"][0]["content"][0]["text"] == "sure"
    assert first["kvtide"]["session_id"] == first["id"]  # a chain's session: its first id
    status, second = create(
        ingress, input="Which service failed?", previous_response_id=first["id"]
    )
    assert status == 200, second
    # The server held the history: the turn ran in the chain's session, extending turn
    # 1's prompt and answer, and pulled that KV back.
    assert second["kvtide"]["session_id"] == first["id"]
    assert second["kvtide"]["kv_plan"] == "pull", second["kvtide"]
    turn1, turn2 = ingress.router.decode.requests
    assert turn2.prompt_token_ids[: len(turn1.prompt_token_ids)] == turn1.prompt_token_ids
    # A third turn chains on the second.
    status, third = create(ingress, input="Why?", previous_response_id=second["id"])
    assert status == 200 and third["kvtide"]["kv_plan"] == "pull", third


def test_a_stored_response_is_its_keys_alone(ingress: Any) -> None:
    status, first = create(ingress, input="hello")
    assert status == 200, first
    # Another key: the same 404 as for an id that never existed.
    theirs = create(ingress, KEY_B, input="next", previous_response_id=first["id"])
    unknown = create(ingress, KEY_B, input="next", previous_response_id="resp_nope")
    assert theirs[0] == unknown[0] == 404
    assert theirs[1]["error"]["code"] == unknown[1]["error"]["code"] == "response_not_found"

    async def get(key: str) -> int:
        request, _ = http_request(
            f"/v1/responses/{first['id']}", b"", {"authorization": f"Bearer {key}"}
        )
        try:
            response = await ingress._responses_get(first["id"], request, False, None)
        except RequestError as exc:
            return exc.status_code
        assert json.loads(response.body)["id"] == first["id"]
        return int(response.status_code)

    assert asyncio.run(get(KEY_A)) == 200
    assert asyncio.run(get(KEY_B)) == 404


def test_delete_forgets_the_response_in_vllms_store_too(ingress: Any) -> None:
    status, first = create(ingress, input="hello")
    assert status == 200, first
    store = ingress.vllm.responses.response_store
    assert first["id"] in store
    request, _ = http_request(
        f"/v1/responses/{first['id']}", b"", {"authorization": f"Bearer {KEY_A}"}
    )
    deleted = asyncio.run(ingress._responses_delete(first["id"], request))
    assert deleted == {"id": first["id"], "object": "response", "deleted": True}
    assert first["id"] not in store and first["id"] not in ingress.vllm.responses.msg_store
    status, body = create(ingress, input="next", previous_response_id=first["id"])
    assert status == 404, body


def test_the_book_expires_with_the_sessions_ttl_and_forgets_in_step(ingress: Any) -> None:
    status, first = create(ingress, input="hello")
    assert status == 200, first
    clock = ingress.router.clock
    clock.now_s += ingress.config.kv.decoder_kv_blocks_ttl_s + 1
    status, body = create(ingress, input="next", previous_response_id=first["id"])
    assert status == 404, body
    assert first["id"] not in ingress.vllm.responses.response_store


def test_store_false_keeps_nothing(ingress: Any) -> None:
    status, first = create(ingress, input="hello", store=False)
    assert status == 200, first
    assert len(ingress.response_book) == 0
    status, body = create(ingress, input="next", previous_response_id=first["id"])
    assert status == 404, body


def test_a_streamed_response_ends_with_kvtides_object(ingress: Any) -> None:
    status, text = create(ingress, input="hello", stream=True)
    assert status == 200, text
    events = [e for e in text.split("\n\n") if e.startswith("event: ")]
    kinds = [e.split("\n", 1)[0][len("event: ") :] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    completed = json.loads(events[-1].split("data: ", 1)[1])
    assert completed["kvtide"]["session_id"] == completed["response"]["id"]
    assert completed["response"]["id"] in ingress.vllm.responses.response_store
