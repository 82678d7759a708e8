"""An engine host's streams (``orchestrator.serve.coalesce``): by default each engine
output leaves as it is made; opted into, tokens leave in chunks: the first token and the
last never wait, tokens that queue up leave together, nothing is lost or reordered, and
closing the stream closes the engine's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from engines.base import GenerateChunk
from orchestrator.serve.coalesce import coalesce, merge_chunks


def tok(i: int, finished: bool = False) -> GenerateChunk:
    return GenerateChunk(
        request_id="r",
        text=f"<{i}>",
        token_ids=[i],
        finished=finished,
        finish_reason="length" if finished else None,
        num_prompt_tokens=7 if finished else 0,
    )


class Engine:
    """A stream the test feeds: ``put`` a chunk, ``fail``, or ``end``; records closing."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[GenerateChunk | BaseException | None] = asyncio.Queue()
        self.closed = False

    def put(self, *chunks: GenerateChunk) -> None:
        for chunk in chunks:
            self.queue.put_nowait(chunk)

    async def stream(self) -> AsyncIterator[GenerateChunk]:
        try:
            while True:
                item = await self.queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed = True


async def settle() -> None:
    """Let every task run until it waits on something the test controls."""
    for _ in range(20):
        await asyncio.sleep(0)


def ids(chunk: GenerateChunk) -> list[int]:
    return list(chunk.token_ids)


def test_the_first_token_leaves_at_once_and_queued_tokens_leave_together() -> None:
    async def story() -> None:
        engine = Engine()
        out = coalesce(engine.stream(), max_tokens=16, window_s=60.0)
        engine.put(tok(0))
        assert ids(await anext(out)) == [0]  # not held for the window
        # Tokens 1-3 are waiting when the ingress asks: they leave as one chunk once the
        # stream finishes (the finished chunk never waits, and carries them).
        engine.put(tok(1), tok(2), tok(3), tok(4, finished=True))
        last = await anext(out)
        assert ids(last) == [1, 2, 3, 4] and last.text == "<1><2><3><4>"
        assert last.finished and last.num_prompt_tokens == 7
        engine.queue.put_nowait(None)
        with pytest.raises(StopAsyncIteration):
            await anext(out)

    asyncio.run(story())


def test_a_chunk_leaves_when_it_holds_max_tokens() -> None:
    async def story() -> list[list[int]]:
        engine = Engine()
        engine.put(*(tok(i) for i in range(9)), tok(9, finished=True))
        engine.queue.put_nowait(None)
        return [ids(c) async for c in coalesce(engine.stream(), max_tokens=4, window_s=60.0)]

    assert asyncio.run(story()) == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]


def test_with_no_window_every_engine_output_leaves_as_it_was_made() -> None:
    # The default: one stream item per engine output (an SSE event per engine step),
    # even when several are already waiting; none is held for company.
    async def story() -> None:
        engine = Engine()
        out = coalesce(engine.stream(), max_tokens=16, window_s=0.0)
        engine.put(tok(0), tok(1), tok(2))
        assert [ids(await anext(out)) for _ in range(3)] == [[0], [1], [2]]
        nxt = asyncio.ensure_future(anext(out))
        await settle()
        assert not nxt.done()  # no token: nothing to send
        engine.put(tok(3))
        assert ids(await nxt) == [3]  # sent as soon as it came
        await out.aclose()
        assert engine.closed  # a client gone mid-stream ends the engine's request

    asyncio.run(story())


def test_a_waiting_token_leaves_when_its_window_closes() -> None:
    async def story() -> list[int]:
        engine = Engine()
        out = coalesce(engine.stream(), max_tokens=16, window_s=0.01)
        engine.put(tok(0), tok(1))
        await anext(out)
        # Token 1 waits for company; none comes; the window sends it alone.
        second = ids(await asyncio.wait_for(anext(out), 5.0))
        await out.aclose()
        return second

    assert asyncio.run(story()) == [1]


def test_an_engine_failure_ends_the_stream_after_the_tokens_before_it() -> None:
    async def story() -> tuple[list[list[int]], str]:
        engine = Engine()
        engine.put(tok(0), tok(1), tok(2))
        engine.queue.put_nowait(RuntimeError("engine died"))
        got: list[list[int]] = []
        with pytest.raises(RuntimeError) as raised:
            async for chunk in coalesce(engine.stream(), max_tokens=16, window_s=60.0):
                got.append(ids(chunk))
        return got, str(raised.value)

    assert asyncio.run(story()) == ([[0], [1, 2]], "engine died")


def test_closing_the_stream_closes_the_engines_and_leaves_no_task() -> None:
    async def story() -> tuple[bool, int]:
        engine = Engine()
        out = coalesce(engine.stream(), max_tokens=16, window_s=60.0)
        engine.put(tok(0), tok(1))
        await anext(out)
        await out.aclose()  # the client went away mid-stream
        await settle()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return engine.closed, len(others)

    assert asyncio.run(story()) == (True, 0)


def test_one_token_chunks_pass_through_unchanged() -> None:
    async def story() -> list[list[int]]:
        engine = Engine()
        engine.put(tok(0), tok(1), tok(2, finished=True))
        engine.queue.put_nowait(None)
        return [ids(c) async for c in coalesce(engine.stream(), max_tokens=1, window_s=60.0)]

    assert asyncio.run(story()) == [[0], [1], [2]]


def test_merged_chunks_keep_the_kv_bytes_either_read() -> None:
    # The first chunk of an engine's request says what it read; a merge keeps it.
    first = msgspec.structs.replace(tok(1), kv_read_bytes=4096)
    assert merge_chunks(first, tok(2)).kv_read_bytes == 4096
    assert merge_chunks(tok(1), tok(2, finished=True)).kv_read_bytes is None
    then = msgspec.structs.replace(tok(2), kv_read_bytes=1)
    assert merge_chunks(first, then).kv_read_bytes == 4097
