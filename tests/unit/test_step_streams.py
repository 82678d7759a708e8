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
    replicas_gone,
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
        self.outboxes = StepOutboxes(replica, unread_ttl_s=600.0)
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


def test_a_request_asking_for_an_engine_goes_to_the_replica_whose_chunks_named_it() -> None:
    class Pending:
        def __init__(self, *args: Any) -> None:
            self.args = args

    extended = GenerateRequest(
        request_id="x", prompt_token_ids=[1, 2, 3], max_tokens=8, engine_id="decode-E9"
    )

    async def story() -> None:
        host = Host("r9")
        channels = StepChannels(host, caller="ingress-1")
        a = channels.generate(req("a"))
        # Before any chunk of engine decode-E9 came: Serve's own choice.
        assert pinned_replica(Pending(extended, "ingress-1")) is None  # type: ignore[arg-type]
        first = asyncio.ensure_future(anext(a))
        await settle()
        host.engine.queues["a"].put_nowait(
            GenerateChunk(request_id="a", token_ids=[4], engine_id="decode-E9")
        )
        await first
        assert pinned_replica(Pending(extended, "ingress-1")) == "r9"  # type: ignore[arg-type]
        await a.aclose()
        # A replica Serve stops no longer runs the engine.
        replicas_gone(["r9"])
        assert pinned_replica(Pending(extended, "ingress-1")) is None  # type: ignore[arg-type]

    asyncio.run(story())


def test_a_pool_sends_a_request_asking_for_an_engine_to_that_engines_deployment() -> None:
    async def story() -> tuple[int, int]:
        a, b = Host("ra"), Host("rb")
        pool = HandlePool([a, b], steps=True)  # type: ignore[list-item]
        # The first request goes to deployment a (first on ties); its chunk names engine
        # decode-Ea.
        first = pool.generate(req("x"))
        nxt = asyncio.ensure_future(anext(first))
        await settle()
        a.engine.queues["x"].put_nowait(
            GenerateChunk(request_id="x", token_ids=[1], engine_id="decode-Ea")
        )
        await nxt
        # With x in flight on a, balancing alone would send the next request to b; one
        # asking for decode-Ea goes to a.
        asked = pool.generate(
            GenerateRequest(
                request_id="z", prompt_token_ids=[1], max_tokens=2, engine_id="decode-Ea"
            )
        )
        waiting = asyncio.ensure_future(anext(asked))
        await settle()
        counts = len(a.generate_stepped.calls), len(b.generate_stepped.calls)
        waiting.cancel()
        for stream in (first, asked):
            await stream.aclose()  # type: ignore[attr-defined]
        return counts

    assert asyncio.run(story()) == (2, 0)


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
        outboxes = StepOutboxes("r1", unread_ttl_s=600.0)
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


async def run_to_the_end(
    outboxes: StepOutboxes, caller: str, tokens: list[int], request_id: str = "a"
) -> None:
    """A request of ``caller`` runs on the host, one step a token, and ends (its call
    too) before anything reads its chunks."""
    engine = Engine()
    request = outboxes.run_request(caller, engine.stream(req(request_id)))
    assert await anext(request) == outboxes.replica
    pump = asyncio.ensure_future(anext(request, None))
    await settle()
    for token in tokens[:-1]:
        engine.step({request_id: token})
    engine.step({request_id: tokens[-1]}, finished=(request_id,))
    assert await pump is None  # the request's call ended: the engine request is done


@pytest.mark.parametrize("stream_before", [False, True])
def test_a_request_that_ends_before_its_step_stream_reads_it_keeps_every_chunk(
    stream_before: bool,
) -> None:
    # A 2-token answer on a fast engine: the engine request ends, its finished chunk in
    # the outbox, before the caller's step stream reaches the replica (or after the
    # caller's previous step stream there ended). The next step stream gets it all.
    async def story() -> tuple[list[list[int]], bool, int]:
        outboxes = StepOutboxes("r1", unread_ttl_s=600.0)
        opened = StepsOpen(replica="r1", caller="ingress-1")
        if stream_before:
            earlier = outboxes.run_steps(opened)
            assert await anext(earlier) == "r1"
            waiting = asyncio.ensure_future(anext(earlier))
            await settle()
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await earlier.aclose()  # that stream ended: nothing reads the outbox now
        await run_to_the_end(outboxes, "ingress-1", [7, 8])
        steps = outboxes.run_steps(opened)  # the caller's step stream arrives only now
        assert await anext(steps) == "r1"
        message = await asyncio.wait_for(anext(steps), 5.0)  # a guard: lost, it never comes
        chunks = decode_batch(message)
        await steps.aclose()
        return [list(c.token_ids) for c in chunks], chunks[-1].finished, len(outboxes)

    assert asyncio.run(story()) == ([[7], [8]], True, 0)


def test_a_short_answer_finished_before_the_ingress_reads_it_reaches_its_reader() -> None:
    # The live hang: the request's own call names the replica only after the engine
    # finished it; the ingress opens its step stream to that replica then.
    async def story() -> list[tuple[list[int], bool]]:
        host = Host()
        channels = StepChannels(host, caller="ingress-1")
        a = channels.generate(req("a"))
        await settle()  # the call runs; nothing reads it yet
        host.engine.step({"a": 1})
        host.engine.step({"a": 2}, finished=("a",))
        await settle()
        assert host.engine.closed == ["a"] and host.steps.calls == []
        got = [await asyncio.wait_for(anext(a), 5.0) for _ in range(2)]  # a guard, as above
        return [(list(c.token_ids), c.finished) for c in got]

    assert asyncio.run(story()) == [([1], False), ([2], True)]


def test_an_outbox_no_step_stream_comes_for_is_dropped_after_its_ttl_and_counted() -> None:
    # The caller's ingress died after its request ran: its chunks are not kept forever.
    async def story() -> tuple[int, int]:
        outboxes = StepOutboxes("r1", unread_ttl_s=0.0)
        await run_to_the_end(outboxes, "ingress-gone", [1, 2])
        held = len(outboxes)
        await settle()  # past the TTL (0 s here): the drop ran
        assert held == 1
        return len(outboxes), outboxes.num_unread_dropped

    assert asyncio.run(story()) == (0, 2)


def test_a_step_stream_on_its_way_keeps_the_outbox_a_failed_request_leaves_empty() -> None:
    # The step stream has taken its outbox and its first item (the replica's id) is on
    # its way to the ingress when the only request there fails before any output. Were
    # the empty outbox forgotten then, the stream would read it forever while the next
    # requests write to a new one: every later request of that ingress there would hang.
    async def story() -> list[int]:
        outboxes = StepOutboxes("r1", unread_ttl_s=600.0)
        engine = Engine()
        failing = outboxes.run_request("ingress-1", engine.stream(req("a")))
        assert await anext(failing) == "r1"
        pump = asyncio.ensure_future(anext(failing, None))
        await settle()
        steps = outboxes.run_steps(StepsOpen(replica="r1", caller="ingress-1"))
        assert await anext(steps) == "r1"  # not read by the ingress yet
        engine.queues["a"].put_nowait(RuntimeError("KV load failed"))
        with pytest.raises(RuntimeError, match="KV load failed"):
            await pump
        message = asyncio.ensure_future(anext(steps))
        await run_to_the_end(outboxes, "ingress-1", [3], request_id="b")
        chunks = decode_batch(await asyncio.wait_for(message, 5.0))  # a guard, as above
        await steps.aclose()
        return [t for c in chunks for t in c.token_ids]

    assert asyncio.run(story()) == [3]


def test_a_replica_serve_stops_has_its_step_stream_ended_once_its_requests_end() -> None:
    """Serve drains a replica it stops (scale-in, redeploy) by waiting for its ongoing
    calls; a standing step stream never ends by itself, so the drain ran to Serve's
    force-kill and the replica's ``__del__`` (which moves its sessions' KV) never ran."""

    async def story() -> None:
        host = Host()
        channels = StepChannels(host, caller="ingress-1")
        a = channels.generate(req("a"))
        await anext_after_step(host, a, {"a": 1})
        (call,) = host.steps.calls
        host.engine.step({"a": 2}, finished=("a",))
        assert (await anext(a)).finished
        await settle()
        assert not call.task.done()  # a replica in service keeps its stream
        b = channels.generate(req("b"))
        await anext_after_step(host, b, {"b": 1})
        replicas_gone(["r1"])  # Serve stopped routing to r1; b still runs there
        await settle()
        assert not call.task.done()
        host.engine.step({"b": 2}, finished=("b",))
        assert (await anext(b)).finished  # b's last chunk came through
        await settle()
        assert call.task.done()  # then the stream ended: the replica's drain can finish
        assert len(host.outboxes) == 0

    asyncio.run(story())


def test_a_pool_closed_with_its_ingress_ends_its_step_streams() -> None:
    """An ingress replica Serve stops ends its standing step streams (``Ingress.__del__``):
    Serve does not end them when their caller is gone, so a decode replica stopped after
    the ingress (a redeploy replaces both) drained to its force-kill and never moved its
    sessions' KV."""

    async def story() -> None:
        host = Host()
        pool = HandlePool(host, steps=True)
        a = pool.generate(req("a"))
        await anext_after_step(host, a, {"a": 1})
        (call,) = host.steps.calls
        host.engine.step({"a": 2}, finished=("a",))
        assert (await anext(a)).finished
        await settle()
        assert not call.task.done()  # a standing stream, as long as the ingress runs
        await pool.close()
        await settle()
        assert call.task.done()  # the replica's side ended: its drain can finish
        assert len(host.outboxes) == 0

    asyncio.run(story())
