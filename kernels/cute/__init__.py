"""CuTe DSL sources of the specialised kernels, and the one place that imports ``cutlass``.

``cutlass`` (PyPI ``nvidia-cutlass-dsl``) is imported only inside ``load_dsl()``, behind an
availability check that names the extra to install. Each kernel module exposes:

- ``geometry(variant)``: launch geometry, pure (the cubin launcher needs it, not cutlass);
- ``build(dsl, variant)``: the ``@cute.jit`` host function and example arguments to compile
  it with (pointers and scalars, so the cubin's entry takes plain ``u64``/``u32``/``f32``
  parameters that ``kernels.launch`` can pass without the DSL).

Kernel bodies are traced Python: ``if``/``for`` on runtime values become device control
flow, and the DSL reads the source, so kernels are written as nested functions with a
``@dsl.kernel`` / ``@dsl.jit`` decorator. ``Dsl`` types those decorators for mypy; values
inside kernels are ``Any``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from functools import cache
from typing import Any

__all__ = ["DSL_PIN", "CutlassUnavailable", "Dsl", "dsl_version", "load_dsl"]

# The version kvtide's kernels are written and checked against (vLLM 0.33's GPU build
# pins the same one).
DSL_PIN = "4.8.0"


class CutlassUnavailable(ImportError):
    """nvidia-cutlass-dsl is not importable here; compiling kernels needs it."""


class Dsl:
    """The parts of nvidia-cutlass-dsl the kernel sources use."""

    def __init__(self) -> None:
        self.cutlass: Any = importlib.import_module("cutlass")
        self.cute: Any = importlib.import_module("cutlass.cute")
        self.runtime: Any = importlib.import_module("cutlass.cute.runtime")
        self.Float32: Any = self.cutlass.Float32
        self.Int32: Any = self.cutlass.Int32

    def kernel(self, fn: Callable[..., None]) -> Callable[..., Any]:
        return self.cute.kernel(fn)  # type: ignore[no-any-return]

    def jit(self, fn: Callable[..., None]) -> Callable[..., Any]:
        return self.cute.jit(fn)  # type: ignore[no-any-return]

    def dtype(self, name: str) -> Any:
        """The DSL numeric type for a scope dtype name."""
        table = {
            "bf16": self.cutlass.BFloat16,
            "fp16": self.cutlass.Float16,
            "fp32": self.cutlass.Float32,
            "fp8_e4m3": self.cutlass.Float8E4M3FN,
        }
        return table[name]

    def gmem_ptr(self, dtype_name: str, align_bytes: int) -> Any:
        """A placeholder global-memory pointer: compiling needs its type, not a value."""
        return self.runtime.make_ptr(
            self.dtype(dtype_name), 0, self.cute.AddressSpace.gmem, assumed_align=align_bytes
        )


@cache
def load_dsl() -> Dsl:
    """Import nvidia-cutlass-dsl, or raise ``CutlassUnavailable`` naming what to install."""
    try:
        return Dsl()
    except ImportError as exc:
        raise CutlassUnavailable(
            "compiling kvtide's kernels needs nvidia-cutlass-dsl "
            f"(pip install 'kvtide[kernels]', or nvidia-cutlass-dsl=={DSL_PIN}); "
            f"import failed: {exc}"
        ) from exc


def dsl_version() -> str | None:
    """The installed nvidia-cutlass-dsl version, or None; never imports it."""
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None
