"""Engine streams on a turn's path: each item awaited against the turn's deadline, and a
stream that ends early aborted, so that its engine request does not stay queued."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from engines.base import GenerateChunk
from orchestrator.errors import DeadlineExceeded, EngineUnavailable, RequestError

__all__ = ["abort_stream", "bounded"]

log = logging.getLogger("kvtide.router")


async def abort_stream(stream: object) -> None:
    """End an engine stream that has not finished, so that its engine aborts the request
    (and frees its KV blocks, or stops its pull): an async generator is closed (the
    engine host aborts in its ``finally``); a Serve ``DeploymentResponseGenerator``, which
    has no ``aclose``, is cancelled (Serve cancels the call on the replica, which closes
    the host's stream). Dropping either unread would leave the request queued."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()
        return
    cancel = getattr(stream, "cancel", None)
    if cancel is not None:
        cancel()


async def bounded(
    stream: AsyncIterator[GenerateChunk], deadline_s: float, clock: Callable[[], float], what: str
) -> AsyncGenerator[GenerateChunk, None]:
    """``stream``'s items, each awaited only until ``deadline_s`` (on ``clock``). Past it:
    ``DeadlineExceeded``; a failure that is not kvtide's own error: ``EngineUnavailable``
    naming ``what`` (the details are logged). Unless the stream ended (or gave its
    finished chunk), its engine request is aborted when this generator ends: past the
    deadline, on a failure, a cancellation, or a consumer that stopped reading."""
    it = aiter(stream)
    ended = False
    try:
        while True:
            left = deadline_s - clock()
            if left <= 0:
                raise TimeoutError
            try:
                item = await asyncio.wait_for(anext(it), left)
            except StopAsyncIteration:
                ended = True
                return
            ended = item.finished
            yield item
    except TimeoutError:
        raise DeadlineExceeded(
            f"the request did not finish within its deadline ({what} was still running); "
            "retry it, or raise server.request_timeout_s"
        ) from None
    except (RequestError, asyncio.CancelledError):
        raise
    except Exception as exc:
        log.warning("%s failed: %s: %s", what, type(exc).__name__, exc)
        raise EngineUnavailable(f"the {what} failed; retry the request") from exc
    finally:
        if not ended:
            await abort_stream(it)  # the engine's request ends with the stream
        elif (close := getattr(it, "aclose", None)) is not None:
            await close()  # a finished generator's own cleanup: now, not at GC
