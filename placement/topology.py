"""Cluster topology: NVLink domains, nodes, GPUs, and who holds which of them.

`NodeSpec` and `ClusterTopology` describe the hardware and never change. The
`ClusterLedger` is the one mutable object: it records which GPUs and CPUs each
engine holds and keeps the indexes that make placement decisions cheap (free GPUs
per domain, nodes bucketed by their number of free GPUs). Planners read it through
side-effect-free queries and change it only through `claim` / `release`.
`ClusterSnapshot` is a frozen copy of the ledger for explanations, metrics and
tests.

Invariants: a node belongs to exactly one domain; an engine never holds GPUs in
two domains when placed by `PlacementPlanner` (the ledger itself does not enforce
it, so that the first-fit baseline can show what goes wrong).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass

from placement.errors import (
    DuplicateEngine,
    InsufficientCapacity,
    InvalidTopology,
    UnknownEngine,
)

__all__ = [
    "NVLINK_DOMAIN_LABEL",
    "ClusterLedger",
    "ClusterSnapshot",
    "ClusterTopology",
    "DomainState",
    "Grant",
    "NodeClaim",
    "NodeSpec",
    "NodeState",
]

# CPUs are counted in thousandths internally so that repeated claims and releases
# of fractional CPUs never drift.
_MILLI = 1000


NVLINK_DOMAIN_LABEL = "nvlink_domain"
"""The Ray node label that names a node's NVLink domain."""


def _to_milli(num_cpus: float) -> int:
    return round(num_cpus * _MILLI)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSpec:
    """One host: its GPUs all sit in the NVLink domain `domain_id`.

    On a GB200/GB300 NVL72 rack a node is a compute tray (4 GPUs) and the domain is
    the rack; on an HGX node (8 GPUs) the domain is the node itself. `labels` are
    extra node labels, kept sorted by key.
    """

    node_id: str
    domain_id: str
    num_gpus: int
    num_cpus: float
    labels: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.node_id:
            raise InvalidTopology("a node needs a non-empty node_id")
        if not self.domain_id:
            raise InvalidTopology(f"node {self.node_id!r} needs a non-empty domain_id")
        if self.num_gpus < 0:
            raise InvalidTopology(
                f"node {self.node_id!r} has num_gpus={self.num_gpus}; use 0 or more"
            )
        if self.num_cpus < 0:
            raise InvalidTopology(
                f"node {self.node_id!r} has num_cpus={self.num_cpus}; use 0 or more"
            )
        keys = [key for key, _ in self.labels]
        if len(set(keys)) != len(keys):
            raise InvalidTopology(f"node {self.node_id!r} repeats a label key: {keys}")
        object.__setattr__(self, "labels", tuple(sorted(self.labels)))

    def label(self, key: str) -> str | None:
        """The value of label `key`, or None when the node has no such label."""
        for label_key, value in self.labels:
            if label_key == key:
                return value
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterTopology:
    """All nodes of the cluster, in a fixed order that breaks every tie."""

    nodes: tuple[NodeSpec, ...]

    def __post_init__(self) -> None:
        if not self.nodes:
            raise InvalidTopology("a cluster needs at least one node")
        seen: set[str] = set()
        for node in self.nodes:
            if node.node_id in seen:
                raise InvalidTopology(f"node id {node.node_id!r} appears twice")
            seen.add(node.node_id)

    @property
    def domain_ids(self) -> tuple[str, ...]:
        """Domain ids in order of their first node."""
        return tuple(dict.fromkeys(node.domain_id for node in self.nodes))

    @property
    def num_gpus(self) -> int:
        return sum(node.num_gpus for node in self.nodes)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeState:
    """A node and what is free on it at the time of a snapshot."""

    node_id: str
    domain_id: str
    num_gpus: int
    num_cpus: float
    free_gpu_indices: tuple[int, ...]
    num_free_cpus: float

    @property
    def num_free_gpus(self) -> int:
        return len(self.free_gpu_indices)

    @property
    def is_whole_free(self) -> bool:
        """True when every GPU of the node is free (an untouched tray)."""
        return self.num_gpus > 0 and self.num_free_gpus == self.num_gpus


@dataclass(frozen=True, slots=True, kw_only=True)
class DomainState:
    """One NVLink domain at the time of a snapshot."""

    domain_id: str
    node_ids: tuple[str, ...]
    num_gpus: int
    num_free_gpus: int
    largest_free_node_gpus: int
    num_whole_free_nodes: int

    def num_stranded_gpus(self, tp_size: int) -> int:
        """Free GPUs of this domain that cannot be part of a TP-`tp_size` engine.

        An engine never spans domains, and inside a domain any free GPUs can be
        combined (an NVL72 engine may span trays), so a free GPU is stranded for
        TP-`tp_size` exactly when its domain has fewer than `tp_size` free GPUs.
        """
        return self.num_free_gpus if self.num_free_gpus < tp_size else 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSnapshot:
    """A frozen copy of the ledger: every node and domain with its free capacity."""

    nodes: tuple[NodeState, ...]
    domains: tuple[DomainState, ...]

    @property
    def num_free_gpus(self) -> int:
        return sum(domain.num_free_gpus for domain in self.domains)

    def domain(self, domain_id: str) -> DomainState:
        for domain in self.domains:
            if domain.domain_id == domain_id:
                return domain
        raise KeyError(domain_id)

    def node(self, node_id: str) -> NodeState:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(node_id)

    def num_stranded_gpus(self, tp_size: int) -> int:
        """Free GPUs, summed over domains, that cannot host a TP-`tp_size` engine."""
        return sum(domain.num_stranded_gpus(tp_size) for domain in self.domains)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeClaim:
    """A request to take `num_gpus` GPUs and `num_cpus` CPUs of one node."""

    node_id: str
    num_gpus: int
    num_cpus: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant:
    """What a claim received: the node's GPU indices (lowest free first) and CPUs."""

    node_id: str
    gpu_indices: tuple[int, ...]
    num_cpus: float


class ClusterLedger:
    """Which GPUs and CPUs of a `ClusterTopology` each engine holds.

    Nodes and domains are also addressed by ordinal (their position in
    `topology.nodes` / `domain_ids`) so that planners can scan indexes without building
    objects. Queries never mutate; only `claim` and `release` do.
    """

    __slots__ = (
        "_bucket",
        "_domain_free",
        "_domain_index",
        "_domain_max_gpus",
        "_domain_nodes",
        "_domain_version",
        "_engines",
        "_free_gpus",
        "_free_mcpus",
        "_node_domain",
        "_node_index",
        "topology",
    )

    def __init__(self, topology: ClusterTopology) -> None:
        self.topology = topology
        domain_ids = topology.domain_ids
        self._domain_index = {domain_id: i for i, domain_id in enumerate(domain_ids)}
        self._node_index = {node.node_id: i for i, node in enumerate(topology.nodes)}
        self._node_domain = [self._domain_index[n.domain_id] for n in topology.nodes]
        self._free_gpus = [list(range(node.num_gpus)) for node in topology.nodes]
        self._free_mcpus = [_to_milli(node.num_cpus) for node in topology.nodes]
        self._domain_nodes: list[list[int]] = [[] for _ in domain_ids]
        for ordinal, domain in enumerate(self._node_domain):
            self._domain_nodes[domain].append(ordinal)
        self._domain_max_gpus = [
            max(topology.nodes[n].num_gpus for n in nodes) for nodes in self._domain_nodes
        ]
        self._domain_free = [
            sum(topology.nodes[n].num_gpus for n in nodes) for nodes in self._domain_nodes
        ]
        # _bucket[domain][k] = ordinals of the domain's nodes with exactly k free GPUs.
        self._bucket: list[list[set[int]]] = [
            [set() for _ in range(max_gpus + 1)] for max_gpus in self._domain_max_gpus
        ]
        for ordinal, node in enumerate(topology.nodes):
            self._bucket[self._node_domain[ordinal]][node.num_gpus].add(ordinal)
        # Bumped whenever anything on one of the domain's nodes changes; lets a
        # planner reuse what it worked out for a domain that has not changed since.
        self._domain_version = [0 for _ in domain_ids]
        self._engines: dict[str, tuple[Grant, ...]] = {}

    # -- queries (side-effect free) -------------------------------------------------

    @property
    def domain_ids(self) -> tuple[str, ...]:
        return tuple(self._domain_index)

    @property
    def engine_ids(self) -> tuple[str, ...]:
        return tuple(self._engines)

    def node_spec(self, ordinal: int) -> NodeSpec:
        return self.topology.nodes[ordinal]

    def domain_of_node(self, ordinal: int) -> int:
        return self._node_domain[ordinal]

    def domain_nodes(self, domain: int) -> Sequence[int]:
        """Node ordinals of a domain, in topology order."""
        return self._domain_nodes[domain]

    def domain_free_gpus(self, domain: int) -> int:
        return self._domain_free[domain]

    def free_gpus_by_domain(self) -> Sequence[int]:
        """Free GPUs of every domain, by domain ordinal (a live read-only view)."""
        return self._domain_free

    def domain_version(self, domain: int) -> int:
        """Changes whenever a claim or release touches the domain."""
        return self._domain_version[domain]

    def domain_max_gpus_per_node(self, domain: int) -> int:
        return self._domain_max_gpus[domain]

    def nodes_with_free_gpus(self, domain: int, num_free: int) -> Set[int]:
        """Ordinals of the domain's nodes with exactly `num_free` free GPUs."""
        buckets = self._bucket[domain]
        return buckets[num_free] if num_free < len(buckets) else frozenset()

    def free_gpus(self, ordinal: int) -> int:
        return len(self._free_gpus[ordinal])

    def free_cpus(self, ordinal: int) -> float:
        return self._free_mcpus[ordinal] / _MILLI

    def free_gpu_indices(self, ordinal: int) -> tuple[int, ...]:
        """The node's free GPU indices, lowest first (the order `claim` takes them)."""
        return tuple(self._free_gpus[ordinal])

    def max_shards(self, ordinal: int, num_cpus_per_shard: float) -> int:
        """How many one-GPU shards needing `num_cpus_per_shard` CPUs fit on the node."""
        free_gpus = len(self._free_gpus[ordinal])
        mcpus = _to_milli(num_cpus_per_shard)
        if mcpus == 0:
            return free_gpus
        return min(free_gpus, self._free_mcpus[ordinal] // mcpus)

    def holds(self, engine_id: str) -> bool:
        return engine_id in self._engines

    def grants(self, engine_id: str) -> tuple[Grant, ...]:
        if engine_id not in self._engines:
            raise UnknownEngine(f"engine {engine_id!r} holds no GPUs in this ledger")
        return self._engines[engine_id]

    def domain_states(self) -> tuple[DomainState, ...]:
        """Every domain's free capacity, without a per-node copy (cheap)."""
        states = []
        for d, domain_id in enumerate(self._domain_index):
            ordinals = self._domain_nodes[d]
            free = [len(self._free_gpus[n]) for n in ordinals]
            specs = [self.topology.nodes[n] for n in ordinals]
            states.append(
                DomainState(
                    domain_id=domain_id,
                    node_ids=tuple(spec.node_id for spec in specs),
                    num_gpus=sum(spec.num_gpus for spec in specs),
                    num_free_gpus=self._domain_free[d],
                    largest_free_node_gpus=max(free),
                    num_whole_free_nodes=sum(
                        0 < f == spec.num_gpus for f, spec in zip(free, specs, strict=True)
                    ),
                )
            )
        return tuple(states)

    def snapshot(self) -> ClusterSnapshot:
        nodes = tuple(
            NodeState(
                node_id=spec.node_id,
                domain_id=spec.domain_id,
                num_gpus=spec.num_gpus,
                num_cpus=spec.num_cpus,
                free_gpu_indices=tuple(self._free_gpus[i]),
                num_free_cpus=self._free_mcpus[i] / _MILLI,
            )
            for i, spec in enumerate(self.topology.nodes)
        )
        return ClusterSnapshot(nodes=nodes, domains=self.domain_states())

    def copy(self) -> ClusterLedger:
        """An independent ledger in the same state, for trying decisions out."""
        other = ClusterLedger.__new__(ClusterLedger)
        other.topology = self.topology
        other._domain_index = self._domain_index
        other._node_index = self._node_index
        other._node_domain = self._node_domain
        other._domain_nodes = self._domain_nodes
        other._domain_max_gpus = self._domain_max_gpus
        other._free_gpus = [list(free) for free in self._free_gpus]
        other._free_mcpus = list(self._free_mcpus)
        other._domain_free = list(self._domain_free)
        other._domain_version = list(self._domain_version)
        other._bucket = [[set(b) for b in buckets] for buckets in self._bucket]
        other._engines = dict(self._engines)
        return other

    # -- actions ----------------------------------------------------------------------

    def claim(self, engine_id: str, claims: Sequence[NodeClaim]) -> tuple[Grant, ...]:
        """Give `engine_id` the claimed GPUs and CPUs, all or nothing."""
        if engine_id in self._engines:
            raise DuplicateEngine(
                f"engine {engine_id!r} already holds GPUs; release it before placing it again"
            )
        wanted: dict[int, tuple[int, int]] = {}
        for claim in claims:
            if claim.node_id not in self._node_index:
                raise InsufficientCapacity(f"no node {claim.node_id!r} in this cluster")
            ordinal = self._node_index[claim.node_id]
            gpus, mcpus = wanted.get(ordinal, (0, 0))
            wanted[ordinal] = (gpus + claim.num_gpus, mcpus + _to_milli(claim.num_cpus))
        for ordinal, (gpus, mcpus) in wanted.items():
            if gpus > len(self._free_gpus[ordinal]) or mcpus > self._free_mcpus[ordinal]:
                raise InsufficientCapacity(
                    f"engine {engine_id!r} claims {gpus} GPUs and {mcpus / _MILLI:g} "
                    f"CPUs on node {self.topology.nodes[ordinal].node_id!r}, which "
                    f"has {len(self._free_gpus[ordinal])} GPUs and "
                    f"{self._free_mcpus[ordinal] / _MILLI:g} CPUs free"
                )
        grants = []
        for claim in claims:
            ordinal = self._node_index[claim.node_id]
            free = self._free_gpus[ordinal]
            taken, self._free_gpus[ordinal] = free[: claim.num_gpus], free[claim.num_gpus :]
            self._free_mcpus[ordinal] -= _to_milli(claim.num_cpus)
            self._move(ordinal, len(free), len(free) - claim.num_gpus)
            self._domain_version[self._node_domain[ordinal]] += 1
            grants.append(
                Grant(node_id=claim.node_id, gpu_indices=tuple(taken), num_cpus=claim.num_cpus)
            )
        self._engines[engine_id] = tuple(grants)
        return tuple(grants)

    def release(self, engine_id: str) -> tuple[Grant, ...]:
        """Return everything `engine_id` holds to the free pool."""
        grants = self.grants(engine_id)
        del self._engines[engine_id]
        for grant in grants:
            ordinal = self._node_index[grant.node_id]
            before = len(self._free_gpus[ordinal])
            self._free_gpus[ordinal] = sorted(self._free_gpus[ordinal] + list(grant.gpu_indices))
            self._free_mcpus[ordinal] += _to_milli(grant.num_cpus)
            self._move(ordinal, before, before + len(grant.gpu_indices))
            self._domain_version[self._node_domain[ordinal]] += 1
        return grants

    def _move(self, ordinal: int, old_free: int, new_free: int) -> None:
        if old_free == new_free:
            return
        domain = self._node_domain[ordinal]
        self._bucket[domain][old_free].discard(ordinal)
        self._bucket[domain][new_free].add(ordinal)
        self._domain_free[domain] += new_free - old_free
