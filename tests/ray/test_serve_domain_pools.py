"""The kvtide Serve app with its engine pools pinned to NVLink domains, on a real Ray
cluster of fake-GPU nodes, served over HTTP to the official `openai` client.

The cluster (nine Ray nodes on this machine):

    head      8 CPUs, no GPUs: Serve's controller and proxy, the ingress, the KV service
    nvl72-a   trays a0..a3, 4 GPUs and 8 CPUs each
    nvl72-b   trays b0..b3, 4 GPUs and 8 CPUs each
    hgx-1     node h1, 8 GPUs and 16 CPUs

The engines are kvtide's simulated engine (no GPU work: the GPUs are fake), a TP8
prefill and a TP16 decode engine. Their GPU bundles are real Ray reservations: each
shard's node is read from Ray's placement group table and its domain from Ray's node
table, never from kvtide's own plan. Engines in different processes cannot hand KV to
each other in simulation, so turns recompute (`kv_load_failure_policy: recompute`); the
send-back path itself is covered by the engine tier.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from fake_cluster import FakeCluster, fake_cluster, node_labels, trays_and_hgx
from openai import OpenAI
from ray import serve
from ray._common.test_utils import wait_for_condition
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from engines.tiny_model import TinyModelShape, generate_tiny_model
from orchestrator import runtime
from orchestrator.cli.inspect import format_engine_groups
from orchestrator.cluster.pool_layout import PoolLayout
from orchestrator.cluster.ports import free_port
from orchestrator.cluster.ray_nodes import read_ray_nodes
from orchestrator.cluster.supervisor import EnginesNotPlaced
from orchestrator.config import KVTideConfig, parse_config
from orchestrator.kv.actor import lookup_service

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeCluster]:
    if ray.is_initialized():
        pytest.skip("this process is already connected to a Ray; run the ray tier on its own")
    workers = trays_and_hgx()
    with fake_cluster(("head", {"num_cpus": 8, "num_gpus": 0}), workers) as cluster:
        yield cluster
        serve.shutdown()


@pytest.fixture(scope="module")
def port() -> int:
    """One HTTP port for the module: Serve keeps the first one it was started with."""
    return free_port()


def config_for(fake: FakeCluster, port: int, *, timeout_s: float) -> KVTideConfig:
    model = Path(fake.temp_dir) / "tiny16"
    # 16 attention and KV heads, so that TP16 divides the model.
    generate_tiny_model(model, TinyModelShape(num_attention_heads=16, num_key_value_heads=16))
    return parse_config(
        {
            "device": "cuda",
            "backend": "simulated",
            "model": {"path": str(model), "max_model_len": 4096},
            "prefill": {"tensor_parallel_size": 8, "cpu_threads_bind": None, "max_num_seqs": 8},
            "decode": {"tensor_parallel_size": 16, "cpu_threads_bind": None, "max_num_seqs": 8},
            "kv": {"kv_load_failure_policy": "recompute"},
            "server": {"port": port},
            "placement": {"timeout_s": timeout_s},
            "observability": {"metrics": False},
        }
    )


def placement_of(deployment: str) -> dict[str, Any]:
    handle = serve.get_deployment_handle(deployment, app_name=runtime.APP_NAME)
    result: dict[str, Any] = handle.placement.remote().result(timeout_s=60)
    return result


def gpu_bundle_domains(placement: dict[str, Any]) -> list[str | None]:
    """The domain of each TP rank's GPU bundle, from Ray's tables."""
    labels = node_labels()
    return [labels[b["node_id"]] for b in placement["bundles"] if b["resources"].get("GPU")]


def chat(config: KVTideConfig, session: str, text: str) -> Any:
    client = OpenAI(base_url=f"http://127.0.0.1:{config.server.port}/v1", api_key="none")
    return client.chat.completions.create(
        model=config.model.name,
        messages=[{"role": "user", "content": text}],
        max_tokens=4,
        extra_headers={"x-session-id": session},
    )


def test_an_engine_ray_cannot_place_fails_within_the_bound_and_lists_the_domains(
    fake: FakeCluster, port: int
) -> None:
    # Something outside kvtide holds both NVL72 domains: kvtide's plan (which counts
    # the GPUs as its own) puts the TP16 decode engine there, and Ray cannot place it.
    squatters = [
        placement_group(
            [{"GPU": 4}] * 4,
            strategy="PACK",
            bundle_label_selector=[{"nvlink_domain": domain}] * 4,
        )
        for domain in ("nvl72-a", "nvl72-b")
    ]
    ray.get([s.ready() for s in squatters], timeout=60)
    try:
        with pytest.raises(EnginesNotPlaced) as err:
            runtime.deploy(config_for(fake, port, timeout_s=3), say=lambda _: None)
        text = str(err.value)
        assert "within 3 s" in text
        assert "decode-pool-nvl72-a: asked 17 bundles with 16 GPUs in all in NVLink domain" in text
        assert "nvl72-a: 0 of 16 GPUs free" in text and "nvl72-b: 0 of 16 GPUs free" in text
        assert runtime.APP_NAME not in serve.status().applications  # removed, not left pending
    finally:
        for squatter in squatters:
            remove_placement_group(squatter)


def test_pools_are_pinned_to_one_domain_per_engine_and_follow_a_lost_node(
    fake: FakeCluster, port: int
) -> None:
    config = config_for(fake, port, timeout_s=120)
    layout: PoolLayout = runtime.deploy(config, say=lambda _: None)
    assert layout.counts() == {"prefill-pool-hgx-1": 1, "decode-pool-nvl72-a": 1}

    prefill = placement_of("prefill-pool-hgx-1")
    decode = placement_of("decode-pool-nvl72-a")
    assert gpu_bundle_domains(prefill) == ["hgx-1"] * 8
    assert gpu_bundle_domains(decode) == ["nvl72-a"] * 16
    decode_nodes = {b["node_id"] for b in decode["bundles"] if b["resources"].get("GPU")}
    assert len(decode_nodes) == 4  # whole trays, four of them
    assert node_labels()[decode["node_id"]] == "nvl72-a"  # the host sits in its group

    # What `kvtide inspect domains` shows operators: each engine group and its GPUs.
    groups = format_engine_groups(placement_group_table(), read_ray_nodes(alive_only=False))
    decode_line = next(line for line in groups.splitlines() if "decode-pool-nvl72-a" in line)
    assert "16 GPUs, CREATED" in decode_line
    per_node = decode_line.split("; ")[1].split(", ")  # "nvl72-a/<node>: 4" each
    assert len(per_node) == 4 and all(p.startswith("nvl72-a/") for p in per_node)
    assert sum(int(p.rsplit(": ", 1)[1]) for p in per_node) == 16

    first = chat(config, "agent-1", "hello there")
    assert first.choices[0].message.content and first.usage.completion_tokens == 4
    service = lookup_service(runtime.APP_NAME)
    assert service is not None
    assert ray.get(service.session.remote("agent-1")).engine_id == decode["engine_id"]

    supervisor = runtime.pool_supervisor(config, layout)  # what `kvtide up` runs
    assert not supervisor.reconcile().changed
    # A tray of nvl72-a dies: 12 GPUs are left there, too few for TP16.
    # The tray killed holds TP ranks of the decode engine but not its host actor: a TP
    # engine that lost a rank is lost.
    fake.kill(fake.name(min(decode_nodes - {decode["node_id"]})))
    # The KV service drops the KV the lost engine held (no pull will wait on it)...
    wait_for_condition(
        lambda: ray.get(service.session.remote("agent-1")).engine_id is None, timeout=30
    )
    # ...and the supervisor moves the engine to the domain that still fits.
    result = supervisor.reconcile()
    assert result.changed and result.layout is not None
    assert result.layout.counts() == {"prefill-pool-hgx-1": 1, "decode-pool-nvl72-b": 1}
    wait_for_condition(
        lambda: serve.status().applications[runtime.APP_NAME].status == "RUNNING",
        timeout=180,
    )
    moved = placement_of("decode-pool-nvl72-b")
    assert gpu_bundle_domains(moved) == ["nvl72-b"] * 16
    assert "decode-pool-nvl72-a" not in serve.status().applications[runtime.APP_NAME].deployments
    # The prefill engine was not restarted: same engine, same replica.
    assert placement_of("prefill-pool-hgx-1")["engine_id"] == prefill["engine_id"]
    # The conversation goes on, on the re-placed engine.
    second = chat(config, "agent-1", "hello there, again")
    assert second.usage.completion_tokens == 4
    assert second.model_extra["kvtide"]["kv_source"] != "sent_back"
