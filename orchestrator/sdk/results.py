"""What a turn and a session look like to the caller, and the per-turn table.

These are plain frozen values: a ``TurnResult`` is built once from the server's answer
and the client's own timings, and never changes after the turn is in the history.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from orchestrator.sdk.errors import StructuredOutputError

__all__ = [
    "Logprob",
    "SessionInfo",
    "SessionRecord",
    "SessionStatus",
    "ToolCall",
    "TurnResult",
    "format_turns",
]

M = TypeVar("M")
M_co = TypeVar("M_co", covariant=True)


class JSONModel(Protocol[M_co]):
    """What ``TurnResult.parse`` needs of a model class: pydantic's ``model_validate_json``
    (the SDK does not import pydantic; any class with this method will do)."""

    def model_validate_json(self, json_data: str, /) -> M_co: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """A function call the model asked for, as the server sent it. ``arguments`` is the
    JSON text the model wrote, unparsed (a model may write invalid JSON): ``args()``
    parses it. Answer it with ``session.add_tool_result(call.id, ...)``."""

    id: str
    name: str
    arguments: str
    type: str = "function"

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ToolCall:
        function = raw.get("function")
        fn: Mapping[str, Any] = function if isinstance(function, Mapping) else {}
        return cls(
            id=str(raw.get("id") or ""),
            name=str(fn.get("name") or ""),
            arguments=str(fn.get("arguments") or ""),
            type=str(raw.get("type") or "function"),
        )

    def args(self) -> Any:
        """The arguments as JSON; ``StructuredOutputError`` when they are not JSON."""
        try:
            return json.loads(self.arguments)
        except ValueError as exc:
            raise StructuredOutputError(
                f"the arguments of tool call {self.id!r} ({self.name}) are not JSON: {exc}",
                text=self.arguments,
            ) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Logprob:
    """One sampled token of the reply with its log-probability; ``top`` holds the
    ``top_logprobs`` alternatives as ``(token, logprob)`` pairs, most likely first."""

    token: str
    logprob: float
    bytes: tuple[int, ...] | None = None
    top: tuple[tuple[str, float], ...] = ()

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Logprob:
        raw_bytes = raw.get("bytes")
        top = raw.get("top_logprobs") or ()
        return cls(
            token=str(raw.get("token", "")),
            logprob=float(raw.get("logprob", 0.0)),
            bytes=tuple(int(b) for b in raw_bytes) if isinstance(raw_bytes, list) else None,
            top=tuple(
                (str(t.get("token", "")), float(t.get("logprob", 0.0)))
                for t in top
                if isinstance(t, Mapping)
            ),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnResult:
    """One completed turn.

    Token counts come from the server's ``usage``. ``kv_source`` says where the prompt's
    KV came from: ``"sent_back"`` (pulled back from the decode engine that kept the previous
    turn), ``"prefix_cache"`` (reused on the prefill engine), ``"transferred"`` or
    ``"recomputed"``. Times are measured by the client from the moment ``send``/``stream``
    was called, so they include network time and any retries: ``ttft_s`` is the
    client-measured time to the first token for a streamed turn and the server's
    ``ttft_s`` for a non-streamed one (the client cannot see the first token there);
    ``server_ttft_s`` is always the server's. ``tokens_per_s`` is the decode rate after the
    first token, ``(completion_tokens - 1) / (total_s - ttft_s)``, or ``None`` when fewer
    than two tokens came back. ``kvtide`` is the server's ``kvtide`` object as sent.
    ``num_resumes``: how often a streamed turn went on after its stream broke on the
    server (an engine failed mid-stream with no other to continue on); ``text`` and
    ``completion_tokens`` cover the whole turn.

    ``message`` is the assistant message exactly as the server returned it (for a streamed
    turn: as its deltas built it); the session's history keeps this message, so
    ``tool_calls`` go back to the server unchanged. ``logprobs`` is ``None`` unless the
    turn asked for them. ``choices`` holds every choice as sent when ``n`` > 1 asked for
    several (non-streamed turns only); the session goes on with the first. ``parsed`` is
    the validated model when ``response_format`` was a model class.
    """

    turn: int
    session_id: str
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    kv_source: str | None
    ttft_s: float
    server_ttft_s: float | None
    tokens_per_s: float | None
    total_s: float
    request_id: str | None
    idempotency_key: str
    num_attempts: int
    streamed: bool
    kvtide: Mapping[str, Any] = field(default_factory=dict)
    num_resumes: int = 0
    message: Mapping[str, Any] = field(default_factory=dict)
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[Logprob, ...] | None = None
    choices: tuple[Mapping[str, Any], ...] = ()
    parsed: Any = None

    def json(self) -> Any:
        """The reply's text as JSON (``response_format`` ``json_object``/``json_schema``);
        ``StructuredOutputError`` when it is not JSON (a ``length`` finish cuts it off)."""
        try:
            return json.loads(self.text)
        except ValueError as exc:
            why = self._why_not(f"is not JSON ({exc})")
            raise StructuredOutputError(why, text=self.text) from None

    def parse(self, model: JSONModel[M]) -> M:
        """The reply's text validated into ``model`` (a pydantic model class);
        ``StructuredOutputError`` when it does not validate."""
        try:
            return model.model_validate_json(self.text)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            why = f"does not validate as {getattr(model, '__name__', model)}: {exc}"
            raise StructuredOutputError(self._why_not(why), text=self.text) from None

    def _why_not(self, why: str) -> str:
        cut = " (it was cut off: finish_reason 'length'; raise max_tokens)"
        tail = cut if self.finish_reason == "length" else ""
        return f"turn {self.turn} of session {self.session_id}: the reply {why}{tail}"


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionRecord:
    """Where kvtide holds a session's KV now; ``expires_in_s`` counts from the answer."""

    engine_id: str
    num_tokens: int
    bytes_held: int
    expires_in_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionStatus:
    """``GET``/``renew`` of a session. ``record`` is ``None`` when no KV is held (never
    recorded, expired, evicted or closed): the next turn then recomputes its prompt.
    ``lease_expires_in_s`` is how long the server keeps the session without a turn or a
    renewal, when it says so; ``raw`` is the body as sent."""

    id: str
    record: SessionRecord | None
    lease_expires_in_s: float | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> SessionStatus:
        rec = body.get("record")
        record = None
        if isinstance(rec, Mapping):
            record = SessionRecord(
                engine_id=str(rec.get("engine_id", "")),
                num_tokens=int(rec.get("num_tokens", 0)),
                bytes_held=int(rec.get("bytes_held", 0)),
                expires_in_s=_seconds(rec.get("expires_in_s")),
            )
        return cls(
            id=str(body.get("id", "")),
            record=record,
            lease_expires_in_s=_seconds(body.get("lease_expires_in_s")),
            raw=dict(body),
        )


# The earlier name, kept for callers that import it (the server has a ``SessionInfo`` of
# its own, so the class itself is named ``SessionStatus``).
SessionInfo = SessionStatus


def _seconds(value: Any) -> float | None:
    return None if value is None else float(value)


_COLUMNS = ("turn", "prompt tok", "cached tok", "KV source", "TTFT s", "tok/s")


def _cells(result: TurnResult) -> tuple[str, ...]:
    rate = "-" if result.tokens_per_s is None else f"{result.tokens_per_s:.1f}"
    return (
        str(result.turn),
        str(result.prompt_tokens),
        str(result.cached_tokens),
        result.kv_source or "-",
        f"{result.ttft_s:.3f}",
        rate,
    )


def format_turns(turns: Iterable[TurnResult]) -> str:
    """A fixed-width table of turns (numbers right-aligned, KV source left-aligned), one
    line per turn under a header, for printing after a session."""
    rows = [_COLUMNS, *(_cells(t) for t in turns)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(w) if i == 3 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
