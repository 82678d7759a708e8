"""A synchronous session: one conversation, its history, and its KV lease.

Each turn sends the whole history with the session's ``x-session-id`` (so kvtide reuses
the KV it kept from the previous turn) and a fresh ``idempotency-key`` that every retry
of that turn repeats. While the session is open and idle a daemon thread renews the
lease every ``renew_every_s``, so KV survives a user who pauses longer than the TTL.

A shell: what a turn sends, when it is retried or continued, and what its answer means
are decided in the protocol core (``_state``, ``_turn``, ``_stream_turn``, and the calls
in ``_base``), which ``AsyncSession`` shares; this module sends, reads and waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import httpx

from orchestrator.sdk._args import TurnArgs, takes_arguments_of, turn_arguments
from orchestrator.sdk._base import SessionView, StreamView
from orchestrator.sdk._state import ConversationState
from orchestrator.sdk._stream_turn import StreamTurn
from orchestrator.sdk._turn import WireRequest
from orchestrator.sdk.errors import KVTideAPIError
from orchestrator.sdk.results import SessionStatus, TurnResult

if TYPE_CHECKING:
    from orchestrator.sdk.client import Client

__all__ = ["Session", "TurnStream"]

_JOIN_TIMEOUT_S = 10.0


class Session(SessionView):
    """Made by ``Client.session()``; use it as a context manager so it is closed (its KV
    released at once) when the block ends, also on an exception."""

    _client: Client

    def __init__(self, client: Client, state: ConversationState) -> None:
        self._client = client
        self._state = state
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # ---- turns --------------------------------------------------------------------

    @takes_arguments_of(turn_arguments)
    def send(self, args: TurnArgs) -> TurnResult:
        """Run one turn and wait for the whole reply.

        ``user_text`` may be left out after ``add_tool_result``: the turn then sends the
        tool results only. ``tools``, ``tool_choice``, ``response_format`` (a mapping, or
        a pydantic model class: the reply is then validated into ``result.parsed``),
        ``logprobs`` and ``top_logprobs`` are the OpenAI fields; ``extra_body`` and other
        keyword arguments (``top_p``, ``seed``, ``stop``, ``n``, ...) go into the body as
        they are. Pass ``idempotency_key`` (from a failed turn's error) to resend that
        turn: the server replays it if it finished."""
        return self._client._run(self._send_turn(args))

    @takes_arguments_of(turn_arguments)
    def stream(self, args: TurnArgs) -> TurnStream:
        """Start one turn and return its text deltas as they come (see ``TurnStream``);
        arguments as ``send``.

        The request is sent (and retried) now, so an error status raises here; once
        deltas flow nothing is retried, since the caller has already seen them."""
        core, response = self._client._run(self._stream_turn(args))
        return TurnStream(self, core, response)

    # ---- lease --------------------------------------------------------------------

    def info(self) -> SessionStatus:
        """Where the server holds this session's KV now (``record`` None: nowhere)."""
        return self._client.get_session(self.id)

    def renew(self) -> SessionStatus:
        """Extend the KV lease now; ``NotFoundError`` if the server no longer knows it."""
        info = self._client.renew_session(self.id)
        self._state.renewed(self._client._clock())
        return info

    def _renew_if_due(self, now_s: float) -> bool:
        """Renew if due; a failure is kept in ``renew_error``, never raised (it runs in the
        background). Returns whether a renewal was attempted."""
        if not self._renew_due(now_s):
            return False
        try:
            self.renew()
        except KVTideAPIError as exc:
            self._state.renew_failed(exc, self._client._clock())
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

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not hide the exception that ended the block behind a failed DELETE
            self.close()
        except KVTideAPIError as close_exc:
            self._state.close_failed(close_exc)


class TurnStream(StreamView):
    """The text deltas of one streamed turn; ``result`` once the stream has ended.

    Iterate it to the end (or use ``with`` and break early: the turn is then abandoned,
    not added to the history). An in-stream server error raises its typed error; a broken
    connection raises ``APIConnectionError``. Either way the history is unchanged.
    """

    _session: Session

    def __init__(self, session: Session, core: StreamTurn, response: httpx.Response) -> None:
        super().__init__(session, core, response)
        self._lines = response.iter_lines()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        while not self._core.ended:
            try:
                delta = self._read()
            except BaseException as exc:
                request = self._core.recover(exc)
                if request is not None and self._continue(request):
                    continue
                self._response.close()
                self._fail(exc)
            if delta is not None:
                return delta
        raise StopIteration

    def _read(self) -> str | None:
        """The next delta; ``None`` once the turn is complete (and in the history)."""
        core = self._core
        while not core.done:
            delta = core.take(next(self._lines, None), self._clock())
            if delta:
                return delta
        self._response.close()
        self._complete()
        return None

    def _continue(self, request: WireRequest) -> bool:
        """Send the request that continues the turn; False when it could not be sent."""
        self._response.close()
        try:
            response, attempts = self._session._client._send(request)
        except KVTideAPIError as exc:
            self._core.not_continued(exc)
            return False
        self._response, self._lines = response, response.iter_lines()
        self._core.continued(response.headers, attempts)
        return True

    def close(self) -> None:
        """Stop reading; an unfinished turn is abandoned (the server stops generating)."""
        self._core.abandon()
        self._response.close()

    def __enter__(self) -> TurnStream:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
