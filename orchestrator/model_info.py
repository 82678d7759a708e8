"""Facts about a served checkpoint that the orchestrator needs, read from its config.json."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.errors import ConfigError
from placement.capacity import kv_bytes_per_token
from placement.hf_config import parse_hf_config

__all__ = ["DTYPE_BYTES", "kv_bytes_per_token_of"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token_of(model_path: str, dtype: str) -> int:
    """KV bytes one token takes on one engine (TP=1) of the checkpoint at ``model_path``."""
    config_file = Path(model_path) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read {config_file}: {exc}; model.path must be a Hugging Face checkpoint "
            "directory with a config.json",
            field="model.path",
        ) from None
    if dtype == "auto":
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    spec = parse_hf_config(config, name=Path(model_path).name)
    return int(kv_bytes_per_token(spec, kv_dtype_bytes=DTYPE_BYTES.get(dtype, 2)))
