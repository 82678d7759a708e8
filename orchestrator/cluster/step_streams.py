"""Step streams: an engine's new tokens for every request of one ingress process travel
to it together, one Serve stream item per engine step, instead of one item per request.

vLLM's engine core hands its API server one message per step with every request's new
tokens. A Serve streaming call per request undoes that: each request's tokens are a Ray
stream item of their own, so at concurrency 32 a decode step costs 32 hops. Here the
per-request call stays (Serve routes it, counts it as the replica's load, and cancelling
it aborts the engine's request), but its tokens do not travel on it:

* ``EngineHost.generate_stepped(request, caller)`` answers with its replica's id, then
  puts each chunk of the engine's stream into that caller's ``StepOutbox`` and ends when
  the engine's request ends (or raises as the engine did);
* ``EngineHost.steps(StepsOpen(replica, caller))`` is the caller's one standing stream
  to that replica, pinned there by ``orchestrator.cluster.step_router``: it answers with
  the replica's id, then yields whatever the outbox holds each time it is woken, one
  msgpack message (``encode_batch``): the outputs the engine's last step gave all the
  caller's requests (the requests' tasks all run before the stream's: they were woken
  first), more where the caller fell behind;
* ``StepChannels`` (the ingress side) opens a replica's step stream the first time one
  of its requests lands there and hands each chunk to the request's reader, a
  ``StepStream``, which the router reads as it would the request's own Serve stream.

Invariants: one request's chunks pass through one outbox and one stream, in order; the
finished chunk is put before ``generate_stepped`` ends, so a request whose call ended
without error gets it unless the step stream breaks. A broken step stream (its replica
died) fails every request still reading from it, as a failed engine stream does, and
the next request there opens a new one. A reader closed early cancels its call (the
engine's request is aborted); chunks of it still on their way are dropped.

Chunks wait in their outbox until a step stream reads them. The two calls of a request
race: its engine request may finish (a short answer on a fast engine) before its
caller's step stream reaches the replica, and a step stream may end (replaced, or its
caller's side broke) with chunks still waiting. So an outbox is forgotten only when no
step stream holds it, no request writes to it and nothing waits in it; the caller's next
step stream gets what waits. Opening the step stream before the engine call instead
would not do: the replica is known only once Serve has routed the call, and a stream may
still end between two chunks. A step stream holds its outbox from its start, before its
first item (the replica's id) reaches the caller: were it forgotten meanwhile (its only
request failed before any output), the stream would read an outbox nobody writes to, and
every later request of that caller there would hang. A caller that never comes back (its
ingress replica died) would leave its outbox forever, so an outbox that nothing reads or
writes is dropped with what waits in it ``unread_ttl_s`` after its last request ended
(the engine host gives ``server.request_timeout_s``: every request whose chunks wait
there is past its deadline by then), counted in ``StepOutboxes.num_unread_dropped`` and
logged. On the ingress side a request's reader exists before its call is made, and any
of the caller's step streams hands it its chunks (also before its call has named the
replica), so none arrives before its reader; a reader is dropped only after its finished
chunk, its error or its close, when nothing more is wanted.

A replica Serve stops (a scale-in, a redeploy) is drained first: Serve stops routing to
it and waits for its ongoing calls, and a standing step stream never ends by itself, so
the drain would run to Serve's force-kill (``graceful_shutdown_timeout_s``) and the
replica's ``__del__`` (which moves its sessions' KV off) would never run. So the decode
deployments' request router (``step_router.StepRouter``), told which replicas left its
set, calls ``replicas_gone`` (a module function: the router is shipped by value), and
each caller in the process ends its step stream to such a replica once no request of
its own reads from there. An ingress replica Serve stops ends all of its step streams
(``HandlePool.close``, from ``Ingress.__del__``): Serve does not end a standing stream
whose caller is gone, and a redeploy may stop the ingress before the decode replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Collection
from typing import Any

import msgspec

from engines.base import GenerateChunk, GenerateRequest

__all__ = [
    "StepChannels",
    "StepOutbox",
    "StepOutboxes",
    "StepStream",
    "StepsOpen",
    "decode_batch",
    "encode_batch",
    "engine_replica",
    "replicas_gone",
]


class StepsOpen(msgspec.Struct, frozen=True, kw_only=True):
    """Opens ``caller``'s step stream to the engine replica named ``replica`` (its Serve
    replica id; the request router pins the call there)."""

    replica: str
    caller: str


log = logging.getLogger("kvtide.step_streams")


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[GenerateChunk])


def encode_batch(chunks: list[GenerateChunk]) -> bytes:
    return _ENCODER.encode(chunks)


def decode_batch(data: bytes) -> list[GenerateChunk]:
    return _DECODER.decode(data)


class StepOutbox:
    """The engine host's side: the chunks waiting for one caller's step stream. Owned by
    the host's event loop; ``put`` never blocks (a caller that falls behind gets its
    waiting chunks in one message)."""

    def __init__(self) -> None:
        self._chunks: list[GenerateChunk] = []
        self._ready = asyncio.Event()
        self.num_requests = 0  # requests putting here now
        self.num_streams = 0  # step streams holding it, reading or about to
        self._reader = 0  # the reading step stream's number: a newer one replaces it
        self.num_idle = 0  # times it became idle: a drop scheduled in an earlier spell waits

    def put(self, chunk: GenerateChunk) -> None:
        self._chunks.append(chunk)
        self._ready.set()

    @property
    def idle(self) -> bool:
        """Nothing reads (or is about to) and nothing writes."""
        return self.num_streams == 0 and self.num_requests == 0

    @property
    def num_waiting(self) -> int:
        """Chunks put and not yet read by a step stream."""
        return len(self._chunks)

    async def batches(self) -> AsyncGenerator[bytes, None]:
        """Each wake-up's waiting chunks, as one message, until the reader goes or a
        newer step stream of the same caller takes over (one reader at a time: two
        would split a request's chunks)."""
        self._reader += 1
        me = self._reader
        self._ready.set()  # wakes an older reader, to step aside
        while True:
            await self._ready.wait()
            if self._reader != me:
                return
            self._ready.clear()
            chunks, self._chunks = self._chunks, []
            if chunks:
                yield encode_batch(chunks)


class StepOutboxes:
    """An engine host's outboxes, one per caller, and the two calls' bodies (see the
    module): ``run_request`` for ``generate_stepped``, ``run_steps`` for ``steps``. An
    outbox is forgotten once nothing reads it, nothing writes to it and nothing waits in
    it; one that still holds chunks is kept for the caller's next step stream, and
    dropped ``unread_ttl_s`` later if none came."""

    def __init__(self, replica: str, *, unread_ttl_s: float) -> None:
        self.replica = replica
        self.unread_ttl_s = unread_ttl_s
        self.num_unread_dropped = 0  # chunks dropped with an outbox no stream came for
        self._by_caller: dict[str, StepOutbox] = {}

    def __len__(self) -> int:
        """The callers whose outbox is held."""
        return len(self._by_caller)

    def _of(self, caller: str) -> StepOutbox:
        outbox = self._by_caller.get(caller)
        if outbox is None:
            outbox = self._by_caller[caller] = StepOutbox()
        return outbox

    def _forget_idle(self, caller: str) -> None:
        outbox = self._by_caller.get(caller)
        if outbox is None or not outbox.idle:
            return
        if not outbox.num_waiting:
            del self._by_caller[caller]
            return
        # Chunks nobody read yet: the caller's step stream may still be on its way.
        outbox.num_idle += 1
        loop = asyncio.get_running_loop()
        loop.call_later(self.unread_ttl_s, self._drop_unread, caller, outbox, outbox.num_idle)

    def _drop_unread(self, caller: str, outbox: StepOutbox, num_idle: int) -> None:
        """Drop ``outbox`` if it stayed idle since the drop was scheduled."""
        if self._by_caller.get(caller) is not outbox or not outbox.idle:
            return
        if outbox.num_idle != num_idle:
            return  # read or written meanwhile: a later drop is scheduled
        del self._by_caller[caller]
        self.num_unread_dropped += outbox.num_waiting
        log.warning(
            "step outbox of caller %s on %s dropped unread after %.0f s: %d chunks "
            "(%d dropped in all)",
            caller,
            self.replica,
            self.unread_ttl_s,
            outbox.num_waiting,
            self.num_unread_dropped,
        )

    async def run_request(
        self, caller: str, stream: AsyncIterator[GenerateChunk]
    ) -> AsyncIterator[str]:
        """This replica's id, then nothing: ``stream``'s chunks go to ``caller``'s
        outbox. Closed early, it closes ``stream`` (the engine's request ends)."""
        outbox = self._of(caller)
        outbox.num_requests += 1
        try:
            yield self.replica
            async for chunk in stream:
                outbox.put(chunk)
        finally:
            outbox.num_requests -= 1
            self._forget_idle(caller)
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()

    async def run_steps(self, opened: StepsOpen) -> AsyncIterator[str | bytes]:
        """This replica's id, then ``opened.caller``'s batches until the caller goes. The
        outbox is held from the start: forgotten while its id travels, the stream would
        read an outbox no request writes to any more."""
        outbox = self._of(opened.caller)
        outbox.num_streams += 1
        try:
            yield self.replica
            # Closed with this stream, so the outbox is no longer read when it is forgotten.
            async with contextlib.aclosing(outbox.batches()) as batches:
                async for batch in batches:
                    yield batch
        finally:
            outbox.num_streams -= 1
            self._forget_idle(opened.caller)


class StepStream:
    """One request's chunks as the router reads them (``PoolClient.generate``): from the
    replica's step stream, its own call watched for failure. ``aclose`` before the
    finished chunk cancels the call, which aborts the engine's request."""

    def __init__(self, channels: StepChannels, request: GenerateRequest) -> None:
        self._channels = channels
        self._request_id = request.request_id
        self._queue: asyncio.Queue[GenerateChunk | BaseException] = asyncio.Queue()
        channels._readers[self._request_id] = self._queue
        self._call: Any = channels._handle.generate_stepped.remote(request, channels.caller)
        self._watch: asyncio.Task[None] | None = None
        self._done = False

    def __aiter__(self) -> StepStream:
        return self

    async def __anext__(self) -> GenerateChunk:
        if self._done:
            raise StopAsyncIteration
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_call())
        item = await self._queue.get()
        if isinstance(item, BaseException):
            await self._end(cancel=False)
            raise item
        if item.finished:
            await self._end(cancel=False)
        return item

    async def _watch_call(self) -> None:
        """The request's own call: its first item names the replica whose step stream
        carries the chunks; its error is the request's."""
        try:
            async for replica in self._call:
                self._channels.attach(str(replica), self._request_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._queue.put_nowait(exc)

    async def aclose(self) -> None:
        await self._end(cancel=not self._done)

    async def _end(self, *, cancel: bool) -> None:
        self._done = True
        self._channels.detach(self._request_id)
        if cancel:
            self._call.cancel()
        if self._watch is not None and not self._watch.done():
            if cancel:
                self._watch.cancel()
                await asyncio.wait([self._watch])


class StepChannels:
    """The ingress side for one engine deployment: a step stream per replica that runs
    this caller's requests, and the readers waiting on them. ``handle`` is the
    deployment's handle with ``stream=True``, routed by ``step_router.StepRouter``."""

    def __init__(self, handle: Any, caller: str | None = None) -> None:
        self._handle = handle
        self.caller = caller or uuid.uuid4().hex
        self._readers: dict[str, asyncio.Queue[GenerateChunk | BaseException]] = {}
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._members: dict[str, set[str]] = {}  # replica -> its requests being read
        self._gone: set[str] = set()  # replicas Serve stopped routing to (draining)
        self.engines: set[str] = set()  # engines whose chunks came on these step streams
        self._loop: asyncio.AbstractEventLoop | None = None
        with _CHANNELS_LOCK:
            _CHANNELS.add(self)

    def generate(self, request: GenerateRequest) -> StepStream:
        return StepStream(self, request)

    def attach(self, replica: str, request_id: str) -> None:
        """``request_id`` runs on ``replica``: read its chunks from that replica's step
        stream, opened now if this caller has none there."""
        if request_id not in self._readers:
            return  # already closed
        self._members.setdefault(replica, set()).add(request_id)
        if replica not in self._streams:
            self._loop = loop = asyncio.get_running_loop()
            self._streams[replica] = loop.create_task(self._read(replica))

    def detach(self, request_id: str) -> None:
        self._readers.pop(request_id, None)
        for members in self._members.values():
            members.discard(request_id)
        self._end_gone()

    def replicas_gone(self, replicas: Collection[str]) -> None:
        """Serve stopped routing to ``replicas``: end the step stream to each once no
        request reads from it. Safe from any thread (Serve's router may run on its own)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # no step stream was ever opened here
        gone = set(replicas)

        def on_loop() -> None:
            self._gone |= gone
            self._end_gone()

        loop.call_soon_threadsafe(on_loop)

    def _end_gone(self) -> None:
        if not self._gone:
            return  # every request's detach comes here: nothing to build in service
        for replica in self._gone & set(self._streams):
            if not self._members.get(replica):
                log.info("ending the step stream to %s: Serve is stopping it", replica)
                self._streams[replica].cancel()

    async def _read(self, replica: str) -> None:
        error: BaseException | None = None
        stream: Any = None
        try:
            stream = self._handle.steps.remote(StepsOpen(replica=replica, caller=self.caller))
            first = True
            async for item in stream:
                if first:
                    first = False
                    if item != replica:
                        raise RuntimeError(f"step stream for {replica} reached {item}")
                    continue
                for chunk in decode_batch(item):
                    if chunk.engine_id is not None:
                        self.engines.add(chunk.engine_id)
                        _learn(chunk.engine_id, replica)
                    reader = self._readers.get(chunk.request_id)
                    if reader is not None:
                        reader.put_nowait(chunk)
            error = RuntimeError(f"engine replica {replica}'s step stream ended")
        except asyncio.CancelledError:
            error = RuntimeError(f"engine replica {replica}'s step stream was cancelled")
            cancel = getattr(stream, "cancel", None)
            if cancel is not None:
                cancel()  # the replica's side ends too (Serve cancels the call)
            raise
        except Exception as exc:
            error = exc
        finally:
            # Every request still reading from it fails as its engine's stream would.
            self._streams.pop(replica, None)
            for request_id in self._members.pop(replica, set()):
                reader = self._readers.get(request_id)
                if reader is not None and error is not None:
                    reader.put_nowait(error)

    async def close(self) -> None:
        """Stop every step stream (the ingress is going away)."""
        with _CHANNELS_LOCK:
            _CHANNELS.discard(self)
        tasks = list(self._streams.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


# Every caller's channels in this process, for ``replicas_gone``.
_CHANNELS: weakref.WeakSet[StepChannels] = weakref.WeakSet()
_CHANNELS_LOCK = threading.Lock()


# Each engine's replica, as its step stream's chunks named it (an engine id names one
# replica's engine for that replica's life): where a request asking for an engine goes.
_ENGINE_REPLICAS: dict[str, str] = {}


def _learn(engine_id: str, replica: str) -> None:
    if _ENGINE_REPLICAS.get(engine_id) != replica:
        with _CHANNELS_LOCK:
            _ENGINE_REPLICAS[engine_id] = replica


def engine_replica(engine_id: str) -> str | None:
    """The replica whose engine is ``engine_id``, once one of its step streams said so
    in this process; None before."""
    return _ENGINE_REPLICAS.get(engine_id)


def replicas_gone(replicas: Collection[str]) -> None:
    """Serve stopped routing to ``replicas`` (they are being stopped): every caller in
    this process ends its step stream to each once its own requests there have ended,
    so the replica's graceful drain can finish (see the module)."""
    if not replicas:
        return
    with _CHANNELS_LOCK:
        channels = list(_CHANNELS)
        for engine_id, replica in list(_ENGINE_REPLICAS.items()):
            if replica in replicas:
                del _ENGINE_REPLICAS[engine_id]
    for channel in channels:
        channel.replicas_gone(replicas)
