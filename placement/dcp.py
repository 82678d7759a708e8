"""Choosing decode context parallelism (DCP) from the memory and decode models.

Under TP an MLA cache (one latent head) is copied on every rank, and a GQA cache once
TP exceeds the KV heads. DCP shards those copies along tokens: each rank keeps 1/dcp
of every sequence, so an engine holds dcp times as many sequences and reads 1/dcp of
the KV per step, at the price of two collectives per attention layer (gather the
queries, merge the partial outputs by their log-sum-exp). Nothing here says "DCP wins
above N tokens": the chooser compares every valid degree with `decode_step` at the
batch each one can hold, and the answer follows from the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from placement.capacity import (
    DEFAULT_MEMORY,
    EngineMemoryConfig,
    EngineShape,
    explain_dcp_degrees,
    memory_plan,
    valid_dcp_degrees,
)
from placement.decode_model import DecodeCalibration, DecodeEstimate, SpeculativeConfig, decode_step
from placement.devices import DeviceSpec
from placement.model_spec import ModelSpec

__all__ = [
    "ContextMix",
    "DCPCandidate",
    "DCPDecision",
    "choose_dcp",
    "evaluate_shape",
    "explain_dcp_degrees",
    "valid_dcp_degrees",
]

# Degrees within this share of the best throughput count as equal (the model is not
# more precise than that); the smaller wins: fewer collectives, fewer ranks per sequence.
_TIE = 0.05


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextMix:
    """Contexts at decode time: (context_tokens, share of sequences) buckets."""

    buckets: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if not self.buckets or any(t < 0 or w <= 0 for t, w in self.buckets):
            raise ValueError(
                f"a ContextMix needs at least one (context_tokens >= 0, share > 0) bucket; "
                f"got {self.buckets}."
            )

    @classmethod
    def single(cls, context_tokens: int) -> ContextMix:
        return cls(buckets=((context_tokens, 1.0),))

    @classmethod
    def of(cls, buckets: Sequence[tuple[int, float]]) -> ContextMix:
        return cls(buckets=tuple(sorted((int(t), float(w)) for t, w in buckets)))

    @property
    def total_weight(self) -> float:
        return sum(w for _, w in self.buckets)

    @property
    def mean_tokens(self) -> float:
        return sum(t * w for t, w in self.buckets) / self.total_weight

    @property
    def max_tokens(self) -> int:
        return max(t for t, _ in self.buckets)

    def split(self, threshold_tokens: int) -> tuple[ContextMix | None, ContextMix | None]:
        """(buckets <= threshold, buckets > threshold); None for an empty side."""
        low = tuple(b for b in self.buckets if b[0] <= threshold_tokens)
        high = tuple(b for b in self.buckets if b[0] > threshold_tokens)
        return (
            ContextMix(buckets=low) if low else None,
            ContextMix(buckets=high) if high else None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class DCPCandidate:
    """One engine shape at the load it would carry."""

    shape: EngineShape
    max_sequences: int  # memory limit at the mix's mean context
    batch_size: int  # sequences decoded together: users, memory and latency target allowing
    kv_bytes_per_token: float  # per GPU
    estimate: DecodeEstimate | None  # None: the engine cannot hold one sequence

    @property
    def fits(self) -> bool:
        return self.estimate is not None

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.estimate.tokens_per_s_per_gpu if self.estimate else 0.0

    @property
    def tokens_per_s_per_user(self) -> float:
        return self.estimate.tokens_per_s_per_user if self.estimate else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DCPDecision:
    """The chosen degree, why, and every degree that was compared."""

    dcp: int
    reasons: tuple[str, ...]
    candidates: tuple[DCPCandidate, ...]

    @property
    def chosen(self) -> DCPCandidate:
        return next(c for c in self.candidates if c.shape.dcp == self.dcp)


def evaluate_shape(
    spec: ModelSpec,
    device: DeviceSpec,
    shape: EngineShape,
    contexts: ContextMix,
    concurrent_users: int,
    *,
    memory: EngineMemoryConfig = DEFAULT_MEMORY,
    calibration: DecodeCalibration | None = None,
    speculative: SpeculativeConfig | None = None,
    min_tokens_per_s_per_user: float = 0.0,
) -> DCPCandidate:
    """Decode one engine of `shape` with as many of the users as it can hold.

    With a latency target, the batch shrinks until each user gets at least
    `min_tokens_per_s_per_user` (no estimate if even one sequence is too slow)."""
    plan = memory_plan(spec, device, shape, memory)
    context = contexts.mean_tokens
    capacity = plan.max_concurrent_sequences(context)
    batch = min(concurrent_users, capacity)

    def step(b: int) -> DecodeEstimate:
        return decode_step(
            spec,
            device,
            shape,
            batch_size=b,
            context_tokens=context,
            memory=memory,
            calibration=calibration,
            speculative=speculative,
        )

    estimate = step(batch) if batch >= 1 else None
    if estimate is not None and estimate.tokens_per_s_per_user < min_tokens_per_s_per_user:
        low, high = 0, batch  # per-user speed falls as the batch grows: bisect
        while high - low > 1:
            mid = (low + high) // 2
            if step(mid).tokens_per_s_per_user >= min_tokens_per_s_per_user:
                low = mid
            else:
                high = mid
        batch = low
        estimate = step(batch) if batch >= 1 else None
    return DCPCandidate(
        shape=shape,
        max_sequences=capacity,
        batch_size=batch if estimate else 0,
        kv_bytes_per_token=plan.kv_bytes_per_token,
        estimate=estimate,
    )


def choose_dcp(
    spec: ModelSpec,
    device: DeviceSpec,
    tp: int,
    contexts: ContextMix | int,
    concurrent_users: int,
    *,
    memory: EngineMemoryConfig = DEFAULT_MEMORY,
    calibration: DecodeCalibration | None = None,
    speculative: SpeculativeConfig | None = None,
    min_tokens_per_s_per_user: float = 0.0,
) -> DCPDecision:
    """The valid DCP degree with the most tokens/s per GPU for this load.

    `concurrent_users` is how many sequences want to decode at once; a degree that
    holds more of them at the mix's mean context decodes a larger batch."""
    mix = ContextMix.single(contexts) if isinstance(contexts, int) else contexts
    candidates = tuple(
        evaluate_shape(
            spec,
            device,
            EngineShape(tp=tp, dcp=d),
            mix,
            concurrent_users,
            memory=memory,
            calibration=calibration,
            speculative=speculative,
            min_tokens_per_s_per_user=min_tokens_per_s_per_user,
        )
        for d in valid_dcp_degrees(spec, tp)
    )
    reasons = [explain_dcp_degrees(spec, tp)]
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        if any(c.max_sequences >= 1 for c in candidates):
            reasons.append(
                f"no DCP degree decodes even one sequence of {mix.mean_tokens:,.0f} tokens at "
                f"{min_tokens_per_s_per_user:,.1f} tok/s on {device.name} at tp={tp}; relax the "
                "latency target or use a faster device or a larger tp."
            )
        else:
            weights = memory_plan(spec, device, EngineShape(tp=tp), memory).weight_bytes
            reasons.append(
                f"no DCP degree holds one sequence of {mix.mean_tokens:,.0f} tokens on "
                f"{device.name} at tp={tp}: the weights take {weights / 1e9:,.1f} GB per GPU; "
                "use a larger tp, a device with more memory, or a shorter context."
            )
        return DCPDecision(dcp=1, reasons=tuple(reasons), candidates=candidates)
    best_rate = max(c.tokens_per_s_per_gpu for c in fitting)
    chosen = min(
        (c for c in fitting if c.tokens_per_s_per_gpu >= best_rate * (1 - _TIE)),
        key=lambda c: c.shape.dcp,
    )
    reasons += [_describe(c, mix, concurrent_users) for c in candidates]
    reasons.append(_conclusion(mix, concurrent_users, candidates, chosen))
    return DCPDecision(dcp=chosen.shape.dcp, reasons=tuple(reasons), candidates=candidates)


def _describe(c: DCPCandidate, mix: ContextMix, users: int) -> str:
    ctx = f"{mix.mean_tokens:,.0f}"
    if c.estimate is None:
        if c.max_sequences < 1:
            return f"dcp={c.shape.dcp}: cannot hold one sequence of {ctx} tokens."
        return f"dcp={c.shape.dcp}: too slow for the latency target even at batch 1."
    return (
        f"dcp={c.shape.dcp}: {c.kv_bytes_per_token:,.0f} B/token of KV per GPU, holds "
        f"{c.max_sequences} sequences of {ctx} tokens, decodes {c.batch_size} of {users} "
        f"users at {c.tokens_per_s_per_user:,.1f} tok/s each = {c.tokens_per_s_per_gpu:,.1f} "
        f"tok/s per GPU (step {c.estimate.step_s * 1e3:,.2f} ms, DCP collectives "
        f"{c.estimate.dcp_comm_s * 1e3:,.2f} ms)."
    )


def _conclusion(
    mix: ContextMix, users: int, candidates: Sequence[DCPCandidate], chosen: DCPCandidate
) -> str:
    base, dcp, ctx = candidates[0], chosen.shape.dcp, f"{mix.mean_tokens:,.0f}"
    if len(candidates) == 1:
        return "choose dcp=1: it is the only valid degree."
    if base.estimate is None:
        return f"choose dcp={dcp}: without DCP not one sequence of {ctx} tokens can be decoded."
    # What holds dcp=1 back: memory (fewer sequences fit than want to run), the latency
    # target (a smaller batch than fits), or nothing (every user is decoded).
    limit = (
        f"KV memory limits dcp=1 to {base.max_sequences} of {users} users"
        if base.max_sequences < users
        else f"the latency target limits dcp=1 to {base.batch_size} of {users} users"
    )
    if dcp == 1:
        if base.batch_size >= users:
            return (
                f"choose dcp=1: without DCP the engine already decodes {_all(users)}, so "
                "sharding the KV saves less than its collectives cost on every attention layer."
            )
        return f"choose dcp=1: {limit}, but what DCP adds does not pay for its collectives."
    gain = f"{chosen.tokens_per_s_per_gpu / base.tokens_per_s_per_gpu:,.2f}x"
    if base.batch_size < users:
        return (
            f"choose dcp={dcp}: {limit} at {ctx} tokens; sharding the KV decodes "
            f"{chosen.batch_size} and lifts throughput per GPU {gain}."
        )
    return (
        f"choose dcp={dcp}: dcp=1 holds {_all(users)} but every rank reads the whole "
        f"replicated KV ({base.estimate.kv_bytes_read / 1e9:,.1f} GB per step); sharding it "
        f"lifts throughput per GPU {gain}."
    )


def _all(users: int) -> str:
    return "its one user" if users == 1 else f"all {users} users"
