"""A turn as the router runs it: ``Turn``, what the caller asks (one frozen object, the
only thing that crosses into ``Router.run_turn``), and ``TurnState``, what the router's
parts write as the turn runs (router-private; the client sees ``TurnReport``)."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from engines.base import GenerateRequest, Sampling
from engines.kv_params import KVTransferParams
from orchestrator.kv.messages import KVDecision
from orchestrator.observability import tracing as tr
from orchestrator.router.turn_report import TurnReport

__all__ = ["IntegritySample", "LeaseUse", "Turn", "TurnSampling", "TurnState"]


@dataclass(frozen=True, slots=True, kw_only=True)
class IntegritySample:
    """A turn chosen for the integrity check (``orchestrator.router.integrity``): its
    plan's reason and the engine it pulls from."""

    source_engine_id: str
    plan_reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseUse:
    """A turn run under this replica's turn lease (``orchestrator.kv.turn_leases``):
    the lease, and the service's answer to its use, awaited before the turn's first item
    (when it refuses, the turn ends with ``LeaseRefused`` before any output)."""

    lease_id: int
    used: Awaitable[bool]


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnSampling:
    """How a turn's tokens are sampled, as the ingress's layer asks (the ``Turn`` fields
    of the same names): kvtide's own layer gives ``sampling``, vLLM's layer its own
    parameters whole."""

    sampling: Sampling = field(default_factory=Sampling)
    engine_sampling: Any = None
    prompt_logprobs: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    """One turn, as its caller asks for it.

    ``prompt_text``: the rendered prompt, when it came as text; the session's next turn
    continues tokenizing from it plus the generated text. ``owner``: the API key's name;
    the finished turn refreshes its ownership. ``sampling``: given to prefill and decode
    alike. ``engine_sampling``: the engine's own parameters (vLLM's ``SamplingParams``,
    from its OpenAI serving layer), given to the decode, which samples every token the
    client gets (the prefill's one token is not used). ``prompt_logprobs``: asked of the
    prefill, which computes the prompt (the report's ``prompt_logprobs``). ``decision``:
    the KV plan the service gave when the turn began (``begin_turn``), or the caller made
    under a turn lease (``lease``); without it a session's turn asks the service
    (``decide_turn``); a pull becomes an ``extend`` where ``orchestrator.router.
    extend_plan`` chooses it, unless ``may_extend`` is False (the turn then pulls as
    planned). ``trace_parent``: the ingress span the turn's spans hang under
    (``orchestrator.observability.tracing``).
    """

    prompt_token_ids: list[int]
    max_tokens: int
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    session_id: str | None = None
    owner: str | None = None
    prompt_text: str | None = None
    sampling: Sampling = field(default_factory=Sampling)
    engine_sampling: Any = None
    prompt_logprobs: int | None = None
    decision: KVDecision | None = None
    lease: LeaseUse | None = None
    may_extend: bool = True
    trace_parent: tr.Parent = None

    def prefill_request(
        self, request_id: str, params: KVTransferParams, prompt_token_ids: list[int]
    ) -> GenerateRequest:
        """A prefill of ``prompt_token_ids`` (the prompt, or after a migration the prompt
        and the tokens streamed): one token, the turn's sampling, its prompt log
        probabilities asked."""
        return GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            max_tokens=1,
            sampling=self.sampling,
            kv_transfer_params=params,
            session_id=self.session_id,
            prompt_logprobs=self.prompt_logprobs,
        )

    def decode_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        params: KVTransferParams,
        logprobs: int | None,
        engine_id: str | None = None,
    ) -> GenerateRequest:
        """A decode of the turn (or of what is left of it after a migration), sampled by
        the engine's own parameters where the caller gave them; ``engine_id``: the engine
        asked to run it (an extended turn's: where its history is kept)."""
        return GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            max_tokens=max_tokens,
            sampling=self.sampling,
            kv_transfer_params=params,
            session_id=self.session_id,
            sampling_params=self.engine_sampling,
            logprobs=logprobs,
            engine_id=engine_id,
        )


@dataclass(slots=True, kw_only=True)
class TurnState:
    """What the router's parts write as a turn runs; ``report`` is what its client gets."""

    turn: Turn
    report: TurnReport
    # The turn ends by then (``Router.request_timeout_s`` from its start).
    deadline_s: float
    # The lease use's answer, until the turn has awaited it.
    lease_pending: Awaitable[bool] | None = None
    # The service refused the lease's use: the turn ended unseen, and reports nothing.
    lease_refused: bool = False
    # Sampled for the integrity check (``orchestrator.router.integrity``): its sample,
    # and each decoded token's log probability (None where the engine gave none).
    integrity: IntegritySample | None = None
    integrity_logprobs: list[float | None] = field(default_factory=list)
    # The decode engine that finished the turn.
    decode_engine_id: str | None = None
    # An extended turn's: the previous turn's kept blocks it ran on, freed unread once
    # the turn is booked (``orchestrator.router.kept_release``).
    extended: KVTransferParams | None = None
