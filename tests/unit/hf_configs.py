"""The Hugging Face ``config.json`` files the placement tests read (tests/data/hf_configs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from placement.model_spec import ModelSpec

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "hf_configs"


def load_config(name: str) -> dict[str, Any]:
    """The parsed ``{name}.json``, as a checkpoint's config.json."""
    config: dict[str, Any] = json.loads((CONFIGS / f"{name}.json").read_text())
    return config


def load(name: str) -> ModelSpec:
    """The model spec kvtide reads from ``{name}.json``."""
    return ModelSpec.from_hf_config(load_config(name), name=name)
