"""The live Ray cluster as the planner sees it, and the placer that keeps engines in it.

`live_topology` reads Ray's node table into the planner's `ClusterTopology`: alive
nodes with GPUs, each in the domain its `nvlink_domain` label names (or its own,
named by its node id), sorted by domain then node id so that decisions are
deterministic for a given cluster. CPUs and GPUs are the nodes' totals: kvtide
assumes the GPUs are its own to place.

`DomainPlacer` is the one place that decides and acts. It keeps a ledger of what
it placed, asks `choose_placement` for a plan, turns the plan into a placement
group pinned to the planned nodes (`placement_groups.create_group`, a bounded
wait) and records both. When nodes are lost (`on_node_lost`, or `refresh`, which
diffs Ray's alive nodes against the topology; the caller decides when to call it)
it removes the groups of the engines that used them and re-places each engine in
a domain that fits, or reports it unplaceable. Each `Replacement` tells the
serving path which engine to stop routing to and what replaced it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from orchestrator.cluster.errors import PlacementGroupError, PlacementTimeout
from orchestrator.cluster.placement_groups import (
    Pin,
    PlacedEngine,
    create_group,
    group_spec,
    remove_group,
)
from orchestrator.cluster.ray_nodes import NVLINK_DOMAIN_LABEL, RayNode, read_ray_nodes
from placement.errors import InsufficientCapacity, InvalidTopology, UnknownEngine
from placement.planner import (
    EngineRequest,
    PickMemo,
    PlacementDecision,
    PlacementPlan,
    Unplaceable,
    choose_placement,
    describe_domains,
)
from placement.topology import ClusterLedger, ClusterSnapshot, ClusterTopology, NodeClaim, NodeSpec

__all__ = [
    "DEFAULT_PLACEMENT_TIMEOUT_S",
    "DomainPlacer",
    "Replacement",
    "live_topology",
    "topology_from_nodes",
]

DEFAULT_PLACEMENT_TIMEOUT_S = 30.0
"""How long `DomainPlacer` waits for Ray to place a group it planned."""


def topology_from_nodes(nodes: Iterable[RayNode]) -> ClusterTopology:
    """The planner's view of Ray's alive GPU nodes (pure)."""
    gpu_nodes = sorted(
        (n for n in nodes if n.alive and n.num_gpus > 0), key=lambda n: (n.domain_id, n.node_id)
    )
    if not gpu_nodes:
        raise InvalidTopology(
            "Ray reports no alive node with GPUs; start nodes with GPUs (ray start "
            "--num-gpus=N, fake GPUs are fine for tests) and the label "
            f"{NVLINK_DOMAIN_LABEL}=<domain id>"
        )
    return ClusterTopology(
        nodes=tuple(
            NodeSpec(
                node_id=n.node_id, domain_id=n.domain_id, num_gpus=n.num_gpus, num_cpus=n.num_cpus
            )
            for n in gpu_nodes
        )
    )


def live_topology(*, domain_label: str = NVLINK_DOMAIN_LABEL) -> ClusterTopology:
    """Ray's alive GPU nodes now, as a `ClusterTopology` (needs `ray.init`)."""
    return topology_from_nodes(read_ray_nodes(domain_label=domain_label))


@dataclass(frozen=True, slots=True, kw_only=True)
class Replacement:
    """What became of an engine that lost a node.

    `old` is the placement whose group was removed (stop routing to it); `new` is
    the engine re-placed in a domain that fits, or the `Unplaceable` saying why
    none does. `lost_node_ids` are the lost nodes the old placement used.
    """

    old: PlacedEngine
    new: PlacedEngine | Unplaceable
    lost_node_ids: tuple[str, ...]

    @property
    def engine_id(self) -> str:
        return self.old.engine_id

    @property
    def replaced(self) -> bool:
        return isinstance(self.new, PlacedEngine)


class DomainPlacer:
    """Places engines as Ray placement groups, one NVLink domain each.

    Queries (`topology`, `engines`, `snapshot`, `plan`, `engines_on`) change
    nothing. `place_engine`, `release`, `on_node_lost` and `refresh` change the
    ledger and create or remove placement groups. Not thread-safe: call it from
    one thread (an actor's event loop).

    `host_num_cpus > 0` adds a CPU-only bundle for the engine host actor on rank
    0's node; the ledger counts those CPUs too.
    """

    def __init__(
        self,
        topology: ClusterTopology,
        *,
        host_num_cpus: float = 0.0,
        domain_label: str = NVLINK_DOMAIN_LABEL,
    ) -> None:
        self._topology = topology
        self._ledger = ClusterLedger(topology)
        self._memo: PickMemo = {}
        self._host_num_cpus = host_num_cpus
        self._domain_label = domain_label
        self._engines: dict[str, PlacedEngine] = {}
        self._requests: dict[str, EngineRequest] = {}

    @classmethod
    def from_ray(
        cls, *, host_num_cpus: float = 0.0, domain_label: str = NVLINK_DOMAIN_LABEL
    ) -> DomainPlacer:
        """A placer over the live cluster (needs `ray.init`)."""
        return cls(
            live_topology(domain_label=domain_label),
            host_num_cpus=host_num_cpus,
            domain_label=domain_label,
        )

    # -- queries (side-effect free) -------------------------------------------------

    @property
    def topology(self) -> ClusterTopology:
        return self._topology

    @property
    def engines(self) -> Mapping[str, PlacedEngine]:
        """Placed engines by id, in placement order (a copy)."""
        return dict(self._engines)

    def snapshot(self) -> ClusterSnapshot:
        return self._ledger.snapshot()

    def plan(self, request: EngineRequest) -> PlacementDecision:
        """Where `request` would go now; places nothing."""
        return choose_placement(self._ledger, request, memo=self._memo)

    def engines_on(self, node_id: str) -> tuple[str, ...]:
        return tuple(e.engine_id for e in self._engines.values() if e.uses_node(node_id))

    # -- actions ----------------------------------------------------------------------

    def place_engine(
        self, request: EngineRequest, *, timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S
    ) -> PlacedEngine | Unplaceable:
        """Plan `request`, create its group and wait at most `timeout_s` for Ray.

        Returns the planner's `Unplaceable` (no group is made) when no domain fits.
        Raises `PlacementTimeout` or `PlacementMismatch` when Ray does not place
        what the plan said it could; the ledger is then as before.
        """
        decision = choose_placement(self._ledger, request, memo=self._memo)
        if isinstance(decision, Unplaceable):
            return decision
        plan = decision
        try:
            self._ledger.claim(plan.engine_id, self._claims(plan))
        except InsufficientCapacity:
            return self._host_short(plan)
        spec = group_spec(
            plan, pin=Pin.NODES, host_num_cpus=self._host_num_cpus, domain_label=self._domain_label
        )
        try:
            placed = create_group(spec, plan, timeout_s=timeout_s)
        except PlacementGroupError:
            self._ledger.release(plan.engine_id)
            raise
        self._engines[plan.engine_id] = placed
        self._requests[plan.engine_id] = request
        return placed

    def release(self, engine_id: str) -> PlacementPlan:
        """Remove the engine's group (Ray stops its actors) and free its GPUs."""
        if engine_id not in self._engines:
            raise UnknownEngine(f"engine {engine_id!r} is not placed here; nothing to release")
        placed = self._engines.pop(engine_id)
        del self._requests[engine_id]
        remove_group(placed)
        self._ledger.release(engine_id)
        return placed.plan

    def on_node_lost(
        self, node_ids: Iterable[str], *, timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S
    ) -> tuple[Replacement, ...]:
        """Forget lost nodes; re-place every engine that used one of them.

        The engines' old groups are removed; each is re-placed (largest TP first)
        in a domain that fits, or reported unplaceable. Results follow placement
        order. Unknown node ids are ignored.
        """
        lost = set(node_ids) & {n.node_id for n in self._topology.nodes}
        if not lost:
            return ()
        remaining = tuple(n for n in self._topology.nodes if n.node_id not in lost)
        return self._change_topology(remaining, lost, timeout_s)

    def refresh(self, *, timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S) -> tuple[Replacement, ...]:
        """Bring the topology in line with Ray's alive GPU nodes now.

        Lost nodes are handled as by `on_node_lost`; new nodes become available to
        later placements (and to the engines being re-placed).
        """
        alive = [n for n in read_ray_nodes(domain_label=self._domain_label) if n.num_gpus > 0]
        known = {n.node_id for n in self._topology.nodes}
        current = {n.node_id for n in alive}
        if current == known:
            return ()
        nodes = topology_from_nodes(alive).nodes if alive else ()
        return self._change_topology(nodes, known - current, timeout_s)

    # -- internals --------------------------------------------------------------------

    def _change_topology(
        self, nodes: Sequence[NodeSpec], lost: set[str], timeout_s: float
    ) -> tuple[Replacement, ...]:
        affected = [e for e in self._engines.values() if any(e.uses_node(n) for n in lost)]
        requests = {}
        for placed in affected:
            requests[placed.engine_id] = self._requests[placed.engine_id]
            self.release(placed.engine_id)
        if not nodes:
            reason = "no node with GPUs is left in the cluster; add nodes and refresh"
            return tuple(
                Replacement(
                    old=p,
                    new=Unplaceable(
                        engine_id=p.engine_id, tp_size=p.plan.tp_size, reason=reason, domains=()
                    ),
                    lost_node_ids=tuple(sorted(n for n in lost if p.uses_node(n))),
                )
                for p in affected
            )
        self._rebuild(ClusterTopology(nodes=tuple(nodes)))
        new: dict[str, PlacedEngine | Unplaceable] = {}
        for placed in sorted(affected, key=lambda p: -p.plan.tp_size):
            request = requests[placed.engine_id]
            try:
                new[placed.engine_id] = self.place_engine(request, timeout_s=timeout_s)
            except PlacementGroupError as err:
                # Ray did not place what the ledger allowed: report it like the planner would.
                new[placed.engine_id] = Unplaceable(
                    engine_id=request.engine_id,
                    tp_size=request.tp_size,
                    reason=str(err),
                    domains=(
                        err.domains
                        if isinstance(err, PlacementTimeout)
                        else self._ledger.domain_states()
                    ),
                )
        return tuple(
            Replacement(
                old=p,
                new=new[p.engine_id],
                lost_node_ids=tuple(sorted(n for n in lost if p.uses_node(n))),
            )
            for p in affected
        )

    def _rebuild(self, topology: ClusterTopology) -> None:
        """A fresh ledger over `topology`, holding every engine still placed."""
        ledger = ClusterLedger(topology)
        for engine_id, placed in self._engines.items():
            ledger.claim(engine_id, self._claims(placed.plan))
        self._topology, self._ledger, self._memo = topology, ledger, {}

    def _claims(self, plan: PlacementPlan) -> list[NodeClaim]:
        claims = []
        for index, node_id in enumerate(plan.node_ids):
            shards = plan.shards_on(node_id)
            host = self._host_num_cpus if index == 0 else 0.0
            claims.append(
                NodeClaim(
                    node_id=node_id,
                    num_gpus=len(shards),
                    num_cpus=sum(s.num_cpus for s in shards) + host,
                )
            )
        return claims

    def _host_short(self, plan: PlacementPlan) -> Unplaceable:
        domains = self._ledger.domain_states()
        reason = (
            f"engine {plan.engine_id!r} (TP{plan.tp_size}, {plan.role}) cannot be placed: "
            f"node {plan.node_ids[0]} of {plan.domain_id!r} has the GPUs but not "
            f"{self._host_num_cpus:g} more CPUs for the engine host; lower "
            f"host_num_cpus or release engines there.\nFree GPUs per domain:\n"
            f"{describe_domains(domains)}"
        )
        return Unplaceable(
            engine_id=plan.engine_id, tp_size=plan.tp_size, reason=reason, domains=domains
        )
