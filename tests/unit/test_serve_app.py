"""The Serve application is buildable without a cluster, from Python and from Serve's
config file format."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from orchestrator.config import parse_config
from orchestrator.errors import ConfigError
from orchestrator.serve.app import app_builder, ingress_options

REPO = Path(__file__).resolve().parents[2]


def test_documented_serve_config_file_is_valid_and_points_at_the_builder() -> None:
    raw = yaml.safe_load((REPO / "docs" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw)
    [app] = schema.applications
    assert app.import_path == "orchestrator.serve.app:app_builder"
    assert app.args["kvtide"]["kv"]["decoder_kv_blocks_ttl_s"] == 480


def test_builder_takes_inline_config_or_a_file(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()  # an existing checkpoint directory: nothing is generated
    app = app_builder({"kvtide": {"model": {"path": str(model), "name": "m"}}})
    assert isinstance(app, Application)
    cfg = tmp_path / "kvtide.yaml"
    cfg.write_text(f"model: {{path: {model}}}\ndecode: {{num_engines: 2}}\n")
    assert isinstance(app_builder({"config": str(cfg)}), Application)
    with pytest.raises(ConfigError, match=r"decode\.num_engines"):
        app_builder({"kvtide": {"model": {"path": str(model)}, "decode": {"num_engines": -1}}})


def test_a_replaced_ingress_replica_waits_for_its_turns_deadline() -> None:
    # A redeploy replaces the ingress with the decode replicas: Serve's own 20 s would
    # cut a turn the decode replica it runs on still waits for.
    config = parse_config({"server": {"request_timeout_s": 90}})
    assert ingress_options(config)["graceful_shutdown_timeout_s"] == 90 + 5
