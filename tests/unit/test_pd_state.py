"""P/D refuses a model whose layers keep state outside paged KV, unless the connector
moves it: a decode engine would start those layers from an empty recurrent state.

The configs are generated from the Hugging Face configs in tests/data/hf_configs (a
hybrid model's config.json in a checkpoint directory), read as kvtide reads a model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_configs import load, load_config

from orchestrator.config import parse_config, pd_state
from orchestrator.errors import ConfigError
from placement.kv_state import LINEAR_ATTENTION, non_paged_state, pd_refusal


def checkpoint(tmp_path: Path, name: str, **change: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(load_config(name) | change))
    return tmp_path


def test_linear_attention_layers_are_non_paged_state_and_full_attention_is_not() -> None:
    (state,) = non_paged_state(load("qwen3_next"))
    assert state.kind == LINEAR_ATTENTION and state.detail == "gated_deltanet"
    assert state.layers[:4] == (0, 1, 2, 4) and 3 not in state.layers
    assert state.bytes_per_sequence_per_layer > 0
    assert non_paged_state(load("llama3_8b")) == ()
    assert non_paged_state(load("deepseek_v3")) == ()


def test_a_hybrid_model_is_refused_for_pd_naming_its_layers(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({"model": {"path": str(checkpoint(tmp_path, "qwen3_next"))}})
    message = str(refused.value)
    assert refused.value.field == "model.path"
    assert "keeps per-sequence state outside paged KV: linear_attention (gated_deltanet)" in message
    assert "in layers 0-2, 4-6, 8-10," in message and "(36 of 48," in message
    assert "The KV connector in use (kvtide's NixlConnector) declares it moves paged KV " in message
    assert "P/D needs a connector that declares it moves linear_attention state" in message
    # vLLM's own connector (kv.per_request_keep: false) moves paged blocks only too.
    with pytest.raises(ConfigError, match=r"in use \(vLLM's NixlConnector\)"):
        parse_config(
            {
                "model": {"path": str(checkpoint(tmp_path, "kimi_linear"))},
                "kv": {"per_request_keep": False},
            }
        )


def test_a_connector_that_declares_it_moves_the_state_is_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    moves = {"kvtide's NixlConnector": frozenset({LINEAR_ATTENTION})}
    monkeypatch.setattr(pd_state, "NON_PAGED_STATE_MOVED", moves)
    config = parse_config({"model": {"path": str(checkpoint(tmp_path, "qwen3_next"))}})
    assert config.model.path == str(tmp_path)
    assert pd_refusal(load("kimi_linear"), "x", {LINEAR_ATTENTION}) is None


def test_a_model_with_paged_kv_only_is_not_refused(tmp_path: Path) -> None:
    parse_config({"model": {"path": str(checkpoint(tmp_path, "llama3_8b"))}})
    assert pd_refusal(load("deepseek_v3"), "x", ()) is None
