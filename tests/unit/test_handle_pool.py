"""A pool spread over several Serve deployments (one per NVLink domain): requests go to
the deployment with the fewest in flight per replica, and every stream is counted out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engines.base import GenerateChunk, GenerateRequest
from orchestrator.cluster.handle_pool import HandlePool


class FakeDeployment:
    """Stands in for a Serve handle: ``options(stream=True).generate.remote(req)``
    streams chunks; each stream waits on ``gate`` so requests stay in flight."""

    def __init__(self, name: str, gate: asyncio.Event) -> None:
        self.deployment_name = name
        self.gate = gate
        self.served: list[str] = []
        self.streams: list[Any] = []
        self.generate = self

    def options(self, **_: Any) -> FakeDeployment:
        return self

    def remote(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        return self._stream(request)

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.served.append(request.request_id)
        await self.gate.wait()
        yield GenerateChunk(request_id=request.request_id, token_ids=[1], finished=True)


def req(i: int) -> GenerateRequest:
    return GenerateRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3], max_tokens=1)


def test_requests_spread_by_in_flight_per_replica_and_are_counted_out() -> None:
    async def run() -> tuple[list[str], list[str], list[int]]:
        gate = asyncio.Event()
        a, b = (
            FakeDeployment("decode-pool-nvl72-a", gate),
            FakeDeployment("decode-pool-hgx-1", gate),
        )
        pool = HandlePool([a, b], weights=[3, 1])  # a has three replicas, b one
        streams = [pool.generate(req(i)) for i in range(4)]
        tasks = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await asyncio.sleep(0)  # let every stream start (no timing involved)
        gate.set()
        await asyncio.gather(*tasks)
        for s in streams:
            with pytest.raises(StopAsyncIteration):
                await s.__anext__()
        return a.served, b.served, list(pool._in_flight)

    a_served, b_served, in_flight = asyncio.run(run())
    # In flight per replica when each is sent: r0 a 0/3 = b 0/1 (first wins), r1 a 1/3 >
    # b 0, r2 a 1/3 < b 1, r3 a 2/3 < b 1.
    assert (a_served, b_served) == (["r0", "r2", "r3"], ["r1"])
    assert in_flight == [0, 0]


def test_a_pool_needs_a_deployment_and_one_weight_each() -> None:
    gate = asyncio.Event()
    with pytest.raises(ValueError, match="at least one"):
        HandlePool([])
    with pytest.raises(ValueError, match="one weight"):
        HandlePool([FakeDeployment("x", gate)], weights=[1, 1])  # type: ignore[list-item]


class ServeStream:
    """Stands in for Serve's ``DeploymentResponseGenerator``: no ``aclose``; ``cancel()``
    ends the call on its replica."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.cancelled = False

    def __aiter__(self) -> ServeStream:
        return self

    async def __anext__(self) -> GenerateChunk:
        await asyncio.Event().wait()  # the engine has it queued
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class QueuedDeployment(FakeDeployment):
    def remote(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        stream = ServeStream(request)
        self.streams.append(stream)
        return stream


def test_a_stream_closed_before_its_end_cancels_its_serve_call() -> None:
    async def run() -> tuple[list[bool], list[int]]:
        gate = asyncio.Event()
        a, b = QueuedDeployment("prefill-pool-a", gate), QueuedDeployment("prefill-pool-b", gate)
        pool = HandlePool([a, b])
        stream = pool.generate(req(0))
        with pytest.raises(TimeoutError):  # the caller's deadline passes
            await asyncio.wait_for(stream.__anext__(), 0.01)
        await stream.aclose()  # type: ignore[attr-defined]
        return [s.cancelled for s in a.streams + b.streams], list(pool._in_flight)

    cancelled, in_flight = asyncio.run(run())
    assert cancelled == [True] and in_flight == [0, 0]
