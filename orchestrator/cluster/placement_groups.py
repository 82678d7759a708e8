"""Placement plans become Ray placement groups: the only module calling `ray.util.placement_group`.

A `PlacementPlan` (from `placement.planner`) says which node of which NVLink domain
runs each TP rank. Here it becomes:

1. a `GroupSpec` (pure, tested without a cluster): one `{"GPU": 1, "CPU": n}` bundle
   per rank in rank order, optionally led by a CPU-only bundle for the engine host
   actor, and how the bundles are pinned (`Pin`);
2. a Ray placement group, waited for at most `timeout_s`. Ray leaves a group it
   cannot place pending forever without an error, so on timeout the group is
   removed and `PlacementTimeout` lists every domain's free GPUs against what was
   asked;
3. a `PlacedEngine`: where each bundle landed (Ray's `bundles_to_node_id`), each
   node's `nvlink_domain` label read back from Ray's node table, and the ranks
   ordered by node. Bundle order is not node order; `ranks_by_node` fixes that.

What Ray says about nodes (labels, GPUs, free GPUs) is read in `orchestrator.cluster.ray_nodes`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.cluster.errors import PlacementMismatch, PlacementTimeout
from orchestrator.cluster.ray_nodes import (
    NODE_ID_LABEL,
    NVLINK_DOMAIN_LABEL,
    domain_states,
    read_free_gpus,
    read_ray_nodes,
)
from placement.plan import PlacementPlan
from placement.planner import describe_domains

__all__ = [
    "NODE_ID_LABEL",
    "NVLINK_DOMAIN_LABEL",
    "GroupSpec",
    "Pin",
    "PlacedEngine",
    "RankPlacement",
    "bind_ranks",
    "create_group",
    "group_spec",
    "ranks_by_node",
    "remove_group",
]


class Pin(StrEnum):
    """How a plan's bundles are pinned.

    `NODES` (what `DomainPlacer` uses): each bundle to the node the plan chose
    (label selector on `ray.io/node-id`), so Ray's placement is the planner's,
    down to the node. `DOMAIN`: each bundle to the plan's domain (label selector
    on `nvlink_domain`); Ray picks the nodes inside it. `TOPOLOGY`: Ray picks the
    domain itself (`topology_strategy={"nvlink_domain": "STRICT_PACK"}`); the
    plan only sizes the bundles. `DOMAIN` and `TOPOLOGY` need labelled nodes.
    """

    NODES = "nodes"
    DOMAIN = "domain"
    TOPOLOGY = "topology"


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupSpec:
    """Everything `ray.util.placement_group` is called with for one engine.

    `shard_bundle_indices[r]` is the bundle of the plan's rank r;
    `host_bundle_index` is the engine host's CPU-only bundle (always bundle 0),
    or None. `planned_node_ids[i]` is the node bundle i is pinned to (`Pin.NODES`
    only, else None).
    """

    name: str
    pin: Pin
    domain_label: str
    bundles: tuple[dict[str, float], ...]
    label_selectors: tuple[dict[str, str], ...] | None
    topology_strategy: dict[str, str] | None
    shard_bundle_indices: tuple[int, ...]
    host_bundle_index: int | None
    planned_node_ids: tuple[str | None, ...]

    def ray_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `ray.util.placement_group`, as fresh containers."""
        kwargs: dict[str, Any] = {"bundles": [dict(b) for b in self.bundles], "name": self.name}
        if self.label_selectors is not None:
            kwargs["bundle_label_selector"] = [dict(s) for s in self.label_selectors]
        if self.topology_strategy is not None:
            kwargs["topology_strategy"] = dict(self.topology_strategy)
        return kwargs

    def describe_ask(self, plan: PlacementPlan) -> str:
        """What the group asks of Ray, in words."""
        shard = self.bundles[self.shard_bundle_indices[0]]
        what = f"{plan.tp_size} bundles of {_format_bundle(shard)}"
        if self.host_bundle_index is not None:
            what += f" plus {_format_bundle(self.bundles[self.host_bundle_index])} for the host"
        if self.pin is Pin.NODES:
            where = f"pinned to {plan.num_nodes} node(s) of NVLink domain {plan.domain_id!r}"
        elif self.pin is Pin.DOMAIN:
            where = f"on nodes labelled {self.domain_label}={plan.domain_id}"
        else:
            where = f"in any one NVLink domain ({self.domain_label}: STRICT_PACK)"
        return f"{what}, {where}"


def group_spec(
    plan: PlacementPlan,
    *,
    pin: Pin = Pin.NODES,
    host_num_cpus: float = 0.0,
    domain_label: str = NVLINK_DOMAIN_LABEL,
) -> GroupSpec:
    """The placement group for `plan` (pure).

    Bundles: with `host_num_cpus > 0`, first `{"CPU": host_num_cpus}` for the
    engine host actor, on rank 0's node (vLLM puts its driver's node first); then
    one `{"GPU": 1, "CPU": n}` per rank, in rank order (a zero CPU count is left
    out).
    """
    if host_num_cpus < 0:
        raise ValueError(f"host_num_cpus={host_num_cpus} is negative; use 0 (no host) or more")
    shard_bundles = [_shard_bundle(shard.num_cpus) for shard in plan.shards]
    shard_nodes: list[str] = [shard.node_id for shard in plan.shards]
    bundles = list(shard_bundles)
    nodes = list(shard_nodes)
    host_index: int | None = None
    if host_num_cpus > 0:
        bundles.insert(0, {"CPU": float(host_num_cpus)})
        nodes.insert(0, plan.shards[0].node_id)
        host_index = 0
    offset = 0 if host_index is None else 1
    selectors: tuple[dict[str, str], ...] | None = None
    topology: dict[str, str] | None = None
    if pin is Pin.NODES:
        selectors = tuple({NODE_ID_LABEL: node_id} for node_id in nodes)
    elif pin is Pin.DOMAIN:
        selectors = tuple({domain_label: plan.domain_id} for _ in bundles)
    else:
        topology = {domain_label: "STRICT_PACK"}
    return GroupSpec(
        name=f"kvtide:{plan.engine_id}",
        pin=pin,
        domain_label=domain_label,
        bundles=tuple(bundles),
        label_selectors=selectors,
        topology_strategy=topology,
        shard_bundle_indices=tuple(range(offset, offset + plan.tp_size)),
        host_bundle_index=host_index,
        planned_node_ids=tuple(nodes) if pin is Pin.NODES else (None,) * len(bundles),
    )


def _shard_bundle(num_cpus: float) -> dict[str, float]:
    return {"GPU": 1.0, "CPU": float(num_cpus)} if num_cpus > 0 else {"GPU": 1.0}


def _format_bundle(bundle: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{key}: {value:g}" for key, value in bundle.items()) + "}"


def ranks_by_node(
    bundle_node_ids: Sequence[str], shard_bundle_indices: Sequence[int], *, first_node_id: str
) -> tuple[int, ...]:
    """The shard bundle that becomes each rank, so that ranks go node by node.

    `first_node_id` comes first (the engine host's node), then the other nodes in
    the order of their lowest shard bundle; within a node, bundle order. Entry r
    of the result is the bundle index of rank r.
    """
    by_node: dict[str, list[int]] = {}
    if any(bundle_node_ids[i] == first_node_id for i in shard_bundle_indices):
        by_node[first_node_id] = []
    for index in sorted(shard_bundle_indices):
        by_node.setdefault(bundle_node_ids[index], []).append(index)
    return tuple(index for indices in by_node.values() for index in indices)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlacement:
    """Where TP rank `rank` runs: its bundle, the node Ray put it on, that node's domain.

    `domain_id` is read from Ray's node table for this node, not taken from the plan.
    """

    rank: int
    bundle_index: int
    node_id: str
    domain_id: str


def bind_ranks(
    spec: GroupSpec,
    plan: PlacementPlan,
    bundle_node_ids: Sequence[str],
    node_domains: Mapping[str, str],
) -> tuple[RankPlacement, ...]:
    """Ranks ordered by node, checked against the plan (pure).

    `bundle_node_ids[i]` is the node Ray put bundle i on; `node_domains` maps node
    id to its domain from Ray's node table. Raises `PlacementMismatch` when a
    bundle is off its pinned node, a shard is outside the plan's domain
    (`Pin.NODES` / `Pin.DOMAIN`), or the shards span domains (any pin).
    """
    for index, planned in enumerate(spec.planned_node_ids):
        if planned is not None and bundle_node_ids[index] != planned:
            raise PlacementMismatch(
                f"engine {plan.engine_id!r}: bundle {index} was pinned to node {planned} "
                f"but Ray placed it on {bundle_node_ids[index]}",
                engine_id=plan.engine_id,
            )
    host = spec.host_bundle_index
    first = bundle_node_ids[host if host is not None else spec.shard_bundle_indices[0]]
    order = ranks_by_node(bundle_node_ids, spec.shard_bundle_indices, first_node_id=first)
    ranks = tuple(
        RankPlacement(
            rank=rank,
            bundle_index=index,
            node_id=bundle_node_ids[index],
            domain_id=node_domains.get(bundle_node_ids[index], "<unknown node>"),
        )
        for rank, index in enumerate(order)
    )
    domains = sorted({r.domain_id for r in ranks})
    expected = None if spec.pin is Pin.TOPOLOGY else plan.domain_id
    if len(domains) > 1 or (expected is not None and domains != [expected]):
        raise PlacementMismatch(
            f"engine {plan.engine_id!r}: its shards landed in NVLink domain(s) {domains}, "
            f"expected one domain{'' if expected is None else f' ({expected!r})'}; check "
            f"the nodes' {spec.domain_label} labels",
            engine_id=plan.engine_id,
        )
    return ranks


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacedEngine:
    """An engine's placement group, ready, with its ranks ordered by node.

    Contract: every rank's node carries `domain_id` in Ray's node table; ranks of
    one node are contiguous and the host's node (or rank 0's) comes first.
    """

    plan: PlacementPlan
    spec: GroupSpec
    group: PlacementGroup
    ranks: tuple[RankPlacement, ...]
    host_node_id: str | None

    @property
    def engine_id(self) -> str:
        return self.plan.engine_id

    @property
    def domain_id(self) -> str:
        return self.ranks[0].domain_id

    @property
    def node_ids(self) -> tuple[str, ...]:
        """The engine's nodes, in rank order (host's node first)."""
        return tuple(dict.fromkeys(r.node_id for r in self.ranks))

    def uses_node(self, node_id: str) -> bool:
        return node_id == self.host_node_id or any(r.node_id == node_id for r in self.ranks)

    def host_actor_options(self, *, env_vars: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Ray actor options that put the engine host in its bundle.

        Child tasks and actors (vLLM's TP workers with
        `distributed_executor_backend="ray"`) join the same group. `env_vars` go
        into the host's runtime env, which those children inherit: the way to
        give vLLM's workers a variable they read at process start.
        """
        index = self.spec.host_bundle_index
        if index is None:
            raise ValueError(
                f"engine {self.engine_id!r} was placed without a host bundle; "
                f"place it with host_num_cpus > 0"
            )
        options: dict[str, Any] = {
            "num_cpus": self.spec.bundles[index]["CPU"],
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group,
                placement_group_bundle_index=index,
                placement_group_capture_child_tasks=True,
            ),
        }
        if env_vars:
            options["runtime_env"] = {"env_vars": dict(env_vars)}
        return options


def create_group(spec: GroupSpec, plan: PlacementPlan, *, timeout_s: float) -> PlacedEngine:
    """Create the group, wait at most `timeout_s` for it, and bind ranks to nodes.

    Raises `PlacementTimeout` (the group removed) when Ray has not placed it in
    time, and `PlacementMismatch` (the group removed) when a bundle is off plan.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s} must be positive")
    group = placement_group(**spec.ray_kwargs())
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        state = _scheduling_state(group)
        remove_placement_group(group)
        raise _timeout(spec, plan, timeout_s, state)
    table = placement_group_table(group)
    bundle_nodes = [table["bundles_to_node_id"][i] for i in range(len(spec.bundles))]
    nodes = read_ray_nodes(alive_only=False, domain_label=spec.domain_label)
    try:
        ranks = bind_ranks(spec, plan, bundle_nodes, {n.node_id: n.domain_id for n in nodes})
    except PlacementMismatch:
        remove_placement_group(group)
        raise
    host = spec.host_bundle_index
    return PlacedEngine(
        plan=plan,
        spec=spec,
        group=group,
        ranks=ranks,
        host_node_id=None if host is None else bundle_nodes[host],
    )


def remove_group(placed: PlacedEngine) -> None:
    """Remove the engine's group; Ray kills the actors in it and frees its bundles."""
    remove_placement_group(placed.group)


def _scheduling_state(group: PlacementGroup) -> str:
    table = placement_group_table(group)
    return str(table.get("stats", {}).get("scheduling_state") or table.get("state", "UNKNOWN"))


def _timeout(
    spec: GroupSpec, plan: PlacementPlan, timeout_s: float, state: str
) -> PlacementTimeout:
    nodes = read_ray_nodes(domain_label=spec.domain_label)
    domains = domain_states(nodes, read_free_gpus())
    alive = {n.node_id for n in nodes}
    gone = sorted({n for n in spec.planned_node_ids if n is not None and n not in alive})
    lines = [
        f"engine {plan.engine_id!r} (TP{plan.tp_size}, {plan.role}): Ray did not place its "
        f"placement group within {timeout_s:g} s (scheduling state {state}); kvtide "
        f"removed the group.",
        f"Asked: {spec.describe_ask(plan)}.",
    ]
    if gone:
        lines.append(f"Planned nodes no longer alive: {', '.join(gone)}.")
    lines += [
        "Free GPUs per domain, as Ray reports them now:",
        describe_domains(domains),
        f"Release engines so that one domain has {plan.tp_size} free GPUs, lower the TP "
        f"size, or wait longer if GPUs are being released.",
    ]
    return PlacementTimeout(
        "\n".join(lines),
        engine_id=plan.engine_id,
        timeout_s=timeout_s,
        scheduling_state=state,
        domains=domains,
    )
