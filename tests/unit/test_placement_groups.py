"""From a placement plan to Ray's placement group arguments, and back from where Ray put it.

Everything here is pure: no Ray cluster. The plans come from kvtide's planner on a
small cluster: one NVL72-like domain "nvl72-a" of four 4-GPU trays and one 8-GPU
HGX node "hgx-1". The Ray side is in tests/ray/test_domain_placement.py.
"""

from __future__ import annotations

import pytest

from orchestrator.cluster.errors import PlacementMismatch
from orchestrator.cluster.placement_groups import (
    GroupSpec,
    Pin,
    bind_ranks,
    group_spec,
    ranks_by_node,
)
from orchestrator.cluster.ray_nodes import RayNode, domain_states
from orchestrator.cluster.topology import topology_from_nodes
from placement.errors import InvalidTopology
from placement.planner import EngineRequest, PlacementPlan, PlacementPlanner
from placement.topology import ClusterTopology, DomainState, NodeSpec

TOPOLOGY = ClusterTopology(
    nodes=(
        *(NodeSpec(node_id=f"a{t}", domain_id="nvl72-a", num_gpus=4, num_cpus=8) for t in range(4)),
        NodeSpec(node_id="h1", domain_id="hgx-1", num_gpus=8, num_cpus=16),
    )
)


def plan_for(tp_size: int, *, cpus: float = 1.0, fill_hgx: bool = True) -> PlacementPlan:
    planner = PlacementPlanner(TOPOLOGY)
    if fill_hgx:  # take the HGX node so that larger engines go to the trays
        planner.place(EngineRequest(engine_id="filler", tp_size=8, role="decode"))
    decision = planner.place(
        EngineRequest(engine_id="e", tp_size=tp_size, role="decode", num_cpus_per_shard=cpus)
    )
    assert isinstance(decision, PlacementPlan), str(decision)
    return decision


# -- plan -> placement group arguments -----------------------------------------------


def test_tp8_bundles_are_pinned_to_the_planned_nodes_in_rank_order() -> None:
    plan = plan_for(8)  # two whole trays: a0 (ranks 0-3), a1 (ranks 4-7)
    spec = group_spec(plan)
    assert spec.ray_kwargs() == {
        "name": "kvtide:e",
        "bundles": [{"GPU": 1.0, "CPU": 1.0}] * 8,
        "bundle_label_selector": [{"ray.io/node-id": "a0"}] * 4 + [{"ray.io/node-id": "a1"}] * 4,
    }
    assert spec.shard_bundle_indices == (0, 1, 2, 3, 4, 5, 6, 7)
    assert spec.host_bundle_index is None
    assert spec.planned_node_ids == ("a0",) * 4 + ("a1",) * 4


def test_a_host_bundle_leads_on_rank_zeros_node() -> None:
    plan = plan_for(8)
    spec = group_spec(plan, host_num_cpus=2)
    kwargs = spec.ray_kwargs()
    assert kwargs["bundles"] == [{"CPU": 2.0}] + [{"GPU": 1.0, "CPU": 1.0}] * 8
    assert kwargs["bundle_label_selector"][:2] == [{"ray.io/node-id": "a0"}] * 2
    assert kwargs["bundle_label_selector"][5] == {"ray.io/node-id": "a1"}
    assert spec.host_bundle_index == 0
    assert spec.shard_bundle_indices == (1, 2, 3, 4, 5, 6, 7, 8)


def test_domain_pin_selects_the_domain_label_for_every_bundle() -> None:
    spec = group_spec(plan_for(4), pin=Pin.DOMAIN, host_num_cpus=1)
    assert spec.ray_kwargs()["bundle_label_selector"] == [{"nvlink_domain": "nvl72-a"}] * 5
    assert "topology_strategy" not in spec.ray_kwargs()
    assert spec.planned_node_ids == (None,) * 5


def test_topology_pin_leaves_the_domain_to_ray_and_passes_no_strategy() -> None:
    # Ray 2.60 refuses `strategy` together with `topology_strategy`.
    spec = group_spec(plan_for(16, fill_hgx=False), pin=Pin.TOPOLOGY)
    assert spec.ray_kwargs() == {
        "name": "kvtide:e",
        "bundles": [{"GPU": 1.0, "CPU": 1.0}] * 16,
        "topology_strategy": {"nvlink_domain": "STRICT_PACK"},
    }


def test_shards_without_cpus_ask_for_a_gpu_only() -> None:
    assert group_spec(plan_for(2, cpus=0)).bundles == ({"GPU": 1.0}, {"GPU": 1.0})


def test_a_negative_host_cpu_count_is_refused() -> None:
    with pytest.raises(ValueError, match="host_num_cpus=-1 is negative"):
        group_spec(plan_for(2), host_num_cpus=-1)


def test_the_ask_is_described_in_words() -> None:
    plan = plan_for(8)
    assert group_spec(plan, host_num_cpus=1).describe_ask(plan) == (
        "8 bundles of {GPU: 1, CPU: 1} plus {CPU: 1} for the host, "
        "pinned to 2 node(s) of NVLink domain 'nvl72-a'"
    )
    assert group_spec(plan, pin=Pin.TOPOLOGY).describe_ask(plan) == (
        "8 bundles of {GPU: 1, CPU: 1}, in any one NVLink domain (nvlink_domain: STRICT_PACK)"
    )


# -- where Ray put the bundles -> ranks ordered by node -------------------------------


def test_ranks_go_node_by_node_whatever_the_bundle_order() -> None:
    # Ray alternated the bundles between two trays; bundle 0 is on a1.
    bundle_nodes = ["a1", "a0", "a1", "a0", "a1", "a0"]
    assert ranks_by_node(bundle_nodes, range(6), first_node_id="a1") == (0, 2, 4, 1, 3, 5)
    # The host's node comes first even when its lowest shard bundle is not the lowest.
    assert ranks_by_node(bundle_nodes, range(6), first_node_id="a0") == (1, 3, 5, 0, 2, 4)


def test_a_host_node_without_shards_does_not_appear_among_the_ranks() -> None:
    assert ranks_by_node(["cpu", "a0", "a0"], [1, 2], first_node_id="cpu") == (1, 2)


def _domains(**by_node: str) -> dict[str, str]:
    return dict(by_node)


def test_bind_ranks_reads_each_shards_domain_from_the_node_table() -> None:
    plan = plan_for(8)
    spec = group_spec(plan, host_num_cpus=1)
    bundle_nodes = ["a0"] * 5 + ["a1"] * 4
    ranks = bind_ranks(spec, plan, bundle_nodes, _domains(a0="nvl72-a", a1="nvl72-a"))
    assert [(r.rank, r.bundle_index, r.node_id, r.domain_id) for r in ranks] == [
        (rank, rank + 1, "a0" if rank < 4 else "a1", "nvl72-a") for rank in range(8)
    ]


def test_bind_ranks_refuses_a_bundle_off_its_pinned_node() -> None:
    plan = plan_for(8)
    bundle_nodes = ["a0"] * 4 + ["a2"] * 4
    with pytest.raises(PlacementMismatch, match="bundle 4 was pinned to node a1 but Ray placed"):
        bind_ranks(group_spec(plan), plan, bundle_nodes, _domains(a0="nvl72-a", a2="nvl72-a"))


def test_bind_ranks_refuses_shards_outside_the_planned_domain() -> None:
    plan = plan_for(4)
    spec = group_spec(plan, pin=Pin.DOMAIN)
    with pytest.raises(PlacementMismatch, match=r"\['nvl72-b'\], expected one domain"):
        bind_ranks(spec, plan, ["b0"] * 4, _domains(b0="nvl72-b"))


def test_bind_ranks_refuses_shards_spanning_domains_under_a_topology_pin() -> None:
    plan = plan_for(8)
    spec = group_spec(plan, pin=Pin.TOPOLOGY)
    nodes = ["a0"] * 4 + ["b0"] * 4
    with pytest.raises(PlacementMismatch, match=r"\['nvl72-a', 'nvl72-b'\]"):
        bind_ranks(spec, plan, nodes, _domains(a0="nvl72-a", b0="nvl72-b"))


# -- Ray's node table -> nodes, domains, topology -------------------------------------


def row(node_id: str, *, gpus: float, cpus: float, domain: str | None, alive: bool = True) -> dict:
    labels = {"ray.io/node-id": node_id}
    if domain is not None:
        labels["nvlink_domain"] = domain
    resources = {"CPU": cpus, "memory": 1e9, f"node:10.0.0.{len(node_id)}": 1.0}
    if gpus:
        resources["GPU"] = gpus
    return {"NodeID": node_id, "Alive": alive, "Labels": labels, "Resources": resources}


NODE_TABLE = [
    row("f00d", gpus=0, cpus=1, domain=None),  # the head: no GPUs
    row("b2", gpus=4, cpus=4, domain="nvl72-b"),
    row("a1", gpus=4, cpus=4, domain="nvl72-a"),
    row("a0", gpus=4, cpus=4, domain="nvl72-a"),
    row("c7", gpus=8, cpus=16, domain=None),  # an HGX node nobody labelled
    row("dead", gpus=4, cpus=4, domain="nvl72-a", alive=False),
]


def test_a_node_without_a_domain_label_is_its_own_domain() -> None:
    nodes = [RayNode.from_row(r) for r in NODE_TABLE]
    assert nodes[4] == RayNode(
        node_id="c7", alive=True, domain_id="c7", labelled=False, num_gpus=8, num_cpus=16.0
    )
    assert nodes[2].domain_id == "nvl72-a" and nodes[2].labelled


def test_topology_holds_alive_gpu_nodes_sorted_by_domain_then_node() -> None:
    topology = topology_from_nodes(RayNode.from_row(r) for r in NODE_TABLE)
    assert [(n.node_id, n.domain_id, n.num_gpus, n.num_cpus) for n in topology.nodes] == [
        ("c7", "c7", 8, 16.0),
        ("a0", "nvl72-a", 4, 4.0),
        ("a1", "nvl72-a", 4, 4.0),
        ("b2", "nvl72-b", 4, 4.0),
    ]


def test_a_cluster_without_gpu_nodes_has_no_topology() -> None:
    with pytest.raises(InvalidTopology, match="no alive node with GPUs"):
        topology_from_nodes([RayNode.from_row(NODE_TABLE[0])])


def test_domain_states_count_free_gpus_per_domain() -> None:
    nodes = [RayNode.from_row(r) for r in NODE_TABLE]
    free = {"a0": 4, "a1": 1, "b2": 0, "c7": 8, "dead": 4}
    assert domain_states(nodes, free) == (
        DomainState(
            domain_id="c7",
            node_ids=("c7",),
            num_gpus=8,
            num_free_gpus=8,
            largest_free_node_gpus=8,
            num_whole_free_nodes=1,
        ),
        DomainState(
            domain_id="nvl72-a",
            node_ids=("a0", "a1"),
            num_gpus=8,
            num_free_gpus=5,
            largest_free_node_gpus=4,
            num_whole_free_nodes=1,
        ),
        DomainState(
            domain_id="nvl72-b",
            node_ids=("b2",),
            num_gpus=4,
            num_free_gpus=0,
            largest_free_node_gpus=0,
            num_whole_free_nodes=0,
        ),
    )


def test_group_spec_is_frozen() -> None:
    spec = group_spec(plan_for(2))
    assert isinstance(spec, GroupSpec)
    with pytest.raises(AttributeError):
        spec.name = "other"  # type: ignore[misc]
