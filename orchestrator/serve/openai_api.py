"""OpenAI-compatible request parsing and response shapes (no Ray, no engines).

``read_body`` and ``parse_body`` turn the HTTP body into a JSON object (413, 415 or 400
otherwise); ``parse_chat`` / ``parse_completion`` (``orchestrator.serve.requests``) turn
that into a validated ``ApiRequest`` or raise a ``RequestError`` whose ``body()`` is an
OpenAI-style error. Unknown fields and fields kvtide cannot honour (``n > 1``, ``tools``,
``logprobs``, batched prompts, ...) are refused with a message naming them, never
silently dropped.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from orchestrator.errors import (
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
)
from orchestrator.serve.refusals import shown
from orchestrator.serve.requests import ApiRequest, parse_chat, parse_completion

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "RESPONSE_OBJECT",
    "ApiRequest",
    "chat_response",
    "completion_response",
    "may_extend",
    "parse_body",
    "parse_chat",
    "parse_completion",
    "parse_session_id",
    "read_body",
    "session_header",
    "stream_chunk",
    "usage",
]

DEFAULT_MAX_TOKENS = 256
RESPONSE_OBJECT = {
    "chat": "chat.completion",
    "completion": "text_completion",
    "responses": "response",
}
"""A whole response body's ``object``, by the kind of request it answers."""

# fullmatch: "$" would also match before a final newline ("abc\n").
_SESSION_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# Python's own bound on int(str) (sys.get_int_max_str_digits), checked before it raises.
_MAX_INT_DIGITS = 4300


def parse_body(raw: bytes, content_type: str | None) -> dict[str, Any]:
    """Decode a JSON object body, checking the content type first. Numbers of more than
    4,300 digits, nesting deeper than Python's recursion limit and the non-JSON constants
    ``NaN`` / ``Infinity`` are refused with a 400 like any other malformed body."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        raise UnsupportedMediaType(
            f"Content-Type must be application/json, got {shown(content_type or 'none')}; "
            "send the request body as JSON with the header 'Content-Type: application/json'"
        )
    try:
        body = json.loads(raw, parse_int=_int, parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            f"the request body is not valid UTF-8 (byte {exc.start}): send JSON in UTF-8"
        ) from None
    except RecursionError:
        raise InvalidRequest(
            "the request body nests arrays or objects too deeply; no field of the API "
            "takes more than a few levels"
        ) from None
    except ValueError:  # anything else json refuses
        raise InvalidRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _int(digits: str) -> int:
    if len(digits) > _MAX_INT_DIGITS:
        raise InvalidRequest(
            f"the request body holds an integer of {len(digits)} digits; no field of the "
            f"API takes more than 20"
        )
    return int(digits)


def _constant(name: str) -> float:
    raise InvalidRequest(f"the request body holds {name}, which is not JSON: send a number")


async def read_body(
    chunks: AsyncIterator[bytes],
    content_length: str | None,
    max_bytes: int,
    timeout_s: float | None = None,
) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``max_bytes``:
    from its ``Content-Length`` before reading anything, else while reading; and with
    408 when it has not all arrived ``timeout_s`` after reading began (None: no bound)."""
    if content_length is not None and content_length.strip().isdigit():
        if int(content_length) > max_bytes:
            raise _too_large(max_bytes)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in chunks:
                body += chunk
                if len(body) > max_bytes:
                    raise _too_large(max_bytes)
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {timeout_s:g} s "
            f"(server.request_body_timeout_s; {len(body)} bytes came); send the whole body "
            "at once, or raise server.request_body_timeout_s"
        ) from None
    return bytes(body)


def _too_large(max_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the request body is over {max_bytes} bytes, this server's limit "
        "(server.max_request_bytes); shorten the prompt or the history",
    )


def may_extend(value: str | None) -> bool:
    """The ``x-kvtide-kv-plan`` header: ``auto`` (or none) lets a session's turn extend
    its kept history on the decode engine where the cost function chooses it; ``pull``
    asks that it be pulled to prefill as planned (docs/api.md)."""
    if value is None or value == "auto":
        return True
    if value == "pull":
        return False
    raise InvalidRequest(
        f"x-kvtide-kv-plan must be auto or pull; got {value[:40]!r}",
        param="x-kvtide-kv-plan",
    )


def session_header(value: str | None) -> str | None:
    """The ``x-session-id`` header's session id (``parse_session_id``). The ASGI server
    hands header values over as bytes read as Latin-1; the header's text is UTF-8 (Serve
    and ``http_guard`` refuse other bytes), so a refusal echoes what the client sent."""
    if value is not None:
        try:
            value = value.encode("latin-1").decode("utf-8")
        except UnicodeError:
            pass  # not UTF-8 bytes: echoed as read
    return parse_session_id(value)


def parse_session_id(value: str | None) -> str | None:
    if value is None or value == "":
        return None
    if not _SESSION_RE.fullmatch(value):
        raise InvalidRequest(
            "x-session-id must be 1-128 ASCII characters: letters, digits and ._:- ; "
            f"got {value[:40]!r}",
            param="x-session-id",
        )
    return value


# ---- responses ----------------------------------------------------------------------


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def chat_response(
    rid: str, model: str, text: str, finish: str | None, use: dict[str, Any], ext: dict[str, Any]
) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    return _response("chat", rid, model, choice, use, ext)


def completion_response(
    rid: str, model: str, text: str, finish: str | None, use: dict[str, Any], ext: dict[str, Any]
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return _response("completion", rid, model, choice, use, ext)


def _response(
    kind: str,
    rid: str,
    model: str,
    choice: dict[str, Any],
    use: dict[str, Any],
    ext: dict[str, Any],
) -> dict[str, Any]:
    """A whole (not streamed) response body with its one choice."""
    return {
        "id": rid,
        "object": RESPONSE_OBJECT[kind],
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
        "kvtide": ext,
    }


def stream_chunk(
    kind: Literal["chat", "completion"],
    rid: str,
    model: str,
    *,
    text: str | None = None,
    finish: str | None = None,
    first: bool = False,
    use: dict[str, Any] | None = None,
    ext: dict[str, Any] | None = None,
    use_so_far: dict[str, Any] | None = None,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> str:
    """One SSE ``data:`` line. ``use`` alone makes the usage-only final chunk;
    ``use_so_far`` is a content chunk's usage up to it (``continuous_usage_stats``).
    ``token_ids`` (the chunk's) and ``prompt_token_ids`` (the first chunk's) where the
    request asked ``return_token_ids``, placed as vLLM's server places them."""
    chunk: dict[str, Any] = {"id": rid, "created": int(time.time()), "model": model}
    choice: dict[str, Any]
    if kind == "chat":
        chunk["object"] = "chat.completion.chunk"
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        if prompt_token_ids is not None:
            chunk["prompt_token_ids"] = prompt_token_ids
    else:
        chunk["object"] = "text_completion"
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        if prompt_token_ids is not None:
            choice["prompt_token_ids"] = prompt_token_ids
    if token_ids is not None:
        choice["token_ids"] = token_ids
    chunk["choices"] = [] if use is not None else [choice]
    if use is not None:
        chunk["usage"] = use
    elif use_so_far is not None:
        chunk["usage"] = use_so_far
    if ext is not None:
        chunk["kvtide"] = ext
    return f"data: {json.dumps(chunk)}\n\n"
