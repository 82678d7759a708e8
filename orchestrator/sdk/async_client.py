"""The asyncio client: the same calls as ``Client``, awaited, over the same protocol core
(``orchestrator.sdk._turn``). See ``orchestrator.sdk.client``."""

from __future__ import annotations

import asyncio
import random
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

from orchestrator.sdk._args import session_arguments, takes_arguments_of
from orchestrator.sdk._base import DEFAULT_BASE_URL, DEFAULT_TIMEOUT, Exchange, Exchanging, Sent
from orchestrator.sdk._base import BaseClient as _BaseClient
from orchestrator.sdk._state import ConversationState
from orchestrator.sdk._turn import Attempts, WireRequest
from orchestrator.sdk.async_session import AsyncSession
from orchestrator.sdk.results import SessionStatus
from orchestrator.sdk.retry import RetryPolicy

T = TypeVar("T")

__all__ = ["AsyncClient"]


class AsyncClient(_BaseClient):
    """A kvtide client for asyncio code; arguments as ``Client`` (``sleep`` is async).

    Use it from one event loop. ``aclose()`` stops the renewal tasks of sessions still
    open but does not delete them.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        api_key: str | None = None,
        *,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        max_retries: int = 3,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        super().__init__(
            base_url, api_key, max_retries=max_retries, retry=retry, clock=clock, rand=rand
        )
        self._sleep = sleep
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers(), timeout=timeout, transport=transport
        )
        self._sessions: weakref.WeakSet[AsyncSession] = weakref.WeakSet()

    # ---- sessions -----------------------------------------------------------------

    @takes_arguments_of(session_arguments)
    def session(self, state: ConversationState) -> AsyncSession:
        """As ``Client.session``; use ``async with``."""
        session = AsyncSession(self, state)
        self._sessions.add(session)
        return session

    async def get_session(self, session_id: str) -> SessionStatus:
        return await self._run(self._session_status("GET", session_id))

    async def renew_session(self, session_id: str) -> SessionStatus:
        return await self._run(self._session_status("POST", session_id, "/renew"))

    async def delete_session(self, session_id: str) -> None:
        await self._run(self._delete_session(session_id))

    # ---- server -------------------------------------------------------------------

    async def models(self) -> list[str]:
        return await self._run(self._models())

    async def stats(self) -> dict[str, Any]:
        return await self._run(self._stats())

    async def default_model(self) -> str:
        return await self._run(self._default_model())

    # ---- transport ----------------------------------------------------------------

    async def _run(self, call: Exchange[T]) -> T:
        """As ``Client._run``, awaiting each send."""
        driven = Exchanging(call)
        while (request := driven.request) is not None:
            try:
                sent = await self._send(request)
            except BaseException as exc:
                driven.failed(exc)
            else:
                driven.sent(sent)
        return driven.value

    async def _send(self, request: WireRequest) -> Sent:
        """As ``Client._send``: same body and headers on every attempt."""
        attempts = Attempts(request, self.retry, self.base_url)
        while True:
            http_request = self._http_request(self._http, request)
            try:
                response = await self._http.send(http_request, stream=request.stream)
                if response.is_success:
                    return response, attempts.num_attempts
                try:
                    await response.aread()
                finally:
                    await response.aclose()
            except httpx.TransportError as exc:
                delay = attempts.after_transport_error(exc, self._rand())
            else:
                delay = attempts.after_response(response, self._rand())
            await self._sleep(delay)

    async def aclose(self) -> None:
        for session in list(self._sessions):
            await session._stop_renewer()
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()
