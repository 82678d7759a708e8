"""A streamed turn without its I/O, shared by ``TurnStream`` and ``AsyncTurnStream``.

The shell reads the response's lines and hands each to ``take`` with the time (``None``
where the body ended) until ``done``; ``take`` returns the text delta the caller sees.
When reading fails, ``recover`` says which request continues the turn (after an engine
failure: resume it from the text so far; after a broken connection: ask again under the
same key) or ``None``; the shell sends it and reports back with ``continued``, or gives up
with ``fail``, which returns the error to raise. ``complete`` puts the finished turn into
the session's history.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import httpx

from orchestrator.sdk._state import ConversationState
from orchestrator.sdk._stream import (
    StreamCollector,
    next_resume,
    reconnect_request,
    reconnected,
)
from orchestrator.sdk._turn import Turn, WireRequest
from orchestrator.sdk._wire import connection_error, request_id_of
from orchestrator.sdk.errors import APIConnectionError, KVTideAPIError, SessionStateError
from orchestrator.sdk.results import TurnResult

log = logging.getLogger("kvtide.sdk")


class StreamTurn:
    """One streamed turn of ``state``, from its first response to its ``TurnResult``.

    Invariants: ``ended`` is set once, by ``complete`` or ``fail``; ``recorded`` only when
    the turn entered the history; every delta ``feed`` returned is text the caller had not
    seen (a replay's repeat is dropped, a resume starts after the text so far).
    """

    def __init__(
        self,
        state: ConversationState,
        turn: Turn,
        response_headers: Mapping[str, str],
        num_attempts: int,
        *,
        base_url: str,
        max_resumes: int,
    ) -> None:
        turn.num_attempts = num_attempts
        self._state = state
        self._turn = turn
        self._base_url = base_url
        self._max_resumes = max_resumes
        self._collector = StreamCollector(request_id_of(response_headers))
        # The headers of the request being read (its idempotency key), and what continues
        # the turn once ``recover`` chose: the tokens a failed stream made (a resume), or
        # None (a reconnect under the same key).
        self._headers = dict(turn.request.headers)
        self._continuation: WireRequest | None = None
        self._made: int | None = None
        self._first_s: float | None = None
        self._finish_s: float | None = None
        self._result: TurnResult | None = None
        self._body_ended = False  # the body being read has no more lines
        self.ended = False
        self.recorded = False

    @property
    def turn(self) -> Turn:
        return self._turn

    @property
    def text(self) -> str:
        return "".join(self._collector.parts)

    @property
    def result(self) -> TurnResult:
        if self._result is None:
            raise SessionStateError(
                "the turn has not finished: iterate the stream to its end first"
            )
        return self._result

    @property
    def done(self) -> bool:
        """``data: [DONE]`` arrived, or the body ended: nothing more to read."""
        return self._collector.done or self._body_ended

    # ---- reading ------------------------------------------------------------------

    def take(self, line: str | None, now_s: float) -> str | None:
        """The body's next line, or ``None`` where it ended: its text delta, if any."""
        if line is None:
            self._body_ended = True
            return self.end(now_s)
        return self.feed(line, now_s)

    def feed(self, line: str, now_s: float) -> str | None:
        """One line of the body: its text delta, if any. Raises an in-stream error."""
        delta = self._collector.feed(line)
        if self._collector.finished and self._finish_s is None:
            self._finish_s = now_s - self._turn.start_s
        return self._seen(delta, now_s)

    def end(self, now_s: float) -> str | None:
        """The body ended: an event without its trailing blank line still counts."""
        return self._seen(self._collector.end(), now_s)

    def _seen(self, delta: str | None, now_s: float) -> str | None:
        if delta and self._first_s is None:
            self._first_s = now_s - self._turn.start_s
        return delta or None

    def complete(self, now_s: float) -> TurnResult:
        """The stream ended: the turn's result, now in the history. Raises
        ``APIConnectionError`` when no finish_reason came (the turn did not finish)."""
        if not self._collector.finished:
            raise APIConnectionError(
                "the stream ended before the turn finished (no finish_reason arrived)"
            )
        total = now_s - self._turn.start_s
        finish = self._finish_s if self._finish_s is not None else total
        result = self._collector.result(
            self._turn.meta(), ttft_s=self._first_s, finish_s=finish, total_s=total
        )
        self.ended = self.recorded = True
        self._result = result  # also when the reply does not validate (end_turn raises)
        self._result = self._state.end_turn(self._turn, result, now_s)
        return self._result

    # ---- after a failure ----------------------------------------------------------

    def recover(self, exc: BaseException) -> WireRequest | None:
        """The request that continues the turn after ``exc`` broke its stream, or
        ``None`` when it cannot go on (then ``fail``)."""
        self._continuation = None
        if self.ended:
            return None
        first = (dict(self._turn.request.json), dict(self._turn.request.headers))
        collector, text = self._collector, self.text
        if isinstance(exc, httpx.TransportError):
            self._made = None
            nxt = reconnect_request(collector, first, self._headers, text, self._max_resumes)
        elif isinstance(exc, KVTideAPIError):
            resume = next_resume(collector, first, text, exc, self._max_resumes)
            nxt = None if resume is None else (resume[0], resume[1])
            self._made = None if resume is None else resume[2]
        else:
            return None
        if nxt is None:
            return None
        self._continuation = WireRequest(
            method="POST", path=self._turn.request.path, json=nxt[0], headers=nxt[1], stream=True
        )
        log.info("turn %s: stream broke (%s); continuing it", self._turn.number, exc)
        return self._continuation

    def continued(self, response_headers: Mapping[str, str], num_attempts: int) -> None:
        """The continuation ``recover`` chose was answered; read its response next."""
        assert self._continuation is not None, "continued() without a recover() request"
        if self._made is None:
            self._collector = reconnected(self._collector, response_headers)
        else:
            rid = request_id_of(response_headers)
            self._collector = self._collector.resumed(rid, self._made)
        self._headers = dict(self._continuation.headers)
        self._body_ended = False
        self._turn.num_attempts += num_attempts
        self._continuation = None

    def not_continued(self, exc: KVTideAPIError) -> None:
        log.warning("could not continue turn %s: %s", self._turn.number, exc)

    def fail(self, exc: BaseException) -> BaseException:
        """End the turn on ``exc``: the history is unchanged (unless the turn was already
        recorded) and the error to raise, tagged with the turn's key, is returned."""
        error: BaseException = exc
        if isinstance(exc, httpx.TransportError):
            error = connection_error(exc, self._base_url, mid_stream=True)
        if not self.ended:
            self.ended = True
            self._state.abort_turn(self._turn, error)
        return error

    def abandon(self) -> None:
        """The caller stopped reading: the turn is dropped (the server stops generating)."""
        if not self.ended:
            self.fail(SessionStateError("stream closed by the caller"))
