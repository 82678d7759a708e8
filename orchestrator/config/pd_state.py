"""P/D refuses a model whose layers keep state the KV connector in use does not move.

``check_pd_state(config)`` runs when a config is parsed: it reads the model's
``config.json`` (``placement.model_catalog.load_model_spec``), asks
``placement.kv_state.pd_refusal`` with the connector the engines will run (kvtide's
NixlConnector subclass, or vLLM's with ``kv.per_request_keep: false``) and what that
connector declares it moves (``engines.kv_connector.NON_PAGED_STATE_MOVED``), and raises
``ConfigError`` naming the layers. A config.json that cannot be read is left to the
engines, which report it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines.kv_connector import NON_PAGED_STATE_MOVED
from orchestrator.errors import ConfigError
from placement.kv_state import pd_refusal
from placement.model_catalog import load_model_spec
from placement.model_errors import UnsupportedModel

if TYPE_CHECKING:
    from orchestrator.config import KVTideConfig

__all__ = ["check_pd_state", "connector_in_use"]


def connector_in_use(config: KVTideConfig) -> str:
    return "kvtide's NixlConnector" if config.kv.per_request_keep else "vLLM's NixlConnector"


def check_pd_state(config: KVTideConfig) -> None:
    try:
        spec = load_model_spec(config.model.resolved_path())
    except (UnsupportedModel, OSError, ValueError):
        return
    connector = connector_in_use(config)
    why = pd_refusal(spec, connector, NON_PAGED_STATE_MOVED.get(connector, frozenset()))
    if why is not None:
        raise ConfigError(f"invalid kvtide config: model.path: {why}", field="model.path")
