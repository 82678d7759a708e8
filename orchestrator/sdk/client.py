"""The synchronous client: one HTTP connection pool, retries, and the session endpoints.

A shell over the protocol core (``orchestrator.sdk._turn``, ``orchestrator.sdk._base``):
it drives the core's calls, sending what they yield, and sleeps what the core decides.
Turns are run by ``Session`` (``orchestrator.sdk.session``); the client owns what every
call shares: the base URL, the API key, the retry policy and the clock.
"""

from __future__ import annotations

import random
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from orchestrator.sdk._args import session_arguments, takes_arguments_of
from orchestrator.sdk._base import DEFAULT_BASE_URL, DEFAULT_TIMEOUT, Exchange, Exchanging, Sent
from orchestrator.sdk._base import BaseClient as _BaseClient
from orchestrator.sdk._state import ConversationState
from orchestrator.sdk._turn import Attempts, WireRequest
from orchestrator.sdk.results import SessionStatus
from orchestrator.sdk.retry import RetryPolicy
from orchestrator.sdk.session import Session

T = TypeVar("T")

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

    @takes_arguments_of(session_arguments)
    def session(self, state: ConversationState) -> Session:
        """A conversation whose KV kvtide keeps between turns (no request is sent yet).

        ``session_id`` defaults to a new random id; pass an old one (with its
        ``messages``) to resume. ``model`` defaults to the first of ``GET /v1/models``.
        ``renew_every_s=None`` turns background lease renewal off.
        """
        session = Session(self, state)
        self._sessions.add(session)
        return session

    def get_session(self, session_id: str) -> SessionStatus:
        return self._run(self._session_status("GET", session_id))

    def renew_session(self, session_id: str) -> SessionStatus:
        """Extend the session's KV lease; ``NotFoundError`` if the server does not know it."""
        return self._run(self._session_status("POST", session_id, "/renew"))

    def delete_session(self, session_id: str) -> None:
        """Release the session's KV now. Deleting an unknown session is not an error."""
        self._run(self._delete_session(session_id))

    # ---- server -------------------------------------------------------------------

    def models(self) -> list[str]:
        return self._run(self._models())

    def stats(self) -> dict[str, Any]:
        """``GET /kvtide/stats`` as the server sends it (KV lifecycle and engine counters)."""
        return self._run(self._stats())

    def default_model(self) -> str:
        """The served model (asked once, then remembered)."""
        return self._run(self._default_model())

    # ---- transport ----------------------------------------------------------------

    def _run(self, call: Exchange[T]) -> T:
        """Send each request ``call`` yields; return what it returns."""
        driven = Exchanging(call)
        while (request := driven.request) is not None:
            try:
                sent = self._send(request)
            except BaseException as exc:
                driven.failed(exc)
            else:
                driven.sent(sent)
        return driven.value

    def _send(self, request: WireRequest) -> Sent:
        """Send with the retries ``Attempts`` decides; a 2xx response and the attempts it
        took. With ``request.stream`` the body of the returned response is not read yet."""
        attempts = Attempts(request, self.retry, self.base_url)
        while True:
            http_request = self._http_request(self._http, request)
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
