"""A stream's outcome in ``kvtide_requests_total``: its HTTP status is 200 before its
first byte, so a stream cut mid-body by a failure counts as the error its last event
reports (a server error), and one its client left as cancelled; never as ok."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

from ingress_harness import MODEL, bare_ingress, handle, http_request
from test_router import FakePool

from engines.base import GenerateChunk, GenerateRequest
from orchestrator.serve.responses import ending, stream_error, stream_status

CHAT = "/v1/chat/completions"


def decode_that_fails(req: GenerateRequest) -> Iterator[GenerateChunk]:
    yield GenerateChunk(request_id=req.request_id, text="a", token_ids=[11])
    raise RuntimeError("the decode engine died")


def statuses(ingress: Any) -> dict[str, float]:
    return {
        k: v for k, v in ingress.metrics.snapshot().items() if k.startswith("kvtide_requests_total")
    }


def test_a_stream_cut_by_a_failure_counts_as_a_server_error(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer)
    ingress.router.decode = FakePool(decode_that_fails)  # type: ignore[arg-type]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def run() -> None:
        status, text = await handle(ingress, CHAT, json.dumps(body).encode())
        assert status == 200 and '"error"' in text  # the failure is in the body
        counted = statuses(ingress)
        assert any("server_error" in k for k in counted), counted
        assert not any("ok" in k for k in counted), counted

    asyncio.run(run())


def test_a_streams_end_reports_how_it_ended() -> None:
    async def run(items: list[str], close_after: int | None = None) -> list[int | None]:
        ended: list[int | None] = []

        async def body() -> Any:
            for item in items:
                yield item

        stream = ending(body(), ended.append)
        n = 0
        async for _ in stream:
            n += 1
            if close_after is not None and n == close_after:
                await stream.aclose()  # type: ignore[attr-defined]
                break
        return ended

    server = stream_error({"error": {"type": "server_error", "code": "engine_unavailable"}}, _out())
    client = stream_error({"error": {"type": "invalid_request_error", "code": "x"}}, _out())
    assert stream_status(server) == 500 and stream_status(client) == 400
    assert asyncio.run(run(["data: {}\n\n", "data: [DONE]\n\n"])) == [200]
    assert asyncio.run(run(["data: {}\n\n", server, "data: [DONE]\n\n"])) == [500]
    assert asyncio.run(run(["data: {}\n\n", "data: {}\n\n"], close_after=1)) == [None]


def _out() -> Any:
    from orchestrator.serve.responses import Output

    return Output()


class _CompleteFails:
    """The KV service, whose ``replay_complete`` fails with an error no refusal names."""

    def __init__(self, kv: Any) -> None:
        self._kv = kv

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    async def replay_complete(self, *args: Any) -> None:
        raise RuntimeError("ActorDiedError: actor 4f2a pid=4242 in /opt/kvtide/x.py")


def test_a_stream_failing_on_an_unexpected_error_ends_with_stream_failed(
    tiny_tokenizer: Any,
) -> None:
    ingress = bare_ingress(tiny_tokenizer, kv=_CompleteFails)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def run() -> None:
        status, text = await handle(ingress, CHAT, json.dumps(body).encode(), idempotency_key="k")
        assert status == 200
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["error"]["code"] == "stream_failed" and last["error"]["type"] == "server_error"
        assert not any(word in events[-2] for word in ("Actor", "4242", "/opt", "RuntimeError"))

    asyncio.run(run())


def test_a_stream_whose_client_went_away_counts_as_cancelled(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def run() -> None:
        request, _ = http_request(CHAT, json.dumps(body).encode())
        routes = ingress.routes
        response = await routes.edge.traced(request, "chat", routes.own.chat)
        events = response.body_iterator
        assert (await events.__anext__()).startswith("data: ")
        await events.aclose()  # the client left after the first event
        await ingress.router.settled()

    asyncio.run(run())
    assert statuses(ingress) == {'kvtide_requests_total{status="cancelled"}': 1.0}
