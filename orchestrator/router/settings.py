"""The router's settings: one frozen value ``Router`` takes beside its collaborators.

The ingress builds it once from its config, the tokenizer and the engines' KV shape
(``orchestrator.serve.ingress``); the router hands each part the fields it uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.router.integrity import IntegritySettings
from policies.kv_cost import ExtendSettings

__all__ = ["RouterSettings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterSettings:
    """How a turn is bounded and measured.

    ``pull_timeout_s``: a pull of the session's KV back to a prefill engine (past it,
    a plain prefill); ``request_timeout_s``: the whole turn; ``max_migrations``: a turn
    moved off failed engines at most this often; ``eos_token_id``: the end-of-turn
    token a decode that stopped on it drops from the session's tokens (the chat template
    writes it itself); ``long_context_threshold_tokens``: prompts longer than this go to
    the long-context decode pool (given with that pool, None without);
    ``block_size_tokens`` and ``kv_bytes_per_token``: the engines' KV shape, for the
    bytes a transfer offers; ``integrity``: the sample of pulled turns computed again
    (the default samples none); ``extend``: when a turn offered a pull runs on the
    decode engine that kept its history instead (``orchestrator.router.extend_plan``;
    it needs the engines' loads, which ``Router`` is given as ``engine_loads``);
    ``decode_max_running``: a decode engine's ``max_num_seqs``; ``decode_chunk_tokens``:
    the most prompt tokens of one request it computes in a step (None: all at once)."""

    pull_timeout_s: float
    request_timeout_s: float = 600.0
    max_migrations: int = 2
    eos_token_id: int | None = None
    long_context_threshold_tokens: int | None = None
    block_size_tokens: int = 16
    kv_bytes_per_token: int = 0
    integrity: IntegritySettings = field(
        default_factory=lambda: IntegritySettings(sample_fraction=0)
    )
    extend: ExtendSettings = field(default_factory=ExtendSettings)
    decode_max_running: int | None = None
    decode_chunk_tokens: int | None = None
