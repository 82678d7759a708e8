"""What the ingress knows of a turn as it opens it, and what it hands to the response.

``TurnOpener.open`` takes an ``OpenTurn`` (from kvtide's own OpenAI layer or from
vLLM's serving layer through ``orchestrator.serve.turn_client``) and returns an
``OpenedTurn``: the turn claimed, planned and run to its first item.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from engines.base import GenerateChunk
from orchestrator.kv.ownership import Principal
from orchestrator.router import TurnReport, TurnSampling

__all__ = ["OpenTurn", "OpenedTurn"]


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenTurn:
    """A turn to open. ``text``: the rendered prompt (None for token ids); ``ids``: its
    token ids when already tokenized (None: the ingress tokenizes ``text``);
    ``retokenize``: tokenize ``text`` again from the session's last turn when there
    is one (token continuity: the ids the decode made stay as they were, not as the
    text tokenizes afresh). ``limits(ids)`` checks the key's limits and the context
    and returns the turn's max_tokens. ``run_args``: how the turn samples (its
    ``Turn``'s sampling fields). ``num_sequences``: the sequences the request runs on the pools (its
    ``n`` choices: this turn and ``n - 1`` sessionless requests of its prompt), which
    admission counts. ``may_extend``: the turn's ``Turn.may_extend`` (the request's
    ``x-kvtide-kv-plan``)."""

    principal: Principal
    session_header: str | None
    has_history: bool
    text: str | None
    ids: list[int] | None
    limits: Callable[[list[int]], int]
    t_in: float
    root: Any
    request_id: str
    render_s: float = 0.0
    retokenize: bool = False
    run_args: TurnSampling = field(default_factory=TurnSampling)
    num_sequences: int = 1
    may_extend: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenedTurn:
    """A running turn: the prompt's ids as run, its first item, the rest of its stream
    and the response headers (kvtide's request id, the session)."""

    ids: list[int]
    first: tuple[GenerateChunk, TurnReport]
    turn: AsyncGenerator[tuple[GenerateChunk, TurnReport], None]
    headers: dict[str, str]

    @property
    def request_id(self) -> str:
        return self.first[1].request_id

    @property
    def session_id(self) -> str | None:
        return self.headers.get("x-session-id")
