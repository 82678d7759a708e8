"""Published model configs shipped with kvtide, and reading a model by name or path.

`kvtide plan --model deepseek-v3` and the simulated engine accept either a built-in
name or a path to a Hugging Face `config.json` (or the checkpoint directory holding
it). The built-in configs are the published `config.json` files of each model, kept
in `placement/data/hf_configs/`.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from placement.model_errors import UnsupportedModel
from placement.model_spec import ModelSpec

__all__ = ["BUILTIN_MODELS", "builtin_model_spec", "load_model_spec"]

# name -> file in placement/data/hf_configs
BUILTIN_MODELS: dict[str, str] = {
    "deepseek-v3": "deepseek_v3.json",
    "kimi-k2": "kimi_k2.json",
    "kimi-linear": "kimi_linear.json",
    "qwen3-next": "qwen3_next.json",
    "llama3-8b": "llama3_8b.json",
}


def builtin_model_spec(name: str) -> ModelSpec:
    """The `ModelSpec` of a built-in model (`deepseek-v3`, `kimi-k2`, ...)."""
    return _builtin(name.lower().replace("_", "-"))


@cache
def _builtin(key: str) -> ModelSpec:  # specs are frozen: one shared instance per model
    if key not in BUILTIN_MODELS:
        raise UnsupportedModel(
            f"no built-in model named {key!r}; choose one of {', '.join(BUILTIN_MODELS)} "
            "or pass the path of a config.json."
        )
    text = (
        resources.files("placement")
        .joinpath("data", "hf_configs", BUILTIN_MODELS[key])
        .read_text(encoding="utf-8")
    )
    return ModelSpec.from_hf_config(json.loads(text), name=key)


def load_model_spec(model: str) -> ModelSpec:
    """A built-in model by name, else a `config.json` (or a directory holding one)."""
    if model.lower().replace("_", "-") in BUILTIN_MODELS:
        return builtin_model_spec(model)
    path = Path(model)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise UnsupportedModel(
            f"{model!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a "
            "config.json file or a checkpoint directory holding one."
        )
    try:
        config: Any = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(
            f"cannot read {str(config_file)!r} as JSON ({exc}); pass a Hugging Face config.json."
        ) from None
    if not isinstance(config, dict):
        raise UnsupportedModel(f"{str(config_file)!r} holds no JSON object; pass a config.json.")
    # "/models/DeepSeek-V3/config.json" is "DeepSeek-V3"; "kimi_k2.json" is "kimi_k2".
    name = config_file.parent.name if config_file.name == "config.json" else config_file.stem
    return ModelSpec.from_hf_config(config, name=name)
