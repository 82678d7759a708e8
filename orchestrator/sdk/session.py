"""A synchronous session: one conversation, its history, and its KV lease.

Each turn sends the whole history with the session's ``x-session-id`` (so kvtide reuses
the KV it kept from the previous turn) and a fresh ``idempotency-key`` that every retry
of that turn repeats. While the session is open and idle a daemon thread renews the
lease every ``renew_every_s``, so KV survives a user who pauses longer than the TTL.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
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
    from orchestrator.sdk.client import Client

__all__ = ["Session", "TurnStream"]

log = logging.getLogger("kvtide.sdk")
_JOIN_TIMEOUT_S = 10.0


class Session:
    """Made by ``Client.session()``; use it as a context manager so it is closed (its KV
    released at once) when the block ends, also on an exception."""

    def __init__(self, client: Client, state: SessionState) -> None:
        self._client = client
        self._state = state
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def id(self) -> str:
        return self._state.id

    @property
    def model(self) -> str | None:
        return self._state.model

    @property
    def messages(self) -> list[dict[str, str]]:
        """The history the next turn sends before its user message (a copy)."""
        return [dict(m) for m in self._state.messages]

    @property
    def turns(self) -> list[TurnResult]:
        return list(self._state.turns)

    @property
    def closed(self) -> bool:
        return self._state.closed

    @property
    def renew_error(self) -> Exception | None:
        """The last background renewal's error (cleared by the next success)."""
        return self._state.renew_error

    # ---- turns --------------------------------------------------------------------

    def send(
        self,
        user_text: str,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        traceparent: str | None = None,
        idempotency_key: str | None = None,
        **sampling: Any,
    ) -> TurnResult:
        """Run one turn and wait for the whole reply. ``sampling`` goes into the request
        body as is (``top_p``, ``seed``, ``stop``, ...). Pass ``idempotency_key`` (from a
        failed turn's error) to resend that turn: the server replays it if it finished."""
        state, clock = self._state, self._client._clock
        state.begin_turn()
        key = idempotency_key or new_idempotency_key()
        try:
            start = clock()
            body, headers = state.turn_request(
                self._model(),
                user_text,
                key,
                stream=False,
                max_tokens=max_tokens,
                temperature=temperature,
                traceparent=traceparent,
                sampling=sampling,
            )
            response, attempts = self._client._send("POST", CHAT_PATH, json=body, headers=headers)
            meta = state.turn_meta(key, attempts)
            result = result_from_completion(
                json_body(response), response.headers, meta, clock() - start
            )
        except BaseException as exc:
            self._turn_failed(exc, key)
            raise
        self._turn_done(user_text, result)
        return result

    def stream(
        self,
        user_text: str,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        traceparent: str | None = None,
        idempotency_key: str | None = None,
        **sampling: Any,
    ) -> TurnStream:
        """Start one turn and return its text deltas as they come (see ``TurnStream``).

        The request is sent (and retried) now, so an error status raises here; once
        deltas flow nothing is retried, since the caller has already seen them."""
        state, clock = self._state, self._client._clock
        state.begin_turn()
        key = idempotency_key or new_idempotency_key()
        try:
            start = clock()
            body, headers = state.turn_request(
                self._model(),
                user_text,
                key,
                stream=True,
                max_tokens=max_tokens,
                temperature=temperature,
                traceparent=traceparent,
                sampling=sampling,
            )
            response, attempts = self._client._send(
                "POST", CHAT_PATH, json=body, headers=headers, stream=True
            )
        except BaseException as exc:
            self._turn_failed(exc, key)
            raise
        meta = state.turn_meta(key, attempts)
        return TurnStream(self, user_text, response, meta, start, (body, headers))

    def _model(self) -> str:
        if self._state.model is None:
            self._state.model = self._client.default_model()
        return self._state.model

    def _turn_done(self, user_text: str, result: TurnResult) -> None:
        self._state.end_turn(user_text, result, self._client._clock())
        self._start_renewer()

    def _turn_failed(self, exc: BaseException, key: str) -> None:
        self._state.abort_turn()
        if isinstance(exc, KVTideAPIError):
            exc.idempotency_key = key

    # ---- lease --------------------------------------------------------------------

    def info(self) -> SessionInfo:
        """Where the server holds this session's KV now (``record`` None: nowhere)."""
        return self._client.get_session(self.id)

    def renew(self) -> SessionInfo:
        """Extend the KV lease now; ``NotFoundError`` if the server no longer knows it."""
        info = self._client.renew_session(self.id)
        self._state.renewed(self._client._clock())
        return info

    def _renew_due(self, now_s: float) -> bool:
        return self._state.renew_due(now_s)

    def _renew_if_due(self, now_s: float) -> bool:
        """Renew if due; a failure is kept in ``renew_error``, never raised (it runs in the
        background). Returns whether a renewal was attempted."""
        if not self._renew_due(now_s):
            return False
        try:
            self.renew()
        except KVTideAPIError as exc:
            gone = isinstance(exc, NotFoundError)
            log.warning("renewing session %s failed: %s", self.id, exc)
            self._state.renew_failed(exc, self._client._clock(), gone=gone)
        return True

    def _renew_loop(self, wait: Callable[[float], bool]) -> None:
        """Sleep until a renewal is due, renew, repeat; ``wait(s)`` returns True to stop."""
        while not wait(self._state.renew_wait_s(self._client._clock())):
            self._renew_if_due(self._client._clock())

    def _start_renewer(self) -> None:
        if self._state.renew_every_s is None or self._renewer is not None or self._stop.is_set():
            return
        self._renewer = threading.Thread(
            target=self._renew_loop,
            args=(self._stop.wait,),
            name=f"kvtide-renew-{self.id}",
            daemon=True,
        )
        self._renewer.start()

    def _stop_renewer(self) -> None:
        self._stop.set()
        renewer = self._renewer
        if renewer is not None and renewer is not threading.current_thread():
            renewer.join(_JOIN_TIMEOUT_S)

    def close(self) -> None:
        """Stop renewing and release the session's KV on the server (``DELETE``). Only the
        first call sends anything; a closed session runs no more turns."""
        if not self._state.close():
            return
        self._stop_renewer()
        self._client.delete_session(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not hide the exception that ended the block behind a failed DELETE
            self.close()
        except KVTideAPIError as close_exc:
            log.warning("closing session %s failed: %s", self.id, close_exc)


class TurnStream:
    """The text deltas of one streamed turn; ``result`` once the stream has ended.

    Iterate it to the end (or use ``with`` and break early: the turn is then abandoned,
    not added to the history). An in-stream server error raises its typed error; a broken
    connection raises ``APIConnectionError``. Either way the history is unchanged.
    """

    def __init__(
        self,
        session: Session,
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
        self._lines = response.iter_lines()
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
        """The text received so far."""
        return "".join(self._collector.parts)

    @property
    def result(self) -> TurnResult:
        if self._result is None:
            raise RuntimeError("the turn has not finished: iterate the stream to its end first")
        return self._result

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._ended:
            raise StopIteration
        while True:
            try:
                delta = self._next_delta()
            except httpx.TransportError as exc:
                error = connection_error(exc, self._session._client.base_url, mid_stream=True)
                if self._reconnect(error):
                    continue
                self._abort(error)
                raise error from exc
            except KVTideAPIError as exc:
                if self._resume(exc):
                    continue
                self._abort(exc)
                raise
            except BaseException as exc:
                self._abort(exc)
                raise
            break
        if delta is None:
            raise StopIteration
        return delta

    def _next_delta(self) -> str | None:
        collector = self._collector
        for line in self._lines:
            delta = collector.feed(line)
            if collector.finished and self._finish_s is None:
                self._finish_s = self._clock() - self._start_s
            if delta:
                return self._first(delta)
            if collector.done:
                break
        else:
            delta = collector.end()
            if delta:
                return self._first(delta)
        self._complete()
        return None

    def _resume(self, error: KVTideAPIError) -> bool:
        """Continue the turn after a retryable in-stream error (see
        ``orchestrator.sdk._wire.resume_request``); False when it cannot go on."""
        client, collector = self._session._client, self._collector
        nxt = next_resume(collector, self._request, self.text, error, client.retry.max_retries)
        if nxt is None:
            return False
        response = self._send_next(nxt[0], nxt[1], error)
        if response is None:
            return False
        self._collector = collector.resumed(request_id_of(response.headers), nxt[2])
        return True

    def _reconnect(self, error: KVTideAPIError) -> bool:
        """Continue the turn after its connection broke (see
        ``orchestrator.sdk._wire.reconnect_request``); False when it cannot go on."""
        client, collector = self._session._client, self._collector
        nxt = reconnect_request(
            collector, self._request, self._headers, self.text, client.retry.max_retries
        )
        if nxt is None:
            return False
        response = self._send_next(nxt[0], nxt[1], error)
        if response is None:
            return False
        self._collector = reconnected(collector, response.headers)
        return True

    def _send_next(
        self, body: dict[str, Any], headers: dict[str, str], error: KVTideAPIError
    ) -> httpx.Response | None:
        """Send the request that continues the turn; None when it could not be sent."""
        self._response.close()
        try:
            response, attempts = self._session._client._send(
                "POST", CHAT_PATH, json=body, headers=headers, stream=True
            )
        except KVTideAPIError:
            log.warning("could not continue turn %s after: %s", self._meta.turn, error)
            return None
        log.info("turn %s: stream broke (%s); continuing it", self._meta.turn, error)
        self._response, self._lines, self._headers = response, response.iter_lines(), headers
        self._meta = dataclasses.replace(
            self._meta, num_attempts=self._meta.num_attempts + attempts
        )
        return response

    def _first(self, delta: str) -> str:
        if self._first_s is None:
            self._first_s = self._clock() - self._start_s
        return delta

    def _complete(self) -> None:
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
        self._response.close()
        self._session._turn_done(self._user_text, self._result)

    def _abort(self, exc: BaseException) -> None:
        self._ended = True
        self._response.close()
        self._session._turn_failed(exc, self._meta.idempotency_key)

    def close(self) -> None:
        """Stop reading; an unfinished turn is abandoned (the server stops generating)."""
        if not self._ended:
            self._abort(RuntimeError("stream closed by the caller"))

    def __enter__(self) -> TurnStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
