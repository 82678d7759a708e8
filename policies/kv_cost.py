"""The cost model behind "pull the KV back or recompute it".

A pull moves the recorded blocks (plus, for hybrid models, the linear-attention state)
from the decode engine to the prefill engine; a recompute prefills the same tokens
again. The tokens after the recorded prefix are prefilled either way, so only the
covered prefix is priced:

    recompute_s = num_tokens / prefill_tokens_per_s
    transfer_s  = bytes * 8 / (link_bandwidth_gbps * 1e9) + transfer_setup_s

The pull wins only when strictly cheaper. Prefill time grows faster than linearly
with context (attention is quadratic), so the linear estimate errs towards
recomputing, which is always correct, only slower.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.kv_records import (
    KVLifecycleConfig,
    KVRecord,
    RecomputeReason,
    TurnAction,
    TurnDecision,
    prefix_hash,
)

__all__ = [
    "CostEstimate",
    "decide_turn",
    "estimate_cost",
    "kv_bytes",
    "offer_refused",
    "worth_pulling",
]


def kv_bytes(num_tokens: int, config: KVLifecycleConfig) -> int:
    """Bytes one sequence of ``num_tokens`` pins: whole blocks, plus linear state."""
    num_blocks = -(-num_tokens // config.block_size_tokens)  # ceiling division
    return (
        num_blocks * config.block_size_tokens * config.kv_bytes_per_token
        + config.linear_state_bytes_per_sequence
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class CostEstimate:
    """Estimated seconds to recompute a prefix against pulling its KV."""

    recompute_s: float
    transfer_s: float

    @property
    def pull_is_cheaper(self) -> bool:
        return self.transfer_s < self.recompute_s


def estimate_cost(*, num_tokens: int, num_bytes: int, config: KVLifecycleConfig) -> CostEstimate:
    """Price recomputing ``num_tokens`` against pulling ``num_bytes`` over the link."""
    bytes_per_s = config.link_bandwidth_gbps * 1e9 / 8
    return CostEstimate(
        recompute_s=num_tokens / config.prefill_tokens_per_s,
        transfer_s=num_bytes / bytes_per_s + config.transfer_setup_s,
    )


def decide_turn(
    record: KVRecord, prompt_token_ids: Sequence[int], now_s: float, config: KVLifecycleConfig
) -> TurnDecision:
    """Pull ``record`` back for this prompt, or recompute, and why. Pure; checks in order:

    1. freshness: never offered at or after ``expiry_s - safety_margin_s``;
    2. prefix: the prompt must start with exactly the recorded tokens (hash compare),
       so a client that rewrites history gets a recompute, never wrong KV;
    3. the threshold floor: fewer reusable tokens than ``recompute_threshold_tokens``;
    4. the cost model: pull only when strictly cheaper than recomputing.
    """
    session_id = record.session_id
    if now_s >= record.expiry_s:
        return _recompute(session_id, RecomputeReason.EXPIRED)
    num_tokens = record.num_tokens
    not_worth = worth_pulling(record, config)
    refused = offer_refused(
        offer_deadline_s=record.offer_deadline_s(config.safety_margin_s),
        num_tokens=num_tokens,
        recorded_prefix_hash=record.prefix_hash,
        not_worth=not_worth,
        prompt_token_ids=prompt_token_ids,
        now_s=now_s,
    )
    if refused is not None and refused is not RecomputeReason.CHEAPER_TO_RECOMPUTE:
        return _recompute(session_id, refused)
    cost = estimate_cost(num_tokens=num_tokens, num_bytes=record.bytes_held, config=config)
    pull = not_worth is None
    return TurnDecision(
        session_id=session_id,
        action=TurnAction.PULL_FROM_DECODE if pull else TurnAction.RECOMPUTE,
        reason=None if pull else RecomputeReason.CHEAPER_TO_RECOMPUTE,
        record=record if pull else None,
        num_reusable_tokens=num_tokens,
        estimated_recompute_s=cost.recompute_s,
        estimated_transfer_s=cost.transfer_s,
    )


def offer_refused(
    *,
    offer_deadline_s: float,
    num_tokens: int,
    recorded_prefix_hash: str,
    not_worth: RecomputeReason | None,
    prompt_token_ids: Sequence[int],
    now_s: float,
) -> RecomputeReason | None:
    """The checks of every turn's KV decision, in their one order (the service's
    ``decide_turn`` and a turn lease's plan alike): None when the prompt should pull
    the kept KV, else why it recomputes.

    1. freshness: never offered at or after ``offer_deadline_s`` (the engine's expiry
       less the safety margin);
    2. prefix: the prompt must start with exactly the recorded ``num_tokens`` tokens
       (hash compare), so a client that rewrites history gets a recompute, never wrong
       KV;
    3. the record's own verdict (``worth_pulling``: threshold, then cost).
    """
    if now_s >= offer_deadline_s:
        return RecomputeReason.WITHIN_MARGIN
    if (
        len(prompt_token_ids) < num_tokens
        or prefix_hash(prompt_token_ids, num_tokens) != recorded_prefix_hash
    ):
        return RecomputeReason.PREFIX_MISMATCH
    return not_worth


def worth_pulling(record: KVRecord, config: KVLifecycleConfig) -> RecomputeReason | None:
    """Checks 3 and 4 of ``decide_turn``, which depend on the record alone: None when a
    prompt that extends it should pull it, else why it should be recomputed."""
    if record.num_tokens < config.recompute_threshold_tokens:
        return RecomputeReason.BELOW_THRESHOLD
    cost = estimate_cost(num_tokens=record.num_tokens, num_bytes=record.bytes_held, config=config)
    return None if cost.pull_is_cheaper else RecomputeReason.CHEAPER_TO_RECOMPUTE


def _recompute(session_id: str, reason: RecomputeReason) -> TurnDecision:
    return TurnDecision(session_id=session_id, action=TurnAction.RECOMPUTE, reason=reason)
