"""A placed engine's vLLM spec: the plan's TP size, Ray workers, the CPU platform plugin.

Pure: no cluster. The engine tier runs it for real in tests/engine/test_tp2_ray_executor.py.
"""

from __future__ import annotations

import pytest

from engines.base import EngineSpec
from engines.vllm_engine import engine_args_for
from orchestrator.cluster.placed_engine import placed_engine_spec
from placement.planner import EngineRequest, PlacementPlan, PlacementPlanner
from placement.topology import ClusterTopology, NodeSpec

TOPOLOGY = ClusterTopology(
    nodes=tuple(NodeSpec(node_id=f"a{t}", domain_id="d0", num_gpus=1, num_cpus=4) for t in range(2))
)


def tp2_plan() -> PlacementPlan:
    plan = PlacementPlanner(TOPOLOGY).place(EngineRequest(engine_id="e", tp_size=2, role="both"))
    assert isinstance(plan, PlacementPlan), str(plan)
    return plan


def spec(**overrides: object) -> EngineSpec:
    fields: dict[str, object] = {
        "engine_id": "e",
        "role": "both",
        "model_path": "/m",
        "served_model_name": "m",
        "env": (("VLLM_CPU_KVCACHE_SPACE", "1"),),
        "extra_engine_args": (("enable_chunked_prefill", False),),
    }
    return EngineSpec(**(fields | overrides))  # type: ignore[arg-type]


def test_a_cpu_engine_runs_ray_workers_at_the_plans_tp_size_with_the_plugin_on() -> None:
    placed = placed_engine_spec(spec(), tp2_plan())
    assert placed.tensor_parallel_size == 2
    assert dict(placed.env) == {"VLLM_CPU_KVCACHE_SPACE": "1", "KVTIDE_CPU_RAY_PLATFORM": "1"}
    args = engine_args_for(placed)
    assert args["tensor_parallel_size"] == 2
    assert args["distributed_executor_backend"] == "ray"
    assert args["enable_chunked_prefill"] is False


def test_a_gpu_engine_needs_no_platform_plugin() -> None:
    placed = placed_engine_spec(spec(device="cuda"), tp2_plan())
    assert dict(placed.env) == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert engine_args_for(placed)["distributed_executor_backend"] == "ray"


def test_a_spec_for_another_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="engine spec 'other' does not match plan 'e'"):
        placed_engine_spec(spec(engine_id="other"), tp2_plan())


def test_a_replica_engine_joins_its_cluster_and_listens_on_its_hosts_address() -> None:
    from orchestrator.config import parse_config
    from orchestrator.serve.engine_host import host_engine_spec

    cfg = parse_config({"placement": {"mode": "domain"}, "decode": {"tensor_parallel_size": 2}})
    spec = host_engine_spec(cfg, "decode", "d0", "e", 5601, "10.0.0.7", "10.0.0.1:6379")
    # vLLM's engine core, a process of its own, joins this cluster to create the workers.
    assert dict(spec.env)["RAY_ADDRESS"] == "10.0.0.1:6379"
    assert dict(spec.env)["KVTIDE_CPU_RAY_PLATFORM"] == "1"
    # Peers on other hosts reach the NIXL side channel at the host's address.
    assert spec.kv_transfer is not None
    assert spec.kv_transfer.side_channel_host == "10.0.0.7"
    # A TP=1 engine runs in the replica: no Ray workers, no cluster address needed.
    tp1 = host_engine_spec(cfg, "prefill", "d0", "p", 5602, "10.0.0.7", "10.0.0.1:6379")
    assert "RAY_ADDRESS" not in dict(tp1.env)
