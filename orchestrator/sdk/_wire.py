"""The wire format, shared by the sync and async clients: request bodies and headers,
error bodies → typed errors, and turning the server's answer into a ``TurnResult``
(streams are read, and continued after they break, in ``orchestrator.sdk._stream``).
No I/O here, so both clients behave identically.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from orchestrator.sdk.errors import (
    APIConnectionError,
    APITimeoutError,
    KVTideAPIError,
    error_class_for,
    implied_status,
    is_retryable,
)
from orchestrator.sdk.results import TurnResult

CHAT_PATH = "/v1/chat/completions"
SESSIONS_PATH = "/kvtide/sessions"
_SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")  # used with fullmatch
# Keys the session owns: a caller passing them as sampling options is a mistake.
_RESERVED = frozenset({"model", "messages", "stream", "stream_options"})


def request_id_of(headers: Mapping[str, str]) -> str | None:
    """kvtide's request id from response headers. ``x-kvtide-request-id`` since Ray Serve
    sets ``x-request-id`` to its own id; older servers sent kvtide's there."""
    return headers.get("x-kvtide-request-id") or headers.get("x-request-id")


def check_session_id(session_id: str) -> str:
    if not _SESSION_ID_RE.fullmatch(session_id):
        raise ValueError(
            "a session id must be 1-128 characters of letters, digits and ._:- ; "
            f"got {session_id[:40]!r}"
        )
    return session_id


def new_session_id() -> str:
    return "sess-" + uuid.uuid4().hex


def new_idempotency_key() -> str:
    return "turn-" + uuid.uuid4().hex


def normalize_base_url(base_url: str) -> str:
    """Accept the server root or, as the openai client wants it, the ``/v1`` URL."""
    url = base_url.rstrip("/")
    return url.removesuffix("/v1")


def chat_body(
    model: str,
    messages: Sequence[Mapping[str, str]],
    *,
    max_tokens: int | None,
    temperature: float | None,
    stream: bool,
    sampling: Mapping[str, Any],
) -> dict[str, Any]:
    clash = _RESERVED.intersection(sampling)
    if clash:
        raise TypeError(f"{sorted(clash)} are set by the session; do not pass them to send")
    body: dict[str, Any] = {"model": model, "messages": [dict(m) for m in messages]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    body.update(sampling)
    body["stream"] = stream
    if stream:
        # The usage so far in every chunk: continuing a stream cut by a broken
        # connection needs the tokens it had made (``reconnect_request``).
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def turn_headers(session_id: str, idempotency_key: str, traceparent: str | None) -> dict[str, str]:
    headers = {"x-session-id": session_id, "idempotency-key": idempotency_key}
    if traceparent:
        headers["traceparent"] = traceparent
    return headers


# ---- errors -------------------------------------------------------------------------


def error_from_payload(
    payload: Any, *, status_code: int | None, request_id: str | None, fallback: str
) -> KVTideAPIError:
    """A typed error from a decoded body: OpenAI-style ``{"error": {...}}``, FastAPI's
    ``{"detail": ...}`` or anything else (then ``fallback`` is the message)."""
    err = payload.get("error") if isinstance(payload, Mapping) else None
    if isinstance(err, Mapping):
        message = str(err.get("message") or fallback)
        code, kind, param = err.get("code"), err.get("type"), err.get("param")
    else:
        detail = payload.get("detail") if isinstance(payload, Mapping) else None
        message = str(detail) if detail else fallback
        code = kind = param = None
    code = None if code is None else str(code)
    return error_class_for(status_code, code)(
        message,
        status_code=status_code,
        code=code,
        type=None if kind is None else str(kind),
        param=None if param is None else str(param),
        request_id=request_id,
        retryable=is_retryable(implied_status(status_code, code), code),
        body=payload,
    )


def error_from_response(response: httpx.Response) -> KVTideAPIError:
    """The typed error for a non-2xx response whose body has been read."""
    text = response.text
    try:
        payload: Any = json.loads(text)
    except ValueError:
        payload = None
    fallback = f"HTTP {response.status_code}: {text[:300] or response.reason_phrase}"
    return error_from_payload(
        payload,
        status_code=response.status_code,
        request_id=request_id_of(response.headers),
        fallback=fallback,
    )


def connection_error(
    exc: httpx.TransportError, url: str, *, mid_stream: bool = False
) -> APIConnectionError:
    """No (complete) response. Local mistakes (bad URL scheme, invalid header) are not
    retryable; ``mid_stream``: the connection broke after deltas reached the caller."""
    why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"timed out waiting for kvtide at {url} ({why})")
    if mid_stream:
        return APIConnectionError(f"the stream from kvtide at {url} broke off ({why})")
    local = isinstance(exc, httpx.LocalProtocolError | httpx.UnsupportedProtocol)
    return APIConnectionError(f"could not reach kvtide at {url} ({why})", retryable=not local)


def json_body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        raise KVTideAPIError(
            f"the server answered {response.status_code} with a body that is not JSON: "
            f"{response.text[:200]!r}",
            status_code=response.status_code,
            request_id=request_id_of(response.headers),
        ) from None


# ---- results ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnMeta:
    """What the session knows about a turn besides the server's answer."""

    turn: int
    session_id: str
    idempotency_key: str
    num_attempts: int


def _usage_counts(usage: Any, ext: Mapping[str, Any]) -> tuple[int, int, int] | None:
    if not isinstance(usage, Mapping):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    if cached is None:
        cached = ext.get("num_cached_tokens", 0)
    return int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)), int(cached)


def decode_rate(completion_tokens: int, decode_s: float) -> float | None:
    if completion_tokens < 2 or decode_s <= 0:
        return None
    return (completion_tokens - 1) / decode_s


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def result_from_completion(
    body: Any, headers: Mapping[str, str], meta: TurnMeta, total_s: float
) -> TurnResult:
    """A non-streamed turn; TTFT is the server's (the client never saw the first token)."""
    if not isinstance(body, Mapping) or not body.get("choices"):
        raise KVTideAPIError(f"the server's answer has no choices: {str(body)[:200]}")
    choice = body["choices"][0]
    message = choice.get("message") or {}
    raw_ext = body.get("kvtide")
    ext: Mapping[str, Any] = raw_ext if isinstance(raw_ext, Mapping) else {}
    counts = _usage_counts(body.get("usage"), ext) or (0, 0, int(ext.get("num_cached_tokens", 0)))
    server_ttft = _float_or_none(ext.get("ttft_s"))
    ttft = server_ttft if server_ttft is not None else total_s
    return TurnResult(
        turn=meta.turn,
        session_id=meta.session_id,
        text=str(message.get("content") or ""),
        finish_reason=choice.get("finish_reason"),
        prompt_tokens=counts[0],
        completion_tokens=counts[1],
        cached_tokens=counts[2],
        kv_source=ext.get("kv_source"),
        ttft_s=ttft,
        server_ttft_s=server_ttft,
        tokens_per_s=decode_rate(counts[1], total_s - ttft),
        total_s=total_s,
        request_id=ext.get("request_id") or request_id_of(headers) or body.get("id"),
        idempotency_key=meta.idempotency_key,
        num_attempts=meta.num_attempts,
        streamed=False,
        kvtide=dict(ext),
    )
