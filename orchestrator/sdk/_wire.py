"""The wire format, shared by the sync and async clients: request bodies and headers,
error bodies → typed errors, SSE decoding and turning the server's answer into a
``TurnResult``. No I/O here, so both clients behave identically.
"""

from __future__ import annotations

import hashlib
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
        body["stream_options"] = {"include_usage": True}
    return body


# In-stream errors after which the turn goes on where it stopped (``resume_request``).
RESUMABLE_CODES = frozenset({"engine_unavailable", "service_unavailable", "stream_failed"})


def resumable_tokens(error: KVTideAPIError) -> int | None:
    """The completion tokens a turn had generated when ``error`` ended its stream, if
    the turn can be continued after it (else ``None``)."""
    ext = error.body.get("kvtide") if isinstance(error.body, Mapping) else None
    used = ext.get("completion_tokens") if isinstance(ext, Mapping) else None
    if error.code not in RESUMABLE_CODES or not isinstance(used, int) or used < 0:
        return None
    return used


def next_resume(
    collector: StreamCollector,
    request: tuple[dict[str, Any], dict[str, str]] | None,
    text: str,
    error: KVTideAPIError,
    max_resumes: int,
) -> tuple[dict[str, Any], dict[str, str], int] | None:
    """Body, headers and the tokens the broken stream made, for continuing a streamed
    turn (first sent as ``request``) after ``error``; ``None`` when it cannot go on."""
    made = resumable_tokens(error)
    if request is None or made is None or collector.num_resumes >= max_resumes:
        return None
    used = made + collector.prior_tokens
    nxt = resume_request(*request, text, used, collector.num_resumes + 1)
    return None if nxt is None else (*nxt, made)


def resume_request(
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    text: str,
    used_tokens: int,
    resumes: int,
) -> tuple[dict[str, Any], dict[str, str]] | None:
    """The request that continues a streamed turn (first sent as ``body``/``headers``)
    whose stream broke after the caller saw ``text`` and the turn had generated
    ``used_tokens``; its ``resumes``-th continuation. ``None``: nothing to continue.

    The server ended the stream with a retryable error event (``resumable_tokens``);
    nothing of the turn was booked. The continuation sends the same conversation with
    ``text`` as a final assistant message to continue (``continue_final_message``),
    ``max_tokens`` lowered by the tokens already made, and its own idempotency key
    (derived from the turn's), so the caller sees every token once and the turn never
    makes more tokens than it was allowed.
    """
    new = dict(body)
    if text:
        new["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
        new["continue_final_message"] = True
        new["add_generation_prompt"] = False
        if isinstance(body.get("max_tokens"), int):
            if body["max_tokens"] - used_tokens < 1:
                return None  # the turn had made all it may
            new["max_tokens"] = body["max_tokens"] - used_tokens
        if isinstance(body.get("min_tokens"), int):
            new["min_tokens"] = max(0, body["min_tokens"] - used_tokens)
    key = headers["idempotency-key"]
    if len(key) > 200:  # the server takes keys of up to 255 characters
        key = hashlib.sha256(key.encode()).hexdigest()
    return new, {**headers, "idempotency-key": f"{key}.resume{resumes}"}


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


class StreamCollector:
    """Reads a chat.completion.chunk SSE stream line by line.

    ``feed(line)`` returns the text delta the line carries (or ``None``) and raises the
    typed error of an in-stream ``{"error": ...}``. Events are one ``data:`` line each in
    kvtide's stream; multi-line events are joined as the SSE spec says. ``done`` is set by
    ``data: [DONE]``.
    """

    def __init__(self, request_id: str | None) -> None:
        self.request_id = request_id
        self.done = False
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.kvtide: dict[str, Any] = {}
        self.response_id: str | None = None
        self.num_deltas = 0
        self.parts: list[str] = []
        self._data: list[str] = []
        # Completion tokens of the streams this one resumes (see ``resume_request``).
        self.prior_tokens = 0
        self.num_resumes = 0

    def resumed(self, request_id: str | None, used_tokens: int) -> StreamCollector:
        """A collector for the stream that continues this one after it failed having
        generated ``used_tokens``: the text so far is kept, the rest starts over."""
        nxt = StreamCollector(request_id)
        nxt.parts = list(self.parts)
        nxt.num_deltas = self.num_deltas
        nxt.prior_tokens = self.prior_tokens + used_tokens
        nxt.num_resumes = self.num_resumes + 1
        return nxt

    def feed(self, line: str) -> str | None:
        if line.startswith("data:"):
            self._data.append(line[5:].removeprefix(" "))
            return None
        if line == "" and self._data:
            data, self._data = "\n".join(self._data), []
            return self._event(data)
        return None  # comments (": ping"), event:/id:/retry: fields

    def end(self) -> str | None:
        """The body ended: an event without its trailing blank line still counts."""
        if self._data:
            data, self._data = "\n".join(self._data), []
            return self._event(data)
        return None

    def _event(self, data: str) -> str | None:
        if data.strip() == "[DONE]":
            self.done = True
            return None
        try:
            chunk = json.loads(data)
        except ValueError:
            raise KVTideAPIError(
                f"the stream carried an event that is not JSON: {data[:200]!r}",
                request_id=self.request_id,
            ) from None
        if not isinstance(chunk, Mapping):
            return None
        if "error" in chunk:
            raise error_from_payload(
                chunk, status_code=None, request_id=self.request_id, fallback="stream failed"
            )
        self.response_id = self.response_id or chunk.get("id")
        if isinstance(chunk.get("kvtide"), Mapping):
            self.kvtide = dict(chunk["kvtide"])
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        text: str | None = None
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                text = (text or "") + str(content)
            if choice.get("finish_reason") is not None:
                self.finish_reason = str(choice["finish_reason"])
        if text:
            self.num_deltas += 1
            self.parts.append(text)
        return text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def result(
        self, meta: TurnMeta, *, ttft_s: float | None, finish_s: float, total_s: float
    ) -> TurnResult:
        """``ttft_s`` and ``finish_s``: client times of the first delta and the finish."""
        ext = self.kvtide
        counts = _usage_counts(self.usage, ext)
        if counts is None:
            counts = (0, self.num_deltas, int(ext.get("num_cached_tokens", 0)))
        else:
            counts = (counts[0], counts[1] + self.prior_tokens, counts[2])
        first = ttft_s if ttft_s is not None else finish_s
        return TurnResult(
            turn=meta.turn,
            session_id=meta.session_id,
            text="".join(self.parts),
            finish_reason=self.finish_reason,
            prompt_tokens=counts[0],
            completion_tokens=counts[1],
            cached_tokens=counts[2],
            kv_source=ext.get("kv_source"),
            ttft_s=first,
            server_ttft_s=_float_or_none(ext.get("ttft_s")),
            tokens_per_s=decode_rate(counts[1], finish_s - first),
            total_s=total_s,
            request_id=ext.get("request_id") or self.request_id or self.response_id,
            idempotency_key=meta.idempotency_key,
            num_attempts=meta.num_attempts,
            streamed=True,
            kvtide=dict(ext),
            num_resumes=self.num_resumes,
        )
