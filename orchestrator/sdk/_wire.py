"""The wire format, shared by the sync and async clients: request bodies and headers,
error bodies → typed errors, and turning the server's answer into a ``TurnResult``
(streams are read, and continued after they break, in ``orchestrator.sdk._stream``).
No I/O here, so both clients behave identically.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from orchestrator.sdk.errors import (
    APIConnectionError,
    APITimeoutError,
    InvalidArgumentError,
    KVTideAPIError,
    error_class_for,
    implied_status,
    is_retryable,
)
from orchestrator.sdk.results import Logprob, ToolCall, TurnResult

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
        raise InvalidArgumentError(
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


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnOptions:
    """What a turn asks besides its messages: ``send``/``stream``'s keyword arguments, the
    same for the sync and async sessions. The named OpenAI fields go into the body as
    given; ``sampling`` (other keyword arguments) and ``extra_body`` (an explicit mapping,
    as the openai client has it) add any other field the server honours."""

    max_tokens: int | None = None
    temperature: float | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] | None = None
    # A mapping as the API takes it, or a pydantic model class (``json_schema`` of it).
    response_format: Mapping[str, Any] | type | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    extra_body: Mapping[str, Any] | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    traceparent: str | None = None
    idempotency_key: str | None = None

    @property
    def parse_as(self) -> Any:
        """The model class the reply is validated into, when ``response_format`` is one."""
        return self.response_format if isinstance(self.response_format, type) else None

    def named_fields(self) -> dict[str, Any]:
        named = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "tools": None if self.tools is None else [copy.deepcopy(dict(t)) for t in self.tools],
            "tool_choice": copy.deepcopy(self.tool_choice),
            "response_format": response_format_body(self.response_format),
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
        }
        return {k: v for k, v in named.items() if v is not None}


def response_format_body(fmt: Mapping[str, Any] | type | None) -> dict[str, Any] | None:
    """``response_format`` as sent: a mapping as given, a pydantic model class as the
    ``json_schema`` format of its schema (named after the class)."""
    if fmt is None:
        return None
    if isinstance(fmt, type):
        schema_of = getattr(fmt, "model_json_schema", None)
        if schema_of is None:
            raise InvalidArgumentError(
                f"response_format={fmt.__name__} is a class without model_json_schema(); "
                "pass a pydantic model class or a mapping such as {'type': 'json_object'}"
            )
        return {"type": "json_schema", "json_schema": {"name": fmt.__name__, "schema": schema_of()}}
    return copy.deepcopy(dict(fmt))


def chat_body(
    model: str, messages: Sequence[Mapping[str, Any]], options: TurnOptions, *, stream: bool
) -> dict[str, Any]:
    named = options.named_fields()
    extras = (("keyword arguments", options.sampling), ("extra_body", options.extra_body or {}))
    seen: set[str] = set(named)
    for where, extra in extras:
        clash = _RESERVED.intersection(extra)
        if clash:
            raise InvalidArgumentError(
                f"{sorted(clash)} are set by the session; do not pass them to send"
            )
        twice = seen.intersection(extra)
        if twice:
            raise InvalidArgumentError(f"{sorted(twice)} given twice (again in {where})")
        seen.update(extra)
    body: dict[str, Any] = {"model": model, "messages": copy.deepcopy([dict(m) for m in messages])}
    body.update(named)
    for _, extra in extras:
        body.update(copy.deepcopy(dict(extra)))
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
    message = assistant_message(choice.get("message"))
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
        message=message,
        tool_calls=tool_calls_of(message),
        logprobs=logprobs_of(choice.get("logprobs")),
        choices=tuple(copy.deepcopy(body["choices"])) if len(body["choices"]) > 1 else (),
    )


def assistant_message(raw: Any) -> dict[str, Any]:
    """The reply as the history keeps it: the server's message as sent (a copy)."""
    message = copy.deepcopy(dict(raw)) if isinstance(raw, Mapping) else {}
    return {"role": "assistant", **message} if "role" not in message else message


def tool_calls_of(message: Mapping[str, Any]) -> tuple[ToolCall, ...]:
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return ()
    return tuple(ToolCall.from_json(c) for c in calls if isinstance(c, Mapping))


def logprobs_of(raw: Any) -> tuple[Logprob, ...] | None:
    """A choice's ``logprobs`` object (``{"content": [...]}``) as values; ``None`` when the
    turn did not ask for them."""
    content = raw.get("content") if isinstance(raw, Mapping) else None
    if not isinstance(content, list):
        return None
    return tuple(Logprob.from_json(entry) for entry in content if isinstance(entry, Mapping))
