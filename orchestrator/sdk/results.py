"""What a turn and a session look like to the caller, and the per-turn table.

These are plain frozen values: a ``TurnResult`` is built once from the server's answer
and the client's own timings, and never changes after the turn is in the history.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SessionInfo", "SessionRecord", "TurnResult", "format_turns"]


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


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionRecord:
    """Where kvtide holds a session's KV now; ``expires_in_s`` counts from the answer."""

    engine_id: str
    num_tokens: int
    bytes_held: int
    expires_in_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionInfo:
    """``GET``/``renew`` of a session. ``record`` is ``None`` when no KV is held (never
    recorded, expired, evicted or closed): the next turn then recomputes its prompt.
    ``lease_expires_in_s`` is how long the server keeps the session without a turn or a
    renewal, when it says so; ``raw`` is the body as sent."""

    id: str
    record: SessionRecord | None
    lease_expires_in_s: float | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> SessionInfo:
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
