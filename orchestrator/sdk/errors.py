"""Errors the kvtide SDK raises, one class per thing a caller handles differently.

    KVTideSDKError                     root: everything the SDK raises on its own
    ├── KVTideAPIError                 the server refused the call, or never answered
    │   ├── APIConnectionError         no response (connect/read failure, reset, broken stream)
    │   │   └── APITimeoutError        the client's timeout ran out
    │   ├── BadRequestError            400: invalid request, context_length_exceeded
    │   ├── AuthenticationError        401: invalid_api_key
    │   ├── NotFoundError              404: model_not_found, session_not_found
    │   ├── ConflictError              409: turn_in_progress (same key still running)
    │   ├── RateLimitError             429: code names the limit (concurrency_limit_exceeded)
    │   ├── InternalServerError        500 and other 5xx the contract does not name
    │   └── EngineUnavailableError     503: no healthy engine right now
    ├── InvalidArgumentError           a call's argument is wrong (also ValueError, TypeError)
    ├── SessionStateError              not now: session closed, busy, tool calls unanswered,
    │                                  stream not finished (also RuntimeError)
    └── StructuredOutputError          a reply is not the JSON asked for (also ValueError)

The three local errors also derive from the builtin a caller would have caught before they
existed, so ``except ValueError`` keeps working.

Every error carries the server's own ``message``, ``code``, ``type`` and ``param`` (from
the OpenAI-style body ``{"error": {...}}``), the ``request_id`` when the server sent one,
and ``retryable``: whether the SDK's retry policy treats it as transient. Errors raised by
a turn also carry that turn's ``idempotency_key``, so a caller that gives up can resend the
same turn later without running it twice. An error that arrives inside an SSE stream has
``status_code=None`` (the HTTP status was already 200); its class follows its ``code``.
"""

from __future__ import annotations

from typing import Any

from orchestrator.errors import reduced

__all__ = [
    "APIConnectionError",
    "APITimeoutError",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "EngineUnavailableError",
    "InternalServerError",
    "InvalidArgumentError",
    "KVTideAPIError",
    "KVTideSDKError",
    "NotFoundError",
    "RateLimitError",
    "SessionStateError",
    "StructuredOutputError",
    "error_class_for",
]

# Codes the SDK retries on with the same idempotency key (see ``orchestrator.sdk.retry``).
RETRYABLE_CODES = {409: "turn_in_progress", 429: "concurrency_limit_exceeded"}


class KVTideSDKError(Exception):
    """The root of every error the SDK raises: ``except KVTideSDKError`` catches them all.
    Each survives a pickle round trip (a worker process or a Ray task that raises one),
    rebuilt from its args and attributes rather than by its ``__init__``."""

    def __reduce__(self) -> tuple[object, ...]:
        return reduced(self)


class InvalidArgumentError(KVTideSDKError, ValueError, TypeError):
    """An argument the caller passed is wrong; the message names it and what would do."""


class SessionStateError(KVTideSDKError, RuntimeError):
    """The call does not fit the session's state now: it is closed, running a turn, has
    tool calls without results, or a stream's result is asked before the stream ended."""


class StructuredOutputError(KVTideSDKError, ValueError):
    """A reply asked to be JSON (``response_format``) does not parse or validate.

    ``result`` is the turn's ``TurnResult`` when a session raised it: the server ran the
    turn, so it is in the history; ``text`` is the content that failed."""

    def __init__(self, message: str, *, text: str, result: Any = None) -> None:
        super().__init__(message)
        self.text = text
        self.result = result


class KVTideAPIError(KVTideSDKError):
    """The server refused the call or never answered; ``str(err)`` is the server's message."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        code: str | None = None,
        type: str | None = None,
        param: str | None = None,
        request_id: str | None = None,
        retryable: bool = False,
        body: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.code = code
        self.type = type
        self.param = param
        self.request_id = request_id
        self.retryable = retryable
        self.body = body
        # Set by a session when the error ends a turn: resend with it to replay, not rerun.
        self.idempotency_key: str | None = None

    def __str__(self) -> str:
        tags = [str(self.status_code)] if self.status_code is not None else []
        if self.code:
            tags.append(self.code)
        if self.request_id:
            tags.append(f"request {self.request_id}")
        return f"{self.message} ({', '.join(tags)})" if tags else self.message


class APIConnectionError(KVTideAPIError):
    """No (complete) response: the connection failed, was reset or the stream broke."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message, retryable=retryable)


class APITimeoutError(APIConnectionError):
    """The client's timeout ran out before the server answered."""


class BadRequestError(KVTideAPIError):
    """400: fix the request (``code`` says what: invalid_request, context_length_exceeded)."""


class AuthenticationError(KVTideAPIError):
    """401: the API key is missing or wrong."""


class NotFoundError(KVTideAPIError):
    """404: unknown model (``model_not_found``) or session (``session_not_found``)."""


class ConflictError(KVTideAPIError):
    """409: a turn with this idempotency key is still running on the server."""


class RateLimitError(KVTideAPIError):
    """429: a rate, concurrency or quota limit; ``code`` names which."""


class InternalServerError(KVTideAPIError):
    """500 (and any 5xx other than 503): a server fault; the message says what failed."""


class EngineUnavailableError(KVTideAPIError):
    """503: an engine, the KV service or the request's deadline failed the turn
    (``code`` says which); transient, retried by the SDK (a stream raises it for the
    caller to send the turn again: the history is unchanged)."""


_BY_STATUS: dict[int, type[KVTideAPIError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    429: RateLimitError,
    503: EngineUnavailableError,
}

# An error inside an SSE stream has no status of its own: its code picks the class.
_STATUS_BY_CODE = {
    "invalid_request": 400,
    "context_length_exceeded": 400,
    "invalid_api_key": 401,
    "model_not_found": 404,
    "session_not_found": 404,
    "turn_in_progress": 409,
    "unsupported_media_type": 415,
    "rate_limit_exceeded": 429,
    "concurrency_limit_exceeded": 429,
    "prompt_too_long_for_key": 429,
    "max_tokens_over_key_limit": 429,
    "session_limit_exceeded": 429,
    "session_capacity_exceeded": 429,
    "engine_unavailable": 503,
    "service_unavailable": 503,
    "deadline_exceeded": 503,
    "overloaded": 503,
    "unavailable": 503,
    "stream_failed": 503,
}


def implied_status(status_code: int | None, code: str | None) -> int:
    """The HTTP status, or for an in-stream error the status its ``code`` comes with."""
    if status_code is not None:
        return status_code
    return _STATUS_BY_CODE.get(code or "", 500)


def error_class_for(status_code: int | None, code: str | None) -> type[KVTideAPIError]:
    """The class for an HTTP status, or for an in-stream error's ``code``."""
    status_code = implied_status(status_code, code)
    if status_code in _BY_STATUS:
        return _BY_STATUS[status_code]
    return InternalServerError if status_code >= 500 else KVTideAPIError


def is_retryable(status_code: int | None, code: str | None) -> bool:
    """Whether the server's answer is transient (contract: 503, 409 turn_in_progress and
    429 concurrency_limit_exceeded). Other 429s are quotas: retrying soon cannot help."""
    if status_code == 503:
        return True
    return status_code in RETRYABLE_CODES and RETRYABLE_CODES[status_code] == code
