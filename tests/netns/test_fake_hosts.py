"""Each fake host is a host to Ray: a process started inside a Serve replica on host N
joins Ray through N's raylet, as vLLM's engine-core process does in an engine replica.

On the one-IP cluster (``tests/ray/fake_cluster.py``) the same process joins through the
head node's raylet, so the actors it creates are owned from the wrong node.
"""

from __future__ import annotations

import json
import sys
from subprocess import PIPE
from typing import Any

import pytest
import ray
from netns_cluster import NetnsCluster
from ray import serve
from ray._common.test_utils import wait_for_condition
from ray.serve.api import _run

pytestmark = [pytest.mark.ray, pytest.mark.netns]

# What a new driver inside the replica sees: its node and that node's IP.
_CHILD = """
import json, ray
ray.init(logging_level="ERROR", log_to_driver=False)
ctx = ray.get_runtime_context()
print(json.dumps({"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address()}))
"""


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Probe:
    """Reports its own node and the node a ``ray.init()`` in a child process attaches to."""

    async def where(self) -> dict[str, Any]:
        import asyncio
        import os

        ctx = ray.get_runtime_context()
        # The engine host gives its engine core the cluster's address the same way.
        env = {**os.environ, "RAY_ADDRESS": ctx.gcs_address}
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CHILD, env=env, stdout=PIPE, stderr=PIPE
        )
        out, err = await asyncio.wait_for(child.communicate(), timeout=240)
        if child.returncode != 0:
            raise RuntimeError(err.decode()[-3000:])
        return {"node_id": ctx.get_node_id(), "child": json.loads(out.decode().splitlines()[-1])}


def test_a_driver_started_in_a_replica_attaches_to_its_own_hosts_raylet(
    hosts: NetnsCluster, serve_on_head: int
) -> None:
    workers = [name for name in hosts.names if name != hosts.head_name]
    # One replica per host, pinned to it by Ray's node-id label.
    for name in workers:
        app = Probe.options(
            name=f"probe-{name}",
            placement_group_bundles=[{"CPU": 0.01}],
            placement_group_bundle_label_selector=[{"ray.io/node-id": hosts.node_id(name)}],
        ).bind()
        _run(app, _blocking=False, name=f"probe-{name}", route_prefix=None)
    try:
        wait_for_condition(
            lambda: all(
                serve.status().applications[f"probe-{n}"].status == "RUNNING" for n in workers
            ),
            timeout=240,
        )
        for name in workers:
            handle = serve.get_app_handle(f"probe-{name}")
            seen = handle.where.remote().result(timeout_s=300)
            assert seen["node_id"] == hosts.node_id(name), name  # the replica is on N...
            # ...and the new driver joined through N's raylet, with N's IP.
            assert seen["child"] == {"node_id": hosts.node_id(name), "node_ip": hosts.ip(name)}
    finally:
        for name in workers:
            serve.delete(f"probe-{name}")


def test_every_host_has_its_own_ip_and_labels_in_rays_node_table(hosts: NetnsCluster) -> None:
    rows = {row["NodeID"]: row for row in ray.nodes() if row["Alive"]}
    for name in hosts.names:
        row = rows[hosts.node_id(name)]
        assert row["NodeManagerAddress"] == hosts.ip(name)
    assert len({hosts.ip(n) for n in hosts.names}) == len(hosts.names)
    domains = {hosts.name(nid): row["Labels"].get("nvlink_domain") for nid, row in rows.items()}
    assert domains == {
        "head": None,
        "p0": "hgx-p",
        "a0": "nvl-a",
        "a1": "nvl-a",
        "b0": "nvl-b",
        "b1": "nvl-b",
    }
