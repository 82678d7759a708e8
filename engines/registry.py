"""Engine backends by name. Importing this module imports no backend.

Each entry is ``name -> (module, class)``; the module is imported only when an engine of
that backend is created, so the orchestrator never imports vLLM until it starts one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engines.base import EngineAdapter, EngineSpec

__all__ = ["BACKENDS", "UnknownBackend", "create_engine"]

BACKENDS: dict[str, tuple[str, str]] = {
    "vllm": ("engines.vllm_engine", "VLLMEngine"),
    "simulated": ("engines.simulated", "SimulatedEngine"),
}


class UnknownBackend(ValueError):
    """An engine backend name that is not registered."""


def create_engine(spec: EngineSpec) -> EngineAdapter:
    try:
        module_name, class_name = BACKENDS[spec.backend]
    except KeyError:
        raise UnknownBackend(
            f"unknown engine backend {spec.backend!r}; choose one of {sorted(BACKENDS)}"
        ) from None
    cls = getattr(importlib.import_module(module_name), class_name)
    engine: EngineAdapter = cls(spec)
    return engine
