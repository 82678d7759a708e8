"""Value types of the KV lifecycle policy: config, records, decisions, effects, stats.

Everything here is frozen and pure. `KVLifecycle` (in `policies.kv_lifecycle`) is the
only thing that holds state; it hands these values across its boundary:

- in:  `KVLifecycleConfig` once, `KVRecord`s on restart;
- out: a `TurnDecision` per turn, a list of `Effect`s (`Expire`, `Evict`, `Release`)
  from every call that can drop a record, and a `KVStats` snapshot.

All times are seconds on the caller's clock (the clock `now_s` comes from); all sizes
are bytes; token counts are ``num_*``.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from policies.errors import InvalidPolicyConfig

__all__ = [
    "HOST_POOL",
    "Effect",
    "Evict",
    "EvictReason",
    "Expire",
    "KVLifecycleConfig",
    "KVRecord",
    "KVStats",
    "RecomputeReason",
    "Release",
    "ReleaseReason",
    "TurnAction",
    "TurnDecision",
    "prefix_hash",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLifecycleConfig:
    """How long KV is offered, when it is worth pulling, and how much idle KV an engine may hold.

    Defaults follow vLLM's NIXL connector options (``kv_connector_extra_config``) and a
    DeepSeek-V3-class MLA model; set the model and link fields from the deployment.
    """

    ttl_s: float = 480.0
    """How long a decode engine pins finished blocks: vLLM's ``decoder_kv_blocks_ttl``.
    Used as the expiry when a turn report carries none."""

    lease_ttl_s: float = 480.0
    """How long kvtide keeps an idle session (and its record) after its last use or SDK
    heartbeat. A lease never extends an engine's expiry: blocks are offered only until
    ``expiry_s - safety_margin_s`` whatever the lease says."""

    safety_margin_s: float = 15.0
    """Stop offering blocks this long before their engine expiry. Must exceed
    ``prefill_decline_window_s``: a read offered inside that window fails the request
    (``kv_load_failure_policy="fail"``) or hangs (``"recompute"``)."""

    prefill_decline_window_s: float = 5.0
    """The prefill engine declines reads this close to expiry (5 s in vLLM 0.32)."""

    recompute_threshold_tokens: int = 64
    """Fewer reusable tokens than this: recompute. Keep it at least vLLM's
    ``kv_recompute_threshold``, or kvtide would book a pull that vLLM silently turns
    into a recompute while the decode engine keeps its blocks pinned."""

    idle_budget_bytes_per_engine: int | None = None
    """Most bytes that idle sessions may keep booked on one engine; ``None``: no bound.
    Derive it from the engine's KV capacity at the config edge."""

    room_kv_cache_usage: float | None = None
    """An engine whose KV cache use reaches this share with nothing running or with
    requests waiting, or with requests waiting and none running for ``room_stall_s``, is
    short of room (``policies.admission.short_of_kv``): idle sessions' records on it are
    evicted, one at a time, nearest expiry first (``KVLifecycle.make_room``). ``None``:
    never."""

    room_stall_s: float = 10.0
    """See ``room_kv_cache_usage`` (admission's ``stall_s``)."""

    room_wait_s: float = 3.0
    """After an eviction for room, how long before the next on the same engine (its
    blocks are freed by a drain and reported with its next load)."""

    prefill_tokens_per_s: float = 10_000.0
    """Prefill throughput used to price a recompute."""

    link_bandwidth_gbps: float = 400.0
    """Decode-to-prefill link bandwidth in gigabits per second used to price a pull."""

    transfer_setup_s: float = 0.005
    """Fixed cost of one pull: descriptor exchange, notification, scheduling."""

    kv_bytes_per_token: int = 70_272
    """KV bytes per token over all attention layers (DeepSeek-V3 MLA in bf16:
    61 layers x 576 values x 2 bytes)."""

    block_size_tokens: int = 16
    """Tokens per KV block; blocks are pinned whole."""

    linear_state_bytes_per_sequence: int = 0
    """Hybrid models: bytes of linear-attention (SSM) state kept per sequence; 0 for
    pure attention models."""

    def __post_init__(self) -> None:
        budget = self.idle_budget_bytes_per_engine
        checks: tuple[tuple[bool, str, str], ...] = (
            (self.ttl_s > 0, "ttl_s", "a positive number of seconds"),
            (self.lease_ttl_s > 0, "lease_ttl_s", "a positive number of seconds"),
            (self.prefill_decline_window_s >= 0, "prefill_decline_window_s", "zero or more"),
            (
                self.prefill_decline_window_s < self.safety_margin_s < self.ttl_s,
                "safety_margin_s",
                f"more than prefill_decline_window_s ({self.prefill_decline_window_s}) "
                f"and less than ttl_s ({self.ttl_s})",
            ),
            (self.recompute_threshold_tokens >= 0, "recompute_threshold_tokens", "zero or more"),
            (
                budget is None or budget >= 0,
                "idle_budget_bytes_per_engine",
                "None (no bound) or zero or more bytes",
            ),
            (self.prefill_tokens_per_s > 0, "prefill_tokens_per_s", "a positive rate"),
            (self.link_bandwidth_gbps > 0, "link_bandwidth_gbps", "a positive bandwidth"),
            (self.transfer_setup_s >= 0, "transfer_setup_s", "zero or more seconds"),
            (self.kv_bytes_per_token > 0, "kv_bytes_per_token", "a positive number of bytes"),
            (self.block_size_tokens >= 1, "block_size_tokens", "at least 1"),
            (
                self.linear_state_bytes_per_sequence >= 0,
                "linear_state_bytes_per_sequence",
                "zero or more bytes (0 for pure attention models)",
            ),
        )
        for ok, name, expected in checks:
            if not ok:
                raise InvalidPolicyConfig(
                    f"KVLifecycleConfig.{name}={getattr(self, name)!r} is invalid: use {expected}"
                )


HOST_POOL = "host"
"""The ``pool_id`` of records in a host-memory tier: a store that engines read like a
peer engine, bounded by its own capacity, not by ``idle_budget_bytes_per_engine``."""

_HASH_PERSON = b"kvtide.prefix.v1"  # blake2b personalisation: at most 16 bytes


def prefix_hash(token_ids: Sequence[int], num_tokens: int | None = None) -> str:
    """Stable hash of the first ``num_tokens`` token ids (all of them by default).

    blake2b over the ids as little-endian int64, so it is the same in every process
    and on every machine (Python's ``hash()`` is salted per process). 128 bits.
    """
    n = len(token_ids) if num_tokens is None else num_tokens
    if not 0 <= n <= len(token_ids):
        raise ValueError(
            f"num_tokens={n} is outside 0..{len(token_ids)} (the number of token ids given)"
        )
    ids = token_ids if n == len(token_ids) else token_ids[:n]
    digest = hashlib.blake2b(struct.pack(f"<{n}q", *ids), digest_size=16, person=_HASH_PERSON)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class KVRecord:
    """Where one session's finished KV lives, and how to pull it back.

    Contract: the engine ``engine_id`` pins ``block_ids`` holding the KV of exactly the
    first ``num_tokens`` tokens of the conversation, whose hash is ``prefix_hash``,
    until ``expiry_s`` (converted by the caller to the clock ``now_s`` uses).
    ``transfer_params`` is the engine's ``kv_transfer_params`` as returned with the
    turn's final output: an opaque, read-only payload the policy never inspects and
    hands back verbatim for the next prefill to pull the blocks (the orchestrator's is
    a frozen ``engines.kv_params.KVTransferParams``; a mapping is kept as a read-only
    copy). It takes no part in equality or hashing. ``pool_id`` names the engine's pool
    for the router; ``bytes_held`` is what the record books on its engine (KV blocks
    plus, for hybrid models, one sequence's linear-attention state).
    """

    session_id: str
    engine_id: str
    pool_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    prefix_hash: str
    expiry_s: float
    last_used_s: float
    bytes_held: int
    transfer_params: object = field(default_factory=lambda: MappingProxyType({}), compare=False)

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(
                f"KVRecord.num_tokens={self.num_tokens}: a record covers at least one token"
            )
        if self.bytes_held < 0:
            raise ValueError(f"KVRecord.bytes_held={self.bytes_held}: use zero or more bytes")
        if isinstance(self.transfer_params, Mapping):
            # A read-only copy: the caller's dict may change after the report.
            params = MappingProxyType(dict(self.transfer_params))
            object.__setattr__(self, "transfer_params", params)

    def offer_deadline_s(self, safety_margin_s: float) -> float:
        """Last moment this record may be offered for a pull."""
        return self.expiry_s - safety_margin_s


class TurnAction(enum.StrEnum):
    """What the next prefill of a session does with its recorded KV."""

    PULL_FROM_DECODE = "pull_from_decode"
    """Send the record's transfer params with the prefill: it pulls the blocks back."""
    RECOMPUTE = "recompute"
    """Plain prefill without transfer params."""


class RecomputeReason(enum.StrEnum):
    """Why a turn recomputes instead of pulling."""

    NO_SESSION = "no_session"  # a request without a session: nothing is kept for it
    NO_RECORD = "no_record"  # first turn, or the session's KV was never kept
    PULL_IN_FLIGHT = "pull_in_flight"  # a concurrent turn of the session is reading it
    EXPIRED = "expired"  # past its engine expiry, or dropped at expiry - margin
    WITHIN_MARGIN = "within_margin"  # inside the safety margin of its engine expiry
    PREFIX_MISMATCH = "prefix_mismatch"  # the prompt does not extend the recorded tokens
    BELOW_THRESHOLD = "below_threshold"  # fewer reusable tokens than the threshold
    CHEAPER_TO_RECOMPUTE = "cheaper_to_recompute"  # the cost model says so
    EVICTED = "evicted"  # dropped under the idle budget or with its engine
    SCALED_IN = "scaled_in"  # its engine was scaled in and the host tier did not take it
    # Its engine was stopped by a redeploy (replaced) or removed (a deleted deployment,
    # fewer engines) and the host tier did not take it.
    REPLACED = "replaced"
    FAILED_PULL = "failed_pull"  # the last pull of this record failed or hung
    # An integrity check found a pull from the record's engine gave wrong KV: reuse from
    # it is off until an operator turns it back on (``KVLifecycle.set_reuse_off``).
    INTEGRITY_CHECK_FAILED = "integrity_check_failed"


class ReleaseReason(enum.StrEnum):
    """Why kvtide stopped booking a record that was not expired or evicted."""

    SUPERSEDED = "superseded"  # a newer turn kept newer KV
    CLOSED = "closed"  # the client closed the session
    LEASE_EXPIRED = "lease_expired"  # no use and no heartbeat for lease_ttl_s
    FAILED_PULL = "failed_pull"  # a pull of it failed: never offer it again


class EvictReason(enum.StrEnum):
    """Why kvtide dropped a live record on its own."""

    BUDGET = "budget"  # idle bytes on its engine exceeded the budget
    PRESSURE = "pressure"  # its engine's KV cache was full with nothing running or turns waiting
    ENGINE_LOST = "engine_lost"  # its engine died or restarted: the blocks are gone
    SCALED_IN = "scaled_in"  # its engine is being stopped by a scale-in
    REPLACED = "replaced"  # its engine is being stopped by a redeploy or a removal


@dataclass(frozen=True, slots=True, kw_only=True)
class _RecordEffect:
    """What every `Effect` carries: the ``record`` it decides about, and its keys."""

    record: KVRecord

    @property
    def session_id(self) -> str:
        return self.record.session_id

    @property
    def engine_id(self) -> str:
        return self.record.engine_id


@dataclass(frozen=True, slots=True, kw_only=True)
class Expire(_RecordEffect):
    """kvtide stopped offering ``record``: its engine expiry is within the safety margin.

    Apply: nothing to free; the engine frees the blocks itself at ``record.expiry_s``.
    ``unread``: the record reached its offer deadline kept and unpulled (not a pull
    that hung), its session idle and leased past the blocks' expiry (an SDK heartbeat),
    so the blocks are intact until then and a host-memory tier may still copy them for
    the session (``KVLifecycle.demote``).
    """

    unread: bool = False

    @property
    def drainable(self) -> bool:
        """Whether a read could still free the blocks early: never this close to expiry."""
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class Evict(_RecordEffect):
    """kvtide dropped a live ``record`` from its books and will never offer it again.

    Apply: stop offering it. In vLLM 0.32 the decode engine keeps the blocks pinned
    until ``record.expiry_s`` unless a consumer reads them; when ``drainable`` the
    orchestrator may free them early with a read whose result it discards.
    """

    reason: EvictReason

    @property
    def drainable(self) -> bool:
        return self.reason in (EvictReason.BUDGET, EvictReason.PRESSURE)


@dataclass(frozen=True, slots=True, kw_only=True)
class Release(_RecordEffect):
    """kvtide no longer needs ``record`` (superseded, closed, lease over, or failed).

    Apply as `Evict`: the engine keeps the blocks until ``record.expiry_s`` unless
    drained; a failed record is not drainable (reads of it fail).
    """

    reason: ReleaseReason

    @property
    def drainable(self) -> bool:
        return self.reason is not ReleaseReason.FAILED_PULL


Effect = Expire | Evict | Release
"""A decision about a record that the orchestrator applies; see each class for how."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnDecision:
    """What the next prefill of ``session_id`` does.

    PULL_FROM_DECODE carries the ``record`` whose ``transfer_params`` go with the
    prefill, and ``reason`` is None. RECOMPUTE carries a ``reason`` and no record.
    The estimates price the ``num_reusable_tokens`` the record covers (0 when there
    is no usable record): recomputing them against pulling them.
    """

    session_id: str
    action: TurnAction
    reason: RecomputeReason | None = None
    record: KVRecord | None = None
    num_reusable_tokens: int = 0
    estimated_recompute_s: float = 0.0
    estimated_transfer_s: float = 0.0

    def __post_init__(self) -> None:
        pulling = self.action is TurnAction.PULL_FROM_DECODE
        if pulling != (self.record is not None) or pulling == (self.reason is not None):
            raise ValueError(
                f"TurnDecision {self.action}: a pull carries a record and no reason, "
                f"a recompute a reason and no record (got record={self.record is not None}, "
                f"reason={self.reason})"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class KVStats:
    """Counters since the policy was created (or rebuilt), and current sizes."""

    num_sessions: int
    num_records: int
    num_pulls: int
    """Turns told to pull."""
    num_declines: int
    """Pulls reported failed, declined or hung (``on_pull_result(ok=False)`` or a turn
    abandoned with its pull unresolved)."""
    num_expiries: int
    num_evictions: int
    num_releases: int
    recomputes_by_reason: tuple[tuple[RecomputeReason, int], ...]
    """Every reason with its count, in `RecomputeReason` order."""
    num_demotions: int = 0
    """Evicted records booked again from a copy in a host-memory tier (``demote``)."""

    @property
    def num_recomputes(self) -> int:
        return sum(count for _, count in self.recomputes_by_reason)

    def num_recomputes_for(self, reason: RecomputeReason) -> int:
        return dict(self.recomputes_by_reason)[reason]
