"""The kvtide Serve application: ingress + prefill pool + decode pool.

Three ways to run it, one builder:

* ``kvtide up [CONFIG]`` (starts or joins Ray, then ``serve.run``);
* from Python: ``serve.run(build_app(load_config(path)))``;
* Ray Serve's own tooling, with a Serve config file whose application has
  ``import_path: orchestrator.serve.app:app_builder`` and ``args: {config: kvtide.yaml}``
  (``serve run`` / ``serve deploy``; see docs/serve.md).
"""

from __future__ import annotations

import hashlib
from typing import Any

from ray.serve import Application

from orchestrator.cluster.pool_layout import PoolLayout, plan_layout, unpinned_layout
from orchestrator.config import KVTideConfig, load_config, parse_config
from orchestrator.serve.engine_host import EngineHost, engine_deployment_options
from orchestrator.serve.ingress import Ingress

__all__ = ["app_builder", "build_app", "layout_for", "prepare_model"]


def prepare_model(config: KVTideConfig) -> str:
    """Make sure the model directory exists; generate the tiny model when none is set."""
    path = config.model.resolved_path()
    if config.model.is_generated:
        from engines.tiny_model import generate_tiny_model

        generate_tiny_model(path)
    return path


def layout_for(config: KVTideConfig, running: PoolLayout | None = None) -> PoolLayout:
    """The pools' deployments: planned into NVLink domains of the live Ray cluster when
    ``placement.mode`` is domain (needs ``ray.init``), else one per pool."""
    if not config.placement.by_domain:
        return unpinned_layout(config)
    from orchestrator.cluster.topology import live_topology

    return plan_layout(config, live_topology(), running=running)


def build_app(config: KVTideConfig, layout: PoolLayout | None = None) -> Application:
    """The Serve application for ``config`` (engines start when it is deployed).

    ``layout`` defaults to ``layout_for(config)``; raises ``EnginesUnplaceable`` when
    the cluster has no room for an engine in any one NVLink domain.
    """
    prepare_model(config)
    layout = layout or layout_for(config)
    pools: dict[str, list[Application]] = {pool.name: [] for pool in config.pools()}
    weights: dict[str, list[int]] = {pool.name: [] for pool in config.pools()}
    # Prefill first: each decode deployment is given the prefill deployments to warm its
    # KV transfers with (``orchestrator.serve.warm_up``).
    for dep in sorted(layout.deployments, key=lambda d: d.pool_name != "prefill"):
        options = engine_deployment_options(config, dep.pool_name, dep)
        if layout.by_domain:
            options.update(_stable_version(config, dep.name))
        warm_with = list(pools["prefill"]) if dep.pool_name != "prefill" else []
        pools[dep.pool_name].append(
            EngineHost.options(**options).bind(config, dep.pool_name, dep.domain_id, warm_with)
        )
        weights[dep.pool_name].append(dep.num_replicas)
    ingress = Ingress.options(**ingress_options(config))
    if layout.by_domain:
        # A new set of engine deployments (or replicas per deployment) restarts the
        # ingress so that it balances over them; the same set keeps it.
        ingress = ingress.options(**_stable_version(config, repr(sorted(layout.counts().items()))))
    return ingress.bind(
        config, pools["prefill"], pools["decode"], pools.get("decode_long") or None, weights
    )


def ingress_options(config: KVTideConfig) -> dict[str, Any]:
    """The ingress deployment's Serve options: the environment its vLLM serving layer
    reads when it loads (vLLM reads tool-call strictness once, at import), and, stopped
    by a redeploy, its turns' deadline for the turns it runs to finish (Serve's own
    20 s would cut a longer one while the decode replica it runs on waits for it)."""
    options: dict[str, Any] = {"graceful_shutdown_timeout_s": config.server.request_timeout_s + 5}
    env = {}
    if not config.model.tool_structural_tags:
        env["VLLM_ENFORCE_STRICT_TOOL_CALLING"] = "0"
    if env:
        options["ray_actor_options"] = {"runtime_env": {"env_vars": env}}
    return options


def _stable_version(config: KVTideConfig, key: str) -> dict[str, Any]:
    """Serve options that give a deployment a version fixed by ``config`` and ``key``.

    Serve versions deployments deployed from Python at random, so re-deploying the
    app would restart every replica; with a stable version a re-deploy after a lost
    node restarts only the deployments whose placement changed.
    """
    digest = hashlib.sha256(f"{config!r}|{key}".encode()).hexdigest()[:16]
    return {"version": digest, "_internal": True}


def app_builder(args: dict[str, Any]) -> Application:
    """Ray Serve application builder: ``args`` is ``{"config": PATH}`` or an inline config
    mapping under ``{"kvtide": {...}}``; empty args give the embedded default."""
    if "config" in args:
        return build_app(load_config(args["config"]))
    return build_app(parse_config(args.get("kvtide")))
