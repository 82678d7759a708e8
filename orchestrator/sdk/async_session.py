"""An asyncio session: ``Session`` with awaited calls and a renewal task instead of a
thread. The semantics (history, idempotency, retries, renewal) are ``Session``'s."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from orchestrator.sdk._state import SessionState
from orchestrator.sdk._stream import StreamCollector, next_resume, reconnect_request, reconnected
from orchestrator.sdk._wire import (
    CHAT_PATH,
    TurnMeta,
    connection_error,
    json_body,
    new_idempotency_key,
    request_id_of,
    result_from_completion,
)
from orchestrator.sdk.errors import APIConnectionError, KVTideAPIError, NotFoundError
from orchestrator.sdk.results import SessionInfo, TurnResult

if TYPE_CHECKING:
    from orchestrator.sdk.async_client import AsyncClient

__all__ = ["AsyncSession", "AsyncTurnStream"]

log = logging.getLogger("kvtide.sdk")


class AsyncSession:
    """Made by ``AsyncClient.session()``; use ``async with`` so it is closed at the end."""

    def __init__(self, client: AsyncClient, state: SessionState) -> None:
        self._client = client
        self._state = state
        self._stop = asyncio.Event()
        self._renewer: asyncio.Task[None] | None = None

    @property
    def id(self) -> str:
        return self._state.id

    @property
    def model(self) -> str | None:
        return self._state.model

    @property
    def messages(self) -> list[dict[str, str]]:
        return [dict(m) for m in self._state.messages]

    @property
    def turns(self) -> list[TurnResult]:
        return list(self._state.turns)

    @property
    def closed(self) -> bool:
        return self._state.closed

    @property
    def renew_error(self) -> Exception | None:
        return self._state.renew_error

    # ---- turns --------------------------------------------------------------------

    async def send(
        self,
        user_text: str,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        traceparent: str | None = None,
        idempotency_key: str | None = None,
        **sampling: Any,
    ) -> TurnResult:
        """As ``Session.send``."""
        state, clock = self._state, self._client._clock
        state.begin_turn()
        key = idempotency_key or new_idempotency_key()
        try:
            start = clock()
            body, headers = state.turn_request(
                await self._model(),
                user_text,
                key,
                stream=False,
                max_tokens=max_tokens,
                temperature=temperature,
                traceparent=traceparent,
                sampling=sampling,
            )
            response, attempts = await self._client._send(
                "POST", CHAT_PATH, json=body, headers=headers
            )
            meta = state.turn_meta(key, attempts)
            result = result_from_completion(
                json_body(response), response.headers, meta, clock() - start
            )
        except BaseException as exc:
            self._turn_failed(exc, key)
            raise
        self._turn_done(user_text, result)
        return result

    async def stream(
        self,
        user_text: str,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        traceparent: str | None = None,
        idempotency_key: str | None = None,
        **sampling: Any,
    ) -> AsyncTurnStream:
        """As ``Session.stream``: ``async for delta in await session.stream(...)``."""
        state, clock = self._state, self._client._clock
        state.begin_turn()
        key = idempotency_key or new_idempotency_key()
        try:
            start = clock()
            body, headers = state.turn_request(
                await self._model(),
                user_text,
                key,
                stream=True,
                max_tokens=max_tokens,
                temperature=temperature,
                traceparent=traceparent,
                sampling=sampling,
            )
            response, attempts = await self._client._send(
                "POST", CHAT_PATH, json=body, headers=headers, stream=True
            )
        except BaseException as exc:
            self._turn_failed(exc, key)
            raise
        meta = state.turn_meta(key, attempts)
        return AsyncTurnStream(self, user_text, response, meta, start, (body, headers))

    async def _model(self) -> str:
        if self._state.model is None:
            self._state.model = await self._client.default_model()
        return self._state.model

    def _turn_done(self, user_text: str, result: TurnResult) -> None:
        self._state.end_turn(user_text, result, self._client._clock())
        self._start_renewer()

    def _turn_failed(self, exc: BaseException, key: str) -> None:
        self._state.abort_turn()
        if isinstance(exc, KVTideAPIError):
            exc.idempotency_key = key

    # ---- lease --------------------------------------------------------------------

    async def info(self) -> SessionInfo:
        return await self._client.get_session(self.id)

    async def renew(self) -> SessionInfo:
        info = await self._client.renew_session(self.id)
        self._state.renewed(self._client._clock())
        return info

    def _renew_due(self, now_s: float) -> bool:
        return self._state.renew_due(now_s)

    async def _renew_if_due(self, now_s: float) -> bool:
        """As ``Session._renew_if_due``: failures go to ``renew_error``, never raised."""
        if not self._renew_due(now_s):
            return False
        try:
            await self.renew()
        except KVTideAPIError as exc:
            log.warning("renewing session %s failed: %s", self.id, exc)
            gone = isinstance(exc, NotFoundError)
            self._state.renew_failed(exc, self._client._clock(), gone=gone)
        return True

    async def _renew_loop(self, wait: Callable[[float], Awaitable[bool]]) -> None:
        while not await wait(self._state.renew_wait_s(self._client._clock())):
            await self._renew_if_due(self._client._clock())

    async def _wait_stop(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._stop.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _start_renewer(self) -> None:
        if self._state.renew_every_s is None or self._renewer is not None or self._stop.is_set():
            return
        self._renewer = asyncio.get_running_loop().create_task(
            self._renew_loop(self._wait_stop), name=f"kvtide-renew-{self.id}"
        )

    async def _stop_renewer(self) -> None:
        self._stop.set()
        renewer, self._renewer = self._renewer, None
        if renewer is not None and not renewer.done():
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)

    async def close(self) -> None:
        """As ``Session.close``: one ``DELETE``, however often it is called."""
        if not self._state.close():
            return
        await self._stop_renewer()
        await self._client.delete_session(self.id)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self.close()
            return
        try:
            await self.close()
        except KVTideAPIError as close_exc:
            log.warning("closing session %s failed: %s", self.id, close_exc)


class AsyncTurnStream:
    """As ``TurnStream``, for ``async for``; ``aclose()`` or ``async with`` to stop early."""

    def __init__(
        self,
        session: AsyncSession,
        user_text: str,
        response: httpx.Response,
        meta: TurnMeta,
        start_s: float,
        request: tuple[dict[str, Any], dict[str, str]] | None = None,
    ) -> None:
        self._session = session
        # The turn's first request, for continuing it after a broken stream, and the
        # headers of the request being read (its idempotency key).
        self._request = request
        self._headers = request[1] if request is not None else {}
        self._user_text = user_text
        self._response = response
        self._lines = response.aiter_lines()
        self._meta = meta
        self._start_s = start_s
        self._clock = session._client._clock
        self._collector = StreamCollector(request_id_of(response.headers))
        self._first_s: float | None = None
        self._finish_s: float | None = None
        self._result: TurnResult | None = None
        self._ended = False

    @property
    def text(self) -> str:
        return "".join(self._collector.parts)

    @property
    def result(self) -> TurnResult:
        if self._result is None:
            raise RuntimeError("the turn has not finished: iterate the stream to its end first")
        return self._result

    def __aiter__(self) -> AsyncIterator[str]:
        return self

    async def __anext__(self) -> str:
        if self._ended:
            raise StopAsyncIteration
        while True:
            try:
                delta = await self._next_delta()
            except httpx.TransportError as exc:
                error = connection_error(exc, self._session._client.base_url, mid_stream=True)
                if await self._reconnect(error):
                    continue
                await self._abort(error)
                raise error from exc
            except KVTideAPIError as exc:
                if await self._resume(exc):
                    continue
                await self._abort(exc)
                raise
            except BaseException as exc:
                await self._abort(exc)
                raise
            break
        if delta is None:
            raise StopAsyncIteration
        return delta

    async def _next_delta(self) -> str | None:
        collector = self._collector
        while True:
            try:
                line = await self._lines.__anext__()
            except StopAsyncIteration:
                delta = collector.end()
                if delta:
                    return self._first(delta)
                break
            delta = collector.feed(line)
            if collector.finished and self._finish_s is None:
                self._finish_s = self._clock() - self._start_s
            if delta:
                return self._first(delta)
            if collector.done:
                break
        await self._complete()
        return None

    async def _resume(self, error: KVTideAPIError) -> bool:
        """Continue the turn after a retryable in-stream error (see
        ``orchestrator.sdk._wire.resume_request``); False when it cannot go on."""
        client, collector = self._session._client, self._collector
        nxt = next_resume(collector, self._request, self.text, error, client.retry.max_retries)
        if nxt is None:
            return False
        response = await self._send_next(nxt[0], nxt[1], error)
        if response is None:
            return False
        self._collector = collector.resumed(request_id_of(response.headers), nxt[2])
        return True

    async def _reconnect(self, error: KVTideAPIError) -> bool:
        """Continue the turn after its connection broke (see
        ``orchestrator.sdk._wire.reconnect_request``); False when it cannot go on."""
        client, collector = self._session._client, self._collector
        nxt = reconnect_request(
            collector, self._request, self._headers, self.text, client.retry.max_retries
        )
        if nxt is None:
            return False
        response = await self._send_next(nxt[0], nxt[1], error)
        if response is None:
            return False
        self._collector = reconnected(collector, response.headers)
        return True

    async def _send_next(
        self, body: dict[str, Any], headers: dict[str, str], error: KVTideAPIError
    ) -> httpx.Response | None:
        """Send the request that continues the turn; None when it could not be sent."""
        await self._response.aclose()
        try:
            response, attempts = await self._session._client._send(
                "POST", CHAT_PATH, json=body, headers=headers, stream=True
            )
        except KVTideAPIError:
            log.warning("could not continue turn %s after: %s", self._meta.turn, error)
            return None
        log.info("turn %s: stream broke (%s); continuing it", self._meta.turn, error)
        self._response, self._lines, self._headers = response, response.aiter_lines(), headers
        self._meta = dataclasses.replace(
            self._meta, num_attempts=self._meta.num_attempts + attempts
        )
        return response

    def _first(self, delta: str) -> str:
        if self._first_s is None:
            self._first_s = self._clock() - self._start_s
        return delta

    async def _complete(self) -> None:
        if not self._collector.finished:
            raise APIConnectionError(
                "the stream ended before the turn finished (no finish_reason arrived)"
            )
        now = self._clock() - self._start_s
        finish = self._finish_s if self._finish_s is not None else now
        self._result = self._collector.result(
            self._meta, ttft_s=self._first_s, finish_s=finish, total_s=now
        )
        self._ended = True
        await self._response.aclose()
        self._session._turn_done(self._user_text, self._result)

    async def _abort(self, exc: BaseException) -> None:
        self._ended = True
        await self._response.aclose()
        self._session._turn_failed(exc, self._meta.idempotency_key)

    async def aclose(self) -> None:
        if not self._ended:
            await self._abort(RuntimeError("stream closed by the caller"))

    async def __aenter__(self) -> AsyncTurnStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
