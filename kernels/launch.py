"""Load a precompiled cubin and launch it on torch CUDA tensors, without the CuTe DSL.

For a GPU host that has a driver, PyTorch and cuda-bindings or CuPy but not
nvidia-cutlass-dsl (and no network): the cubins come from ``kernels.compile`` run
anywhere. Backends, each imported lazily, tried in this order:

- ``cuda-bindings`` (``cuda.bindings.driver``): ``cuModuleLoadData`` + ``cuLaunchKernel``
  in torch's primary context, parameters packed by hand with ctypes (works across
  cuda-bindings versions);
- CuPy: ``cupy.cuda.function.Module().load(image)`` and a kernel call with numpy scalars.

If the driver refuses the cubin (e.g. it predates the toolkit that built it) the loader
tries the PTX beside it, which the driver compiles itself, then that PTX with its
``.version`` lowered to the oldest ISA that knows its target (the kernels use nothing
newer); ``LoadedKernel.image_kind`` says which ran. Launches are asynchronous on the
given stream, like any torch op.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernels.resources import PTX_TARGET, PTX_VERSION

__all__ = [
    "PARAM_CTYPES",
    "KernelImage",
    "LaunchError",
    "LoadedKernel",
    "candidate_images",
    "load_kernel",
]

# PTX parameter types the kvtide kernels use → the C type a launch must pass.
PARAM_CTYPES: dict[str, type[ctypes._SimpleCData[Any]]] = {
    "u64": ctypes.c_uint64,
    "u32": ctypes.c_uint32,
    "s32": ctypes.c_int32,
    "f32": ctypes.c_float,
}


class LaunchError(RuntimeError):
    """A cubin could not be loaded or launched (no backend, driver refusal, bad args)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelImage:
    """A cubin, its PTX fallback and its entry, as ``kernels/cubins/manifest.json`` says."""

    cubin: Path
    ptx: Path | None
    entry: str
    param_types: tuple[str, ...]
    threads: int
    smem_bytes: int

    def __post_init__(self) -> None:
        unknown = [t for t in self.param_types if t not in PARAM_CTYPES]
        if unknown:
            raise ValueError(f"entry {self.entry} takes unsupported parameter types {unknown}")


Launch = Callable[[int, Sequence[int | float], int], None]


@dataclass(frozen=True, slots=True)
class LoadedKernel:
    """A kernel ready to launch: ``kernel(grid, args, stream)``; args match the entry."""

    image: KernelImage
    backend: str  # "cuda-bindings" | "cupy"
    image_kind: str  # "cubin" | "ptx" | "ptx-isa-<version>" (see candidate_images)
    _launch: Launch

    def __call__(self, grid: int, args: Sequence[int | float], stream: int) -> None:
        if len(args) != len(self.image.param_types):
            raise LaunchError(
                f"{self.image.entry} takes {len(self.image.param_types)} arguments, got {len(args)}"
            )
        if grid <= 0:
            return
        self._launch(grid, args, stream)


def load_kernel(image: KernelImage, device_index: int, backend: str | None = None) -> LoadedKernel:
    """Load ``image`` on CUDA device ``device_index`` with the first backend importable."""
    loaders: dict[str, Callable[[KernelImage, int], LoadedKernel]] = {
        "cuda-bindings": _load_cuda_bindings,
        "cupy": _load_cupy,
    }
    names = [backend] if backend else list(loaders)
    missing = []
    for name in names:
        try:
            return loaders[name](image, device_index)
        except ImportError as exc:
            missing.append(f"{name}: {exc}")
    raise LaunchError(
        "launching a cubin needs cuda-bindings or CuPy (pip install cuda-bindings); "
        + "; ".join(missing)
    )


# The oldest PTX ISA that knows each target: a driver older than the PTX the DSL writes
# (ISA 8.8, CUDA 12.9) may still take the same instructions under the older version line.
_MIN_PTX_ISA = {"sm_90a": "8.0", "sm_100a": "8.6", "sm_103a": "8.8"}


def candidate_images(image: KernelImage) -> list[tuple[str, bytes]]:
    """What to offer the driver, in order: the cubin, the PTX as written, and the PTX with
    its ``.version`` lowered to the oldest ISA for its ``.target``."""
    images = [("cubin", image.cubin.read_bytes())]
    if image.ptx is None:
        return images
    ptx = image.ptx.read_text()
    images.append(("ptx", ptx.encode() + b"\0"))
    target = PTX_TARGET.search(ptx)
    version = PTX_VERSION.search(ptx)
    lowest = _MIN_PTX_ISA.get(target.group(1)) if target else None
    if version and lowest and float(lowest) < float(version.group(1)):
        lowered = ptx[: version.start(1)] + lowest + ptx[version.end(1) :]
        images.append((f"ptx-isa-{lowest}", lowered.encode() + b"\0"))
    return images


def _first_loadable(image: KernelImage, load: Callable[[bytes], Any]) -> tuple[str, Any]:
    """(kind, module) of the first candidate the driver accepts, or LaunchError with all
    the refusals."""
    refusals = []
    for kind, data in candidate_images(image):
        try:
            return kind, load(data)
        except LaunchError as exc:
            refusals.append(f"{kind}: {exc}")
    raise LaunchError(f"the driver refused every image of {image.cubin.name}: {refusals}")


def _load_cuda_bindings(image: KernelImage, device_index: int) -> LoadedKernel:
    driver: Any = importlib.import_module("cuda.bindings.driver")

    def check(result: tuple[Any, ...], what: str) -> Any:
        err = result[0]
        if err != driver.CUresult.CUDA_SUCCESS:
            _, msg = driver.cuGetErrorString(err)
            raise LaunchError(f"{what} failed: {err} {msg!r} ({image.cubin.name})")
        return result[1] if len(result) > 1 else None

    check(driver.cuInit(0), "cuInit")
    device = check(driver.cuDeviceGet(device_index), "cuDeviceGet")
    # torch runs in the device's primary context; retain it and make it current here.
    context = check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    kind, module = _first_loadable(
        image, lambda data: check(driver.cuModuleLoadData(data), "cuModuleLoadData")
    )
    function = check(driver.cuModuleGetFunction(module, image.entry.encode()), "get function")
    ctypes_of = [PARAM_CTYPES[t] for t in image.param_types]

    def launch(grid: int, args: Sequence[int | float], stream: int) -> None:
        check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        holders = [ctype(value) for ctype, value in zip(ctypes_of, args, strict=True)]
        pointers = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        check(
            driver.cuLaunchKernel(
                function,
                grid,
                1,
                1,
                image.threads,
                1,
                1,
                image.smem_bytes,
                driver.CUstream(stream),
                ctypes.addressof(pointers),
                0,
            ),
            "cuLaunchKernel",
        )

    return LoadedKernel(image, "cuda-bindings", kind, launch)


def _load_cupy(image: KernelImage, device_index: int) -> LoadedKernel:
    cupy: Any = importlib.import_module("cupy")
    numpy: Any = importlib.import_module("numpy")
    scalar = {"u64": numpy.uint64, "u32": numpy.uint32, "s32": numpy.int32, "f32": numpy.float32}

    def load(data: bytes) -> Any:
        module = cupy.cuda.function.Module()
        try:
            module.load(data)
        except cupy.cuda.driver.CUDADriverError as exc:
            raise LaunchError(str(exc)) from exc
        return module

    with cupy.cuda.Device(device_index):
        kind, module = _first_loadable(image, load)
        function = module.get_function(image.entry)
    converters = [scalar[t] for t in image.param_types]

    def launch(grid: int, args: Sequence[int | float], stream: int) -> None:
        # The module unloads its image when collected: this closure keeps it alive.
        assert module is not None
        values = tuple(conv(value) for conv, value in zip(converters, args, strict=True))
        with cupy.cuda.Device(device_index):
            function(
                (grid,),
                (image.threads,),
                values,
                shared_mem=image.smem_bytes,
                stream=cupy.cuda.ExternalStream(stream),
            )

    return LoadedKernel(image, "cupy", kind, launch)
