"""Engines placed as Ray placement groups inside one NVLink domain, on a real Ray cluster.

The cluster, ten Ray nodes on this machine with fake GPUs and `nvlink_domain` labels:

    nvl72-a   trays a0..a3, 4 GPUs and 8 CPUs each (16 GPUs)
    nvl72-b   trays b0..b3, 4 GPUs and 8 CPUs each (16 GPUs)
    hgx-1     node h1, 8 GPUs, 16 CPUs (its own domain)
    hgx-2     node h2, 8 GPUs, 16 CPUs (its own domain; also Ray's head node)

A real NVL72 domain has 18 trays of 4 GPUs; four trays are the fewest that still hold
a TP16 engine, and are what one machine can run. Every test places its engines with
a fresh `DomainPlacer` over the live cluster and releases them at the end; the
node-loss test runs last because it removes nodes.

Each shard's domain is checked against Ray's own tables: the node of its bundle from
`placement_group_table`, that node's label from `ray.nodes()`.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import ray
from fake_cluster import TRAYS, FakeCluster, fake_cluster, node_labels, trays_and_hgx
from ray.util.placement_group import placement_group_table

from orchestrator.cluster.errors import PlacementTimeout
from orchestrator.cluster.placement_groups import Pin, PlacedEngine, create_group, group_spec
from orchestrator.cluster.topology import DomainPlacer
from placement.first_fit import FirstFitPlanner
from placement.planner import EngineRequest, PlacementPlan, PlacementPlanner, Unplaceable
from placement.topology import NodeClaim

pytestmark = pytest.mark.ray

TIMEOUT_S = 3.0
"""The bound on waiting for a group Ray cannot place."""


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeCluster]:
    if ray.is_initialized():
        pytest.skip("this process is already connected to a Ray; run the ray tier on its own")
    head = ("h2", {"num_cpus": 16, "num_gpus": 8, "labels": {"nvlink_domain": "hgx-2"}})
    workers = trays_and_hgx()
    with fake_cluster(head, workers) as cluster:
        yield cluster


@pytest.fixture
def placer(fake: FakeCluster) -> Iterator[DomainPlacer]:
    placer = DomainPlacer.from_ray()
    yield placer
    for engine_id in list(placer.engines):
        placer.release(engine_id)


def decode(engine_id: str, tp_size: int) -> EngineRequest:
    return EngineRequest(engine_id=engine_id, tp_size=tp_size, role="decode")


def place(placer: DomainPlacer, engine_id: str, tp_size: int) -> PlacedEngine:
    placed = placer.place_engine(decode(engine_id, tp_size), timeout_s=30)
    assert isinstance(placed, PlacedEngine), str(placed)
    return placed


def shard_domains(placed: PlacedEngine) -> list[str]:
    """Each rank's node's `nvlink_domain` label, read from Ray's tables, not from kvtide."""
    bundle_nodes = placement_group_table(placed.group)["bundles_to_node_id"]
    labels = node_labels()
    return [labels[bundle_nodes[rank.bundle_index]] for rank in placed.ranks]


def shards_per_node(fake: FakeCluster, placed: PlacedEngine) -> dict[str, int]:
    """Shards on each node (by name), in rank order."""
    bundle_nodes = placement_group_table(placed.group)["bundles_to_node_id"]
    names = [fake.name(bundle_nodes[rank.bundle_index]) for rank in placed.ranks]
    assert names == sorted(names, key=names.index), "ranks of one node must be contiguous"
    return dict(Counter(names))


def tray_counts(counts: dict[str, int]) -> list[tuple[str, int]]:
    """(domain, shards) per node, sorted: which trays of a rack is Ray's choice of ids."""
    return sorted((TRAYS.get(name, name), n) for name, n in counts.items())


def test_tp16_and_tp8_engines_keep_every_shard_in_one_domain(
    fake: FakeCluster, placer: DomainPlacer
) -> None:
    # A TP16 needs four whole trays of one rack; nvl72-a comes first.
    tp16 = place(placer, "dec-tp16", 16)
    assert shard_domains(tp16) == ["nvl72-a"] * 16
    assert tray_counts(shards_per_node(fake, tp16)) == [("nvl72-a", 4)] * 4
    # TP8s take the HGX nodes whole before breaking into the untouched rack ...
    on_hgx1 = place(placer, "dec-tp8-1", 8)
    on_hgx2 = place(placer, "dec-tp8-2", 8)
    assert shard_domains(on_hgx1) == ["hgx-1"] * 8
    assert shards_per_node(fake, on_hgx1) == {"h1": 8}
    assert shard_domains(on_hgx2) == ["hgx-2"] * 8
    # ... and the third spans two whole trays of nvl72-b, all of its shards in it.
    tp8 = place(placer, "dec-tp8-3", 8)
    assert shard_domains(tp8) == ["nvl72-b"] * 8
    assert tray_counts(shards_per_node(fake, tp8)) == [("nvl72-b", 4)] * 2
    # kvtide's own reading agrees with Ray's tables, and the rank order is by node.
    assert [r.domain_id for r in tp8.ranks] == ["nvl72-b"] * 8
    assert [r.node_id for r in tp8.ranks] == [s.node_id for s in tp8.plan.shards]
    assert placer.snapshot().domain("nvl72-b").num_free_gpus == 8


def test_a_fragmented_cluster_where_first_fit_spans_domains_and_kvtide_does_not(
    fake: FakeCluster, placer: DomainPlacer
) -> None:
    # Fill both HGX nodes, then scatter small engines over nvl72-a:
    # two whole trays (TP4, TP4) and half a third (TP2) leave 6 GPUs free there.
    for engine_id, tp_size in [("h-1", 8), ("h-2", 8), ("s-1", 4), ("s-2", 4), ("s-3", 2)]:
        assert place(placer, engine_id, tp_size).domain_id in {"hgx-1", "hgx-2", "nvl72-a"}
    assert placer.snapshot().domain("nvl72-a").num_free_gpus == 6

    # First fit by node, on exactly this state, takes nvl72-a's 6 GPUs and 2 of nvl72-b.
    naive = FirstFitPlanner(placer.topology)
    for engine in placer.engines.values():
        naive.ledger.claim(
            engine.engine_id,
            [
                NodeClaim(node_id=n, num_gpus=c, num_cpus=float(c))
                for n, c in Counter(r.node_id for r in engine.ranks).items()
            ],
        )
    first_fit = naive.place(decode("tp8", 8))
    assert not isinstance(first_fit, Unplaceable)
    assert first_fit.domain_ids == ("nvl72-a", "nvl72-b")

    # kvtide puts the TP8 on two whole trays of nvl72-b.
    tp8 = place(placer, "tp8", 8)
    assert shard_domains(tp8) == ["nvl72-b"] * 8
    assert tray_counts(shards_per_node(fake, tp8)) == [("nvl72-b", 4)] * 2


FREE_AFTER_TWO_TP12 = (
    "  hgx-1: 8 of 8 GPUs free, largest free node 8 GPUs\n"
    "  hgx-2: 8 of 8 GPUs free, largest free node 8 GPUs\n"
    "  nvl72-a: 4 of 16 GPUs free, largest free node 4 GPUs\n"
    "  nvl72-b: 4 of 16 GPUs free, largest free node 4 GPUs"
)


def test_tp16_without_a_large_enough_domain_fails_within_the_bound_and_says_why(
    fake: FakeCluster, placer: DomainPlacer
) -> None:
    # A TP12 in each rack: 24 GPUs stay free, but no domain has 16.
    assert place(placer, "tp12-a", 12).domain_id == "nvl72-a"
    assert place(placer, "tp12-b", 12).domain_id == "nvl72-b"

    # kvtide's planner knows at once, without asking Ray.
    started = time.monotonic()
    refused = placer.place_engine(decode("big", 16), timeout_s=TIMEOUT_S)
    assert time.monotonic() - started < 1.0
    assert isinstance(refused, Unplaceable)
    assert str(refused) == (
        "engine 'big' (TP16, decode) cannot be placed: no NVLink domain has 16 free GPUs "
        "(24 are free across 4 domains, but an engine's shards never span domains); "
        "release engines in one domain or lower the TP size.\n"
        "Free GPUs per domain:\n" + FREE_AFTER_TWO_TP12
    )

    # Ray's own topology strategy would wait forever; kvtide bounds the wait.
    plan = PlacementPlanner(placer.topology).plan(decode("big", 16))
    assert isinstance(plan, PlacementPlan)
    started = time.monotonic()
    with pytest.raises(PlacementTimeout) as caught:
        create_group(group_spec(plan, pin=Pin.TOPOLOGY), plan, timeout_s=TIMEOUT_S)
    elapsed = time.monotonic() - started
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 10  # the rest: explaining, on a busy box
    assert caught.value.scheduling_state == "NO_RESOURCES"
    message = str(caught.value)
    assert message.startswith(
        "engine 'big' (TP16, decode): Ray did not place its placement group within 3 s "
        "(scheduling state NO_RESOURCES); kvtide removed the group.\n"
        "Asked: 16 bundles of {GPU: 1, CPU: 1}, in any one NVLink domain "
        "(nvlink_domain: STRICT_PACK).\n"
    )
    assert "Free GPUs per domain, as Ray reports them now:\n" + FREE_AFTER_TWO_TP12 in message
    assert message.endswith(
        "Release engines so that one domain has 16 free GPUs, lower the TP size, or wait "
        "longer if GPUs are being released."
    )
    assert [(d.domain_id, d.num_free_gpus) for d in caught.value.domains] == [
        ("hgx-1", 8),
        ("hgx-2", 8),
        ("nvl72-a", 4),
        ("nvl72-b", 4),
    ]
    # The group is gone, not left pending.
    states = {t["name"]: t["state"] for t in placement_group_table().values()}
    assert states["kvtide:big"] == "REMOVED"


def test_a_placer_with_a_stale_view_times_out_and_keeps_its_ledger(
    fake: FakeCluster, placer: DomainPlacer
) -> None:
    place(placer, "tp12-a", 12)
    # A second placer does not know about tp12-a and plans the TP16 on nvl72-a's trays.
    stale = DomainPlacer.from_ray()
    with pytest.raises(
        PlacementTimeout, match="pinned to 4 node\\(s\\) of NVLink domain 'nvl72-a'"
    ):
        stale.place_engine(decode("big", 16), timeout_s=TIMEOUT_S)
    assert stale.engines == {}
    assert stale.snapshot().domain("nvl72-a").num_free_gpus == 16


def test_the_engine_host_runs_in_its_bundle_on_rank_zeros_node(fake: FakeCluster) -> None:
    placer = DomainPlacer.from_ray(host_num_cpus=1)
    try:
        placed = place(placer, "with-host", 2)
        assert placed.spec.bundles[0] == {"CPU": 1.0}
        assert placed.host_node_id == placed.ranks[0].node_id == fake.node_id("h1")

        @ray.remote(num_cpus=0)
        def child_env() -> str | None:
            return os.environ.get("KVTIDE_TEST_HOST_ENV")

        @ray.remote(num_cpus=0)
        class Host:
            def where(self) -> tuple[str, str | None]:
                group = ray.util.get_current_placement_group()
                return ray.get_runtime_context().get_node_id(), group and group.id.hex()

            def env(self) -> tuple[str | None, str | None]:
                # A child with a runtime env of its own (as vLLM gives its workers)
                # still inherits the host's variables.
                child = child_env.options(runtime_env={"env_vars": {"OTHER": "1"}})
                return os.environ.get("KVTIDE_TEST_HOST_ENV"), ray.get(child.remote())

        options = placed.host_actor_options(env_vars={"KVTIDE_TEST_HOST_ENV": "on"})
        host = Host.options(**options).remote()  # type: ignore[attr-defined]
        node_id, group_id = ray.get(host.where.remote(), timeout=60)
        assert (node_id, group_id) == (fake.node_id("h1"), placed.group.id.hex())
        assert ray.get(host.env.remote(), timeout=60) == ("on", "on")
        ray.kill(host)
    finally:
        for engine_id in list(placer.engines):
            placer.release(engine_id)


def test_losing_a_node_re_places_its_engine_or_reports_it_unplaceable(
    fake: FakeCluster, placer: DomainPlacer
) -> None:
    # Both HGX nodes full; nvl72-a holds the victim and a neighbour (two trays
    # each); nvl72-b holds a TP4 on one tray.
    for engine_id in ("hgx-fill-1", "hgx-fill-2"):
        place(placer, engine_id, 8)
    victim = place(placer, "victim", 8)
    assert place(placer, "neighbour", 8).domain_id == "nvl72-a"
    assert place(placer, "b-small", 4).domain_id == "nvl72-b"
    assert shard_domains(victim) == ["nvl72-a"] * 8

    # One of the victim's trays dies. nvl72-a has only the victim's other tray
    # left (4 GPUs), so the victim moves to two whole trays of nvl72-b.
    fake.kill(fake.name(victim.ranks[-1].node_id))
    (moved,) = placer.refresh(timeout_s=30)
    assert moved.engine_id == "victim"
    assert moved.lost_node_ids == (victim.ranks[-1].node_id,)
    assert isinstance(moved.new, PlacedEngine)
    assert shard_domains(moved.new) == ["nvl72-b"] * 8
    assert tray_counts(shards_per_node(fake, moved.new)) == [("nvl72-b", 4)] * 2
    assert placement_group_table(victim.group)["state"] == "REMOVED"
    assert placer.engines_on(moved.new.ranks[0].node_id) == ("victim",)

    # Then hgx-1 dies. Its TP8 fits nowhere: 8 GPUs are free, 4 in each rack.
    fake.kill("h1")
    (stranded,) = placer.refresh(timeout_s=30)
    assert stranded.engine_id == "hgx-fill-1" and not stranded.replaced
    assert str(stranded.new) == (
        "engine 'hgx-fill-1' (TP8, decode) cannot be placed: no NVLink domain has 8 free "
        "GPUs (8 are free across 3 domains, but an engine's shards never span domains); "
        "release engines in one domain or lower the TP size.\n"
        "Free GPUs per domain:\n"
        "  hgx-2: 0 of 8 GPUs free, largest free node 0 GPUs\n"
        "  nvl72-a: 4 of 12 GPUs free, largest free node 4 GPUs\n"
        "  nvl72-b: 4 of 16 GPUs free, largest free node 4 GPUs"
    )
    assert sorted(placer.engines) == ["b-small", "hgx-fill-2", "neighbour", "victim"]
