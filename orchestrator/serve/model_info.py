"""Facts about a served checkpoint that the orchestrator needs, read from its config.json."""

from __future__ import annotations

from orchestrator.errors import ConfigError
from placement.capacity import kv_bytes_per_token
from placement.model_catalog import load_model_spec
from placement.model_errors import UnsupportedModel

__all__ = ["DTYPE_BYTES", "kv_bytes_per_token_of"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token_of(model_path: str, dtype: str) -> int:
    """KV bytes one token takes on one engine (TP=1) of the checkpoint at ``model_path``;
    ``dtype="auto"`` takes the checkpoint's own dtype."""
    try:
        spec = load_model_spec(model_path)
    except UnsupportedModel as exc:
        raise ConfigError(f"model.path: {exc}", field="model.path") from None
    kv_dtype_bytes = spec.dtype_bytes if dtype == "auto" else DTYPE_BYTES.get(dtype, 2)
    return int(kv_bytes_per_token(spec, kv_dtype_bytes=kv_dtype_bytes))
