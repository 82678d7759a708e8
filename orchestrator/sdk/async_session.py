"""An asyncio session: ``Session`` with awaited calls and a renewal task instead of a
thread. The semantics (history, tool results, idempotency, retries, continuation,
renewal) are the protocol core's, shared with ``Session``; this module only awaits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx

from orchestrator.sdk._base import SessionView
from orchestrator.sdk._state import ConversationState
from orchestrator.sdk._stream_turn import StreamTurn
from orchestrator.sdk._turn import Turn, WireRequest
from orchestrator.sdk._wire import TurnOptions
from orchestrator.sdk.errors import KVTideAPIError
from orchestrator.sdk.results import SessionStatus, TurnResult

if TYPE_CHECKING:
    from orchestrator.sdk.async_client import AsyncClient

__all__ = ["AsyncSession", "AsyncTurnStream"]


class AsyncSession(SessionView):
    """Made by ``AsyncClient.session()``; use ``async with`` so it is closed at the end."""

    def __init__(self, client: AsyncClient, state: ConversationState) -> None:
        self._client = client
        self._state = state
        self._stop = asyncio.Event()
        self._renewer: asyncio.Task[None] | None = None

    # ---- turns --------------------------------------------------------------------

    async def send(
        self,
        user_text: str | None = None,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        response_format: Mapping[str, Any] | type | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        extra_body: Mapping[str, Any] | None = None,
        traceparent: str | None = None,
        idempotency_key: str | None = None,
        **sampling: Any,
    ) -> TurnResult:
        """As ``Session.send``."""
        options = TurnOptions(
            max_tokens=max_tokens,
            temperature=temperature,
            tools=tools,
            tool_choice=tool_choice,
            response_format=response_format,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            extra_body=extra_body,
            sampling=sampling,
            traceparent=traceparent,
            idempotency_key=idempotency_key,
        )
        turn, response, attempts = await self._open(user_text, options, stream=False)
        try:
            result = turn.completed(response, attempts, self._client._clock())
        except BaseException as exc:
            self._state.abort_turn(turn, exc)
            raise
        try:
            return self._state.end_turn(turn, result, self._client._clock())
        finally:
            self._start_renewer()

    async def stream(
        self,
        user_text: str | None = None,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        response_format: Mapping[str, Any] | type | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        extra_body: Mapping[str, Any] | None = None,
        traceparent: str | None = None,
        idempotency_key: str | None = None,
        **sampling: Any,
    ) -> AsyncTurnStream:
        """As ``Session.stream``: ``async for delta in await session.stream(...)``."""
        options = TurnOptions(
            max_tokens=max_tokens,
            temperature=temperature,
            tools=tools,
            tool_choice=tool_choice,
            response_format=response_format,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            extra_body=extra_body,
            sampling=sampling,
            traceparent=traceparent,
            idempotency_key=idempotency_key,
        )
        turn, response, attempts = await self._open(user_text, options, stream=True)
        core = StreamTurn(
            self._state,
            turn,
            response.headers,
            attempts,
            base_url=self._client.base_url,
            max_resumes=self._client.retry.max_retries,
        )
        return AsyncTurnStream(self, core, response)

    async def _open(
        self, user_text: str | None, options: TurnOptions, *, stream: bool
    ) -> tuple[Turn, httpx.Response, int]:
        """Start the turn and send its request (with retries): the turn, its response
        and the attempts it took. A turn that could not be sent is aborted."""
        now_s = self._client._clock()
        if self._state.model is None:
            self._state.model = await self._client.default_model()
        turn = self._state.start_turn(
            self._state.model, user_text, options, stream=stream, now_s=now_s
        )
        try:
            response, attempts = await self._client._send(turn.request)
        except BaseException as exc:
            self._state.abort_turn(turn, exc)
            raise
        return turn, response, attempts

    # ---- lease --------------------------------------------------------------------

    async def info(self) -> SessionStatus:
        return await self._client.get_session(self.id)

    async def renew(self) -> SessionStatus:
        info = await self._client.renew_session(self.id)
        self._state.renewed(self._client._clock())
        return info

    async def _renew_if_due(self, now_s: float) -> bool:
        """As ``Session._renew_if_due``: failures go to ``renew_error``, never raised."""
        if not self._renew_due(now_s):
            return False
        try:
            await self.renew()
        except KVTideAPIError as exc:
            self._state.renew_failed(exc, self._client._clock())
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

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            await self.close()
            return
        try:
            await self.close()
        except KVTideAPIError as close_exc:
            self._state.close_failed(close_exc)


class AsyncTurnStream:
    """As ``TurnStream``, for ``async for``; ``aclose()`` or ``async with`` to stop early."""

    def __init__(self, session: AsyncSession, core: StreamTurn, response: httpx.Response) -> None:
        self._session = session
        self._core = core
        self._response = response
        self._lines = response.aiter_lines()
        self._clock = session._client._clock

    @property
    def text(self) -> str:
        return self._core.text

    @property
    def result(self) -> TurnResult:
        return self._core.result

    def __aiter__(self) -> AsyncIterator[str]:
        return self

    async def __anext__(self) -> str:
        core = self._core
        while not core.ended:
            try:
                delta = await self._read()
            except BaseException as exc:
                request = core.recover(exc)
                if request is not None and await self._continue(request):
                    continue
                await self._response.aclose()
                error = core.fail(exc)
                if core.recorded:
                    self._session._start_renewer()
                if error is exc:
                    raise
                raise error from exc
            if delta is not None:
                return delta
        raise StopAsyncIteration

    async def _read(self) -> str | None:
        core, clock = self._core, self._clock
        async for line in self._lines:
            delta = core.feed(line, clock())
            if delta:
                return delta
            if core.done:
                break
        else:
            delta = core.end(clock())
            if delta:
                return delta
        await self._response.aclose()
        core.complete(clock())
        self._session._start_renewer()
        return None

    async def _continue(self, request: WireRequest) -> bool:
        await self._response.aclose()
        try:
            response, attempts = await self._session._client._send(request)
        except KVTideAPIError as exc:
            self._core.not_continued(exc)
            return False
        self._response, self._lines = response, response.aiter_lines()
        self._core.continued(response.headers, attempts)
        return True

    async def aclose(self) -> None:
        self._core.abandon()
        await self._response.aclose()

    async def __aenter__(self) -> AsyncTurnStream:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()
