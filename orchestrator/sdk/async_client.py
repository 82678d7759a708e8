"""The asyncio client: the same calls as ``Client``, awaited, over the same protocol core
(``orchestrator.sdk._turn``). See ``orchestrator.sdk.client``."""

from __future__ import annotations

import asyncio
import random
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import httpx

from orchestrator.sdk._base import (
    DEFAULT_BASE_URL,
    DEFAULT_RENEW_EVERY_S,
    DEFAULT_TIMEOUT,
    MODELS_PATH,
    STATS_PATH,
)
from orchestrator.sdk._base import BaseClient as _BaseClient
from orchestrator.sdk._state import ConversationState
from orchestrator.sdk._turn import Attempts, WireRequest
from orchestrator.sdk._wire import json_body
from orchestrator.sdk.async_session import AsyncSession
from orchestrator.sdk.errors import NotFoundError
from orchestrator.sdk.results import SessionStatus
from orchestrator.sdk.retry import RetryPolicy

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

    def session(
        self,
        session_id: str | None = None,
        *,
        model: str | None = None,
        system: str | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        renew_every_s: float | None = DEFAULT_RENEW_EVERY_S,
    ) -> AsyncSession:
        """As ``Client.session``; use ``async with``."""
        state = ConversationState(
            session_id=session_id,
            model=model,
            system=system,
            messages=messages,
            renew_every_s=renew_every_s,
        )
        session = AsyncSession(self, state)
        self._sessions.add(session)
        return session

    async def get_session(self, session_id: str) -> SessionStatus:
        return SessionStatus.from_json(await self._json(self._session_call("GET", session_id)))

    async def renew_session(self, session_id: str) -> SessionStatus:
        body = await self._json(self._session_call("POST", session_id, "/renew"))
        return SessionStatus.from_json(body)

    async def delete_session(self, session_id: str) -> None:
        try:
            await self._send(self._session_call("DELETE", session_id))
        except NotFoundError as exc:
            if exc.code != "session_not_found":
                raise

    # ---- server -------------------------------------------------------------------

    async def models(self) -> list[str]:
        return self._model_ids(await self._json(self._get(MODELS_PATH)))

    async def stats(self) -> dict[str, Any]:
        body: dict[str, Any] = await self._json(self._get(STATS_PATH))
        return body

    async def default_model(self) -> str:
        if self._model is None:
            self._model = self._first_model(await self._json(self._get(MODELS_PATH)))
        return self._model

    # ---- transport ----------------------------------------------------------------

    async def _json(self, request: WireRequest) -> Any:
        response, _ = await self._send(request)
        return json_body(response)

    async def _send(self, request: WireRequest) -> tuple[httpx.Response, int]:
        """As ``Client._send``: same body and headers on every attempt."""
        attempts = Attempts(request, self.retry, self.base_url)
        while True:
            http_request = self._http.build_request(
                request.method, request.path, json=request.json, headers=request.headers
            )
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
