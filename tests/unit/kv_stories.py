"""The round-number KV lifecycle config that the policy's stories are told in.

1 ms to prefill a token, 1 GB/s link (8 Gb/s), 100 ms to set a pull up, 1,000 KV bytes
per token in 16-token blocks. So a record of N tokens holds ceil(N / 16) * 16,000 bytes,
and with the default TTL (480 s) and margin (15 s) a record kept at t=0 is offered until
t=465.
"""

from __future__ import annotations

from policies.kv_lifecycle import (
    KVLifecycleConfig,
    RecomputeReason,
    TurnAction,
    TurnDecision,
)

CONFIG = KVLifecycleConfig(
    prefill_tokens_per_s=1_000.0,
    link_bandwidth_gbps=8.0,
    transfer_setup_s=0.1,
    kv_bytes_per_token=1_000,
    block_size_tokens=16,
)
BYTES_1100 = 69 * 16 * 1_000  # 1,100 tokens fill 69 blocks


def tokens(num_tokens: int, first: int = 1) -> list[int]:
    """A run of distinct token ids: tokens(3) == [1, 2, 3]."""
    return list(range(first, first + num_tokens))


def recompute(session_id: str, reason: RecomputeReason) -> TurnDecision:
    """The decision of a turn that recomputes for ``reason``."""
    return TurnDecision(session_id=session_id, action=TurnAction.RECOMPUTE, reason=reason)
