"""The kvtide Serve application: ingress + prefill pool + decode pool.

Three ways to run it, one builder:

* ``kvtide up [CONFIG]`` (starts or joins Ray, then ``serve.run``);
* from Python: ``serve.run(build_app(load_config(path)))``;
* Ray Serve's own tooling, with a Serve config file whose application has
  ``import_path: orchestrator.serve.app:app_builder`` and ``args: {config: kvtide.yaml}``
  (``serve run`` / ``serve deploy``; see docs/serve.md).
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from orchestrator.config import KVTideConfig, load_config, parse_config
from orchestrator.serve.engine_host import EngineHost, engine_deployment_options
from orchestrator.serve.ingress import Ingress

__all__ = ["app_builder", "build_app", "prepare_model"]


def prepare_model(config: KVTideConfig) -> str:
    """Make sure the model directory exists; generate the tiny model when none is set."""
    path = config.model.resolved_path()
    if config.model.is_generated:
        from engines.tiny_model import generate_tiny_model

        generate_tiny_model(path)
    return path


def build_app(config: KVTideConfig) -> Application:
    """The Serve application for ``config`` (engines start when it is deployed)."""
    prepare_model(config)
    pools = {
        pool.name: EngineHost.options(**engine_deployment_options(config, pool.name)).bind(
            config, pool.name
        )
        for pool in config.pools()
    }
    return Ingress.bind(config, pools["prefill"], pools["decode"], pools.get("decode_long"))


def app_builder(args: dict[str, Any]) -> Application:
    """Ray Serve application builder: ``args`` is ``{"config": PATH}`` or an inline config
    mapping under ``{"kvtide": {...}}``; empty args give the embedded default."""
    if "config" in args:
        return build_app(load_config(args["config"]))
    return build_app(parse_config(args.get("kvtide")))
