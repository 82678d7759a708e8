"""OpenAI-compatible request parsing and response shapes (no Ray, no engines).

``parse_chat`` / ``parse_completion`` turn a raw HTTP body into a validated ``ApiRequest``
or raise a ``RequestError`` whose ``body()`` is an OpenAI-style error. Unknown fields are
ignored (as OpenAI-compatible servers do); fields kvtide cannot honour (``n > 1``,
``tools``, batched prompts) are rejected with a message saying so, never silently dropped.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

from orchestrator.errors import InvalidRequest, ModelNotFound, UnsupportedMediaType

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "ApiRequest",
    "chat_response",
    "completion_response",
    "parse_body",
    "parse_chat",
    "parse_completion",
    "parse_session_id",
    "stream_chunk",
    "usage",
]

DEFAULT_MAX_TOKENS = 256
# fullmatch: "$" would also match before a final newline ("abc\n").
_SESSION_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiRequest:
    """A validated chat or completion request, before tokenization."""

    kind: Literal["chat", "completion"]
    model: str
    messages: tuple[tuple[str, str], ...] = ()
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    # vLLM's extension: return prompt and completion token ids in the response.
    return_token_ids: bool = False


def parse_body(raw: bytes, content_type: str | None) -> dict[str, Any]:
    """Decode a JSON object body, checking the content type first."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        raise UnsupportedMediaType(
            f"Content-Type must be application/json, got {content_type or 'none'!r}; send the "
            "request body as JSON with the header 'Content-Type: application/json'"
        )
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_session_id(value: str | None) -> str | None:
    if value is None or value == "":
        return None
    if not _SESSION_RE.fullmatch(value):
        raise InvalidRequest(
            "x-session-id must be 1-128 characters of letters, digits and ._:- ; "
            f"got {value[:40]!r}",
            param="x-session-id",
        )
    return value


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be a number in [{lo}, {hi}], got {value!r}", param=name)
    return float(value)


def _common(body: dict[str, Any], served_model: str) -> dict[str, Any]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required: send the served model's name", param="model")
    if model != served_model:
        raise ModelNotFound(
            f"The model {model!r} does not exist on this server; it serves {served_model!r} "
            "(see GET /v1/models)",
            param="model",
        )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise InvalidRequest(f"{name} must be an integer >= 1, got {max_tokens!r}", param=name)
    n = body.get("n", 1)
    if n != 1:
        raise InvalidRequest(f"only n=1 is supported, got {n!r}; send n separate requests", "n")
    for unsupported in ("tools", "functions", "logit_bias"):
        if body.get(unsupported):
            raise InvalidRequest(f"{unsupported} is not supported by kvtide yet", unsupported)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be true or false, got {stream!r}", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise InvalidRequest("stop must be a string or a list of up to 4 strings", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidRequest(f"seed must be an integer, got {seed!r}", param="seed")
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 1e-6, 1.0),
        "seed": seed,
        "stop": stops,
        "stream": stream,
        "include_usage": bool(opts.get("include_usage", False)),
        "ignore_eos": bool(body.get("ignore_eos", False)),
        "return_token_ids": bool(body.get("return_token_ids", False)),
    }


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequest(
                    f"messages[{index}].content: only text parts are supported",
                    param=f"messages[{index}].content",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    if content is None:
        return ""
    raise InvalidRequest(
        f"messages[{index}].content must be a string or a list of text parts",
        param=f"messages[{index}].content",
    )


def parse_chat(body: dict[str, Any], served_model: str) -> ApiRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise InvalidRequest(
                f"messages[{i}] must be an object with role in {list(_ROLES)}",
                param=f"messages[{i}].role",
            )
        parsed.append((str(m["role"]), _content_text(m.get("content"), i)))
    return ApiRequest(kind="chat", messages=tuple(parsed), **_common(body, served_model))


def parse_completion(body: dict[str, Any], served_model: str) -> ApiRequest:
    prompt = body.get("prompt")
    common = _common(body, served_model)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return ApiRequest(kind="completion", prompt_text=prompt, **common)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return ApiRequest(kind="completion", prompt_token_ids=tuple(prompt), **common)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise InvalidRequest(
            "batched prompts are not supported; send one prompt per request", "prompt"
        )
    raise InvalidRequest(
        "prompt must be a non-empty string or a non-empty list of token ids", "prompt"
    )


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
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
                "logprobs": None,
            }
        ],
        "usage": use,
        "kvtide": ext,
    }


def completion_response(
    rid: str, model: str, text: str, finish: str | None, use: dict[str, Any], ext: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
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
) -> str:
    """One SSE ``data:`` line. ``use`` alone makes the usage-only final chunk."""
    chunk: dict[str, Any] = {"id": rid, "created": int(time.time()), "model": model}
    if kind == "chat":
        chunk["object"] = "chat.completion.chunk"
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        chunk["choices"] = (
            [] if use is not None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        )
    else:
        chunk["object"] = "text_completion"
        chunk["choices"] = (
            []
            if use is not None
            else [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
        )
    if use is not None:
        chunk["usage"] = use
    if ext is not None:
        chunk["kvtide"] = ext
    return f"data: {json.dumps(chunk)}\n\n"
