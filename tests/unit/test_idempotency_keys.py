"""An Idempotency-Key names one request: reused with another endpoint or body it is a
422 naming the header, never a replay of the wrong answer; a replay has the shape of
the endpoint it answers; the SDK's continuation of a cut stream is still the same
request. Through the ingress's own request handling (no Ray)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ingress_harness import MODEL, bare_ingress, handle

from orchestrator.kv.replay import TurnReplayBook

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 4, **fields}).encode()


def test_a_key_reused_on_another_endpoint_or_body_is_refused(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer)

    async def run() -> None:
        status, first = await handle(ingress, CHAT, _body(messages=MESSAGES), idempotency_key="k1")
        assert status == 200 and first["object"] == "chat.completion"
        # The same key on /v1/completions, unstreamed and streamed: 422, not the chat.
        for stream in (False, True):
            status, body = await handle(
                ingress, COMPLETIONS, _body(prompt="hi", stream=stream), idempotency_key="k1"
            )
            assert status == 422, body
            assert body["error"]["code"] == "idempotency_key_reused"
            assert body["error"]["param"] == "Idempotency-Key"
            assert "Idempotency-Key" in body["error"]["message"]
        # The same key with another prompt: 422, not the first prompt's answer.
        other = [{"role": "user", "content": "something else"}]
        status, body = await handle(ingress, CHAT, _body(messages=other), idempotency_key="k1")
        assert status == 422 and body["error"]["code"] == "idempotency_key_reused"
        # The very same request (streamed or not) is replayed.
        status, again = await handle(ingress, CHAT, _body(messages=MESSAGES), idempotency_key="k1")
        assert status == 200 and again == first

    asyncio.run(run())


def test_a_replay_has_the_shape_of_its_endpoint(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer)

    async def run() -> None:
        status, first = await handle(ingress, COMPLETIONS, _body(prompt="hi"), idempotency_key="k")
        assert status == 200 and first["object"] == "text_completion"
        status, text = await handle(
            ingress, COMPLETIONS, _body(prompt="hi", stream=True), idempotency_key="k"
        )
        assert status == 200
        events = [json.loads(line[6:]) for line in text.splitlines() if line[6:12] == '{"id":']
        assert events and all(e["object"] == "text_completion" for e in events)
        assert (
            "".join(e["choices"][0]["text"] for e in events if e["choices"])
            == (first["choices"][0]["text"])
        )

    asyncio.run(run())


def test_the_sdks_continuation_of_a_cut_stream_is_the_same_request(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer)

    async def run() -> None:
        original = _body(messages=MESSAGES, stream=True, max_tokens=8)
        status, _ = await handle(ingress, CHAT, original, idempotency_key="k")
        assert status == 200
        # The connection broke after "ab": the SDK continues under the same key with the
        # text as a final assistant message and a lower max_tokens (sdk/_stream.py).
        continuation = _body(
            messages=[*MESSAGES, {"role": "assistant", "content": "ab"}],
            continue_final_message=True,
            add_generation_prompt=False,
            stream=True,
            max_tokens=6,
        )
        status, text = await handle(ingress, CHAT, continuation, idempotency_key="k")
        assert status == 200 and "data: [DONE]" in text  # replayed, not refused

    asyncio.run(run())


def test_the_binding_survives_a_restart_of_the_book() -> None:
    book = TurnReplayBook(clock=lambda: 0.0)
    assert book.begin("k", ("chat:aa",)).action == "run"
    assert book.begin("k", ("completion:bb",)).action == "mismatch"  # while it runs
    book.complete("k", {"id": "x"})
    again = TurnReplayBook(clock=lambda: 0.0, store=book.store)
    assert again.begin("k", ("completion:bb",)).action == "mismatch"
    assert again.begin("k", ("chat:zz", "chat:aa")).action == "replay"


class _AnswerLost:
    """The KV service, whose first ``replay_begin`` answer is lost: the call reaches
    the book (as a call Ray delivers to a restarted service after the caller's deadline
    passed) but the caller gets ``ServiceUnavailable``."""

    def __init__(self, kv: Any) -> None:
        self._kv = kv
        self.lost = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    async def replay_begin(self, *args: Any) -> Any:
        from orchestrator.errors import ServiceUnavailable

        answer = await self._kv.replay_begin(*args)
        if self.lost == 0:
            self.lost += 1
            raise ServiceUnavailable("the KV lifecycle service did not answer in time")
        return answer


def test_a_begin_whose_answer_was_lost_does_not_hold_the_key(tiny_tokenizer: Any) -> None:
    """The attempt that got a 503 takes back what its ``begin`` booked: the client's
    retry runs the turn (a 409 until the book's running grace, before)."""
    ingress = bare_ingress(tiny_tokenizer, kv=_AnswerLost)

    async def run() -> None:
        status, body = await handle(ingress, CHAT, _body(messages=MESSAGES), idempotency_key="k")
        assert status == 503, body
        status, body = await handle(ingress, CHAT, _body(messages=MESSAGES), idempotency_key="k")
        assert status == 200, body
        status, again = await handle(ingress, CHAT, _body(messages=MESSAGES), idempotency_key="k")
        assert status == 200 and again == body  # replayed: it ran once

    asyncio.run(run())


def test_a_key_is_1_to_255_printable_characters(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer)

    async def run() -> None:
        for key in ("k" * 256, "a\tb", " "):
            status, body = await handle(
                ingress, CHAT, _body(messages=MESSAGES), idempotency_key=key
            )
            assert status == 400, (key, body)
            assert body["error"]["param"] == "Idempotency-Key"
            assert "1-255 printable characters" in body["error"]["message"]
        for key in ("k" * 255, "k"):
            status, body = await handle(
                ingress, CHAT, _body(messages=MESSAGES), idempotency_key=key
            )
            assert status == 200, (key, body)

    asyncio.run(run())


def test_a_retry_may_change_how_it_is_delivered_and_its_token_budget(tiny_tokenizer: Any) -> None:
    """What a retry may change and still be answered from the first run: ``stream``,
    ``stream_options``, ``max_tokens``, ``max_completion_tokens``, ``min_tokens``."""
    ingress = bare_ingress(tiny_tokenizer)

    async def run() -> None:
        status, first = await handle(ingress, CHAT, _body(messages=MESSAGES), idempotency_key="k")
        assert status == 200
        for changed in (
            {"max_tokens": 2},
            {"max_tokens": None, "max_completion_tokens": 3},
            {"min_tokens": 1},
        ):
            body = {"model": MODEL, "max_tokens": 4, "messages": MESSAGES, **changed}
            body = {k: v for k, v in body.items() if v is not None}
            status, again = await handle(
                ingress, CHAT, json.dumps(body).encode(), idempotency_key="k"
            )
            assert status == 200 and again == first, changed  # replayed: the same answer
        options = {"include_usage": True, "continuous_usage_stats": True}
        status, text = await handle(
            ingress,
            CHAT,
            _body(messages=MESSAGES, stream=True, stream_options=options),
            idempotency_key="k",
        )
        assert status == 200
        events = [json.loads(line[6:]) for line in text.splitlines() if line[6:12] == '{"id":']
        assert events and all(e["id"] == first["id"] for e in events)  # the first run's
        text_streamed = "".join(
            e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
        )
        assert text_streamed == first["choices"][0]["message"]["content"]

    asyncio.run(run())


def test_a_key_is_scoped_by_the_session(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer)

    async def run() -> None:
        other = [{"role": "user", "content": "something else"}]
        status, first = await handle(
            ingress, CHAT, _body(messages=MESSAGES), idempotency_key="k", x_session_id="s1"
        )
        assert status == 200
        # The same key in another session names another request: it runs, not a 422.
        status, second = await handle(
            ingress, CHAT, _body(messages=other), idempotency_key="k", x_session_id="s2"
        )
        assert status == 200 and second["id"] != first["id"], second

    asyncio.run(run())
