"""The router's view of the KV lifecycle policy: what to do with a session's KV this turn.

``KVPlanner`` applies the pure ``policies.kv_lifecycle.KVLifecycle`` to vLLM's
``kv_transfer_params``: it turns a decision into the params the prefill sends, and a
decode engine's final params into a record. It owns the clock-to-policy translation
(the router passes ``now_s`` from one monotonic clock) and the counters the service
reports. Requests without a session id never leave records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.kv.ledger import kept_blocks_of
from orchestrator.kv.messages import TurnPlan
from policies.kv_lifecycle import Effect, KVLifecycle, KVLifecycleConfig, TurnAction

__all__ = ["Effect", "KVPlanner", "TurnPlan", "kv_lifecycle_config"]


def kv_lifecycle_config(
    *,
    ttl_s: float,
    safety_margin_s: float,
    recompute_threshold_tokens: int,
    kv_bytes_per_token: int,
    block_size_tokens: int,
    idle_budget_bytes_per_engine: int | None = None,
) -> KVLifecycleConfig:
    return KVLifecycleConfig(
        ttl_s=ttl_s,
        lease_ttl_s=ttl_s,
        safety_margin_s=safety_margin_s,
        recompute_threshold_tokens=recompute_threshold_tokens,
        kv_bytes_per_token=kv_bytes_per_token,
        block_size_tokens=block_size_tokens,
        idle_budget_bytes_per_engine=idle_budget_bytes_per_engine,
    )


class KVPlanner:
    """Wraps ``KVLifecycle`` for the router. Single-threaded (one event loop)."""

    def __init__(self, config: KVLifecycleConfig) -> None:
        self.lifecycle = KVLifecycle(config)

    def plan_turn(
        self, session_id: str | None, prompt_token_ids: Sequence[int], now_s: float
    ) -> TurnPlan:
        if session_id is None:
            return TurnPlan(kind="recompute", reason="no_session")
        decision = self.lifecycle.on_turn_start(session_id, prompt_token_ids, now_s)
        if decision.action is TurnAction.PULL_FROM_DECODE and decision.record is not None:
            return TurnPlan(
                kind="pull",
                reason="reuse",
                kv_transfer_params=dict(decision.record.transfer_params),
                num_reusable_tokens=decision.num_reusable_tokens,
            )
        return TurnPlan(kind="recompute", reason=str(decision.reason))

    def pull_failed(self, session_id: str | None, now_s: float) -> list[Effect]:
        if session_id is None:
            return []
        return self.lifecycle.on_pull_result(session_id, ok=False, now_s=now_s)

    def turn_finished(
        self,
        session_id: str | None,
        token_ids: Sequence[int],
        kv_transfer_params: Mapping[str, Any] | None,
        now_s: float,
        *,
        expiry_s: float | None = None,
    ) -> list[Effect]:
        """Record the blocks the decode engine kept (its final ``kv_transfer_params``).

        ``expiry_s``: the engine's expiry converted to this clock (None: ``now_s`` +
        TTL, a few ms late, which the safety margin covers)."""
        if session_id is None:
            return []
        kept = kept_blocks_of(kv_transfer_params)
        if kept is None:
            # The engine kept nothing to send back (send-back off, or an aborted turn).
            return self.lifecycle.on_turn_abandoned(session_id, now_s=now_s)
        engine_id, _, block_ids, num_tokens = kept
        return self.lifecycle.on_turn_finished(
            session_id,
            engine_id=engine_id,
            token_ids_covered=token_ids[:num_tokens],
            block_ids=block_ids,
            transfer_params=kv_transfer_params or {},
            expiry_s=expiry_s,
            now_s=now_s,
        )

    def abandon(self, session_id: str | None, now_s: float) -> list[Effect]:
        if session_id is None:
            return []
        return self.lifecycle.on_turn_abandoned(session_id, now_s=now_s)

    def tick(self, now_s: float) -> list[Effect]:
        """Expire and evict what is due."""
        return self.lifecycle.on_tick(now_s)

    def close(self, session_id: str, now_s: float) -> list[Effect]:
        return self.lifecycle.close(session_id, now_s)

    def stats(self) -> dict[str, Any]:
        s = self.lifecycle.stats()
        return {
            "num_sessions": self.lifecycle.num_sessions(),
            **{k: getattr(s, k) for k in s.__dataclass_fields__ if not k.startswith("_")},
        }
