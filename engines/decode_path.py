"""Which decode path an engine runs, and why: ``kernels.gate``'s decision, carried in its spec.

The orchestrator decides once, where it builds an ``EngineSpec`` (``decode_path_for``),
and the spec carries the result (``DecodePath``) to the engine:

* ``DecodePath.engine`` is the shape the gate decided on (``None``: the gate was not
  asked: a CPU engine, a simulated one, or no ``gpu_arch`` in the config);
* ``DecodePath.paths`` are the specialised paths the engine runs, each one the config
  opted in to, the gate allowed on checked-in evidence, AND that vLLM can take today
  (``kernels.vllm_plugin.INTEGRATED_PATHS``: vLLM's own Kimi K3 path; kvtide's kernels
  have no vLLM integration yet);
  empty: the stock path;
* ``DecodePath.reason`` is the gate's reason, kept for ``kvtide inspect`` and the logs.

``decode_path_settings`` turns it into what vLLM needs (``kernels.vllm_plugin``): the
plugin's environment variables and the ``additional_config`` keys. It re-runs the gate,
so an engine whose decision no longer holds refuses to start. ``check_decode_backend``
refuses vLLM's Kimi K3 backend in engine args the decision did not ask for.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kernels.gate import (
    KIMI_K3_ADDITIONAL_CONFIG,
    KIMI_K3_PATH,
    VALIDATED,
    EngineShape,
    ValidatedScope,
    decide,
)
from kernels.vllm_plugin import (
    INTEGRATED_PATHS,
    EngineSettings,
    KernelGateRefused,
    check_additional_config,
    engine_settings,
)

__all__ = [
    "STOCK",
    "DecodePath",
    "check_decode_backend",
    "choose_decode_path",
    "decode_path_settings",
]

STOCK = "stock"
"""The name of the path an engine runs when no specialised path is on: vLLM's own."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodePath:
    """The decode path of one engine and why (see the module docstring).

    Invariant: ``paths`` is empty when ``engine`` is None; every path in it was enabled
    by ``kernels.gate.decide(engine)`` when the decision was made.
    """

    paths: tuple[str, ...] = ()
    reason: str = "no specialised decode path was asked for"
    engine: EngineShape | None = None

    @property
    def name(self) -> str:
        """``stock``, or the specialised paths joined with ``+``."""
        return "+".join(self.paths) or STOCK


def choose_decode_path(
    engine: EngineShape,
    validated: tuple[ValidatedScope, ...] = VALIDATED,
    opted_in: Collection[str] = (),
) -> DecodePath:
    """The gate's decision for ``engine`` as a ``DecodePath``; ``opted_in`` are the paths
    the config's ``specialised_paths`` names."""
    decisions = decide(engine, validated, opted_in)
    on = [d for d in decisions if d.enabled and d.path in INTEGRATED_PATHS]
    if on:
        reason = "; ".join(f"{d.path}: {d.reason}" for d in on)
        return DecodePath(paths=tuple(d.path for d in on), reason=reason, engine=engine)
    why = [
        f"{d.path}: "
        + (d.reason if not d.enabled else "passed the gate but has no vLLM integration yet")
        for d in decisions
    ]
    return DecodePath(reason="; ".join(why), engine=engine)


def decode_path_settings(
    path: DecodePath, validated: tuple[ValidatedScope, ...] = VALIDATED
) -> EngineSettings:
    """The plugin's environment and vLLM's ``additional_config`` for ``path``; nothing for
    the stock path. Raises ``KernelGateRefused`` if the gate now refuses one of its paths."""
    if path.engine is None or not path.paths:
        return EngineSettings(env={}, additional_config={})
    return engine_settings(path.engine, path.paths, validated)


def check_decode_backend(
    additional_config: Mapping[str, Any] | None,
    path: DecodePath,
    validated: tuple[ValidatedScope, ...] = VALIDATED,
) -> None:
    """Refuse vLLM's Kimi K3 backend in ``additional_config`` unless ``path`` runs it and
    the gate still allows it for ``path.engine`` (``KernelGateRefused`` names why)."""
    backend = (additional_config or {}).get("decode_backend")
    if backend != KIMI_K3_ADDITIONAL_CONFIG["decode_backend"]:
        return
    if path.engine is None or KIMI_K3_PATH not in path.paths:
        raise KernelGateRefused(
            f"additional_config asks for decode_backend {backend!r} (vLLM's Kimi K3 path) "
            f"but this engine's decode path is {path.name}: {path.reason}; remove it from "
            "the engine args (kvtide turns it on where kernels.gate allows it)"
        )
    check_additional_config(additional_config, path.engine, validated)
