"""What kvtide hands Ray Serve and vLLM for GPU engines at TP8 and TP16, with DCP: the
exact placement-group bundles of each replica and the exact engine arguments, without a
cluster or a GPU (as Ray Serve LLM tests its builders).

The cluster: two NVL72 racks (18 trays of 4 GPUs each, one NVLink domain per rack) and
two 8-GPU HGX nodes (each its own domain). The config: a TP8 prefill pool, a TP8 decode
pool and a TP16 long-context decode pool with decode context parallelism 16.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from engines.vllm_engine import engine_args_for
from orchestrator.cluster.pool_layout import PoolDeployment, plan_layout
from orchestrator.cluster.step_router import step_router_config
from orchestrator.config import ConfigError, KVTideConfig, parse_config
from orchestrator.serve.engine_host import engine_deployment_options, host_engine_spec
from placement.topology import ClusterTopology, NodeSpec

TOPOLOGY = ClusterTopology(
    nodes=(
        *(
            NodeSpec(
                node_id=f"{rack}-tray{t:02d}", domain_id=f"nvl72-{rack}", num_gpus=4, num_cpus=72
            )
            for rack in "ab"
            for t in range(18)
        ),
        *(
            NodeSpec(node_id=f"hgx-{i}", domain_id=f"hgx-{i}", num_gpus=8, num_cpus=96)
            for i in (1, 2)
        ),
    )
)

CONFIG: dict[str, Any] = {
    "device": "cuda",
    "model": {
        "path": "/models/kimi-k2",
        "name": "kimi-k2",
        "dtype": "bfloat16",
        "max_model_len": 131072,
    },
    "prefill": {"tensor_parallel_size": 8, "num_cpus": 4, "max_num_seqs": 16},
    "decode": {"tensor_parallel_size": 8, "max_num_seqs": 64},
    "decode_long": {
        "tensor_parallel_size": 16,
        "decode_context_parallel_size": 16,
        "max_num_seqs": 32,
    },
    "routing": {"long_context_threshold_tokens": 32768},
    "placement": {"num_cpus_per_shard": 2},
    # Racks and HGX nodes: each listener on its own node's address.
    "server": {"internal_host": "node"},
}

HOST_IP, PORT, GCS = "10.0.3.7", 5601, "10.0.0.1:6379"


def config() -> KVTideConfig:
    return parse_config(CONFIG)


def deployment(cfg: KVTideConfig, pool_name: str) -> PoolDeployment:
    (dep,) = plan_layout(cfg, TOPOLOGY).of_pool(pool_name)
    return dep


def engine_args(cfg: KVTideConfig, pool_name: str) -> dict[str, Any]:
    """What a replica of the pool's deployment passes to vLLM's AsyncEngineArgs."""
    dep = deployment(cfg, pool_name)
    spec = host_engine_spec(cfg, pool_name, dep.domain_id, f"{pool_name}-0", PORT, HOST_IP, GCS)
    return engine_args_for(spec)


def test_each_pool_is_one_deployment_in_one_domain() -> None:
    layout = plan_layout(config(), TOPOLOGY)
    # TP8 engines fill the HGX nodes exactly; the TP16 engine takes four trays of a rack.
    assert layout.counts() == {
        "prefill-pool-hgx-1": 1,
        "decode-pool-hgx-2": 1,
        "decode-long-pool-nvl72-a": 1,
    }
    (long_plan,) = deployment(config(), "decode_long").plans
    assert long_plan.node_ids == ("a-tray00", "a-tray01", "a-tray02", "a-tray03")


def test_tp16_dcp16_replica_bundles_and_serve_options() -> None:
    cfg = config()
    opts = engine_deployment_options(cfg, "decode_long", deployment(cfg, "decode_long"))
    # DCP shards the KV cache over the TP ranks: 16 GPUs, not 16 x 16.
    assert opts == {
        "name": "decode-long-pool-nvl72-a",
        "num_replicas": 1,
        "max_ongoing_requests": 64,
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
        # A decode replica's turns' deadline and its sessions' move before it stops.
        "graceful_shutdown_timeout_s": cfg.server.request_timeout_s + cfg.kv.service_timeout_s + 5,
        "ray_actor_options": {"num_cpus": 1.0, "num_gpus": 0.0},
        "placement_group_bundles": [{"CPU": 1.0}] + [{"GPU": 1.0, "CPU": 2.0}] * 16,
        "placement_group_strategy": "PACK",
        "placement_group_bundle_label_selector": [{"nvlink_domain": "nvl72-a"}] * 17,
        # Each ingress's step stream reaches the replica it names.
        "request_router_config": step_router_config(),
    }


def test_tp8_prefill_replica_bundles_and_serve_options() -> None:
    cfg = config()
    opts = engine_deployment_options(cfg, "prefill", deployment(cfg, "prefill"))
    assert opts == {
        "name": "prefill-pool-hgx-1",
        "num_replicas": 1,
        "max_ongoing_requests": 32,
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
        "graceful_shutdown_timeout_s": 5,
        # GPU engines need no variables in their workers: no runtime env.
        "ray_actor_options": {"num_cpus": 4.0, "num_gpus": 0.0},
        "placement_group_bundles": [{"CPU": 4.0}] + [{"GPU": 1.0, "CPU": 2.0}] * 8,
        "placement_group_strategy": "PACK",
        "placement_group_bundle_label_selector": [{"nvlink_domain": "hgx-1"}] * 9,
    }


def _kv_config(engine_id: str) -> dict[str, Any]:
    return {
        "kv_connector": "NixlConnector",
        "kv_connector_module_path": "engines.kv_connector",  # kvtide's subclass
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_buffer_device": "cuda",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            "bidirectional_kv_xfer": True,
            "decoder_kv_blocks_ttl": 480,
            "kv_lease_duration": 30,
            "kv_recompute_threshold": 64,
            "kvtide_progress_wait_ms": 0.0,  # NIXL's own busy polling on GPUs
        },
    }


def test_tp16_dcp16_engine_arguments() -> None:
    assert engine_args(config(), "decode_long") == {
        "model": "/models/kimi-k2",
        "served_model_name": ["kimi-k2"],
        "dtype": "bfloat16",
        "max_model_len": 131072,
        "max_num_seqs": 32,
        "tensor_parallel_size": 16,
        "decode_context_parallel_size": 16,
        "distributed_executor_backend": "ray",
        "enable_prefix_caching": True,
        # CUDA graphs on: eager mode is for CPU engines only.
        "enforce_eager": False,
        "seed": 0,
        "disable_log_stats": False,
        "kv_transfer_config": _kv_config("decode_long-0"),
    }


def test_tp8_engine_arguments() -> None:
    cfg = config()
    expected = {
        "model": "/models/kimi-k2",
        "served_model_name": ["kimi-k2"],
        "dtype": "bfloat16",
        "max_model_len": 131072,
        "tensor_parallel_size": 8,
        "distributed_executor_backend": "ray",
        "enable_prefix_caching": True,
        "enforce_eager": False,
        "seed": 0,
        "disable_log_stats": False,
    }
    assert engine_args(cfg, "prefill") == expected | {
        "max_num_seqs": 16,
        "kv_transfer_config": _kv_config("prefill-0"),
    }
    # No DCP on the TP-only decode pool: vLLM's default (1) applies.
    assert engine_args(cfg, "decode") == expected | {
        "max_num_seqs": 64,
        "kv_transfer_config": _kv_config("decode-0"),
    }


def test_the_replica_hands_vllm_its_host_address_and_its_cluster() -> None:
    cfg = config()
    dep = deployment(cfg, "decode_long")
    spec = host_engine_spec(cfg, "decode_long", dep.domain_id, "e", PORT, HOST_IP, GCS)
    # vLLM's engine core joins this cluster (not one an address file names) ...
    assert dict(spec.env) == {"RAY_ADDRESS": GCS}
    # ... and the engine's NIXL side channel listens where peers on other hosts dial it.
    assert spec.kv_transfer is not None
    assert (spec.kv_transfer.side_channel_host, spec.kv_transfer.side_channel_port) == (
        HOST_IP,
        PORT,
    )


def test_dcp_is_refused_on_cpu_with_the_reason() -> None:
    cpu = {k: v for k, v in CONFIG.items() if k != "device"}
    with pytest.raises(ConfigError, match=r"decode_long.decode_context_parallel_size: 16 needs"):
        parse_config(cpu)


def _vllm_engine_arg_names() -> set[str]:
    """The fields of vLLM's EngineArgs, read from its source (importing vLLM takes
    seconds; parsing one file does not)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vllm is not installed")
    source = Path(spec.origin).with_name("engine") / "arg_utils.py"
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs")
    return {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def test_every_argument_kvtide_passes_is_an_engine_argument_of_the_installed_vllm() -> None:
    names = _vllm_engine_arg_names()
    cfg = config()
    for pool in ("prefill", "decode", "decode_long"):
        assert set(engine_args(cfg, pool)) <= names, set(engine_args(cfg, pool)) - names
