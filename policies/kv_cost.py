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

A turn whose KV the service offers for a pull may instead **extend** it: run on the
decode engine that kept it, which prefills only the new tokens against its own prefix
cache and decodes; nothing moves. ``choose_plan`` decides between the two from the
tokens the engine would compute, where the history is, the decode engine's reported load
and KV headroom, the prefill pool's queue and an ITL budget (``PlanInputs``,
``ExtendSettings``). vLLM's prefix cache hits whole blocks only, and never the prompt's
last token, so the engine computes the new tokens and the history after its last whole
block (``in_place_tokens``), up to ``block_size - 1`` more than the increment:

    extra_step_s = min(num_prefill_tokens, chunk) * decode_prefill_s_per_token

is what one step of that in-place prefill adds to the decode engine's steps, which its
other running sequences wait through; over ``itl_budget_s`` (with others running) the
turn pulls. The per-token cost is the decode engine's own, as it measured it at
start and reports it with its load (``PlanInputs.decode_prefill_s_per_token``), or,
where it reported none, the calibration ``kv.extend_prefill_ms_per_token``. What it
reports follows what it does while serving: ``PrefillCost`` starts at that measurement
and folds in each in-place prefill the engine runs (``observe_prefill``: the time the
prefill added to its steps over its tokens), smoothed and bounded.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

from policies.kv_records import (
    HOST_POOL,
    KVLifecycleConfig,
    KVRecord,
    RecomputeReason,
    TurnAction,
    TurnDecision,
    prefix_hash,
)

__all__ = [
    "CostEstimate",
    "ExtendSettings",
    "PlanChoice",
    "PlanInputs",
    "PlanReason",
    "PrefillCost",
    "PrefillCostSettings",
    "budget_chunk_tokens",
    "choose_plan",
    "decide_turn",
    "estimate_cost",
    "extra_step_s",
    "in_place_tokens",
    "kv_bytes",
    "observe_prefill",
    "offer_refused",
    "prefill_steps",
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


class PlanReason(enum.StrEnum):
    """Why a turn whose history may be pulled extends it in place, or pulls it."""

    SHORT_INCREMENT = "short_increment"  # extend: few new tokens, room on the engine
    PREFILL_QUEUED = "prefill_queued"  # extend: a long increment, but prefill is queued
    EXTEND_OFF = "extend_off"  # pull: extending is off (config, or the turn's)
    HOST_TIER = "host_tier"  # pull: the history is in a host tier, on no decode engine
    OTHER_DECODE_POOL = "other_decode_pool"  # pull: the prompt goes to another decode pool
    NO_LOAD_REPORT = "no_load_report"  # pull: the decode engine's load is unknown or old
    DECODE_SATURATED = "decode_saturated"  # pull: the engine queues or runs its maximum
    DECODE_KV_FULL = "decode_kv_full"  # pull: the engine's KV cache has no headroom
    ITL_BUDGET = "itl_budget"  # pull: the in-place prefill would stall others' steps
    LONG_INCREMENT = "long_increment"  # pull: too many new tokens for the decode engine


@dataclass(frozen=True, slots=True, kw_only=True)
class ExtendSettings:
    """The ``kv.extend_*`` settings (``docs/config.md``). ``decode_prefill_s_per_token``:
    a decode engine's time to prefill one token in place (its calibration);
    ``itl_budget_s``: the extra step time its other sequences may see from one turn's
    in-place prefill; ``max_new_tokens``: a turn whose in-place prefill is longer (its
    new tokens and the history after its last whole block) goes to the prefill pool
    unless it has ``prefill_queue_waiting`` requests waiting; ``max_kv_cache_usage``:
    the decode engine's KV cache use at which it takes no more in-place prefills;
    ``max_load_age_s``: older load reports are not trusted."""

    enabled: bool = True
    max_new_tokens: int = 512
    itl_budget_s: float = 0.05
    decode_prefill_s_per_token: float = 0.0014
    max_kv_cache_usage: float = 0.9
    prefill_queue_waiting: int = 2
    max_load_age_s: float = 5.0


def in_place_tokens(
    *, num_prompt_tokens: int, num_history_tokens: int, block_size_tokens: int | None
) -> int:
    """The prompt tokens a decode engine computes for a prompt whose first
    ``num_history_tokens`` it computed before and kept: all but its prefix cache hit.
    vLLM caches a block once all its tokens are computed and looks a prompt up in whole
    blocks, at most ``num_prompt_tokens - 1`` tokens (the last is computed again for its
    logits: ``KVCacheManager.get_computed_blocks``), so the hit is the history's whole
    blocks, short of the prompt's last token (None: a cache of single tokens)."""
    block = block_size_tokens if block_size_tokens is not None and block_size_tokens > 0 else 1
    hit = max(0, min(num_history_tokens, num_prompt_tokens - 1)) // block * block
    return max(0, num_prompt_tokens - hit)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanInputs:
    """What ``choose_plan`` weighs for one turn the service offered a pull.

    ``num_new_tokens``: the prompt's tokens after the kept history, the
    ``num_history_tokens`` the decode engine computed and kept in blocks of
    ``block_size_tokens`` (``num_prefill_tokens``: what it computes of the prompt in
    place, the new tokens and the history after its last whole block); ``history_pool``: the
    kept history's pool (``HOST_POOL``: a host tier's store); the decode engine's load,
    as it last reported it at ``decode_reported_s`` (None: no report): its running and
    waiting requests, its KV cache use (0-1) and ``decode_max_running`` (its
    ``max_num_seqs``); ``prefill_waiting``: requests waiting on the prefill pool's
    engines; ``in_turn_pool``: the engine holding the history is in the decode pool the
    prompt goes to (a prompt past the long-context threshold goes to the other);
    ``decode_prefill_s_per_token``: the decode engine's own prefill time per token, as it
    measured and reported it (None: none reported; the settings' calibration then);
    ``decode_chunk_tokens``: the most prompt tokens of one request the decode engine
    computes in a step (vLLM's ``long_prefill_token_threshold``; None: a prompt's new
    tokens in one step)."""

    num_new_tokens: int
    history_pool: str
    in_turn_pool: bool = True
    decode_reported_s: float | None = None
    decode_running: int = 0
    decode_waiting: int = 0
    decode_kv_cache_usage: float = 0.0
    decode_max_running: int | None = None
    prefill_waiting: int = 0
    decode_prefill_s_per_token: float | None = None
    decode_chunk_tokens: int | None = None
    num_history_tokens: int = 0
    block_size_tokens: int | None = None

    @property
    def num_prefill_tokens(self) -> int:
        return in_place_tokens(
            num_prompt_tokens=self.num_history_tokens + max(0, self.num_new_tokens),
            num_history_tokens=self.num_history_tokens,
            block_size_tokens=self.block_size_tokens,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanChoice:
    """``choose_plan``'s answer: extend in place or pull, why, the prompt tokens the
    decode engine would compute in place (``PlanInputs.num_prefill_tokens``) and that
    prefill's estimated extra time in each step of the engine's other sequences."""

    extend: bool
    reason: PlanReason
    num_prefill_tokens: int = 0
    extra_step_s: float = 0.0


def extra_step_s(inputs: PlanInputs, settings: ExtendSettings) -> float:
    """What the turn's in-place prefill (``PlanInputs.num_prefill_tokens``) adds to each
    step of the decode engine's other sequences: one step's share of it (all, or
    ``decode_chunk_tokens`` where the engine chunks prefills) at the engine's reported
    time per token, else the settings' calibration."""
    per_token = inputs.decode_prefill_s_per_token
    if per_token is None or per_token <= 0:
        per_token = settings.decode_prefill_s_per_token
    step_tokens = inputs.num_prefill_tokens
    if inputs.decode_chunk_tokens is not None and inputs.decode_chunk_tokens > 0:
        step_tokens = min(step_tokens, inputs.decode_chunk_tokens)
    return step_tokens * per_token


def choose_plan(inputs: PlanInputs, settings: ExtendSettings, now_s: float) -> PlanChoice:
    """Extend the kept history on its decode engine, or pull it to prefill. Pure; checks
    in order, the first that refuses decides:

    1. extending is on;
    2. the history is on a decode engine (not a host tier) of the prompt's decode pool;
    3. that engine reported its load within ``max_load_age_s``;
    4. it is not saturated: nothing waiting, fewer running than its maximum;
    5. its KV cache is under ``max_kv_cache_usage``;
    6. the ITL budget: with other sequences running, the in-place prefill (the new
       tokens and the history after its last whole block) adds at most ``itl_budget_s``
       to each of their steps (at the engine's reported prefill time per token, else
       the settings'; an engine that chunks prefills computes at most
       ``decode_chunk_tokens`` of it a step);
    7. the in-place prefill is at most ``max_new_tokens``, or the prefill pool has
       ``prefill_queue_waiting`` requests waiting (a queue the pull would join).
    """
    extra_s = extra_step_s(inputs, settings)
    num_prefill = inputs.num_prefill_tokens

    def plan(extend: bool, reason: PlanReason) -> PlanChoice:
        return PlanChoice(
            extend=extend, reason=reason, num_prefill_tokens=num_prefill, extra_step_s=extra_s
        )

    def pull(reason: PlanReason) -> PlanChoice:
        return plan(False, reason)

    if not settings.enabled:
        return pull(PlanReason.EXTEND_OFF)
    if inputs.history_pool == HOST_POOL:
        return pull(PlanReason.HOST_TIER)
    if not inputs.in_turn_pool:
        return pull(PlanReason.OTHER_DECODE_POOL)
    reported = inputs.decode_reported_s
    if reported is None or now_s - reported > settings.max_load_age_s:
        return pull(PlanReason.NO_LOAD_REPORT)
    most = inputs.decode_max_running
    if inputs.decode_waiting > 0 or (most is not None and inputs.decode_running >= most):
        return pull(PlanReason.DECODE_SATURATED)
    if inputs.decode_kv_cache_usage >= settings.max_kv_cache_usage:
        return pull(PlanReason.DECODE_KV_FULL)
    if inputs.decode_running > 0 and extra_s > settings.itl_budget_s:
        return pull(PlanReason.ITL_BUDGET)
    if num_prefill <= settings.max_new_tokens:
        return plan(True, PlanReason.SHORT_INCREMENT)
    if inputs.prefill_waiting >= settings.prefill_queue_waiting:
        return plan(True, PlanReason.PREFILL_QUEUED)
    return pull(PlanReason.LONG_INCREMENT)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillCostSettings:
    """How a decode engine's prefill cost follows its serving (``observe_prefill``):
    ``weight``, each sample's share of the new mean; ``bound_factor``, how far from its
    start calibration the figure may go either way; ``min_tokens``, fewer computed
    tokens are not a sample (the step's own overhead and the clock's grain would decide)."""

    weight: float = 0.2
    bound_factor: float = 4.0
    min_tokens: int = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillCost:
    """A decode engine's in-place prefill time per token, the figure its heartbeat
    reports (``PlanInputs.decode_prefill_s_per_token``): ``calibrated_s_per_token`` as
    its host measured it at start, ``s_per_token`` the exponentially weighted mean of
    that and the samples ``observe_prefill`` folded in since (``num_samples``), always
    within ``bound_factor`` of the calibration."""

    calibrated_s_per_token: float
    s_per_token: float
    num_samples: int = 0

    @classmethod
    def calibrated(cls, s_per_token: float) -> PrefillCost:
        return cls(calibrated_s_per_token=s_per_token, s_per_token=s_per_token)


def budget_chunk_tokens(*, itl_budget_s: float, s_per_token: float) -> int:
    """The most prompt tokens of an in-place prefill a decode engine may compute in one
    step beside other sequences for that step to grow by at most ``itl_budget_s``, at
    ``s_per_token``: its prefill chunk (vLLM's ``long_prefill_token_threshold``); at
    least 1. Sized at deploy from the configured cost, then by each engine from its own."""
    if s_per_token <= 0:
        raise ValueError(f"s_per_token must be above 0, got {s_per_token}")
    return max(1, int(itl_budget_s / s_per_token + 1e-9))


def prefill_steps(num_tokens: int, chunk_tokens: int | None) -> int:
    """The engine steps a prefill of ``num_tokens`` takes when each computes at most
    ``chunk_tokens`` of it (vLLM's ``long_prefill_token_threshold``; None: all in one)."""
    if chunk_tokens is None or chunk_tokens <= 0:
        return 1
    return max(1, -(-num_tokens // chunk_tokens))


def observe_prefill(
    cost: PrefillCost,
    *,
    num_tokens: int,
    prefill_s: float,
    step_s: float,
    num_steps: int,
    settings: PrefillCostSettings,
) -> PrefillCost:
    """``cost`` with one in-place prefill folded in. The engine computed ``num_tokens``
    of a prompt in ``num_steps`` steps, ``prefill_s`` from scheduling it to its first
    token by its own clock, while one of its steps without the prefill took ``step_s``
    (the request's own decode steps after it, in the same batch): the prefill added
    ``prefill_s - num_steps * step_s`` to those steps, which, over its tokens, is the
    sample; what the engine's other sequences waited per token, as the ITL budget
    prices it. The sample is held within ``settings.bound_factor`` of the calibration
    and weighs ``settings.weight`` in the new mean. Unchanged for a prefill of fewer than
    ``settings.min_tokens`` tokens or without its times."""
    if num_tokens < settings.min_tokens or num_steps < 1 or prefill_s <= 0 or step_s < 0:
        return cost
    sample = max(0.0, prefill_s - num_steps * step_s) / num_tokens
    base = cost.calibrated_s_per_token
    sample = min(max(sample, base / settings.bound_factor), base * settings.bound_factor)
    mean = cost.s_per_token + settings.weight * (sample - cost.s_per_token)
    return replace(cost, s_per_token=mean, num_samples=cost.num_samples + 1)
