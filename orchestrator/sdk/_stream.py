"""Reading a streamed turn and going on after it broke, shared by the sync and async
sessions: ``StreamCollector`` reads the SSE stream line by line into a ``TurnResult``;
``next_resume`` (after a retryable in-stream error) and ``reconnect_request`` (after a
broken connection) build the request that continues the turn. No I/O here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from orchestrator.sdk._wire import (
    TurnMeta,
    _float_or_none,
    _usage_counts,
    decode_rate,
    error_from_payload,
    logprobs_of,
    request_id_of,
    tool_calls_of,
)
from orchestrator.sdk.errors import KVTideAPIError
from orchestrator.sdk.results import TurnResult

# A response the server replays for a repeated Idempotency-Key carries this header.
REPLAYED_HEADER = "x-kvtide-replayed"

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
    if request is None or made is None or not collector.can_continue(max_resumes):
        return None
    used = made + collector.prior_tokens
    nxt = resume_request(*request, text, used, collector.num_resumes + 1)
    return None if nxt is None else (*nxt, made)


def reconnect_request(
    collector: StreamCollector,
    request: tuple[dict[str, Any], dict[str, str]] | None,
    headers: Mapping[str, str],
    text: str,
    max_resumes: int,
) -> tuple[dict[str, Any], dict[str, str]] | None:
    """The request that continues a streamed turn (first sent as ``request``) whose
    connection broke while ``collector`` read a response to ``headers``; ``None`` when
    it cannot go on (no usage so far in the chunks, or no resumes left).

    The server may have finished that response, may still be running it, or may have
    dropped it when the connection went: so the continuation is sent with the *same*
    idempotency key as the broken request. A finished response is then replayed (the
    caller gets what it had not seen of it, ``StreamCollector.replayed``), a running one
    answers 409 until it ends (the client retries), and a dropped one is continued from
    ``text`` (``resume_request``) under that key: the turn runs at most once either way.
    """
    made = collector.made_tokens()
    if request is None or made is None or not collector.can_continue(max_resumes):
        return None
    nxt = resume_request(*request, text, made + collector.prior_tokens, collector.num_resumes + 1)
    return None if nxt is None else (nxt[0], dict(headers))


def reconnected(collector: StreamCollector, headers: Mapping[str, str]) -> StreamCollector:
    """The collector for the response to a ``reconnect_request`` (with its ``headers``):
    a replay of the broken response, or the turn's continuation."""
    rid = request_id_of(headers)
    if headers.get(REPLAYED_HEADER) == "true":
        return collector.replayed(rid)
    return collector.resumed(rid, collector.made_tokens() or 0)


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


class StreamCollector:
    """Reads a chat.completion.chunk SSE stream line by line.

    ``feed(line)`` returns the text delta the line carries (or ``None``) and raises the
    typed error of an in-stream ``{"error": ...}``. Events are one ``data:`` line each in
    kvtide's stream; multi-line events are joined as the SSE spec says. ``done`` is set by
    ``data: [DONE]``. Only the first choice is read (a session goes on with it); its
    ``tool_calls`` deltas are joined by index and its ``logprobs`` collected.
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
        self.tool_calls: dict[int, dict[str, Any]] = {}  # index -> the call so far
        self.logprobs: list[Any] | None = None  # the first choice's logprobs.content
        self._data: list[str] = []
        # Completion tokens of the streams this one resumes (see ``resume_request``).
        self.prior_tokens = 0
        self.num_resumes = 0
        # Parts from the responses before this one; text a replay repeats (``replayed``).
        self._base = 0
        self._skip = ""
        self._logprobs_base = 0

    def can_continue(self, max_resumes: int) -> bool:
        """Whether a broken stream may be continued: resumes left, and no tool call begun
        (a continuation continues text; half a call's arguments cannot be continued)."""
        return self.num_resumes < max_resumes and not self.tool_calls

    def resumed(self, request_id: str | None, used_tokens: int) -> StreamCollector:
        """A collector for the stream that continues this one after it failed having
        generated ``used_tokens``: the text so far is kept, the rest starts over."""
        nxt = StreamCollector(request_id)
        nxt.parts = list(self.parts)
        nxt.num_deltas = self.num_deltas
        nxt.prior_tokens = self.prior_tokens + used_tokens
        nxt.num_resumes = self.num_resumes + 1
        nxt._base = len(nxt.parts)
        nxt.logprobs = None if self.logprobs is None else list(self.logprobs)
        nxt._logprobs_base = len(nxt.logprobs or ())
        return nxt

    def replayed(self, request_id: str | None) -> StreamCollector:
        """A collector for the server's replay of the response this one was reading when
        the connection broke: the replay repeats what was already seen of it, which is
        dropped (and must match), and only the rest is new text."""
        nxt = StreamCollector(request_id)
        nxt.parts = self.parts[: self._base]
        nxt.num_deltas = self.num_deltas
        nxt.prior_tokens = self.prior_tokens
        nxt.num_resumes = self.num_resumes + 1
        nxt._base = self._base
        nxt._skip = "".join(self.parts[self._base :])
        # The replay carries the logprobs of the whole response again: keep only those of
        # the responses before it.
        nxt.logprobs = None if self.logprobs is None else self.logprobs[: self._logprobs_base]
        nxt._logprobs_base = self._logprobs_base
        return nxt

    def made_tokens(self) -> int | None:
        """Completion tokens of the response read so far, from the usage its chunks
        carry (``continuous_usage_stats``); None when they carry none."""
        made = self.usage.get("completion_tokens") if isinstance(self.usage, Mapping) else None
        if isinstance(made, int) and made >= 0:
            return made
        return 0 if not self.parts[self._base :] else None

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
        text = self._choice_text(chunk.get("choices") or ())
        if text and self._skip:
            text = self._skipped(text)
        if text:
            self.num_deltas += 1
            self.parts.append(text)
        return text

    def _choice_text(self, choices: Any) -> str | None:
        """Choice 0's new text in an event's ``choices``; its tool calls, logprobs and
        finish reason noted on the way."""
        text: str | None = None
        for choice in choices:
            if not isinstance(choice, Mapping) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                text = (text or "") + str(content)
            self._add_tool_calls(delta.get("tool_calls"))
            self._add_logprobs(choice.get("logprobs"))
            if choice.get("finish_reason") is not None:
                self.finish_reason = str(choice["finish_reason"])
        return text

    def _add_tool_calls(self, deltas: Any) -> None:
        """Join ``delta.tool_calls``: the id, type and name come once, the arguments in
        pieces, all under the call's ``index``."""
        for delta in deltas if isinstance(deltas, list) else ():
            if not isinstance(delta, Mapping):
                continue
            call = self.tool_calls.setdefault(
                int(delta.get("index", 0)),
                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if delta.get("id"):
                call["id"] = str(delta["id"])
            if delta.get("type"):
                call["type"] = str(delta["type"])
            fn = delta.get("function")
            if isinstance(fn, Mapping):
                if fn.get("name"):
                    call["function"]["name"] += str(fn["name"])
                if fn.get("arguments"):
                    call["function"]["arguments"] += str(fn["arguments"])

    def _add_logprobs(self, raw: Any) -> None:
        content = raw.get("content") if isinstance(raw, Mapping) else None
        if isinstance(content, list):
            self.logprobs = [*(self.logprobs or []), *content]

    def message(self) -> dict[str, Any]:
        """The assistant message the deltas built, as the history keeps it."""
        text = "".join(self.parts)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tool_calls:
            message["content"] = text or None
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return message

    def _skipped(self, text: str) -> str | None:
        """``text`` of a replay less what the caller has seen already."""
        n = min(len(self._skip), len(text))
        if text[:n] != self._skip[:n]:
            raise KVTideAPIError(
                "the replayed turn differs from the text already streamed",
                request_id=self.request_id,
            )
        self.parts.append(self._skip[:n])  # seen before: kept, not returned again
        self._skip = self._skip[n:]
        return text[n:] or None

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
        message = self.message()
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
            message=message,
            tool_calls=tool_calls_of(message),
            logprobs=logprobs_of(None if self.logprobs is None else {"content": self.logprobs}),
        )
