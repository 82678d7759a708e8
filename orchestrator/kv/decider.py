"""The router's view of the KV lifecycle policy: what to do with a session's KV this turn.

``KVDecider`` applies the pure ``policies.kv_lifecycle.KVLifecycle`` to vLLM's
``kv_transfer_params`` (``engines.kv_params.KVTransferParams``): it turns a decision into
the kept blocks the prefill pulls, and a decode engine's final params into a record,
which carries them (opaque to the policy) until the next turn or a drain. It owns the
clock-to-policy translation (the router passes ``now_s`` from one monotonic clock) and
the counters the service reports. Requests without a session id never leave records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engines.kv_params import KVTransferParams
from orchestrator.kv.messages import KVDecision
from policies.kv_lifecycle import Effect, KVLifecycle, KVLifecycleConfig, KVRecord, TurnAction
from policies.kv_records import RecomputeReason

__all__ = ["Effect", "KVDecider", "KVDecision", "kv_decision", "kv_lifecycle_config", "params_of"]


def params_of(record: KVRecord) -> KVTransferParams:
    """The kept blocks' params a record carries (``KVDecider`` books them as given)."""
    params = record.transfer_params
    if not isinstance(params, KVTransferParams):
        raise TypeError(
            f"the record of session {record.session_id!r} carries "
            f"{type(params).__name__} transfer params; kvtide books KVTransferParams"
        )
    return params


def kv_decision(
    verdict: RecomputeReason | None,
    params: KVTransferParams | None = None,
    *,
    num_tokens: int = 0,
    source_pool: str = "decode",
) -> KVDecision:
    """The one place a turn's KV plan is built, from the verdict of
    ``policies.kv_cost`` (``decide_turn`` for the service, ``offer_refused`` under a
    turn lease; None: pull) and the kept blocks the verdict is about. So "why was this
    turn recomputed?" is answered by ``policies/kv_cost.py`` and this call."""
    if verdict is not None:
        return KVDecision(kind="recompute", reason=verdict)
    if params is None:
        raise ValueError("a pull needs the kept blocks' kv_transfer_params")
    return KVDecision(
        kind="pull",
        kv_transfer_params=params,
        num_reusable_tokens=num_tokens,
        source_pool=source_pool,
    )


def kv_lifecycle_config(
    *,
    ttl_s: float,
    safety_margin_s: float,
    recompute_threshold_tokens: int,
    kv_bytes_per_token: int,
    block_size_tokens: int,
    idle_budget_bytes_per_engine: int | None = None,
    room_kv_cache_usage: float | None = None,
    room_stall_s: float = 10.0,
) -> KVLifecycleConfig:
    return KVLifecycleConfig(
        ttl_s=ttl_s,
        lease_ttl_s=ttl_s,
        safety_margin_s=safety_margin_s,
        recompute_threshold_tokens=recompute_threshold_tokens,
        kv_bytes_per_token=kv_bytes_per_token,
        block_size_tokens=block_size_tokens,
        idle_budget_bytes_per_engine=idle_budget_bytes_per_engine,
        room_kv_cache_usage=room_kv_cache_usage,
        room_stall_s=room_stall_s,
    )


class KVDecider:
    """Wraps ``KVLifecycle`` for the router. Single-threaded (one event loop)."""

    def __init__(self, config: KVLifecycleConfig) -> None:
        self.lifecycle = KVLifecycle(config)

    def decide_turn(
        self, session_id: str | None, prompt_token_ids: Sequence[int], now_s: float
    ) -> KVDecision:
        if session_id is None:
            return kv_decision(RecomputeReason.NO_SESSION)
        decision = self.lifecycle.on_turn_start(session_id, prompt_token_ids, now_s)
        record = decision.record
        if decision.action is TurnAction.PULL_FROM_DECODE and record is not None:
            return kv_decision(
                None,
                params_of(record),
                num_tokens=decision.num_reusable_tokens,
                source_pool=record.pool_id,
            )
        return kv_decision(decision.reason or RecomputeReason.NO_RECORD)

    def pull_failed(self, session_id: str | None, now_s: float) -> list[Effect]:
        if session_id is None:
            return []
        return self.lifecycle.on_pull_result(session_id, ok=False, now_s=now_s)

    def turn_finished(
        self,
        session_id: str | None,
        token_ids: Sequence[int],
        kv_transfer_params: KVTransferParams | None,
        now_s: float,
        *,
        expiry_s: float | None = None,
        hold: bool = False,
    ) -> list[Effect]:
        """Record the blocks the decode engine kept (its final ``kv_transfer_params``).

        ``expiry_s``: the engine's expiry converted to this clock (None: ``now_s`` +
        TTL, a few ms late, which the safety margin covers). ``hold``: the session's
        next turn held at once (``KVLifecycle.on_turn_finished``)."""
        if session_id is None:
            return []
        if kv_transfer_params is None or (kept := kv_transfer_params.kept_blocks()) is None:
            # The engine kept nothing to send back (send-back off, or an aborted turn).
            return self.lifecycle.on_turn_abandoned(session_id, now_s=now_s)
        engine_id, _, block_ids, num_tokens = kept
        return self.lifecycle.on_turn_finished(
            session_id,
            engine_id=engine_id,
            token_ids_covered=token_ids[:num_tokens],
            block_ids=block_ids,
            transfer_params=kv_transfer_params,
            expiry_s=expiry_s,
            now_s=now_s,
            hold=hold,
        )

    def abandon(
        self, session_id: str | None, now_s: float, *, unread: bool = False
    ) -> list[Effect]:
        """A turn that kept nothing ended; ``unread``: it read none of the record it was
        handed (an extended turn: ``KVLifecycle.on_turn_abandoned``)."""
        if session_id is None:
            return []
        return self.lifecycle.on_turn_abandoned(session_id, now_s=now_s, unread=unread)

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
