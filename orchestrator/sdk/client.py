"""The synchronous client: one HTTP connection pool, retries, and the session endpoints.

A shell over the protocol core (``orchestrator.sdk._turn``): it sends what the core builds
and sleeps what the core decides. Turns are run by ``Session``
(``orchestrator.sdk.session``); the client owns what every call shares: the base URL, the
API key, the retry policy and the clock.
"""

from __future__ import annotations

import random
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
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
from orchestrator.sdk.errors import NotFoundError
from orchestrator.sdk.results import SessionStatus
from orchestrator.sdk.retry import RetryPolicy
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
        messages: Sequence[Mapping[str, Any]] | None = None,
        renew_every_s: float | None = DEFAULT_RENEW_EVERY_S,
    ) -> Session:
        """A conversation whose KV kvtide keeps between turns (no request is sent yet).

        ``session_id`` defaults to a new random id; pass an old one (with its
        ``messages``) to resume. ``model`` defaults to the first of ``GET /v1/models``.
        ``renew_every_s=None`` turns background lease renewal off.
        """
        state = ConversationState(
            session_id=session_id,
            model=model,
            system=system,
            messages=messages,
            renew_every_s=renew_every_s,
        )
        session = Session(self, state)
        self._sessions.add(session)
        return session

    def get_session(self, session_id: str) -> SessionStatus:
        return SessionStatus.from_json(self._json(self._session_call("GET", session_id)))

    def renew_session(self, session_id: str) -> SessionStatus:
        """Extend the session's KV lease; ``NotFoundError`` if the server does not know it."""
        return SessionStatus.from_json(self._json(self._session_call("POST", session_id, "/renew")))

    def delete_session(self, session_id: str) -> None:
        """Release the session's KV now. Deleting an unknown session is not an error."""
        try:
            self._send(self._session_call("DELETE", session_id))
        except NotFoundError as exc:
            if exc.code != "session_not_found":
                raise

    # ---- server -------------------------------------------------------------------

    def models(self) -> list[str]:
        return self._model_ids(self._json(self._get(MODELS_PATH)))

    def stats(self) -> dict[str, Any]:
        """``GET /kvtide/stats`` as the server sends it (KV lifecycle and engine counters)."""
        body: dict[str, Any] = self._json(self._get(STATS_PATH))
        return body

    def default_model(self) -> str:
        """The served model (asked once, then remembered)."""
        if self._model is None:
            self._model = self._first_model(self._json(self._get(MODELS_PATH)))
        return self._model

    # ---- transport ----------------------------------------------------------------

    def _json(self, request: WireRequest) -> Any:
        response, _ = self._send(request)
        return json_body(response)

    def _send(self, request: WireRequest) -> tuple[httpx.Response, int]:
        """Send with the retries ``Attempts`` decides; a 2xx response and the attempts it
        took. With ``request.stream`` the body of the returned response is not read yet."""
        attempts = Attempts(request, self.retry, self.base_url)
        while True:
            http_request = self._http.build_request(
                request.method, request.path, json=request.json, headers=request.headers
            )
            try:
                response = self._http.send(http_request, stream=request.stream)
                if response.is_success:
                    return response, attempts.num_attempts
                try:
                    response.read()
                finally:
                    response.close()
            except httpx.TransportError as exc:
                delay = attempts.after_transport_error(exc, self._rand())
            else:
                delay = attempts.after_response(response, self._rand())
            self._sleep(delay)

    def _stop_renewers(self) -> None:
        for session in list(self._sessions):
            session._stop_renewer()

    def close(self) -> None:
        self._stop_renewers()
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
