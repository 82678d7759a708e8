"""Which engines of which pool run in which NVLink domain: the Serve deployments to make.

Ray Serve places each replica in a placement group built from its deployment's
``placement_group_bundles``, and ``placement_group_bundle_label_selector`` can pin
every bundle to nodes with a label, but a deployment has one selector for all its
replicas. So a domain-pinned pool is one deployment per (pool, domain):
``decode-pool-nvl72-a`` with the engines kvtide planned into ``nvl72-a``. Ray then
packs each replica's bundles onto the fewest nodes of that domain.

``plan_layout`` is pure: the config, the cluster's topology and optionally the layout
running now go in; a ``PoolLayout`` comes out, or ``EnginesUnplaceable`` with the
planner's reason (each domain's free GPUs against what was asked). Given the running
layout it keeps every engine in its domain while the domain still holds it and moves
only the others (after a node is lost), so a re-deploy restarts nothing that need not
move.

Bundles of one engine (TP = tensor_parallel_size):

* TP 1: ``[{GPU: 1, CPU: num_cpus}]``; the engine host holds the GPU and runs the
  engine in-process;
* TP > 1: ``[{CPU: num_cpus}] + TP * [{GPU: 1, CPU: num_cpus_per_shard}]``; the host
  sits in bundle 0 and vLLM's Ray executor puts one worker in each GPU bundle, ordered
  by node (the host's node first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from orchestrator.config import KVTideConfig, PoolConfig
from orchestrator.errors import KVTideError
from placement.planner import EngineRequest, PlacementPlan, PlacementPlanner, Unplaceable
from placement.topology import NVLINK_DOMAIN_LABEL, ClusterTopology, DomainState

__all__ = [
    "EnginesUnplaceable",
    "PoolDeployment",
    "PoolLayout",
    "engine_bundles",
    "plan_layout",
    "pool_deployment_name",
    "unpinned_layout",
]


class EnginesUnplaceable(KVTideError):
    """No NVLink domain can hold an engine of the config on this cluster now."""

    def __init__(self, message: str, *, domains: Sequence[DomainState] = ()) -> None:
        super().__init__(message)
        self.domains = tuple(domains)


def pool_deployment_name(pool_name: str, domain_id: str | None = None) -> str:
    """``decode-pool`` (not pinned) or ``decode-pool-nvl72-a`` (pinned to a domain)."""
    base = f"{pool_name.replace('_', '-')}-pool"
    return base if domain_id is None else f"{base}-{domain_id}"


def engine_bundles(pool: PoolConfig, num_cpus_per_shard: float) -> list[dict[str, float]]:
    """The placement group bundles of one engine of ``pool`` (see the module doc)."""
    tp = pool.tensor_parallel_size
    if tp == 1:
        return [{"GPU": 1.0, "CPU": float(pool.num_cpus)}]
    shard = {"GPU": 1.0, "CPU": float(num_cpus_per_shard)}
    return [{"CPU": float(pool.num_cpus)}] + [dict(shard) for _ in range(tp)]


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolDeployment:
    """One Serve deployment of engines: a pool's engines in one domain (or unpinned)."""

    pool_name: str
    domain_id: str | None  # None: not pinned (placement off)
    num_replicas: int
    plans: tuple[PlacementPlan, ...] = ()  # the planned engines (domain mode)

    @property
    def name(self) -> str:
        return pool_deployment_name(self.pool_name, self.domain_id)

    def serve_options(
        self, pool: PoolConfig, num_cpus_per_shard: float, domain_label: str = NVLINK_DOMAIN_LABEL
    ) -> dict[str, object]:
        """The placement part of this deployment's Serve options (empty when unpinned)."""
        if self.domain_id is None:
            return {}
        bundles = engine_bundles(pool, num_cpus_per_shard)
        return {
            "placement_group_bundles": bundles,
            "placement_group_strategy": "STRICT_PACK" if len(bundles) == 1 else "PACK",
            "placement_group_bundle_label_selector": [
                {domain_label: self.domain_id} for _ in bundles
            ],
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolLayout:
    """Every pool's deployments, in pool order, then domain order."""

    deployments: tuple[PoolDeployment, ...]

    def of_pool(self, pool_name: str) -> tuple[PoolDeployment, ...]:
        return tuple(d for d in self.deployments if d.pool_name == pool_name)

    def counts(self) -> dict[str, int]:
        """Replicas by deployment name."""
        return {d.name: d.num_replicas for d in self.deployments}

    @property
    def by_domain(self) -> bool:
        return any(d.domain_id is not None for d in self.deployments)

    def describe(self) -> str:
        """One line per deployment, for logs and the CLI."""
        return "\n".join(
            f"  {d.name}: {d.num_replicas} engine(s)"
            + ("" if d.domain_id is None else f" in {d.domain_id}")
            for d in self.deployments
        )


def unpinned_layout(config: KVTideConfig) -> PoolLayout:
    """One deployment per pool, placed by Serve (placement mode off)."""
    return PoolLayout(
        deployments=tuple(
            PoolDeployment(pool_name=p.name, domain_id=None, num_replicas=p.num_engines)
            for p in config.pools()
        )
    )


def _request(pool: PoolConfig, index: int, num_cpus_per_shard: float) -> EngineRequest:
    tp = pool.tensor_parallel_size
    return EngineRequest(
        engine_id=f"{pool.name}-{index}",
        tp_size=tp,
        role=pool.role,
        num_cpus_per_shard=float(pool.num_cpus) if tp == 1 else num_cpus_per_shard,
    )


def plan_layout(
    config: KVTideConfig,
    topology: ClusterTopology,
    *,
    running: PoolLayout | None = None,
) -> PoolLayout:
    """Plan every engine of ``config`` into one NVLink domain of ``topology`` (pure).

    Engines of ``running`` stay in their domain while it still holds them; the
    rest (and all engines without ``running``) go where the planner chooses, largest
    TP first. Raises ``EnginesUnplaceable`` naming the first engine that fits nowhere.
    """
    per_shard = config.placement.num_cpus_per_shard
    planner = PlacementPlanner(topology)
    kept: dict[str, list[str]] = {p.name: [] for p in config.pools()}
    if running is not None:
        for dep in running.deployments:
            if dep.domain_id is not None and dep.pool_name in kept:
                kept[dep.pool_name] += [dep.domain_id] * dep.num_replicas
    placed: dict[str, list[PlacementPlan]] = {p.name: [] for p in config.pools()}
    loose: list[tuple[str, EngineRequest]] = []
    for pool in sorted(config.pools(), key=lambda p: -p.tensor_parallel_size):
        wanted = kept[pool.name][: pool.num_engines]
        for index in range(pool.num_engines):
            request = _request(pool, index, per_shard)
            plan = planner.place_in_domain(request, wanted[index]) if index < len(wanted) else None
            if plan is None:
                loose.append((pool.name, request))
            else:
                placed[pool.name].append(plan)
    for pool_name, request in sorted(loose, key=lambda pr: -pr[1].tp_size):
        decision = planner.place(request)
        if isinstance(decision, Unplaceable):
            raise EnginesUnplaceable(
                f"{decision.reason}\nkvtide places every engine of the config "
                f"({_engines_of(config)}); lower num_engines or tensor_parallel_size, or "
                "add nodes.",
                domains=decision.domains,
            )
        placed[pool_name].append(decision)
    return PoolLayout(deployments=tuple(_group(config, placed, topology)))


def _engines_of(config: KVTideConfig) -> str:
    return ", ".join(
        f"{p.name}: {p.num_engines} x TP{p.tensor_parallel_size}" for p in config.pools()
    )


def _group(
    config: KVTideConfig, placed: Mapping[str, list[PlacementPlan]], topology: ClusterTopology
) -> list[PoolDeployment]:
    order = {d: i for i, d in enumerate(topology.domain_ids)}
    out = []
    for pool in config.pools():
        by_domain: dict[str, list[PlacementPlan]] = {}
        for plan in placed[pool.name]:
            by_domain.setdefault(plan.domain_id, []).append(plan)
        for domain_id in sorted(by_domain, key=order.__getitem__):
            plans = tuple(by_domain[domain_id])
            out.append(
                PoolDeployment(
                    pool_name=pool.name,
                    domain_id=domain_id,
                    num_replicas=len(plans),
                    plans=plans,
                )
            )
    return out
