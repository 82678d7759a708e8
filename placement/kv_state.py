"""Which layers of a model keep per-sequence state outside paged KV, and whether a P/D
hand-over can move it. Pure (standard library only).

A P/D system prefills on one engine and decodes on another; the KV connector moves the
prompt's paged KV blocks between them. A linear-attention layer (Kimi Linear's KDA,
Qwen3-Next's gated DeltaNet, Ling's lightning attention) or an SSM keeps a recurrent
state per sequence instead, outside the paged KV cache: a connector that moves blocks
only leaves the decode engine with an empty state for those layers, and every token it
then samples is wrong. ``pd_refusal`` refuses such a model unless the connector in use
declares it moves that kind of state.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from placement.model_spec import ModelSpec

__all__ = ["LINEAR_ATTENTION", "NonPagedState", "non_paged_state", "pd_refusal"]

LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True, slots=True, kw_only=True)
class NonPagedState:
    """Layers of one kind that keep per-sequence state outside paged KV."""

    kind: str  # what a connector declares it moves: LINEAR_ATTENTION, ...
    detail: str  # e.g. "gated_deltanet"
    layers: tuple[int, ...]
    bytes_per_sequence_per_layer: int


def non_paged_state(spec: ModelSpec) -> tuple[NonPagedState, ...]:
    """Every kind of non-paged state ``spec``'s main layers keep (empty: paged KV only)."""
    layers = tuple(i for i, linear in enumerate(spec.layer_is_linear) if linear)
    linear = spec.linear_attention
    if not layers or linear is None:
        return ()
    return (
        NonPagedState(
            kind=LINEAR_ATTENTION,
            detail=str(linear.kind),
            layers=layers,
            bytes_per_sequence_per_layer=linear.state_bytes_per_layer(),
        ),
    )


def _ranges(layers: Sequence[int]) -> str:
    """ "0-2, 4-6, 9" for (0, 1, 2, 4, 5, 6, 9)."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def pd_refusal(spec: ModelSpec, connector: str, moves: Collection[str]) -> str | None:
    """Why P/D must not serve ``spec`` through ``connector``, which declares it moves the
    non-paged state kinds in ``moves`` besides paged KV blocks; None when it may."""
    missing = [s for s in non_paged_state(spec) if s.kind not in moves]
    if not missing:
        return None
    held = "; ".join(
        f"{s.kind} ({s.detail}) in layers {_ranges(s.layers)} "
        f"({len(s.layers)} of {spec.num_hidden_layers}, "
        f"{s.bytes_per_sequence_per_layer} bytes per sequence per layer)"
        for s in missing
    )
    kinds = ", ".join(sorted({s.kind for s in missing}))
    declared = ", ".join(sorted(moves)) or "paged KV blocks only"
    return (
        f"model {spec.name!r} keeps per-sequence state outside paged KV: {held}. The KV "
        f"connector in use ({connector}) declares it moves {declared}, so a decode engine "
        f"would start those layers from an empty state and sample wrong tokens. P/D needs "
        f"a connector that declares it moves {kinds} state, or a model whose layers all "
        "keep paged KV"
    )
