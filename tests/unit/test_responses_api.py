"""The stateful Responses API on kvtide's turn: vLLM's ``OpenAIServingResponses`` with
its real request models, renderer and event shapes, over the ingress's real routes and a
scripted decode engine (``ingress_harness``, ``test_vllm_layer.scripted``).

What a user relies on: a later turn sends only its new input (``previous_response_id``)
and runs in the chain's kvtide session, so the previous turn's KV is pulled back; a
fork of a response runs in a session of its own; a stored response is its key's alone;
``GET`` and ``DELETE`` work on it (``DELETE`` frees its KV); what vLLM stores is bounded
in bytes per key and in all, expires with the session's TTL, and a request that does
not complete (refused, failed, cancelled) or asks ``store: false`` leaves nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from ingress_harness import MODEL, bare_ingress, handle, http_request
from test_auth import KEY_A, KEY_B, _key_entry
from test_router import FakePool
from test_vllm_layer import scripted

from engines.base import GenerateChunk, GenerateRequest
from orchestrator.config import parse_config
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
            response = await ingress.routes.responses.get(first["id"], request, False, None)
        except RequestError as exc:
            return exc.status_code
        assert json.loads(response.body)["id"] == first["id"]
        return int(response.status_code)

    assert asyncio.run(get(KEY_A)) == 200
    assert asyncio.run(get(KEY_B)) == 404


def test_delete_forgets_the_response_in_vllms_store_too(ingress: Any) -> None:
    status, first = create(ingress, input="hello")
    assert status == 200, first
    store = ingress.routes.vllm.serving.responses.response_store
    assert first["id"] in store
    request, _ = http_request(
        f"/v1/responses/{first['id']}", b"", {"authorization": f"Bearer {KEY_A}"}
    )
    deleted = asyncio.run(ingress.routes.responses.delete(first["id"], request))
    assert deleted == {"id": first["id"], "object": "response", "deleted": True}
    messages = ingress.routes.vllm.serving.responses.msg_store
    assert first["id"] not in store and first["id"] not in messages
    status, body = create(ingress, input="next", previous_response_id=first["id"])
    assert status == 404, body


def test_the_book_expires_with_the_sessions_ttl_and_forgets_in_step(ingress: Any) -> None:
    status, first = create(ingress, input="hello")
    assert status == 200, first
    clock = ingress.router.clock
    clock.now_s += ingress.config.kv.decoder_kv_blocks_ttl_s + 1
    status, body = create(ingress, input="next", previous_response_id=first["id"])
    assert status == 404, body
    assert first["id"] not in ingress.routes.vllm.serving.responses.response_store


def test_store_false_keeps_nothing(ingress: Any) -> None:
    status, first = create(ingress, input="hello", store=False)
    assert status == 200, first
    assert len(ingress.routes.responses.book) == 0
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
    assert completed["response"]["id"] in ingress.routes.vllm.serving.responses.response_store


# ---- what is kept, and for how long -------------------------------------------------------

# Long enough that pulling its KV back is cheaper than recomputing it.
LOG = " ".join(["cache engine rack token"] * 60) + "\nSummarise the incident log."


def stores(ingress: Any) -> tuple[int, int, int]:
    """What vLLM's serving class holds: its two maps' sizes, and the book's bytes."""
    responses = ingress.routes.vllm.serving.responses
    book = ingress.routes.responses.book
    return len(responses.msg_store), len(responses.response_store), book.num_bytes


def kept_sessions(ingress: Any, key_name: str) -> int:
    return int(ingress.kv.owners.num_owned(key_name))


def failing_after_one_token(req: GenerateRequest) -> Iterator[GenerateChunk]:
    """A decode engine that takes the turn, writes one token, and dies."""
    yield GenerateChunk(request_id=req.request_id, text="s", token_ids=[11])
    raise RuntimeError("engine died")


async def cancelled_stream(ingress: Any, **fields: Any) -> None:
    """A streamed request whose client goes away after the first event."""
    body = json.dumps({"model": MODEL, "max_output_tokens": 4, "stream": True, **fields})
    request, _ = http_request("/v1/responses", body.encode(), {"authorization": f"Bearer {KEY_B}"})
    routes = ingress.routes
    response = await routes.edge.traced(request, "responses", routes.responses.create)
    events: AsyncIterator[str] = response.body_iterator
    assert (await events.__anext__()).startswith("event: response.created")
    await events.aclose()  # type: ignore[attr-defined]
    await ingress.router.settled()


def test_requests_that_do_not_complete_leave_the_store_as_it_was(tiny_tokenizer: Any) -> None:
    """vLLM stores a request's conversation when it starts: a request refused by the
    turn, failed after the engine took it, or cancelled by its client must give it
    back, and close the session it opened."""
    ingress = bare_ingress(
        tiny_tokenizer,
        max_model_len=1024,
        api_keys=[_key_entry("team-b", KEY_B, max_prompt_tokens=400)],
    )
    ingress.router.decode.script = scripted("sure", finish="length")
    status, first = create(ingress, KEY_B, input="hello")
    assert status == 200, first
    before = stores(ingress)
    assert before[0] == before[1] == 1 and before[2] > 0
    assert kept_sessions(ingress, "team-b") == 1
    long_input = " ".join(["cache engine rack token"] * 120)  # over the key's 400 tokens
    for i in range(10):
        # Refused by the key's limit once vLLM has stored the conversation.
        previous = {"previous_response_id": first["id"]} if i % 2 else {}
        status, body = create(ingress, KEY_B, input=long_input, **previous)
        assert status == 429 and body["error"]["code"] == "prompt_too_long_for_key", body
        assert stores(ingress) == before
    ingress.router.decode.script = failing_after_one_token
    for i in range(5):
        previous = {"previous_response_id": first["id"]} if i % 2 else {}
        status, body = create(ingress, KEY_B, input="next", **previous)
        assert status == 503 and body["error"]["code"] == "engine_unavailable", body
        assert stores(ingress) == before
    ingress.router.decode.script = scripted("sure", finish="length")
    for i in range(5):
        previous = {"previous_response_id": first["id"]} if i % 2 else {}
        asyncio.run(cancelled_stream(ingress, input="next", **previous))
        assert stores(ingress) == before
    # Every new chain's session was closed again; the first response's is still kept.
    assert kept_sessions(ingress, "team-b") == 1
    status, body = create(ingress, KEY_B, input="again", previous_response_id=first["id"])
    assert status == 200 and body["kvtide"]["session_id"] == first["id"], body


def test_the_store_is_bounded_in_bytes_per_key_and_in_all(tiny_tokenizer: Any) -> None:
    per_key, total = 40_000, 64_000
    ingress = bare_ingress(
        tiny_tokenizer,
        max_model_len=8192,
        api_keys=[_key_entry("team-a", KEY_A), _key_entry("team-b", KEY_B)],
        responses_max_mib=total / 2**20,
        responses_max_mib_per_key=per_key / 2**20,
    )
    ingress.router.decode.script = scripted("sure", finish="length")
    book = ingress.routes.responses.book
    # Each response stores about 6 KB of conversation (1,000 tokens), and its output.
    text = "cache engine rack token " * 250
    status, b_first = create(ingress, KEY_B, input=text)
    assert status == 200, b_first
    ids = []
    for _ in range(12):  # about 80 KB for key A: over its bound
        status, body = create(ingress, KEY_A, input=text)
        assert status == 200, body
        ids.append(body["id"])
        assert book.bytes_of("team-a") <= per_key and book.num_bytes <= total
    # Key A's oldest went to make room for its newest; key B's response stayed.
    assert book.bytes_of("team-a") > per_key - 8000
    assert create(ingress, KEY_A, input="next", previous_response_id=ids[0])[0] == 404
    assert create(ingress, KEY_A, input="next", previous_response_id=ids[-1])[0] == 200
    assert create(ingress, KEY_B, input="next", previous_response_id=b_first["id"])[0] == 200
    # Key B stores more: the total's oldest go, whoever's they are.
    for _ in range(6):
        assert create(ingress, KEY_B, input=text)[0] == 200
        assert book.num_bytes <= total and book.bytes_of("team-b") <= per_key
    assert len(ingress.routes.vllm.serving.responses.msg_store) == len(book)
    # One response whose conversation alone is over a key's bound: refused before its
    # turn runs, nothing stored.
    num_turns, before = len(ingress.router.decode.requests), stores(ingress)
    status, body = create(ingress, KEY_A, input=text * 8)
    assert status == 429 and body["error"]["code"] == "response_too_large_to_store", body
    assert "store: false" in body["error"]["message"]
    assert len(ingress.router.decode.requests) == num_turns and stores(ingress) == before
    # The same with store: false runs, and keeps nothing.
    status, body = create(ingress, KEY_A, input=text * 8, store=False)
    assert status == 200 and stores(ingress) == before, body


def test_store_false_runs_without_a_session_and_keeps_nothing(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(
        tiny_tokenizer, max_model_len=1024, api_keys=[_key_entry("team-a", KEY_A, max_sessions=2)]
    )
    ingress.router.decode.script = scripted("sure", finish="length")
    status, first = create(ingress, input=LOG)
    assert status == 200 and kept_sessions(ingress, "team-a") == 1, first
    before = stores(ingress)
    for i in range(5):  # more one-shot calls than the key's sessions
        previous = {"previous_response_id": first["id"]} if i % 2 else {}
        status, body = create(ingress, input=f"question {i}", store=False, **previous)
        assert status == 200, body
        assert body["kvtide"]["session_id"] is None, body["kvtide"]
        assert stores(ingress) == before
    assert kept_sessions(ingress, "team-a") == 1
    # The decode engine was asked to keep the stored turn's KV, and none of theirs.
    kept = [r.kv_transfer_params.kvtide_keep for r in ingress.router.decode.requests]
    assert kept == [True] + [False] * 5, kept
    # The chain they read from is whole: its next turn pulls its KV back.
    status, body = create(ingress, input="next", previous_response_id=first["id"])
    assert status == 200 and body["kvtide"]["kv_plan"] == "pull", body


def test_a_key_out_of_sessions_is_told_how_to_free_one(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(
        tiny_tokenizer, max_model_len=1024, api_keys=[_key_entry("team-a", KEY_A, max_sessions=1)]
    )
    ingress.router.decode.script = scripted("sure", finish="length")
    status, first = create(ingress, input="hello")
    assert status == 200, first
    before = stores(ingress)
    status, body = create(ingress, input="another chain")
    assert status == 429 and body["error"]["code"] == "session_limit_exceeded", body
    assert "DELETE /v1/responses/{id}" in body["error"]["message"], body
    assert stores(ingress) == before
    delete(ingress, first["id"])  # closes its session: the key may start another
    assert create(ingress, input="another chain")[0] == 200


def delete(ingress: Any, response_id: str, key: str = KEY_A) -> Any:
    request, _ = http_request(
        f"/v1/responses/{response_id}", b"", {"authorization": f"Bearer {key}"}
    )
    return asyncio.run(ingress.routes.responses.delete(response_id, request))


def test_delete_closes_the_session_and_frees_its_kv(ingress: Any) -> None:
    status, first = create(ingress, input="hello")
    assert status == 200, first
    session = first["kvtide"]["session_id"]
    assert asyncio.run(ingress.kv.session(session)).known
    assert delete(ingress, first["id"])["deleted"] is True
    assert not asyncio.run(ingress.kv.session(session)).known  # the KV freed
    assert stores(ingress) == (0, 0, 0) and kept_sessions(ingress, "team-a") == 0
    status, body = create(ingress, input="next", previous_response_id=first["id"])
    assert status == 404 and body["error"]["param"] == "previous_response_id", body
    assert "deleted" in body["error"]["message"]


def test_deleting_a_response_that_was_continued_keeps_its_chains_kv(ingress: Any) -> None:
    status, first = create(ingress, input=LOG)
    status, second = create(ingress, input="next", previous_response_id=first["id"])
    assert status == 200, second
    delete(ingress, first["id"])
    # The session's KV is the second turn's: still kept, and pulled by the next turn.
    status, third = create(ingress, input="why?", previous_response_id=second["id"])
    assert status == 200 and third["kvtide"]["kv_plan"] == "pull", third
    delete(ingress, third["id"])
    assert not asyncio.run(ingress.kv.session(first["kvtide"]["session_id"])).known


def test_a_fork_runs_in_a_session_of_its_own_and_the_chain_keeps_its_kv(ingress: Any) -> None:
    status, first = create(ingress, input=LOG)
    assert status == 200, first
    status, second = create(ingress, input="Which service?", previous_response_id=first["id"])
    assert status == 200 and second["kvtide"]["kv_plan"] == "pull", second
    # A second continuation of the first response: a fork, its history recomputed in a
    # session named by its own id.
    status, fork = create(ingress, input="Which rack?", previous_response_id=first["id"])
    assert status == 200, fork
    assert fork["kvtide"]["session_id"] == fork["id"] and fork["kvtide"]["kv_plan"] != "pull"
    # Both branches continue with their own KV pulled back.
    status, third = create(ingress, input="Why?", previous_response_id=second["id"])
    assert status == 200 and third["kvtide"]["session_id"] == first["id"], third
    assert third["kvtide"]["kv_plan"] == "pull", third["kvtide"]
    status, fork2 = create(ingress, input="And then?", previous_response_id=fork["id"])
    assert status == 200 and fork2["kvtide"]["session_id"] == fork["id"], fork2
    assert fork2["kvtide"]["kv_plan"] == "pull", fork2["kvtide"]


class HeldPool(FakePool):
    """A decode pool that holds the next request it gets until released."""

    def __init__(self, script: Any) -> None:
        super().__init__(script)
        self.hold_next = False
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        if self.hold_next:
            self.hold_next = False
            self.entered.set()
            await self.release.wait()
        async for chunk in super()._stream(request):
            yield chunk


def test_a_fork_while_the_first_continuation_runs_is_served(ingress: Any) -> None:
    status, first = create(ingress, input="hello")
    assert status == 200, first
    decode = HeldPool(scripted("sure", finish="length"))
    ingress.router.decode = decode

    async def both() -> tuple[tuple[int, Any], tuple[int, Any]]:
        def body(text: str) -> bytes:
            fields = {"input": text, "previous_response_id": first["id"]}
            return json.dumps({"model": MODEL, "max_output_tokens": 4, **fields}).encode()

        decode.hold_next = True
        running = asyncio.create_task(
            handle(ingress, "/v1/responses", body("one"), authorization=f"Bearer {KEY_A}")
        )
        await decode.entered.wait()  # the first continuation is generating
        forked = await handle(
            ingress, "/v1/responses", body("two"), authorization=f"Bearer {KEY_A}"
        )
        decode.release.set()
        return await running, forked

    (status1, one), (status2, two) = asyncio.run(both())
    assert status1 == status2 == 200, (one, two)
    assert one["kvtide"]["session_id"] == first["id"]
    assert two["kvtide"]["session_id"] == two["id"]


def test_a_stored_response_is_not_replayed_as_a_stream(ingress: Any) -> None:
    status, first = create(ingress, input="hello", stream=True)
    assert status == 200, first
    response_id = first.split('"id":"', 1)[1].split('"', 1)[0]
    request, _ = http_request(
        f"/v1/responses/{response_id}", b"", {"authorization": f"Bearer {KEY_A}"}
    )
    with pytest.raises(RequestError) as refused:
        asyncio.run(ingress.routes.responses.get(response_id, request, True, None))
    assert refused.value.status_code == 400 and refused.value.param == "stream"
    assert "without stream" in str(refused.value)


@pytest.mark.parametrize("field", ["truncation", "background", "store", "stream", "stop"])
def test_a_null_is_the_fields_default(ingress: Any, field: str) -> None:
    status, body = create(ingress, input="hello", **{field: None})
    assert status == 200, body


def test_a_background_response_is_refused_naming_the_field(ingress: Any) -> None:
    status, body = create(ingress, input="hello", background=True)
    assert status == 400 and body["error"]["param"] == "background", body
    assert "background: false" in body["error"]["message"]
    # The store's bounds by default: 64 MiB a key, 256 MiB in all.
    server = parse_config({}).server
    assert (server.responses_max_mib_per_key, server.responses_max_mib) == (64, 256)


def test_a_session_the_client_names_is_the_chains_and_is_never_closed_by_it(
    ingress: Any,
) -> None:
    body = json.dumps({"model": MODEL, "max_output_tokens": 4, "input": "hello"}).encode()
    status, first = asyncio.run(
        handle(ingress, "/v1/responses", body, authorization=f"Bearer {KEY_A}", x_session_id="mine")
    )
    assert status == 200 and first["kvtide"]["session_id"] == "mine", first
    # Deleting its response closes nothing: the session is the client's.
    assert delete(ingress, first["id"])["deleted"] is True
    assert asyncio.run(ingress.kv.session("mine")).known
    # store: false with the header still runs in that session.
    body = json.dumps(
        {"model": MODEL, "max_output_tokens": 4, "input": "again", "store": False}
    ).encode()
    status, second = asyncio.run(
        handle(ingress, "/v1/responses", body, authorization=f"Bearer {KEY_A}", x_session_id="mine")
    )
    assert status == 200 and second["kvtide"]["session_id"] == "mine", second
