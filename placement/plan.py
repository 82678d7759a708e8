"""What the planner is asked and what it answers: value types only.

`EngineRequest` goes in; a `PlacementPlan` (or an `Unplaceable` explaining why
not) comes out. The plan is all that reaches the code that creates Ray placement
groups. The planner itself is in `placement.planner`, which re-exports these.
"""

from __future__ import annotations

from dataclasses import dataclass

from placement.errors import InvalidEngineRequest
from placement.topology import DomainState

__all__ = [
    "MAX_TP_SIZE",
    "EngineRequest",
    "EngineShards",
    "PlacementDecision",
    "PlacementPlan",
    "ShardAssignment",
    "Unplaceable",
]

MAX_TP_SIZE = 16
"""The largest TP size kvtide places: four NVL72 trays, or beyond an HGX node."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest:
    """One engine to place: `tp_size` shards of one GPU and `num_cpus_per_shard` CPUs.

    Any TP size from 1 to 16 is accepted; whether the model's heads divide by it is
    the engine's concern, not the placement's. `role` ("prefill", "decode", ...) is
    carried into the plan and does not change where the engine goes.
    """

    engine_id: str
    tp_size: int
    role: str
    num_cpus_per_shard: float = 1.0

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise InvalidEngineRequest("an engine request needs a non-empty engine_id")
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int):
            raise InvalidEngineRequest(
                f"engine {self.engine_id!r}: tp_size must be an int, got {self.tp_size!r}"
            )
        if not 1 <= self.tp_size <= MAX_TP_SIZE:
            raise InvalidEngineRequest(
                f"engine {self.engine_id!r}: tp_size={self.tp_size} is outside "
                f"1..{MAX_TP_SIZE}; use 1, 2, 4, 8 or 16"
            )
        if not self.role:
            raise InvalidEngineRequest(f"engine {self.engine_id!r} needs a role")
        if self.num_cpus_per_shard < 0:
            raise InvalidEngineRequest(
                f"engine {self.engine_id!r}: num_cpus_per_shard="
                f"{self.num_cpus_per_shard} is negative; use 0 or more"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardAssignment:
    """Where TP rank `rank` runs.

    `local_rank` counts the engine's shards on that node from 0. `gpu_index` is the
    GPU the ledger reserved on the node; under Ray, Ray picks the physical device
    for a bundle, so treat it as the ledger's bookkeeping, not CUDA_VISIBLE_DEVICES.
    """

    rank: int
    node_id: str
    local_rank: int
    gpu_index: int
    num_cpus: float


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineShards:
    """One engine's shards, wherever a planner put them (`PlacementPlan`, or the
    baseline's `FirstFitPlacement`), in rank order."""

    engine_id: str
    tp_size: int
    shards: tuple[ShardAssignment, ...]

    @property
    def node_ids(self) -> tuple[str, ...]:
        """The engine's nodes, the one holding rank 0 first."""
        return tuple(dict.fromkeys(shard.node_id for shard in self.shards))

    @property
    def num_nodes(self) -> int:
        return len(self.node_ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementPlan(EngineShards):
    """Everything the code that calls Ray needs to know about one engine's placement.

    Contract: all shards are in `domain_id`; `shards` are ordered by rank, ranks on
    one node are contiguous (node by node, then local rank) and the node holding
    rank 0 comes first. `bundles` follows the same order.
    """

    role: str
    domain_id: str

    def __post_init__(self) -> None:
        if len(self.shards) != self.tp_size:
            raise ValueError(f"{len(self.shards)} shards for TP{self.tp_size}")
        seen: list[str] = []
        for rank, shard in enumerate(self.shards):
            if shard.rank != rank:
                raise ValueError(f"shard {rank} carries rank {shard.rank}")
            if not seen or seen[-1] != shard.node_id:
                if shard.node_id in seen:
                    raise ValueError(f"ranks on node {shard.node_id!r} are not contiguous")
                seen.append(shard.node_id)

    def shards_on(self, node_id: str) -> tuple[ShardAssignment, ...]:
        return tuple(shard for shard in self.shards if shard.node_id == node_id)

    @property
    def bundles(self) -> tuple[dict[str, float], ...]:
        """One resource bundle per shard, in rank order."""
        return tuple({"GPU": 1.0, "CPU": shard.num_cpus} for shard in self.shards)


@dataclass(frozen=True, slots=True, kw_only=True)
class Unplaceable:
    """The answer when no domain can host an engine now; `reason` says why."""

    engine_id: str
    tp_size: int
    reason: str
    domains: tuple[DomainState, ...]

    def __str__(self) -> str:
        return self.reason


PlacementDecision = PlacementPlan | Unplaceable
