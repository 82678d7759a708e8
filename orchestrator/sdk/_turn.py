"""The SDK's protocol core, shared by the sync and async shells: what to send, whether to
send it again, and what an answer means. Nothing here touches the network or a clock;
the shells (``client.py``, ``async_client.py``, ``session.py``, ``async_session.py``)
send what this module builds, sleep what it says, and pass the time in as ``now_s``.

    WireRequest   one HTTP call to make (method, path, JSON body, headers, streamed?)
    Attempts      the retry decisions of one call: after each failed attempt, how long to
                  wait before the next (same body, same idempotency key) or the error
    Turn          one turn from its request to its ``TurnResult``
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from orchestrator.sdk._wire import (
    TurnMeta,
    connection_error,
    error_from_response,
    json_body,
    result_from_completion,
)
from orchestrator.sdk.errors import KVTideAPIError, StructuredOutputError
from orchestrator.sdk.results import TurnResult
from orchestrator.sdk.retry import RetryPolicy, parse_retry_after

log = logging.getLogger("kvtide.sdk")


@dataclass(frozen=True, slots=True, kw_only=True)
class WireRequest:
    """One HTTP call. Every attempt of it sends exactly this (so a turn keeps its
    idempotency key across retries); ``stream``: the body is read by the caller."""

    method: str
    path: str
    json: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    stream: bool = False

    @property
    def what(self) -> str:
        return f"{self.method} {self.path}"


class Attempts:
    """The retry loop of one call, without the loop's I/O. A shell sends ``request``; on a
    2xx it is done (``num_attempts`` made); on a failure it asks ``after_response`` or
    ``after_transport_error`` for the seconds to sleep before sending again, and those
    raise the call's typed error once the policy says stop. ``draw``: the shell's jitter
    source's next value in [0, 1)."""

    def __init__(self, request: WireRequest, policy: RetryPolicy, base_url: str) -> None:
        self.request = request
        self._policy = policy
        self._base_url = base_url
        self.num_attempts = 1

    def after_response(self, response: httpx.Response, draw: float) -> float:
        """A non-2xx response whose body has been read: the delay, or raise its error."""
        error = error_from_response(response)
        return self._next(error, parse_retry_after(response.headers), draw, None)

    def after_transport_error(self, exc: httpx.TransportError, draw: float) -> float:
        """No response at all: the delay, or raise ``APIConnectionError``."""
        return self._next(connection_error(exc, self._base_url), None, draw, exc)

    def _next(
        self,
        error: KVTideAPIError,
        retry_after_s: float | None,
        draw: float,
        cause: BaseException | None,
    ) -> float:
        attempt = self.num_attempts - 1
        delay = self._policy.delay_s(attempt, error, retry_after_s, draw)
        if delay is None:
            raise error from cause
        log.info("%s failed (%s); retry %d in %.2fs", self.request.what, error, attempt + 1, delay)
        self.num_attempts += 1
        return delay


@dataclass(slots=True, kw_only=True)
class Turn:
    """One turn of a session, from the request that starts it to its result.

    ``new_messages``: what the turn adds to the history before the reply (tool results
    added since the last turn, then the user message, if any), once the server answered.
    ``parse_as``: the model class the reply is validated into (``response_format``).
    """

    number: int
    session_id: str
    key: str
    start_s: float
    new_messages: tuple[dict[str, Any], ...]
    request: WireRequest
    parse_as: Any = None
    num_attempts: int = 0

    def meta(self) -> TurnMeta:
        return TurnMeta(
            turn=self.number,
            session_id=self.session_id,
            idempotency_key=self.key,
            num_attempts=self.num_attempts,
        )

    def completed(self, response: httpx.Response, num_attempts: int, now_s: float) -> TurnResult:
        """The result of a non-streamed turn from its (read) 2xx response."""
        self.num_attempts = num_attempts
        body = json_body(response)
        return result_from_completion(body, response.headers, self.meta(), now_s - self.start_s)

    def parsed(self, result: TurnResult) -> tuple[TurnResult, StructuredOutputError | None]:
        """``result`` with ``parsed`` filled in when the turn asked for a model, or the
        error that says why the reply does not validate (the turn still happened)."""
        if self.parse_as is None:
            return result, None
        try:
            return dataclasses.replace(result, parsed=result.parse(self.parse_as)), None
        except StructuredOutputError as exc:
            return result, exc

    def failed(self, exc: BaseException) -> None:
        """Tag an error that ended the turn with its key: resending with it replays."""
        if isinstance(exc, KVTideAPIError):
            exc.idempotency_key = self.key
