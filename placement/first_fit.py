"""The naive baseline kvtide's planner is measured against: first fit by node.

It walks nodes in cluster order and takes free GPUs from each until the engine has
all its shards, the way a per-node packing scheduler that knows nothing of NVLink
domains would. It may therefore span domains, which is exactly what
`PlacementPlanner` never does. Used by `benchmarks/placement.py` and by a test that
shows the difference; nothing in kvtide places engines with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from placement.errors import DuplicateEngine, UnknownEngine
from placement.plan import EngineRequest, EngineShards, ShardAssignment, Unplaceable
from placement.planner import describe_domains
from placement.topology import ClusterLedger, ClusterSnapshot, ClusterTopology, NodeClaim

__all__ = ["FirstFitPlacement", "FirstFitPlanner"]


@dataclass(frozen=True, slots=True, kw_only=True)
class FirstFitPlacement(EngineShards):
    """A first-fit placement; unlike `PlacementPlan` it may cover several domains."""

    domain_ids: tuple[str, ...]

    @property
    def spans_domains(self) -> bool:
        return len(self.domain_ids) > 1


class FirstFitPlanner:
    """First nodes with free GPUs, in cluster order; may span NVLink domains.

    With `within_domain=True` it is the naive fix: the first domain with enough
    free GPUs, then the first nodes in it. The benchmark uses it to separate what
    staying in one domain buys from what choosing the domain well buys.
    """

    def __init__(self, topology: ClusterTopology, *, within_domain: bool = False) -> None:
        self._ledger = ClusterLedger(topology)
        self._within_domain = within_domain

    @property
    def ledger(self) -> ClusterLedger:
        return self._ledger

    def snapshot(self) -> ClusterSnapshot:
        return self._ledger.snapshot()

    def place(self, request: EngineRequest) -> FirstFitPlacement | Unplaceable:
        ledger = self._ledger
        if ledger.holds(request.engine_id):
            raise DuplicateEngine(f"engine {request.engine_id!r} is already placed")
        remaining = request.tp_size
        picks: list[tuple[int, int]] = []
        for domain, free in enumerate(ledger.free_gpus_by_domain()):
            if free == 0 or (self._within_domain and free < request.tp_size):
                continue  # skip domains that cannot contribute without visiting nodes
            if self._within_domain:
                remaining, picks = request.tp_size, []  # start over in each domain
            for ordinal in ledger.domain_nodes(domain):
                count = min(remaining, ledger.max_shards(ordinal, request.num_cpus_per_shard))
                if count > 0:
                    picks.append((ordinal, count))
                    remaining -= count
                if remaining == 0:
                    break
            if remaining == 0:
                break
        if remaining > 0:
            domains = ledger.domain_states()
            where = "one domain" if self._within_domain else "the whole cluster"
            reason = (
                f"engine {request.engine_id!r} (TP{request.tp_size}) cannot be placed: "
                f"fewer than {request.tp_size} GPUs are free in {where}.\n"
                f"Free GPUs per domain:\n{describe_domains(domains)}"
            )
            return Unplaceable(
                engine_id=request.engine_id,
                tp_size=request.tp_size,
                reason=reason,
                domains=domains,
            )
        claims = [
            NodeClaim(
                node_id=ledger.node_spec(ordinal).node_id,
                num_gpus=count,
                num_cpus=count * request.num_cpus_per_shard,
            )
            for ordinal, count in picks
        ]
        grants = ledger.claim(request.engine_id, claims)
        shards: list[ShardAssignment] = []
        for grant in grants:
            for local_rank, gpu_index in enumerate(grant.gpu_indices):
                shards.append(
                    ShardAssignment(
                        rank=len(shards),
                        node_id=grant.node_id,
                        local_rank=local_rank,
                        gpu_index=gpu_index,
                        num_cpus=request.num_cpus_per_shard,
                    )
                )
        domain_ids = tuple(
            dict.fromkeys(ledger.domain_ids[ledger.domain_of_node(o)] for o, _ in picks)
        )
        return FirstFitPlacement(
            engine_id=request.engine_id,
            tp_size=request.tp_size,
            shards=tuple(shards),
            domain_ids=domain_ids,
        )

    def release(self, engine_id: str) -> None:
        if not self._ledger.holds(engine_id):
            raise UnknownEngine(f"engine {engine_id!r} is not placed; nothing to release")
        self._ledger.release(engine_id)
