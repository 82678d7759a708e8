"""Step streams (``orchestrator.cluster.step_streams``): an engine step's tokens for every
request of one ingress travel as one message on one standing stream; each request's own
call still carries its failure and its cancellation. A hand-written fake Serve handle
runs the host's real ``StepOutboxes`` in this process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from engines.base import GenerateChunk, GenerateRequest
from orchestrator.cluster.handle_pool import HandlePool
from orchestrator.cluster.step_router import pinned_replica
from orchestrator.cluster.step_streams import (
    StepChannels,
    StepOutboxes,
    StepsOpen,
    decode_batch,
)


class FakeCall:
    """A Serve streaming call: the replica's generator runs in a task of its own, items
    reach the caller in order, ``cancel`` cancels the replica's side."""

    def __init__(self, gen: AsyncIterator[Any]) -> None:
        self._items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._pump(gen))

    async def _pump(self, gen: AsyncIterator[Any]) -> None:
        try:
            async for item in gen:
                self._items.put_nowait(("item", item))
            self._items.put_nowait(("end", None))
        except Exception as exc:
            self._items.put_nowait(("error", exc))

    def __aiter__(self) -> FakeCall:
        return self

    async def __anext__(self) -> Any:
        kind, value = await self._items.get()
        if kind == "item":
            return value
        if kind == "end":
            raise StopAsyncIteration
        raise value

    def cancel(self) -> None:
        self.task.cancel()

    def fail(self, exc: Exception) -> None:
        """The replica died: the call ends with an error."""
        self.task.cancel()
        self._items.put_nowait(("error", exc))


class Method:
    def __init__(self, body: Callable[..., AsyncIterator[Any]]) -> None:
        self.body = body
        self.calls: list[FakeCall] = []

    def remote(self, *args: Any) -> FakeCall:
        call = FakeCall(self.body(*args))
        self.calls.append(call)
        return call


class Engine:
    """An engine whose steps the test makes: ``step`` gives each named request one
    output at once, as vLLM's output handler wakes every request of a step."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue[GenerateChunk | Exception]] = {}
        self.closed: list[str] = []

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        queue = self.queues[request.request_id] = asyncio.Queue()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.closed.append(request.request_id)

    def step(self, outputs: dict[str, int], finished: tuple[str, ...] = ()) -> None:
        for rid, token in outputs.items():
            self.queues[rid].put_nowait(
                GenerateChunk(request_id=rid, token_ids=[token], finished=rid in finished)
            )


class Host:
    """One engine replica as its Serve handle reaches it."""

    def __init__(self, replica: str = "r1") -> None:
        self.engine = Engine()
        self.outboxes = StepOutboxes(replica)
        self.messages: list[bytes] = []
        self.generate_stepped = Method(self._run_request)
        self.steps = Method(self._run_steps)

    def options(self, **_: Any) -> Host:
        return self

    def _run_request(self, request: GenerateRequest, caller: str) -> AsyncIterator[str]:
        return self.outboxes.run_request(caller, self.engine.stream(request))

    async def _run_steps(self, opened: StepsOpen) -> AsyncIterator[str | bytes]:
        async for item in self.outboxes.run_steps(opened):
            if isinstance(item, bytes):
                self.messages.append(item)
            yield item


def req(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3], max_tokens=8)


async def settle() -> None:
    """Let every task run until it waits on something the test controls."""
    for _ in range(30):
        await asyncio.sleep(0)


def test_one_step_of_two_requests_travels_as_one_message() -> None:
    async def story() -> None:
        host = Host()
        channels = StepChannels(host, caller="ingress-1")
        a, b = channels.generate(req("a")), channels.generate(req("b"))
        first_a, first_b = asyncio.ensure_future(anext(a)), asyncio.ensure_future(anext(b))
        await settle()
        assert len(host.steps.calls) == 1  # one step stream for both requests
        host.engine.step({"a": 11, "b": 21})
        assert ((await first_a).token_ids, (await first_b).token_ids) == ([11], [21])
        assert [[c.request_id for c in decode_batch(m)] for m in host.messages] == [["a", "b"]]
        # The next step finishes "a": its reader ends; "b" goes on.
        host.engine.step({"a": 12, "b": 22}, finished=("a",))
        last_a = await anext(a)
        assert last_a.finished and last_a.token_ids == [12]
        with pytest.raises(StopAsyncIteration):
            await anext(a)
        assert (await anext(b)).token_ids == [22]
        assert len(host.messages) == 2
        await b.aclose()
        await settle()
        assert host.engine.closed == ["a", "b"]  # b's engine request ended with its reader

    asyncio.run(story())


def test_a_reader_closed_early_aborts_only_its_engine_request() -> None:
    async def story() -> None:
        host = Host()
        channels = StepChannels(host, caller="ingress-1")
        a, b = channels.generate(req("a")), channels.generate(req("b"))
        pending = asyncio.ensure_future(anext(b))
        await anext_after_step(host, a, {"a": 1, "b": 2})
        await a.aclose()  # the client went away
        await settle()
        assert host.engine.closed == ["a"]
        assert (await pending).token_ids == [2]
        host.engine.step({"b": 3})
        assert (await anext(b)).token_ids == [3]  # b's stream is untouched
        await b.aclose()

    asyncio.run(story())


async def anext_after_step(host: Host, stream: Any, outputs: dict[str, int]) -> GenerateChunk:
    nxt = asyncio.ensure_future(anext(stream))
    await settle()
    host.engine.step(outputs)
    chunk: GenerateChunk = await nxt
    return chunk


def test_an_engine_failure_reaches_the_request_through_its_own_call() -> None:
    async def story() -> str:
        host = Host()
        channels = StepChannels(host, caller="ingress-1")
        a = channels.generate(req("a"))
        await anext_after_step(host, a, {"a": 1})
        host.engine.queues["a"].put_nowait(RuntimeError("KV load failed"))
        with pytest.raises(RuntimeError) as raised:
            await anext(a)
        return str(raised.value)

    assert asyncio.run(story()) == "KV load failed"


def test_a_broken_step_stream_fails_its_readers_and_the_next_request_opens_another() -> None:
    async def story() -> None:
        host = Host()
        channels = StepChannels(host, caller="ingress-1")
        a = channels.generate(req("a"))
        await anext_after_step(host, a, {"a": 1})
        host.steps.calls[0].fail(RuntimeError("replica died"))
        with pytest.raises(RuntimeError, match="replica died"):
            await anext(a)
        b = channels.generate(req("b"))
        assert (await anext_after_step(host, b, {"b": 5})).token_ids == [5]
        assert len(host.steps.calls) == 2
        await b.aclose()

    asyncio.run(story())


def test_a_step_stream_names_the_replica_serve_must_send_it_to() -> None:
    class Pending:
        def __init__(self, *args: Any) -> None:
            self.args = args

    opened = StepsOpen(replica="r7", caller="ingress-1")
    assert pinned_replica(Pending(opened)) == "r7"  # type: ignore[arg-type]
    assert pinned_replica(Pending(req("a"), "ingress-1")) is None  # type: ignore[arg-type]
    assert pinned_replica(None) is None


def test_a_pool_with_step_streams_reads_its_requests_from_them() -> None:
    async def story() -> tuple[int, list[int]]:
        host = Host()
        pool = HandlePool(host, steps=True)
        stream = pool.generate(req("a"))
        chunk = await anext_after_step(host, stream, {"a": 4})
        await stream.aclose()  # type: ignore[attr-defined]
        return len(host.generate_stepped.calls), list(chunk.token_ids)

    assert asyncio.run(story()) == (1, [4])


def test_a_newer_step_stream_of_the_same_caller_takes_over_the_outbox() -> None:
    # An ingress that saw its step stream fail opens another while the host may still
    # run the old one: the chunks go to the new one only, none split off to the old.
    async def story() -> tuple[list[Any], list[list[int]]]:
        outboxes = StepOutboxes("r1")
        opened = StepsOpen(replica="r1", caller="ingress-1")
        old, new = outboxes.run_steps(opened), outboxes.run_steps(opened)
        assert await anext(old) == "r1"
        old_next = asyncio.ensure_future(anext(old))
        await settle()
        assert await anext(new) == "r1"
        new_next = asyncio.ensure_future(anext(new))
        engine = Engine()
        request = outboxes.run_request("ingress-1", engine.stream(req("a")))
        assert await anext(request) == "r1"
        pump = asyncio.ensure_future(anext(request))
        await settle()
        engine.step({"a": 7})
        message = await asyncio.wait_for(new_next, 5.0)  # a guard: split, it never comes
        ended = await asyncio.gather(old_next, return_exceptions=True)
        pump.cancel()
        return [type(e) for e in ended], [list(c.token_ids) for c in decode_batch(message)]

    assert asyncio.run(story()) == ([StopAsyncIteration], [[7]])
