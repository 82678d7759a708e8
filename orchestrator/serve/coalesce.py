"""An engine host's stream to the ingress: each engine output as it is made, or, opted
into (``server.stream_chunk_window_ms`` above 0), a request's tokens held back and sent
in chunks.

By default (no window) ``coalesce`` hands the engine's stream on unchanged: one Serve
stream item per engine output, so the client gets an SSE event per engine step. Outputs
that queue up while the host is busy still leave together, merged by vLLM's own output
collector (``RequestOutputCollector``: a delta the consumer has not taken yet absorbs the
next), as in vLLM's own server; nothing waits for company.

With a window, ``coalesce`` reads the engine's stream in a task of its own and merges
what has arrived since the last chunk it gave out: up to ``max_tokens`` tokens, or what
arrives within ``window_s`` of the first one waiting. The first chunk and the finished
chunk are never held: a stream's first token leaves as soon as the engine makes it, and
its last carries every token still waiting. Fewer Serve hops for many tokens, at the
price of tokens reaching the client in bursts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import msgspec

from engines.base import GenerateChunk

__all__ = ["coalesce", "merge_chunks"]

_END = object()


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def merge_chunks(first: GenerateChunk, then: GenerateChunk) -> GenerateChunk:
    """``then`` with ``first``'s text, tokens and their log probabilities in front, and
    the KV bytes either read (its other fields are the later chunk's: a finished chunk
    keeps its accounting)."""
    logprobs = first.logprobs
    if then.logprobs is not None:
        logprobs = [*(logprobs or ()), *then.logprobs]
    read_bytes = first.kv_read_bytes
    if then.kv_read_bytes is not None:
        read_bytes = then.kv_read_bytes + (read_bytes or 0)
    return msgspec.structs.replace(
        then,
        text=first.text + then.text,
        token_ids=[*first.token_ids, *then.token_ids],
        logprobs=logprobs,
        kv_read_bytes=read_bytes,
        prompt_logprobs=(
            first.prompt_logprobs if then.prompt_logprobs is None else then.prompt_logprobs
        ),
    )


async def coalesce(
    source: AsyncIterator[GenerateChunk],
    *,
    max_tokens: int,
    window_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncGenerator[GenerateChunk, None]:
    """``source``'s chunks, merged when a window is given (see the module): with
    ``window_s`` 0 or ``max_tokens`` 1, ``source`` itself. An exception from ``source``
    ends the stream after the tokens that arrived before it; closing the stream closes
    ``source`` (a disconnected client aborts the engine's request)."""
    if max_tokens <= 1 or window_s <= 0:
        try:
            async for chunk in source:
                yield chunk
        finally:
            await _close(source)
        return
    window = _Window(source, max_tokens=max_tokens, window_s=window_s, clock=clock)
    try:
        async for chunk in window.chunks():
            yield chunk
    finally:
        await window.close()


_WINDOW_CLOSED = object()


class _Window:
    """The windowed stream: ``source`` read by a task of its own into a queue, and the
    chunk that waits for company (``pending``) until its window closes."""

    def __init__(
        self,
        source: AsyncIterator[GenerateChunk],
        *,
        max_tokens: int,
        window_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.source = source
        self.max_tokens = max_tokens
        self.window_s = window_s
        self.clock = clock
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.reader = asyncio.get_running_loop().create_task(self._read())
        self.pending: GenerateChunk | None = None
        self.deadline = 0.0

    async def _read(self) -> None:
        try:
            async for chunk in self.source:
                self.queue.put_nowait(chunk)
        except Exception as exc:
            self.queue.put_nowait(_Failed(exc))
        else:
            self.queue.put_nowait(_END)

    async def _next(self) -> object:
        """The next item from the engine, or ``_WINDOW_CLOSED`` when the waiting chunk's
        window closed first."""
        if self.pending is None:
            return await self.queue.get()
        if not self.queue.empty():
            return self.queue.get_nowait()
        left = self.deadline - self.clock()
        if left <= 0:
            return _WINDOW_CLOSED
        try:
            return await asyncio.wait_for(self.queue.get(), left)
        except TimeoutError:
            return _WINDOW_CLOSED

    def _take(self) -> list[GenerateChunk]:
        pending, self.pending = self.pending, None
        return [] if pending is None else [pending]

    async def chunks(self) -> AsyncGenerator[GenerateChunk, None]:
        first = True
        while True:
            item = await self._next()
            if item is _WINDOW_CLOSED or item is _END or isinstance(item, _Failed):
                for chunk in self._take():  # what waited leaves
                    yield chunk
                if isinstance(item, _Failed):
                    raise item.exc
                if item is _END:
                    return
                continue
            assert isinstance(item, GenerateChunk)
            waiting, self.pending = self.pending, None
            chunk = item if waiting is None else merge_chunks(waiting, item)
            if first or chunk.finished or len(chunk.token_ids) >= self.max_tokens:
                first = False
                yield chunk
                continue
            self.pending = chunk
            if waiting is None:  # the window runs from the first token waiting
                self.deadline = self.clock() + self.window_s

    async def close(self) -> None:
        self.reader.cancel()
        await asyncio.wait([self.reader])  # its end, not its exception (it was cancelled)
        await _close(self.source)


async def _close(source: AsyncIterator[GenerateChunk]) -> None:
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        await aclose()
