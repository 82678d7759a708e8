"""What Ray's node table says about nodes: NVLink domain labels, GPUs, free GPUs.

Each node carries the label `nvlink_domain=<id>`; a GPU node without it is its own
domain, named by its Ray node id. Ray itself labels every node `ray.io/node-id`.
`RayNode.from_row` and `domain_states` are pure; `read_ray_nodes` and
`read_free_gpus` ask the connected Ray.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray._private.state import available_resources_per_node

from placement.topology import NVLINK_DOMAIN_LABEL, DomainState

__all__ = [
    "NODE_ID_LABEL",
    "NVLINK_DOMAIN_LABEL",
    "RayNode",
    "domain_states",
    "read_free_gpus",
    "read_node_addresses",
    "read_ray_nodes",
]

NODE_ID_LABEL = "ray.io/node-id"
"""The label Ray itself puts on every node: its node id (hex)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RayNode:
    """One node of Ray's node table, as kvtide sees it.

    `domain_id` is the node's `nvlink_domain` label, or its node id when it has
    none (`labelled` is then False).
    """

    node_id: str
    alive: bool
    domain_id: str
    labelled: bool
    num_gpus: int
    num_cpus: float

    @classmethod
    def from_row(
        cls, row: Mapping[str, Any], *, domain_label: str = NVLINK_DOMAIN_LABEL
    ) -> RayNode:
        """From one entry of `ray.nodes()` (pure)."""
        labels: Mapping[str, str] = row.get("Labels") or {}
        resources: Mapping[str, float] = row.get("Resources") or {}
        node_id = str(row["NodeID"])
        domain = labels.get(domain_label)
        return cls(
            node_id=node_id,
            alive=bool(row.get("Alive", False)),
            domain_id=domain or node_id,
            labelled=bool(domain),
            num_gpus=math.floor(resources.get("GPU", 0)),
            num_cpus=float(resources.get("CPU", 0.0)),
        )


def read_ray_nodes(
    *, alive_only: bool = True, domain_label: str = NVLINK_DOMAIN_LABEL
) -> tuple[RayNode, ...]:
    """Ray's node table now (needs `ray.init`)."""
    nodes = (RayNode.from_row(row, domain_label=domain_label) for row in ray.nodes())
    return tuple(node for node in nodes if node.alive or not alive_only)


def read_node_addresses() -> set[str]:
    """The addresses of the alive nodes, as Ray knows them (needs `ray.init`): one for
    every node of a cluster on a single host, one per host otherwise."""
    return {str(row["NodeManagerAddress"]) for row in ray.nodes() if row.get("Alive")}


def domain_states(
    nodes: Sequence[RayNode], free_gpus: Mapping[str, int]
) -> tuple[DomainState, ...]:
    """Each NVLink domain's GPUs and free GPUs, from alive GPU nodes (pure).

    Domains are sorted by id; `free_gpus` maps node id to the GPUs Ray has free.
    """
    by_domain: dict[str, list[RayNode]] = {}
    for node in sorted(nodes, key=lambda n: (n.domain_id, n.node_id)):
        if node.alive and node.num_gpus > 0:
            by_domain.setdefault(node.domain_id, []).append(node)
    states = []
    for domain_id, members in by_domain.items():
        free = [min(free_gpus.get(n.node_id, 0), n.num_gpus) for n in members]
        states.append(
            DomainState(
                domain_id=domain_id,
                node_ids=tuple(n.node_id for n in members),
                num_gpus=sum(n.num_gpus for n in members),
                num_free_gpus=sum(free),
                largest_free_node_gpus=max(free),
                num_whole_free_nodes=sum(
                    f == n.num_gpus for f, n in zip(free, members, strict=True)
                ),
            )
        )
    return tuple(states)


def read_free_gpus() -> dict[str, int]:
    """GPUs Ray has free on each alive node now, by node id (needs `ray.init`)."""
    # Ray has no public per-node view of available resources; `ray status` uses this one.
    return {
        node_id: math.floor(resources.get("GPU", 0))
        for node_id, resources in available_resources_per_node().items()
    }
