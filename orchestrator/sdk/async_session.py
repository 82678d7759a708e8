"""An asyncio session: ``Session`` with awaited calls and a renewal task instead of a
thread. The semantics (history, tool results, idempotency, retries, continuation,
renewal) are the protocol core's, shared with ``Session``; this module only awaits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import httpx

from orchestrator.sdk._args import TurnArgs, awaits_arguments_of, turn_arguments
from orchestrator.sdk._base import SessionView, StreamView
from orchestrator.sdk._state import ConversationState
from orchestrator.sdk._stream_turn import StreamTurn
from orchestrator.sdk._turn import WireRequest
from orchestrator.sdk.errors import KVTideAPIError
from orchestrator.sdk.results import SessionStatus, TurnResult

if TYPE_CHECKING:
    from orchestrator.sdk.async_client import AsyncClient

__all__ = ["AsyncSession", "AsyncTurnStream"]


class AsyncSession(SessionView):
    """Made by ``AsyncClient.session()``; use ``async with`` so it is closed at the end."""

    _client: AsyncClient

    def __init__(self, client: AsyncClient, state: ConversationState) -> None:
        self._client = client
        self._state = state
        self._stop = asyncio.Event()
        self._renewer: asyncio.Task[None] | None = None

    # ---- turns --------------------------------------------------------------------

    @awaits_arguments_of(turn_arguments)
    async def send(self, args: TurnArgs) -> TurnResult:
        """As ``Session.send``."""
        return await self._client._run(self._send_turn(args))

    @awaits_arguments_of(turn_arguments)
    async def stream(self, args: TurnArgs) -> AsyncTurnStream:
        """As ``Session.stream``: ``async for delta in await session.stream(...)``."""
        core, response = await self._client._run(self._stream_turn(args))
        return AsyncTurnStream(self, core, response)

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


class AsyncTurnStream(StreamView):
    """As ``TurnStream``, for ``async for``; ``aclose()`` or ``async with`` to stop early."""

    _session: AsyncSession

    def __init__(self, session: AsyncSession, core: StreamTurn, response: httpx.Response) -> None:
        super().__init__(session, core, response)
        self._lines = response.aiter_lines()

    def __aiter__(self) -> AsyncIterator[str]:
        return self

    async def __anext__(self) -> str:
        while not self._core.ended:
            try:
                delta = await self._read()
            except BaseException as exc:
                request = self._core.recover(exc)
                if request is not None and await self._continue(request):
                    continue
                await self._response.aclose()
                self._fail(exc)
            if delta is not None:
                return delta
        raise StopAsyncIteration

    async def _read(self) -> str | None:
        core = self._core
        while not core.done:
            delta = core.take(await anext(self._lines, None), self._clock())
            if delta:
                return delta
        await self._response.aclose()
        self._complete()
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
