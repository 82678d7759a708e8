"""The asyncio client: the same calls as ``Client``, awaited. See ``orchestrator.sdk.client``."""

from __future__ import annotations

import asyncio
import random
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx

from orchestrator.sdk._base import DEFAULT_BASE_URL, DEFAULT_RENEW_EVERY_S, DEFAULT_TIMEOUT
from orchestrator.sdk._base import BaseClient as _BaseClient
from orchestrator.sdk._state import SessionState
from orchestrator.sdk._wire import connection_error, error_from_response, json_body
from orchestrator.sdk.async_session import AsyncSession
from orchestrator.sdk.errors import KVTideAPIError, NotFoundError
from orchestrator.sdk.results import SessionInfo
from orchestrator.sdk.retry import RetryPolicy, parse_retry_after

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
        messages: Sequence[Mapping[str, str]] | None = None,
        renew_every_s: float | None = DEFAULT_RENEW_EVERY_S,
    ) -> AsyncSession:
        """As ``Client.session``; use ``async with``."""
        state = SessionState(
            session_id=session_id,
            model=model,
            system=system,
            messages=messages,
            renew_every_s=renew_every_s,
        )
        session = AsyncSession(self, state)
        self._sessions.add(session)
        return session

    async def get_session(self, session_id: str) -> SessionInfo:
        response, _ = await self._send("GET", self._session_path(session_id))
        return SessionInfo.from_json(json_body(response))

    async def renew_session(self, session_id: str) -> SessionInfo:
        response, _ = await self._send("POST", self._session_path(session_id, "/renew"))
        return SessionInfo.from_json(json_body(response))

    async def delete_session(self, session_id: str) -> None:
        try:
            await self._send("DELETE", self._session_path(session_id))
        except NotFoundError as exc:
            if exc.code != "session_not_found":
                raise

    # ---- server -------------------------------------------------------------------

    async def models(self) -> list[str]:
        response, _ = await self._send("GET", "/v1/models")
        body = json_body(response)
        return [str(m["id"]) for m in body.get("data", [])]

    async def stats(self) -> dict[str, Any]:
        response, _ = await self._send("GET", "/kvtide/stats")
        body: dict[str, Any] = json_body(response)
        return body

    async def default_model(self) -> str:
        if self._model is None:
            response, _ = await self._send("GET", "/v1/models")
            self._model = self._first_model(json_body(response))
        return self._model

    # ---- transport ----------------------------------------------------------------

    async def _send(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        stream: bool = False,
    ) -> tuple[httpx.Response, int]:
        """As ``Client._send``: same body and headers on every attempt."""
        attempt = 0
        while True:
            cause: BaseException | None = None
            retry_after = None
            request = self._http.build_request(method, path, json=json, headers=headers)
            try:
                response = await self._http.send(request, stream=stream)
                if response.is_success:
                    return response, attempt + 1
                try:
                    await response.aread()
                finally:
                    await response.aclose()
                error: KVTideAPIError = error_from_response(response)
                retry_after = parse_retry_after(response.headers)
            except httpx.TransportError as exc:
                error, cause = connection_error(exc, self.base_url), exc
            delay = self._retry_delay(attempt, error, retry_after, f"{method} {path}")
            if delay is None:
                raise error from cause
            await self._sleep(delay)
            attempt += 1

    async def aclose(self) -> None:
        for session in list(self._sessions):
            await session._stop_renewer()
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
