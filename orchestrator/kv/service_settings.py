"""The KV service's settings, apart from the lifecycle's own (``KVLifecycleConfig``).

One frozen value that ``KVService`` takes beside its collaborators (the prefill pool,
the durable store, the host tier, the clocks); the service actor builds it from the
arguments the ingress draws from its config (``orchestrator.kv.actor``).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.kv.turn_leases import HANDOVER_WAIT_S

__all__ = ["ServiceSettings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceSettings:
    """How the service bounds its books and waits.

    ``drain_timeout_s``: a read-back of blocks nobody reuses; ``num_prefill_engines``
    and ``restore_wait_s``: a restarted service waits that long for that many engines'
    ledgers; ``max_sessions``, ``replay_max_bytes`` and ``session_state_max_bytes``
    bound its memory; ``engine_silence_s``: an engine (or an ingress replica's metric
    book) silent this long is lost; ``running_grace_s``: a running turn's claim older
    than this is stale (its ingress is gone); ``handover_wait_s``: a session's next
    ``begin_turn`` waits this long for the running one's ``turn_done``;
    ``turn_lease_s``: how long a turn lease lasts (0: none); ``kept_check_margin_s``:
    the margin of the check of decode blocks no hand-over booked."""

    drain_timeout_s: float
    num_prefill_engines: int = 1
    restore_wait_s: float = 10.0
    max_sessions: int = 50_000
    engine_silence_s: float = 60.0
    replay_max_bytes: int = 64 * 2**20
    session_state_max_bytes: int | None = None
    running_grace_s: float = 600.0
    handover_wait_s: float = HANDOVER_WAIT_S
    turn_lease_s: float = 0.0
    kept_check_margin_s: float = 30.0
