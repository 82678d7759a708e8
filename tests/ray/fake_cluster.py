"""Multi-node Ray clusters on this machine: fake GPUs, `nvlink_domain` labels, a private
temp dir, and a driver connected for the test module (shared by the ray-tier modules)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import ray
from ray._common.test_utils import wait_for_condition
from ray.cluster_utils import Cluster

TRAYS = {f"{rack}{t}": f"nvl72-{rack}" for rack in "ab" for t in range(4)}
"""Two NVL72-like domains of four 4-GPU trays (a real one has 18; four hold a TP16)."""


def trays_and_hgx() -> dict[str, dict[str, Any]]:
    """Worker nodes: the trays of ``TRAYS`` (8 CPUs each) and one 8-GPU HGX node, h1."""
    workers: dict[str, dict[str, Any]] = {
        name: {"num_cpus": 8, "num_gpus": 4, "labels": {"nvlink_domain": domain}}
        for name, domain in TRAYS.items()
    }
    workers["h1"] = {"num_cpus": 16, "num_gpus": 8, "labels": {"nvlink_domain": "hgx-1"}}
    return workers


@dataclass
class FakeCluster:
    cluster: Cluster
    nodes: dict[str, Any] = field(default_factory=dict)  # name -> Ray node
    temp_dir: str = ""

    def name(self, node_id: str) -> str:
        return next(name for name, node in self.nodes.items() if node.node_id == node_id)

    def node_id(self, name: str) -> str:
        return str(self.nodes[name].node_id)

    def kill(self, name: str) -> None:
        """Stop a node's processes; wait (bounded) until Ray's node table says it is dead."""
        node = self.nodes.pop(name)
        self.cluster.remove_node(node)
        wait_for_condition(
            lambda: node.node_id not in {row["NodeID"] for row in ray.nodes() if row["Alive"]},
            timeout=30,
        )


def node_labels() -> dict[str, str | None]:
    """Each node's `nvlink_domain` label, read from Ray's node table."""
    return {row["NodeID"]: row["Labels"].get("nvlink_domain") for row in ray.nodes()}


@contextmanager
def fake_cluster(
    head: tuple[str, Mapping[str, Any]], workers: Mapping[str, Mapping[str, Any]]
) -> Iterator[FakeCluster]:
    """Start a head node and ``workers`` (name -> ``add_node`` arguments: num_cpus,
    num_gpus, labels), connect this process, and tear everything down after."""
    tmp = tempfile.mkdtemp(prefix="kvt-")
    saved = {key: os.environ.get(key) for key in ("RAY_TMPDIR", "RAY_worker_niceness")}
    os.environ["RAY_TMPDIR"] = tmp  # Cluster writes the cluster address under $RAY_TMPDIR/ray
    os.environ["RAY_worker_niceness"] = "0"
    os.makedirs(os.path.join(tmp, "ray"))
    cluster: Cluster | None = None
    try:
        head_name, head_args = head
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                **head_args,
                "temp_dir": tmp,
                "include_dashboard": False,
                # No idle workers: the tests start what they need.
                "_system_config": {"prestart_worker_first_driver": False},
            },
        )
        fake = FakeCluster(cluster=cluster, nodes={head_name: cluster.head_node}, temp_dir=tmp)
        for name, args in workers.items():
            fake.nodes[name] = cluster.add_node(**args, wait=False)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        yield fake
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(tmp, ignore_errors=True)
