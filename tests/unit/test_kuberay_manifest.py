"""examples/kuberay/rayservice.yaml deploys the application ``serve deploy`` deploys.

Its ``serveConfigV2`` is read as Serve reads a config file (``ServeDeploySchema``), the
import path resolved as Serve resolves it, and the application built onto the cluster
the manifest's worker groups make: one Ray node per pod, with the ``nvlink_domain``
label and the GPUs and CPUs its container is given. No Ray is started: the builder's
placement step (``layout_for``) reads Ray's node table, so the test plans the same
layout from the nodes the manifest describes (``plan_layout``, pure).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from ray.serve import Application
from ray.serve._private.utils import import_attr
from ray.serve.schema import ServeDeploySchema

from orchestrator import runtime
from orchestrator.cluster.pool_layout import plan_layout
from orchestrator.cluster.ray_nodes import NVLINK_DOMAIN_LABEL, RayNode
from orchestrator.cluster.topology import topology_from_nodes
from orchestrator.config import parse_config
from orchestrator.serve.app import app_builder, build_app

REPO = Path(__file__).resolve().parents[2]
MANIFEST = yaml.safe_load((REPO / "examples" / "kuberay" / "rayservice.yaml").read_text())
CLUSTER = MANIFEST["spec"]["rayClusterConfig"]


def _serve_config() -> ServeDeploySchema:
    return ServeDeploySchema.model_validate(yaml.safe_load(MANIFEST["spec"]["serveConfigV2"]))


def _labels(start_params: dict[str, str]) -> dict[str, str]:
    """``ray start --labels k=v,k2=v2`` as a mapping."""
    text = start_params.get("labels", "")
    return dict(pair.split("=", 1) for pair in text.split(",") if pair)


def _nodes() -> list[RayNode]:
    """The Ray nodes the worker groups start, as ``ray.nodes()`` would list them."""
    nodes = []
    for group in CLUSTER["workerGroupSpecs"]:
        [container] = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        for i in range(group["replicas"]):
            row: dict[str, Any] = {
                "NodeID": f"{group['groupName']}-{i}",
                "Alive": True,
                "Labels": _labels(group["rayStartParams"]),
                "Resources": {"GPU": float(limits["nvidia.com/gpu"]), "CPU": float(limits["cpu"])},
            }
            nodes.append(RayNode.from_row(row))
    return nodes


def test_the_serve_config_builds_kvtides_application_on_the_manifests_cluster() -> None:
    [app] = _serve_config().applications
    builder = import_attr(app.import_path)
    assert builder is app_builder
    config = parse_config(app.args["kvtide"])  # the builder's own parse: a bad field fails
    assert config.device == "cuda" and config.placement.by_domain
    # Each worker group is one NVLink domain, labelled as kvtide reads it.
    nodes = _nodes()
    assert all(node.labelled for node in nodes)
    assert {n.domain_id for n in nodes} == {
        _labels(g["rayStartParams"])[NVLINK_DOMAIN_LABEL] for g in CLUSTER["workerGroupSpecs"]
    }
    layout = plan_layout(config, topology_from_nodes(nodes))  # raises if an engine fits nowhere
    assert layout.counts() and all(d.domain_id for d in layout.deployments)
    assert isinstance(build_app(config, layout), Application)


def test_the_manifest_and_docs_serve_config_deploy_the_same_application() -> None:
    docs = ServeDeploySchema.model_validate(
        yaml.safe_load((REPO / "docs" / "serve_config.yaml").read_text())
    )
    [ours], [theirs] = _serve_config().applications, docs.applications
    assert (ours.name, ours.route_prefix, ours.import_path) == (
        theirs.name,
        theirs.route_prefix,
        theirs.import_path,
    )

    # Every field the documented file sets, the manifest sets to the same value.
    def leaves(tree: dict[str, Any], path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
        out: dict[tuple[str, ...], Any] = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(leaves(value, (*path, key)))
            else:
                out[(*path, key)] = value
        return out

    manifest_args = leaves(ours.args)
    for field, value in leaves(theirs.args).items():
        assert manifest_args.get(field) == value, field


def test_every_ray_pod_starts_with_the_environment_kvtide_runs_ray_with() -> None:
    wanted = {**runtime.SERVE_IN_LOOP_ENV, **runtime.DIRECT_INGRESS_ENV, "RAY_worker_niceness": "0"}
    groups = [CLUSTER["headGroupSpec"], *CLUSTER["workerGroupSpecs"]]
    for group in groups:
        [container] = group["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env == wanted, group.get("groupName", "head")
    # The head runs the controller and the KV service, not engines.
    assert CLUSTER["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
