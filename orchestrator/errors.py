"""Errors kvtide raises on purpose, under one root: ``KVTideError``, whose docstring
draws the whole tree (those a caller triggers are here; the server's internal ones live
beside the code that raises them). Messages name the offending value and the fix.

"Cannot right now" (no KV to reuse, a pool is busy) is a return value, not an exception.
"""

from __future__ import annotations

import math

__all__ = [
    "AuthenticationFailed",
    "ConfigError",
    "ContextLengthExceeded",
    "DeadlineExceeded",
    "EngineUnavailable",
    "IdempotencyKeyReused",
    "InvalidRequest",
    "KVTideError",
    "LimitExceeded",
    "ModelNotFound",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "PermissionDenied",
    "RequestError",
    "RequestTimeout",
    "ResponseNotFound",
    "ServiceUnavailable",
    "ServingLayerRefused",
    "SessionNotFound",
    "TurnInProgress",
    "Unavailable",
    "UnsupportedMediaType",
    "UnsupportedParameter",
]


class KVTideError(Exception):
    """Base of every error kvtide's server raises on purpose. The tree (HTTP status
    where the error is a response; the other branches never reach a client as such):

    KVTideError
    ├── ConfigError                 a config field is missing or invalid (names the field)
    ├── RequestError                a request kvtide cannot serve → OpenAI-style body, HTTP 4xx/5xx
    │   ├── InvalidRequest          400: malformed JSON, bad parameter values
    │   │   └── UnsupportedParameter    a field kvtide's own layer does not serve
    │   ├── ContextLengthExceeded   400: prompt + max_tokens over the model's context
    │   ├── AuthenticationFailed    401: API key missing, malformed or unknown (never echoed)
    │   ├── PermissionDenied        403: an operator route called with a key that is not one
    │   ├── ModelNotFound           404: the requested model is not served here
    │   ├── NotFound                404: a route that is switched off in the config
    │   ├── SessionNotFound         404: no such session for this key (also: another key's)
    │   ├── ResponseNotFound        404: no such stored response for this key (likewise)
    │   ├── RequestTimeout          408: the body took over server.request_body_timeout_s
    │   ├── TurnInProgress          409: the session already has a turn running
    │   ├── PayloadTooLarge         413: the body is over server.max_request_bytes
    │   ├── UnsupportedMediaType    415: the body is not application/json
    │   ├── IdempotencyKeyReused    422: an Idempotency-Key sent with a different request
    │   ├── LimitExceeded           429: over one of the key's limits (``code`` says which)
    │   ├── ServingLayerRefused     4xx: refused by vLLM's serving layer, as vLLM's server would
    │   └── Unavailable             503 with Retry-After: retrying later may succeed
    │       ├── EngineUnavailable   no healthy engine in a pool, or an engine failed
    │       ├── ServiceUnavailable  the KV lifecycle service did not answer in time
    │       ├── DeadlineExceeded    the request ran past server.request_timeout_s
    │       └── Overloaded          a pool cannot take the turn now (admission control)
    ├── PlacementGroupError         a placement group not made as planned (cluster.errors;
    │   │                           also a placement.errors.PlacementError)
    │   ├── PlacementTimeout        Ray did not place the group within the bound
    │   └── PlacementMismatch       Ray put a bundle outside the planned node or domain
    ├── EnginesNotPlaced            an engine's group not placed in time (cluster.supervisor)
    ├── EnginesUnplaceable          no domain has room for an engine (cluster.pool_layout)
    ├── CallTimedOut                a GCS call past its deadline (cluster.deadlines; also a
    │                               TimeoutError)
    ├── HostReadPending             a host-tier READ may still land (kv.drains; also a
    │                               RuntimeError)
    └── LeaseRefused                the service refused a turn's lease use; the turn runs
                                    again through begin_turn (router.turn_report)

    Every one survives a pickle round trip (Ray and Serve pickle what an actor or a
    replica raises): it is rebuilt from its args and attributes, not by calling its
    ``__init__`` again, whose keyword-only fields the args do not carry.
    """

    def __reduce__(self) -> tuple[object, ...]:
        return reduced(self)


def reduced(error: BaseException) -> tuple[object, ...]:
    """``error`` as pickle rebuilds it: from its class, its args and its attributes, not
    through its ``__init__`` (the SDK's errors use it too)."""
    return (_rebuilt, (type(error), error.args), error.__dict__ or None)


def _rebuilt(cls: type[BaseException], args: tuple[object, ...]) -> BaseException:
    error = cls.__new__(cls)
    error.args = args  # pickle sets the attributes after
    return error


class ConfigError(KVTideError, ValueError):
    """Invalid configuration. ``field`` is the dotted path of the offending field."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class RequestError(KVTideError):
    """A client error. Maps to an OpenAI-style error body with ``status_code``."""

    status_code = 400
    error_type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": _utf8(self.message),
                "type": self.error_type,
                "param": None if self.param is None else _utf8(self.param),
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        """HTTP headers the response must carry besides the body (none by default)."""
        return {}


def _utf8(text: str) -> str:
    """``text`` with anything UTF-8 cannot carry (a lone surrogate from a client's JSON)
    escaped, so that the body always encodes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ServingLayerRefused(RequestError):
    """A request vLLM's OpenAI serving layer refused, with the status, type and message
    vLLM's own server gives it (``orchestrator.serve.vllm_api``)."""

    def __init__(
        self, message: str, param: str | None = None, *, status_code: int, error_type: str
    ) -> None:
        super().__init__(message, param)
        self.status_code = status_code
        self.error_type = error_type


class InvalidRequest(RequestError):
    code = "invalid_request"


class UnsupportedParameter(InvalidRequest):
    """400: a field kvtide's own OpenAI layer does not implement (or does not know);
    the ingress hands such a request to vLLM's serving layer when vLLM's takes it."""


class ContextLengthExceeded(RequestError):
    code = "context_length_exceeded"


class AuthenticationFailed(RequestError):
    """401. The message says how to send a key; it never contains the presented one."""

    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="kvtide"'}


class PermissionDenied(RequestError):
    """403. The key is valid but not an operator's (``server.api_keys[].operator``); the
    message names the route and what it needs."""

    status_code = 403
    error_type = "permission_error"
    code = "operator_key_required"


class ModelNotFound(RequestError):
    status_code = 404
    code = "model_not_found"


class NotFound(RequestError):
    """404 for a route the config switched off; the message names the setting."""

    status_code = 404
    code = "not_found"


class SessionNotFound(RequestError):
    """404. Raised alike for an unknown session and for another key's session, with the
    same message, so that a caller learns nothing about sessions it does not own."""

    status_code = 404
    code = "session_not_found"


class ResponseNotFound(RequestError):
    """404 for a stored response (Responses API) that is unknown, expired, deleted or
    another key's, with the same message for each."""

    status_code = 404
    code = "response_not_found"


class TurnInProgress(RequestError):
    """409. The session already has a turn running; retry when it has finished."""

    status_code = 409
    code = "turn_in_progress"

    @staticmethod
    def words(session_id: str) -> str:
        """The refusal's message (the service's ``Claim`` carries it too)."""
        return (
            f"session {session_id!r} already has a turn running; send the next turn after "
            "it has finished"
        )

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class RequestTimeout(RequestError):
    """408. The request's body did not arrive in time."""

    status_code = 408
    code = "request_timeout"


class PayloadTooLarge(RequestError):
    status_code = 413
    code = "request_too_large"


class UnsupportedMediaType(RequestError):
    status_code = 415
    code = "unsupported_media_type"


class IdempotencyKeyReused(RequestError):
    """422. The ``Idempotency-Key`` was first sent with another request (another
    endpoint or body): the key names one turn, so it is neither replayed nor run."""

    status_code = 422
    code = "idempotency_key_reused"


class LimitExceeded(RequestError):
    """429. Over one of the API key's limits. ``code`` names the limit
    (``prompt_too_long_for_key``, ``max_tokens_over_key_limit``,
    ``concurrency_limit_exceeded``); ``retry_after_s`` is set when waiting helps."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(
        self,
        message: str,
        *,
        code: str,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, param)
        self.code = code
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class Unavailable(RequestError):
    """503. Something kvtide needs did not answer in time; the body names what, never
    internal details (those go to the log), and ``Retry-After`` says when to retry."""

    status_code = 503
    error_type = "server_error"
    code = "unavailable"

    def __init__(
        self, message: str, param: str | None = None, *, retry_after_s: float = 1.0
    ) -> None:
        super().__init__(message, param)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class EngineUnavailable(Unavailable):
    code = "engine_unavailable"


class ServiceUnavailable(Unavailable):
    code = "service_unavailable"


class DeadlineExceeded(Unavailable):
    code = "deadline_exceeded"


class Overloaded(Unavailable):
    """A pool cannot take the turn now (its engines' queues or KV caches are full, or it
    makes no progress): refused at once, before anything is claimed or queued, instead
    of waiting out the deadline (``policies.admission``)."""

    code = "overloaded"
