"""The NVLink-domain planner, told as stories on one small cluster.

The cluster: two NVL72 racks ("nvl72-a", "nvl72-b"), each 18 trays of 4 GPUs, and
two 8-GPU HGX nodes, each its own domain ("hgx-1", "hgx-2"). 160 GPUs in all.
"""

from __future__ import annotations

import pytest

from placement.errors import DuplicateEngine, InvalidEngineRequest, UnknownEngine
from placement.first_fit import FirstFitPlacement, FirstFitPlanner
from placement.planner import (
    EngineRequest,
    PlacementPlan,
    PlacementPlanner,
    ShardAssignment,
    Unplaceable,
    leftover_for_large_engines,
)
from placement.topology import ClusterTopology, NodeClaim, NodeSpec


def tray(rack: str, index: int) -> str:
    return f"{rack}-tray{index:02d}"


def racks_and_hgx() -> ClusterTopology:
    nodes = [
        NodeSpec(node_id=tray(rack, t), domain_id=f"nvl72-{rack}", num_gpus=4, num_cpus=144)
        for rack in ("a", "b")
        for t in range(18)
    ]
    nodes += [
        NodeSpec(node_id=f"hgx-{i}", domain_id=f"hgx-{i}", num_gpus=8, num_cpus=224) for i in (1, 2)
    ]
    return ClusterTopology(nodes=tuple(nodes))


TOPOLOGY = racks_and_hgx()
DOMAIN_OF = {node.node_id: node.domain_id for node in TOPOLOGY.nodes}


def request(engine_id: str, tp_size: int, *, cpus: float = 1.0) -> EngineRequest:
    return EngineRequest(
        engine_id=engine_id, tp_size=tp_size, role="decode", num_cpus_per_shard=cpus
    )


def placed(decision: PlacementPlan | Unplaceable) -> PlacementPlan:
    assert isinstance(decision, PlacementPlan), str(decision)
    return decision


def layout(plan: PlacementPlan) -> list[tuple[int, str, int]]:
    """(rank, node, gpu index) for every shard, in rank order."""
    return [(s.rank, s.node_id, s.gpu_index) for s in plan.shards]


def whole_trays(rack: str, *indices: int) -> list[tuple[int, str, int]]:
    """The layout of an engine on whole trays, rank 0 on the first tray."""
    return [
        (rank, tray(rack, t), gpu)
        for rank, (t, gpu) in enumerate((t, gpu) for t in indices for gpu in range(4))
    ]


def test_tp8_takes_an_hgx_node_before_breaking_into_an_nvl72_rack() -> None:
    planner = PlacementPlanner(TOPOLOGY)

    # A TP8 fits an HGX node exactly; on a rack it would leave 64 of 72 GPUs.
    # Best fit takes the HGX node and keeps both racks whole.
    first = placed(planner.place(request("dec-0", 8)))
    assert first.domain_id == "hgx-1"
    assert layout(first) == [(rank, "hgx-1", rank) for rank in range(8)]
    assert [s.local_rank for s in first.shards] == list(range(8))

    # The second TP8 takes the other HGX node.
    assert placed(planner.place(request("dec-1", 8))).domain_id == "hgx-2"

    # The third has no HGX node left: two whole trays of rack a, rank 0 on tray 0.
    third = placed(planner.place(request("dec-2", 8)))
    assert third.domain_id == "nvl72-a"
    assert layout(third) == whole_trays("a", 0, 1)
    assert third.node_ids == (tray("a", 0), tray("a", 1))


def test_tp16_spans_four_whole_trays_of_one_rack_and_packs_that_rack() -> None:
    planner = PlacementPlanner(TOPOLOGY)

    # TP16 is more than an HGX node holds: four whole trays of rack a.
    big = placed(planner.place(request("dec-big-0", 16)))
    assert big.domain_id == "nvl72-a"
    assert layout(big) == whole_trays("a", 0, 1, 2, 3)
    assert {DOMAIN_OF[s.node_id] for s in big.shards} == {"nvl72-a"}
    # Bundles follow the ranks: node by node, rank 0's node first.
    assert big.bundles == tuple({"GPU": 1.0, "CPU": 1.0} for _ in range(16))
    assert [s.local_rank for s in big.shards_on(tray("a", 2))] == [0, 1, 2, 3]

    # A second TP16 goes to rack a again (56 -> 40 free) rather than opening rack
    # b: rack b stays whole for the next large engines.
    second = placed(planner.place(request("dec-big-1", 16)))
    assert second.domain_id == "nvl72-a"
    assert layout(second) == whole_trays("a", 4, 5, 6, 7)


def test_small_engines_fill_a_partly_used_tray_before_a_whole_one() -> None:
    planner = PlacementPlanner(TOPOLOGY)
    planner.place_many([request("hgx-user-1", 8), request("hgx-user-2", 8)])

    # With the HGX nodes busy a TP2 lands on rack a, tray 0, GPUs 0-1.
    assert layout(placed(planner.place(request("p-0", 2)))) == [
        (0, tray("a", 0), 0),
        (1, tray("a", 0), 1),
    ]
    # Two TP1 engines take the two GPUs left on that tray, not a fresh tray.
    assert layout(placed(planner.place(request("p-1", 1)))) == [(0, tray("a", 0), 2)]
    assert layout(placed(planner.place(request("p-2", 1)))) == [(0, tray("a", 0), 3)]
    snapshot = planner.snapshot()
    assert snapshot.node(tray("a", 0)).num_free_gpus == 0
    assert snapshot.domain("nvl72-a").num_whole_free_nodes == 17


def occupy(planner: PlacementPlanner | FirstFitPlanner, claims: list[NodeClaim]) -> None:
    """Mark GPUs as used by engines placed elsewhere (the same for both planners)."""
    planner.ledger.claim("already-running", claims)


def rack_a_nearly_full_and_hgx_busy() -> list[NodeClaim]:
    """Rack a: every tray full but tray 17, which has 2 free; HGX nodes full."""
    claims = [NodeClaim(node_id=tray("a", t), num_gpus=4, num_cpus=4) for t in range(17)]
    claims.append(NodeClaim(node_id=tray("a", 17), num_gpus=2, num_cpus=2))
    claims += [NodeClaim(node_id=f"hgx-{i}", num_gpus=8, num_cpus=8) for i in (1, 2)]
    return claims


def test_first_fit_spans_domains_where_the_planner_does_not() -> None:
    naive = FirstFitPlanner(TOPOLOGY)
    kvtide = PlacementPlanner(TOPOLOGY)
    occupy(naive, rack_a_nearly_full_and_hgx_busy())
    occupy(kvtide, rack_a_nearly_full_and_hgx_busy())

    # First fit takes the 2 GPUs left on rack a's last tray and 6 on rack b: the
    # engine's all-reduce would cross racks.
    packed = naive.place(request("dec-0", 8))
    assert isinstance(packed, FirstFitPlacement)
    assert [(s.node_id, s.gpu_index) for s in packed.shards] == [
        (tray("a", 17), 2),
        (tray("a", 17), 3),
        (tray("b", 0), 0),
        (tray("b", 0), 1),
        (tray("b", 0), 2),
        (tray("b", 0), 3),
        (tray("b", 1), 0),
        (tray("b", 1), 1),
    ]
    assert packed.node_ids == (tray("a", 17), tray("b", 0), tray("b", 1))
    assert packed.num_nodes == 3
    assert packed.domain_ids == ("nvl72-a", "nvl72-b")
    assert packed.spans_domains

    # kvtide puts the whole engine on two whole trays of rack b.
    plan = placed(kvtide.place(request("dec-0", 8)))
    assert plan.domain_id == "nvl72-b"
    assert layout(plan) == whole_trays("b", 0, 1)
    assert {DOMAIN_OF[s.node_id] for s in plan.shards} == {"nvl72-b"}


def test_a_small_engine_goes_where_the_rest_still_fits_tp16_and_tp8() -> None:
    planner = PlacementPlanner(TOPOLOGY)
    # Rack a has trays 13-17 free (20 GPUs), rack b trays 16-17 (8 GPUs), HGX full.
    occupy(
        planner,
        [NodeClaim(node_id=tray("a", t), num_gpus=4, num_cpus=4) for t in range(13)]
        + [NodeClaim(node_id=tray("b", t), num_gpus=4, num_cpus=4) for t in range(16)]
        + [NodeClaim(node_id=f"hgx-{i}", num_gpus=8, num_cpus=8) for i in (1, 2)],
    )

    # The tightest fit for a TP4 would be rack b (8 -> 4 free), leaving 20 + 4 free
    # GPUs that hold one TP16 but no TP8 after it. Rack a (20 -> 16) leaves 16 + 8:
    # exactly a TP16 and a TP8. The planner takes rack a.
    small = placed(planner.place(request("p-tp4", 4)))
    assert layout(small) == whole_trays("a", 13)

    # And both large engines still find a domain.
    assert layout(placed(planner.place(request("d-tp16", 16)))) == whole_trays("a", 14, 15, 16, 17)
    assert layout(placed(planner.place(request("d-tp8", 8)))) == whole_trays("b", 16, 17)


def test_tp16_without_a_domain_that_fits_explains_every_domain() -> None:
    planner = PlacementPlanner(TOPOLOGY)
    # Rack a: 15 trays full, 3 trays (12 GPUs) free. Rack b: 16 trays full, 2 free
    # (8 GPUs). hgx-1 free, hgx-2 full. 28 GPUs free, no domain with 16.
    occupy(
        planner,
        [NodeClaim(node_id=tray("a", t), num_gpus=4, num_cpus=4) for t in range(15)]
        + [NodeClaim(node_id=tray("b", t), num_gpus=4, num_cpus=4) for t in range(16)]
        + [NodeClaim(node_id="hgx-2", num_gpus=8, num_cpus=8)],
    )

    assert not planner.can_place(request("dec-big", 16))
    decision = planner.place(request("dec-big", 16))

    assert isinstance(decision, Unplaceable)
    assert [(d.domain_id, d.num_free_gpus) for d in decision.domains] == [
        ("nvl72-a", 12),
        ("nvl72-b", 8),
        ("hgx-1", 8),
        ("hgx-2", 0),
    ]
    assert decision.reason == (
        "engine 'dec-big' (TP16, decode) cannot be placed: no NVLink domain has 16 free "
        "GPUs (28 are free across 4 domains, but an engine's shards never span "
        "domains); release engines in one domain or lower the TP size.\n"
        "Free GPUs per domain:\n"
        "  nvl72-a: 12 of 72 GPUs free, largest free node 4 GPUs\n"
        "  nvl72-b: 8 of 72 GPUs free, largest free node 4 GPUs\n"
        "  hgx-1: 8 of 8 GPUs free, largest free node 8 GPUs\n"
        "  hgx-2: 0 of 8 GPUs free, largest free node 0 GPUs"
    )
    # Nothing was taken by the failed attempt.
    assert planner.snapshot().num_free_gpus == 28
    assert planner.ledger.engine_ids == ("already-running",)


def test_tp16_on_hgx_only_cluster_says_no_domain_is_large_enough() -> None:
    hgx_only = ClusterTopology(
        nodes=tuple(
            NodeSpec(node_id=f"hgx-{i}", domain_id=f"hgx-{i}", num_gpus=8, num_cpus=224)
            for i in (1, 2)
        )
    )
    decision = PlacementPlanner(hgx_only).place(request("dec-big", 16))
    assert isinstance(decision, Unplaceable)
    assert decision.reason.startswith(
        "engine 'dec-big' (TP16, decode) cannot be placed: no NVLink domain has 16 "
        "GPUs at all (the largest has 8)"
    )


def test_release_makes_the_gpus_available_again() -> None:
    planner = PlacementPlanner(TOPOLOGY)
    # Fill the cluster with TP16 engines: 4 per rack (64 GPUs), plus TP8 engines
    # on the HGX nodes and on the last 8 GPUs of each rack.
    for i in range(8):
        placed(planner.place(request(f"big-{i}", 16)))
    for i in range(4):
        placed(planner.place(request(f"mid-{i}", 8)))
    assert planner.snapshot().num_free_gpus == 0
    assert isinstance(planner.place(request("late", 16)), Unplaceable)

    # Releasing one TP16 engine frees its four trays; the late engine gets them.
    released = planner.release("big-1")
    assert released.domain_id == "nvl72-a"
    assert planner.snapshot().domain("nvl72-a").num_free_gpus == 16
    late = placed(planner.place(request("late", 16)))
    assert layout(late) == whole_trays("a", 4, 5, 6, 7)
    assert layout(late) == layout(released)

    # Releasing twice, or an engine never placed, is the caller's mistake.
    with pytest.raises(UnknownEngine, match="'big-1' is not placed"):
        planner.release("big-1")


def test_a_plan_sees_every_change_to_the_ledger_since_the_last_one() -> None:
    planner = PlacementPlanner(TOPOLOGY)
    # Asked twice, the planner gives the same answer: trays 0-3 of rack a.
    assert layout(placed(planner.plan(request("dec-big", 16)))) == whole_trays("a", 0, 1, 2, 3)
    assert layout(placed(planner.plan(request("dec-big", 16)))) == whole_trays("a", 0, 1, 2, 3)

    # Tray 0 is taken outside the planner (say, for maintenance). The next answer
    # moves one tray along instead of reusing what it worked out before.
    occupy(planner, [NodeClaim(node_id=tray("a", 0), num_gpus=4, num_cpus=4)])
    plan = placed(planner.place(request("dec-big", 16)))
    assert layout(plan) == whole_trays("a", 1, 2, 3, 4)


def test_several_engines_at_once_go_largest_first() -> None:
    planner = PlacementPlanner(TOPOLOGY)
    batch = [
        request("p-tp1", 1),
        request("d-tp16", 16),
        request("d-tp8", 8),
        request("p-tp4", 4),
        request("p-tp2", 2),
    ]

    # A dry run decides without taking anything.
    dry = planner.plan_many(batch)
    assert planner.snapshot().num_free_gpus == 160

    results = planner.place_many(batch)
    assert results == dry
    plans = [placed(result) for result in results]  # results come in request order
    assert [p.engine_id for p in plans] == ["p-tp1", "d-tp16", "d-tp8", "p-tp4", "p-tp2"]
    # TP16 first: four trays of rack a. TP8: an HGX node. The small engines then
    # share the other HGX node rather than cutting into a rack's trays.
    assert layout(plans[1]) == whole_trays("a", 0, 1, 2, 3)
    assert layout(plans[2]) == [(rank, "hgx-1", rank) for rank in range(8)]
    assert layout(plans[3]) == [(rank, "hgx-2", rank) for rank in range(4)]
    assert layout(plans[4]) == [(0, "hgx-2", 4), (1, "hgx-2", 5)]
    assert layout(plans[0]) == [(0, "hgx-2", 6)]
    for plan in plans:
        assert {DOMAIN_OF[s.node_id] for s in plan.shards} == {plan.domain_id}


def test_cpus_per_shard_can_spread_an_engine_over_more_trays() -> None:
    rack = ClusterTopology(
        nodes=tuple(
            NodeSpec(node_id=tray("c", t), domain_id="nvl72-c", num_gpus=4, num_cpus=8)
            for t in range(2)
        )
    )
    planner = PlacementPlanner(rack)
    # 4 CPUs per shard: each 8-CPU tray hosts only 2 shards, so TP4 takes 2 trays.
    plan = placed(planner.place(request("dec-0", 4, cpus=4)))
    assert layout(plan) == [
        (0, tray("c", 0), 0),
        (1, tray("c", 0), 1),
        (2, tray("c", 1), 0),
        (3, tray("c", 1), 1),
    ]
    assert plan.bundles[0] == {"GPU": 1.0, "CPU": 4.0}
    # Four GPUs are still free, but no CPUs next to them.
    decision = planner.place(request("dec-1", 1, cpus=1))
    assert isinstance(decision, Unplaceable)
    assert decision.reason.startswith(
        "engine 'dec-1' (TP1, decode) cannot be placed: nvl72-c has 1 or more free GPUs, "
        "but their nodes lack the 1 free CPUs each shard needs;"
    )
    assert "nvl72-c: 4 of 8 GPUs free, largest free node 2 GPUs" in decision.reason


@pytest.mark.parametrize("tp_size", [0, 17, -1])
def test_tp_size_outside_1_to_16_is_an_invalid_request(tp_size: int) -> None:
    with pytest.raises(InvalidEngineRequest, match=f"tp_size={tp_size} is outside 1..16"):
        request("bad", tp_size)


def test_other_invalid_requests_are_typed_errors() -> None:
    with pytest.raises(InvalidEngineRequest, match="must be an int"):
        EngineRequest(engine_id="bad", tp_size=True, role="decode")
    with pytest.raises(InvalidEngineRequest, match="negative"):
        request("bad", 2, cpus=-1)
    planner = PlacementPlanner(TOPOLOGY)
    placed(planner.place(request("dec-0", 4)))
    with pytest.raises(DuplicateEngine, match="'dec-0' is already placed"):
        planner.place(request("dec-0", 4))
    with pytest.raises(InvalidEngineRequest, match=r"repeated within one batch: \['x'\]"):
        planner.place_many([request("x", 1), request("x", 2)])


def test_a_plan_keeps_each_nodes_ranks_together() -> None:
    def shard(rank: int, node_id: str) -> ShardAssignment:
        return ShardAssignment(rank=rank, node_id=node_id, local_rank=0, gpu_index=rank, num_cpus=1)

    with pytest.raises(ValueError, match="not contiguous"):
        PlacementPlan(
            engine_id="e",
            role="decode",
            tp_size=3,
            domain_id="d",
            shards=(shard(0, "n1"), shard(1, "n2"), shard(2, "n1")),
        )


def test_leftover_for_large_engines_and_stranded_gpus() -> None:
    # 64 free GPUs are four TP16 engines; a whole rack leaves 8 for a TP8.
    assert leftover_for_large_engines(64) == 0
    assert leftover_for_large_engines(72) == 8
    assert leftover_for_large_engines(68) == 4 + 4
    planner = PlacementPlanner(TOPOLOGY)
    occupy(planner, rack_a_nearly_full_and_hgx_busy())
    snapshot = planner.snapshot()
    # Rack a's 2 free GPUs cannot join any TP8 or TP16 engine; rack b's 72 can.
    assert snapshot.domain("nvl72-a").num_stranded_gpus(8) == 2
    assert snapshot.domain("nvl72-b").num_stranded_gpus(16) == 0
    assert snapshot.num_stranded_gpus(8) == 2
