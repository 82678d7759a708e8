"""A turn that ends early aborts its engine requests, also behind Serve's handles.

Serve's ``DeploymentResponseGenerator`` has no ``aclose``: a stream dropped or given up
leaves its request running on the replica, queued in the engine. ``ServePool`` streams
as Serve's handles do, and counts a request aborted only when its caller cancels it.
A turn past its deadline (prefill, pull or decode), or whose client went away, must
abort what it started; a request that finished is left alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from test_router import Script, decode_script, make_router, prefill_script, turn

from engines.base import GenerateChunk, GenerateRequest
from engines.kv_params import KVTransferParams
from orchestrator.errors import DeadlineExceeded
from orchestrator.router import Turn


class ServeStream:
    """Stands in for ``DeploymentResponseGenerator``: iterable, ``cancel()``, no
    ``aclose``. The replica's side is ``chunks``; only ``cancel`` reaches it."""

    def __init__(self, pool: ServePool, request: GenerateRequest) -> None:
        self.pool, self.request = pool, request
        self._chunks = pool.replica(request)

    def __aiter__(self) -> ServeStream:
        return self

    async def __anext__(self) -> GenerateChunk:
        return await self._chunks.__anext__()

    def cancel(self) -> None:
        self.pool.aborted.append(self.request.request_id)


class ServePool:
    """A pool behind a Serve handle whose engine answers by script; ``hang`` says which
    requests never finish (a full KV cache: queued forever), after ``hang_after``
    chunks."""

    def __init__(self, script: Script, hang: tuple[str, ...] = (), hang_after: int = 0) -> None:
        self.script, self.hang, self.hang_after = script, hang, hang_after
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []

    async def replica(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.requests.append(request)
        chunks = self.script(request)
        if request.request_id.endswith(self.hang):
            for chunk in chunks[: self.hang_after]:
                yield chunk
            await asyncio.Event().wait()
        for chunk in chunks:
            yield chunk

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        return ServeStream(self, request)


def is_pull(request: GenerateRequest) -> bool:
    params = request.kv_transfer_params or KVTransferParams()
    return bool(params.remote_block_ids)


def test_a_prefill_past_the_deadline_is_aborted_on_its_engine() -> None:
    prefill, decode = ServePool(prefill_script(), hang=("-p",)), ServePool(decode_script)
    router = make_router(prefill, decode)
    router.request_timeout_s = 0.2
    with pytest.raises(DeadlineExceeded, match="prefill was still running"):
        asyncio.run(turn(router, list(range(100)), None))
    [request] = prefill.requests
    assert prefill.aborted == [request.request_id]
    assert decode.requests == []


def test_a_decode_past_the_deadline_is_aborted_and_the_finished_prefill_is_not() -> None:
    # The decode streams one token, then its engine stops making progress.
    prefill = ServePool(prefill_script())
    decode = ServePool(decode_script, hang=("-d",), hang_after=1)
    router = make_router(prefill, decode)
    router.request_timeout_s = 0.2
    with pytest.raises(DeadlineExceeded, match="decode was still running"):
        asyncio.run(turn(router, list(range(100)), None))
    [dec] = decode.requests
    assert decode.aborted == [dec.request_id]
    assert prefill.aborted == []


def test_a_pull_past_its_timeout_is_aborted_and_the_recompute_completes() -> None:
    prefill, decode = ServePool(prefill_script()), ServePool(decode_script)
    router = make_router(prefill, decode, pull_timeout_s=0.05)
    asyncio.run(turn(router, list(range(100)), "s"))
    prefill.hang = ("-p",)  # turn 2's pull (request "<id>-p") never completes
    report = asyncio.run(turn(router, [*range(100), 11, 12, 13, 50], "s"))
    assert report.pull_fallback and report.num_completion_tokens == 3
    pulls = [r.request_id for r in prefill.requests if is_pull(r)]
    assert len(pulls) == 1 and prefill.aborted == pulls


def test_a_client_that_goes_away_mid_stream_aborts_the_decode_request() -> None:
    prefill, decode = ServePool(prefill_script()), ServePool(decode_script)
    router = make_router(prefill, decode)

    async def run() -> None:
        stream = router.run_turn(Turn(prompt_token_ids=list(range(100)), max_tokens=3))
        chunk, _ = await anext(stream)
        assert not chunk.finished
        await stream.aclose()  # the ingress closes the turn when its client is gone

    asyncio.run(run())
    [dec] = decode.requests
    assert decode.aborted == [dec.request_id]
