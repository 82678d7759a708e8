"""A pool reached through its Ray Serve deployment handles.

A pool placed by NVLink domain is one deployment per domain (``orchestrator.cluster.pool_layout``),
so a pool can have several handles. Serve balances replicas inside a deployment; across
deployments the pool sends each request to the one with the fewest requests in flight
from here per replica, the first on ties; a request that asks for an engine
(``GenerateRequest.engine_id``) to the deployment whose step streams brought that
engine's chunks, when one did. With ``steps``, a request's tokens come back on this
process's step stream to its replica (``orchestrator.cluster.step_streams``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from ray.serve.handle import DeploymentHandle

from engines.base import GenerateChunk, GenerateRequest
from orchestrator.cluster.step_streams import StepChannels

__all__ = ["HandlePool", "as_handles"]


def as_handles(
    handles: DeploymentHandle | Sequence[DeploymentHandle],
) -> tuple[DeploymentHandle, ...]:
    """One handle or several, as a non-empty tuple."""
    out = tuple(handles) if isinstance(handles, (list, tuple)) else (handles,)
    if not out:
        raise ValueError("a pool needs at least one deployment handle")
    return out


class HandlePool:
    """A pool's deployments (streaming ``generate``). ``weights`` are the replicas of
    each deployment (default 1 each); ``steps``: through step streams."""

    def __init__(
        self,
        handles: DeploymentHandle | Sequence[DeploymentHandle],
        weights: Sequence[int] | None = None,
        *,
        steps: bool = False,
    ) -> None:
        self.handles = as_handles(handles)
        self.handle = self.handles[0]
        self._weights = tuple(weights) if weights is not None else (1,) * len(self.handles)
        if len(self._weights) != len(self.handles) or min(self._weights) < 1:
            raise ValueError("give one weight of at least 1 per deployment handle")
        self._streams = [h.options(stream=True) for h in self.handles]
        self._steps = [StepChannels(s) for s in self._streams] if steps else None
        self._in_flight = [0] * len(self.handles)

    def pick(self) -> int:
        """Index of the deployment the next request goes to."""
        if len(self.handles) == 1:
            return 0
        return min(range(len(self.handles)), key=lambda i: self._in_flight[i] / self._weights[i])

    def runs(self, engine_id: str) -> int | None:
        """Index of the deployment whose step streams brought ``engine_id``'s chunks."""
        for index, channels in enumerate(self._steps or ()):
            if engine_id in channels.engines:
                return index
        return None

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        index = None if request.engine_id is None else self.runs(request.engine_id)
        if index is None:
            index = self.pick()
        stream: AsyncIterator[GenerateChunk]
        if self._steps is not None:
            stream = self._steps[index].generate(request)
        else:
            stream = self._streams[index].generate.remote(request)
        if len(self.handles) == 1:
            return stream
        self._in_flight[index] += 1
        return _Counted(stream, self, index)

    def _done(self, index: int) -> None:
        self._in_flight[index] -= 1

    async def close(self) -> None:
        """End this process's step streams (its ingress replica is going away): Serve
        drains a replica it stops by waiting for its ongoing calls, and does not end a
        standing stream whose caller is gone, so a decode replica stopped after the
        ingress would wait for it to its force-kill and never move its sessions' KV."""
        for channels in self._steps or ():
            await channels.close()


class _Counted:
    """A deployment's stream that gives its in-flight count back exactly once: when it
    ends, fails, is closed, or is dropped unread. Closed before its end, it cancels the
    Serve call (which aborts the engine's request), as the router does to a stream of
    one deployment (``orchestrator.router.abort_stream``)."""

    def __init__(self, stream: AsyncIterator[GenerateChunk], pool: HandlePool, index: int) -> None:
        self._stream, self._pool, self._index = stream, pool, index
        self._open = True
        self._ended = False  # ended, finished or failed: nothing left to abort

    def __aiter__(self) -> _Counted:
        return self

    async def __anext__(self) -> GenerateChunk:
        try:
            chunk = await self._stream.__anext__()
        except BaseException as exc:
            # A wait given up (cancelled) leaves the call running: aclose cancels it.
            self._ended = not isinstance(exc, asyncio.CancelledError)
            self._release()
            raise
        if chunk.finished:
            self._ended = True
            self._release()
        return chunk

    async def aclose(self) -> None:
        self._release()
        if self._ended:
            return
        self._ended = True
        close = getattr(self._stream, "aclose", None)
        if close is not None:
            await close()
            return
        cancel = getattr(self._stream, "cancel", None)
        if cancel is not None:
            cancel()

    def _release(self) -> None:
        if self._open:
            self._open = False
            self._pool._done(self._index)

    def __del__(self) -> None:
        self._release()
