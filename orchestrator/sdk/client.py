"""The synchronous client: one HTTP connection pool, retries, and the session endpoints.

Turns are run by ``Session`` (see ``orchestrator.sdk.session``); the client owns what
every call shares: the base URL, the API key, the retry policy and the clock.
"""

from __future__ import annotations

import random
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx

from orchestrator.sdk._base import DEFAULT_BASE_URL, DEFAULT_RENEW_EVERY_S, DEFAULT_TIMEOUT
from orchestrator.sdk._base import BaseClient as _BaseClient
from orchestrator.sdk._state import SessionState
from orchestrator.sdk._wire import connection_error, error_from_response, json_body
from orchestrator.sdk.errors import KVTideAPIError, NotFoundError
from orchestrator.sdk.results import SessionInfo
from orchestrator.sdk.retry import RetryPolicy, parse_retry_after
from orchestrator.sdk.session import Session

__all__ = ["Client"]


class Client(_BaseClient):
    """A kvtide client. Thread-safe; one per process is enough.

    ``api_key`` defaults to the ``KVTIDE_API_KEY`` environment variable. ``base_url`` may
    be the server root or its ``/v1`` URL. ``transport`` replaces the network (tests pass
    ``httpx.MockTransport``); ``sleep``, ``clock`` and ``rand`` replace real waiting, time
    and jitter. ``close()`` stops the background renewal of sessions still open but does
    not delete them: the server keeps their KV until its TTL, so a later client can resume
    them by id.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        api_key: str | None = None,
        *,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        max_retries: int = 3,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        super().__init__(
            base_url, api_key, max_retries=max_retries, retry=retry, clock=clock, rand=rand
        )
        self._sleep = sleep
        self._http = httpx.Client(
            base_url=self.base_url, headers=self._headers(), timeout=timeout, transport=transport
        )
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()

    # ---- sessions -----------------------------------------------------------------

    def session(
        self,
        session_id: str | None = None,
        *,
        model: str | None = None,
        system: str | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        renew_every_s: float | None = DEFAULT_RENEW_EVERY_S,
    ) -> Session:
        """A conversation whose KV kvtide keeps between turns (no request is sent yet).

        ``session_id`` defaults to a new random id; pass an old one (with its
        ``messages``) to resume. ``model`` defaults to the first of ``GET /v1/models``.
        ``renew_every_s=None`` turns background lease renewal off.
        """
        state = SessionState(
            session_id=session_id,
            model=model,
            system=system,
            messages=messages,
            renew_every_s=renew_every_s,
        )
        session = Session(self, state)
        self._sessions.add(session)
        return session

    def get_session(self, session_id: str) -> SessionInfo:
        response, _ = self._send("GET", self._session_path(session_id))
        return SessionInfo.from_json(json_body(response))

    def renew_session(self, session_id: str) -> SessionInfo:
        """Extend the session's KV lease; ``NotFoundError`` if the server does not know it."""
        response, _ = self._send("POST", self._session_path(session_id, "/renew"))
        return SessionInfo.from_json(json_body(response))

    def delete_session(self, session_id: str) -> None:
        """Release the session's KV now. Deleting an unknown session is not an error."""
        try:
            self._send("DELETE", self._session_path(session_id))
        except NotFoundError as exc:
            if exc.code != "session_not_found":
                raise

    # ---- server -------------------------------------------------------------------

    def models(self) -> list[str]:
        response, _ = self._send("GET", "/v1/models")
        body = json_body(response)
        return [str(m["id"]) for m in body.get("data", [])]

    def stats(self) -> dict[str, Any]:
        """``GET /kvtide/stats`` as the server sends it (KV lifecycle and engine counters)."""
        response, _ = self._send("GET", "/kvtide/stats")
        body: dict[str, Any] = json_body(response)
        return body

    def default_model(self) -> str:
        """The served model (asked once, then remembered)."""
        if self._model is None:
            response, _ = self._send("GET", "/v1/models")
            self._model = self._first_model(json_body(response))
        return self._model

    # ---- transport ----------------------------------------------------------------

    def _send(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        stream: bool = False,
    ) -> tuple[httpx.Response, int]:
        """Send with retries; returns a 2xx response and the number of attempts made.

        Every attempt sends the same body and headers (so a turn keeps its idempotency
        key). With ``stream=True`` the body of the returned response is not read yet.
        """
        attempt = 0
        while True:
            cause: BaseException | None = None
            retry_after = None
            request = self._http.build_request(method, path, json=json, headers=headers)
            try:
                response = self._http.send(request, stream=stream)
                if response.is_success:
                    return response, attempt + 1
                try:
                    response.read()
                finally:
                    response.close()
                error: KVTideAPIError = error_from_response(response)
                retry_after = parse_retry_after(response.headers)
            except httpx.TransportError as exc:
                error, cause = connection_error(exc, self.base_url), exc
            delay = self._retry_delay(attempt, error, retry_after, f"{method} {path}")
            if delay is None:
                raise error from cause
            self._sleep(delay)
            attempt += 1

    def _stop_renewers(self) -> None:
        for session in list(self._sessions):
            session._stop_renewer()

    def close(self) -> None:
        self._stop_renewers()
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
