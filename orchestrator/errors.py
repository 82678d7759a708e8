"""Errors a caller of kvtide can trigger. Messages name the offending value and the fix.

    KVTideError
    ├── ConfigError                 a config field is missing or invalid (names the field)
    ├── RequestError                a client request is invalid → HTTP 4xx
    │   ├── InvalidRequest          400: malformed JSON, bad parameter values
    │   ├── ContextLengthExceeded   400: prompt + max_tokens over the model's context
    │   ├── ModelNotFound           404: the requested model is not served here
    │   └── UnsupportedMediaType    415: the body is not application/json
    └── EngineUnavailable           503: no healthy engine in a pool, or an engine failed

"Cannot right now" (no KV to reuse, a pool is busy) is a return value, not an exception.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ContextLengthExceeded",
    "EngineUnavailable",
    "InvalidRequest",
    "KVTideError",
    "ModelNotFound",
    "RequestError",
    "UnsupportedMediaType",
]


class KVTideError(Exception):
    """Base of every error kvtide raises on purpose."""


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
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(RequestError):
    code = "invalid_request"


class ContextLengthExceeded(RequestError):
    code = "context_length_exceeded"


class ModelNotFound(RequestError):
    status_code = 404
    code = "model_not_found"


class UnsupportedMediaType(RequestError):
    status_code = 415
    code = "unsupported_media_type"


class EngineUnavailable(RequestError):
    status_code = 503
    error_type = "server_error"
    code = "engine_unavailable"
