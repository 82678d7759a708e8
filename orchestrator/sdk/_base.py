"""What the sync and async shells share besides the protocol core (``_turn``): the
client's settings and headers, and every call a client, a session or a stream makes,
written once. Nothing here sends anything.

A call is an ``Exchange``: a generator that yields each ``WireRequest`` it needs sent and
is sent back the 2xx response and the attempts it took (or has the call's error thrown
in), then returns its value. ``Client._run`` and ``AsyncClient._run`` drive one through
``Exchanging``, sending with their own I/O: that loop is all a shell adds to a call.
"""

from __future__ import annotations

import abc
import copy
import os
from collections.abc import Callable, Generator
from typing import Any, Generic, NoReturn, TypeAlias, TypeVar

import httpx

from orchestrator.sdk._args import TurnArgs
from orchestrator.sdk._state import ConversationState
from orchestrator.sdk._stream_turn import StreamTurn
from orchestrator.sdk._turn import Turn, WireRequest
from orchestrator.sdk._wire import SESSIONS_PATH, check_session_id, json_body, normalize_base_url
from orchestrator.sdk.errors import KVTideAPIError, NotFoundError
from orchestrator.sdk.results import SessionStatus, TurnResult
from orchestrator.sdk.retry import RetryPolicy

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# A long turn streams for minutes; connecting should fail fast.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
API_KEY_ENV = "KVTIDE_API_KEY"
MODELS_PATH = "/v1/models"
STATS_PATH = "/kvtide/stats"

T = TypeVar("T")
Sent: TypeAlias = tuple[httpx.Response, int]
"""A sent request's 2xx response and the attempts it took."""
Exchange: TypeAlias = Generator[WireRequest, Sent, T]


class Exchanging(Generic[T]):
    """One ``Exchange`` being driven: ``request`` is what it waits on, ``None`` once it
    returned ``value``. The shell sends ``request`` and answers with ``sent`` or
    ``failed``; an error the call does not handle comes out of those."""

    def __init__(self, call: Exchange[T]) -> None:
        self._call = call
        self.request: WireRequest | None = None
        self._value: tuple[T] | None = None
        self._advance(lambda: next(call))

    @property
    def value(self) -> T:
        assert self._value is not None, "the call has not returned"
        return self._value[0]

    def sent(self, sent: Sent) -> None:
        self._advance(lambda: self._call.send(sent))

    def failed(self, exc: BaseException) -> None:
        self._advance(lambda: self._call.throw(exc))

    def _advance(self, resume: Callable[[], WireRequest]) -> None:
        try:
            self.request = resume()
        except StopIteration as stop:
            self.request, self._value = None, (stop.value,)


class BaseClient:
    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        max_retries: int,
        retry: RetryPolicy | None,
        clock: Callable[[], float],
        rand: Callable[[], float],
    ) -> None:
        self.base_url = normalize_base_url(base_url)
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.retry = retry if retry is not None else RetryPolicy(max_retries=max_retries)
        self._clock = clock
        self._rand = rand
        self._model: str | None = None

    def _headers(self) -> dict[str, str]:
        headers = {"user-agent": "kvtide-sdk"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        return headers

    @staticmethod
    def _http_request(
        http: httpx.Client | httpx.AsyncClient, request: WireRequest
    ) -> httpx.Request:
        """One attempt of ``request`` (every attempt sends the same body and headers)."""
        return http.build_request(
            request.method, request.path, json=request.json, headers=request.headers
        )

    # ---- calls (``Exchange``s) ------------------------------------------------------

    @staticmethod
    def _json(request: WireRequest) -> Exchange[Any]:
        response, _ = yield request
        return json_body(response)

    def _session_status(
        self, method: str, session_id: str, suffix: str = ""
    ) -> Exchange[SessionStatus]:
        path = f"{SESSIONS_PATH}/{check_session_id(session_id)}{suffix}"
        body = yield from self._json(WireRequest(method=method, path=path))
        return SessionStatus.from_json(body)

    def _delete_session(self, session_id: str) -> Exchange[None]:
        """Deleting an unknown session is not an error."""
        path = f"{SESSIONS_PATH}/{check_session_id(session_id)}"
        try:
            yield WireRequest(method="DELETE", path=path)
        except NotFoundError as exc:
            if exc.code != "session_not_found":
                raise

    def _models(self) -> Exchange[list[str]]:
        body = yield from self._json(WireRequest(method="GET", path=MODELS_PATH))
        data = body.get("data") if isinstance(body, dict) else None
        return [str(m["id"]) for m in data or ()]

    def _stats(self) -> Exchange[dict[str, Any]]:
        body: dict[str, Any] = yield from self._json(WireRequest(method="GET", path=STATS_PATH))
        return body

    def _default_model(self) -> Exchange[str]:
        """The served model: the first of ``GET /v1/models``, asked once."""
        if self._model is None:
            ids = yield from self._models()
            if not ids:
                raise KVTideAPIError("GET /v1/models listed no model; pass model= to the session")
            self._model = ids[0]
        return self._model


class SessionView(abc.ABC):
    """A session's read-only side, its bookkeeping and its calls, the same in both shells;
    a shell adds how it sends (its client's ``_run``) and how it renews in the background
    (``_start_renewer``)."""

    _client: BaseClient
    _state: ConversationState

    @property
    def id(self) -> str:
        return self._state.id

    @property
    def model(self) -> str | None:
        return self._state.model

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The history the next turn sends first (a copy): completed turns only, each
        reply as the server sent it (``tool_calls`` included)."""
        return copy.deepcopy(self._state.messages)

    @property
    def tool_results(self) -> list[dict[str, Any]]:
        """The ``tool`` messages added for the next turn (a copy)."""
        return copy.deepcopy(self._state.pending)

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

    def add_tool_result(self, tool_call_id: str, content: Any) -> None:
        """Answer one of the last reply's ``tool_calls``; the next turn sends the reply's
        calls, then every result, then its user message (if any). ``content``: the
        tool's output, a string or anything JSON-serialisable (sent as its JSON text)."""
        self._state.add_tool_result(tool_call_id, content)

    def _renew_due(self, now_s: float) -> bool:
        return self._state.renew_due(now_s)

    @abc.abstractmethod
    def _start_renewer(self) -> None:
        """Renew the lease in the background while the session is open and idle (a
        thread in ``Session``, a task in ``AsyncSession``)."""

    # ---- calls (``Exchange``s) ------------------------------------------------------

    def _open(self, args: TurnArgs, *, stream: bool) -> Exchange[tuple[Turn, Sent]]:
        """Start the turn and send its request: the turn, its response and the attempts
        it took. A turn that could not be sent is aborted."""
        now_s = self._client._clock()
        if self._state.model is None:
            self._state.model = yield from self._client._default_model()
        turn = self._state.start_turn(
            self._state.model, args.user_text, args.options, stream=stream, now_s=now_s
        )
        try:
            sent = yield turn.request
        except BaseException as exc:
            self._state.abort_turn(turn, exc)
            raise
        return turn, sent

    def _send_turn(self, args: TurnArgs) -> Exchange[TurnResult]:
        """One turn, its whole reply read: the result, now in the history."""
        turn, (response, attempts) = yield from self._open(args, stream=False)
        try:
            result = turn.completed(response, attempts, self._client._clock())
        except BaseException as exc:
            self._state.abort_turn(turn, exc)
            raise
        try:
            return self._state.end_turn(turn, result, self._client._clock())
        finally:
            self._start_renewer()

    def _stream_turn(self, args: TurnArgs) -> Exchange[tuple[StreamTurn, httpx.Response]]:
        """One turn, sent: its core and its response, whose body is not read yet."""
        turn, (response, attempts) = yield from self._open(args, stream=True)
        core = StreamTurn(
            self._state,
            turn,
            response.headers,
            attempts,
            base_url=self._client.base_url,
            max_resumes=self._client.retry.max_retries,
        )
        return core, response


class StreamView:
    """What ``TurnStream`` and ``AsyncTurnStream`` share: the text so far, the result, and
    how the turn ends. A shell reads the lines and sends what continues the turn."""

    _session: SessionView

    def __init__(self, session: SessionView, core: StreamTurn, response: httpx.Response) -> None:
        self._session = session
        self._core = core
        self._response = response
        self._clock = session._client._clock

    @property
    def text(self) -> str:
        """The text received so far."""
        return self._core.text

    @property
    def result(self) -> TurnResult:
        return self._core.result

    def _complete(self) -> None:
        """The body was read to its end (the response closed): the turn enters the
        history, or ``complete`` raises why it did not finish."""
        self._core.complete(self._clock())
        self._session._start_renewer()

    def _fail(self, exc: BaseException) -> NoReturn:
        """Reading failed and the turn cannot go on (the response closed): raise its error."""
        error = self._core.fail(exc)
        if self._core.recorded:
            self._session._start_renewer()
        if error is exc:
            raise exc
        raise error from exc
