"""Config: defaults, errors that name the field, and the one conversion to engine specs."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.vllm_engine import engine_args_for
from orchestrator.config import default_config, load_config, parse_config
from orchestrator.errors import ConfigError
from orchestrator.serve.engine_host import engine_deployment_options


def test_embedded_default_is_one_prefill_and_one_decode_engine_on_their_own_cores() -> None:
    cfg = default_config()
    assert cfg.model.is_generated and cfg.model.max_model_len >= 4096
    assert (cfg.prefill.num_engines, cfg.decode.num_engines) == (1, 1)
    assert (cfg.prefill.cpu_threads_bind, cfg.decode.cpu_threads_bind) == ("0", "1")
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.1", 8000)
    assert cfg.kv.bidirectional_kv_xfer and cfg.kv.decoder_kv_blocks_ttl_s == 480


def test_errors_name_the_field_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"decode": {"num_engines": 0}})
    assert err.value.field == "decode.num_engines"
    assert "decode.num_engines" in str(err.value) and "greater than or equal to 1" in str(err.value)

    with pytest.raises(ConfigError) as err:
        parse_config({"prefill": {"num_engine": 2}})
    assert err.value.field == "prefill.num_engine" and "spelling" in str(err.value)

    with pytest.raises(ConfigError, match=r"safety_margin_s .* must be below"):
        parse_config({"kv": {"decoder_kv_blocks_ttl_s": 20, "safety_margin_s": 30}})

    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(listy)


def test_yaml_file_round_trips_into_engine_specs(tmp_path: Path) -> None:
    path = tmp_path / "kvtide.yaml"
    path.write_text(
        "model: {path: /models/llama, name: llama, dtype: bfloat16, max_model_len: 32768}\n"
        "decode: {num_engines: 3, cpu_threads_bind: '2-3', kv_cache_space_gib: 4}\n"
        "kv: {decoder_kv_blocks_ttl_s: 120, kv_recompute_threshold_tokens: 32}\n"
    )
    cfg = load_config(path)
    spec = cfg.engine_spec(cfg.decode, "decode-0", side_channel_port=7001)
    assert spec.role == "decode" and spec.model_path == "/models/llama"
    assert dict(spec.env) == {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "2-3"}
    args = engine_args_for(spec)
    assert args["model"] == "/models/llama" and args["served_model_name"] == ["llama"]
    assert args["dtype"] == "bfloat16" and args["max_model_len"] == 32768
    assert args["kv_transfer_config"] == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "engine_id": "decode-0",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            "bidirectional_kv_xfer": True,
            "decoder_kv_blocks_ttl": 120,
            "kv_recompute_threshold": 32,
        },
    }
    assert spec.kv_transfer is not None and spec.kv_transfer.side_channel_port == 7001


def test_one_directional_transfer_uses_producer_and_consumer_roles() -> None:
    cfg = parse_config({"kv": {"bidirectional_kv_xfer": False}})
    roles = [
        engine_args_for(cfg.engine_spec(pool, "e", 1))["kv_transfer_config"]["kv_role"]
        for pool in cfg.pools()
    ]
    assert roles == ["kv_producer", "kv_consumer"]


def test_pool_deployment_options() -> None:
    cfg = parse_config({"decode": {"num_engines": 4, "num_cpus": 2, "max_num_seqs": 16}})
    opts = engine_deployment_options(cfg, "decode")
    assert opts["name"] == "decode-pool" and opts["num_replicas"] == 4
    assert opts["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 0.0}
    assert opts["max_ongoing_requests"] == 32


def test_every_config_field_is_documented() -> None:
    from orchestrator.config import ConfigFile

    doc = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    for section, field in ConfigFile.model_fields.items():
        sub = getattr(field.annotation, "model_fields", None)
        names = [f"{section}.{n}" for n in sub] if sub else [section]
        for name in names:
            assert f"`{name}`" in doc, f"docs/config.md does not describe {name}"


def test_cpu_kv_cache_space_is_whole_gib() -> None:
    # vllm-cpu parses VLLM_CPU_KVCACHE_SPACE with int(): a fraction would fail engine start.
    with pytest.raises(ConfigError) as err:
        parse_config({"decode": {"kv_cache_space_gib": 0.5}})
    assert err.value.field == "decode.kv_cache_space_gib"


def test_a_long_context_pool_comes_with_its_threshold() -> None:
    cfg = parse_config(
        {
            "decode_long": {"num_engines": 2, "cpu_threads_bind": "1"},
            "routing": {"long_context_threshold_tokens": 32768},
        }
    )
    assert cfg.decode_long is not None and cfg.decode_long.role == "decode"
    assert [p.name for p in cfg.pools()] == ["prefill", "decode", "decode_long"]
    assert cfg.routing.long_context_threshold_tokens == 32768
    assert engine_deployment_options(cfg, "decode_long")["name"] == "decode-long-pool"
    for half in ({"decode_long": {}}, {"routing": {"long_context_threshold_tokens": 100}}):
        with pytest.raises(ConfigError, match="go together") as err:
            parse_config(half)
        assert err.value.field == "routing.long_context_threshold_tokens"


def test_decode_context_parallelism_is_checked_where_it_can_run() -> None:
    gpu = {"device": "cuda", "prefill": {"cpu_threads_bind": None}}
    cfg = parse_config(
        {**gpu, "decode": {"tensor_parallel_size": 8, "decode_context_parallel_size": 4}}
    )
    spec = cfg.engine_spec(cfg.decode, "d0", side_channel_port=5600)
    assert dict(spec.extra_engine_args)["decode_context_parallel_size"] == 4
    cases = [
        ({"decode": {"decode_context_parallel_size": 2}}, "needs device: cuda"),
        (
            {**gpu, "decode": {"tensor_parallel_size": 8, "decode_context_parallel_size": 3}},
            "must divide",
        ),
        ({**gpu, "prefill": {"decode_context_parallel_size": 2}}, "decode setting"),
    ]
    for data, why in cases:
        with pytest.raises(ConfigError, match=why) as err:
            parse_config(data)
        assert str(err.value.field).endswith("decode_context_parallel_size")
