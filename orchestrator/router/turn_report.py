"""What a turn reports and carries inside the router: ``TurnReport`` (the per-turn facts
a client gets in the response's ``kvtide`` object), ``Streamed`` (what it has streamed so
far), and the protocol the router reaches a pool by."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from engines.base import GenerateChunk, GenerateRequest, TokenLogprob
from orchestrator.errors import KVTideError
from orchestrator.kv.conversations import is_unnamed
from orchestrator.observability import tracing as tr

__all__ = ["KV_SOURCES", "LeaseRefused", "PoolClient", "Streamed", "TurnReport"]

# Where a turn's prompt KV came from, as reported to clients.
KV_SOURCES = {
    "sent_back": "pulled back from the decode engine (previous turn)",
    "prefix_cache": "prefix cache on the prefill engine",
    "recomputed": "computed on the prefill engine",
    "extended": "kept on the decode engine that ran the turn (previous turn); only the new "
    "tokens computed there",
}


class PoolClient(Protocol):
    """How the router reaches a pool. ``generate`` streams one engine's output; ending
    the stream early (``aclose``, or ``cancel`` on a Serve generator: ``abort_stream``)
    aborts the engine's request."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]: ...


@dataclass(slots=True, kw_only=True)
class TurnReport:
    """Per-turn facts, returned to the client in the response's ``kvtide`` object; the
    router writes them as the turn runs, its callers read them."""

    request_id: str
    session_id: str | None
    num_prompt_tokens: int
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    kv_source: str = "recomputed"
    kv_plan: str = "recompute"
    kv_plan_reason: str = ""
    # Why a turn offered a pull extended its history in place or pulled it
    # (``policies.kv_cost.PlanReason``); None: it had no kept history to choose for.
    extend_reason: str | None = None
    # For the same turns: the prompt tokens the decode engine would compute in place (the
    # new tokens and the history after its last whole cached block), as the plan priced
    # them; an extended turn's engine computes them (``num_prompt_tokens`` less its hit).
    extend_prefill_tokens: int | None = None
    pull_fallback: bool = False
    decode_pool: str = "decode"
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    # The decode engine's mean time per step for this turn, by its own clock (None where
    # it did not say): what a client's gaps between stream events are measured against.
    decode_step_s: float | None = None
    router_s: float = 0.0
    # The ingress's time before the router: parsing, the chat template, tokenizing and
    # the KV service's begin_turn (set by the ingress).
    ingress_s: float = 0.0
    # Of ``ingress_s``: waiting for the KV service: its begin_turn (a session turn), or
    # under a turn lease the hand-over of the session's last turn here, when it is on its way.
    service_s: float = 0.0
    # Of ``ingress_s``: rendering the chat template and tokenizing the prompt (work any
    # OpenAI server does; a prompt sent as token ids has none).
    tokenize_s: float = 0.0
    finish_reason: str | None = None
    migrations: int = 0
    prefill_retries: int = 0
    # The prefill engine that computed the prompt, and why it was chosen: a prefix
    # router's reason (``policies.prefix_routing``), or "pow2" (Serve's load balancing).
    prefill_replica: str | None = None
    prefill_route_reason: str = "pow2"
    prefill_matched_tokens: int = 0
    # A request without x-session-id: "started" (it carries history: an unnamed session
    # keeps its KV), "continued" (it extends one), "unmatched" (that session was busy:
    # served without one); None otherwise (``orchestrator.kv.conversations``).
    conversation: str | None = None
    # The turn's KV transfers, by direction (``tr.DIRECTIONS``): the bytes they moved, as
    # the reading engine measured them (None: it did not say; 0: nothing moved), and the
    # bytes offered to them (the blocks the sending engine named, as bytes).
    kv_transfer_bytes: dict[str, int | None] = field(
        default_factory=lambda: dict.fromkeys(tr.DIRECTIONS, 0)
    )
    kv_offered_bytes: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(tr.DIRECTIONS, 0)
    )
    # The prompt's log probabilities, when the turn asked its prefill for them (vLLM's
    # ``prompt_logprobs``: one list per position, None at the first); not in ``as_dict``.
    prompt_logprobs: list[list[TokenLogprob] | None] | None = None

    def add_transfer(self, direction: tr.Direction, moved: int | None, offered: int) -> None:
        """A KV transfer of this turn: what it moved (None: not measured) and was offered."""
        before = self.kv_transfer_bytes[direction]
        self.kv_transfer_bytes[direction] = (
            None if before is None or moved is None else before + moved
        )
        self.kv_offered_bytes[direction] += offered

    def as_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "session_id": None if is_unnamed(self.session_id) else self.session_id,
            "conversation": self.conversation,
            "kv_source": self.kv_source,
            "kv_plan": self.kv_plan,
            "kv_plan_reason": self.kv_plan_reason,
            "extend_reason": self.extend_reason,
            "extend_prefill_tokens": self.extend_prefill_tokens,
            "pull_fallback": self.pull_fallback,
            "decode_pool": self.decode_pool,
            "num_cached_tokens": self.num_cached_tokens,
            "prefill_s": round(self.prefill_s, 6),
            "ttft_s": round(self.ttft_s, 6),
            "total_s": round(self.total_s, 6),
            "decode_step_s": None if self.decode_step_s is None else round(self.decode_step_s, 6),
            "router_s": round(self.router_s, 6),
            "ingress_s": round(self.ingress_s, 6),
            "service_s": round(self.service_s, 6),
            "tokenize_s": round(self.tokenize_s, 6),
            "migrations": self.migrations,
            "prefill_retries": self.prefill_retries,
            "prefill_replica": self.prefill_replica,
            "prefill_route_reason": self.prefill_route_reason,
            "prefill_matched_tokens": self.prefill_matched_tokens,
            "kv_transfer_bytes": dict(self.kv_transfer_bytes),
            "kv_offered_bytes": dict(self.kv_offered_bytes),
        }


class LeaseRefused(KVTideError):
    """The service refused a turn's lease use: the turn ended before any output; run it
    again through ``begin_turn``."""


@dataclass(slots=True)
class Streamed:
    """What a turn has streamed to its client so far, across decode engines."""

    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
