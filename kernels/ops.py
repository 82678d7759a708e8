"""The specialised kernels as torch calls on CUDA tensors, through precompiled cubins.

``CubinSet`` reads a directory that ``kernels.compile`` wrote (``kernels/cubins/`` is the
one shipped); ``Kernels`` loads the cubins for one device's arch and checks every call's
shapes, dtypes, contiguity and alignment before launching on the current torch stream.
Inputs outside the kernels' scope raise ``ValueError`` naming the value; the gate
(``kernels.gate``) is what decides whether an engine calls these at all.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernels.compile import SHIPPED_DIR
from kernels.launch import KernelImage, LoadedKernel, load_kernel
from kernels.scope import MAX_ELEMENTS, arch_from_capability
from kernels.sources import file_sha256

__all__ = ["CubinSet", "Kernels"]


@dataclass(frozen=True, slots=True)
class CubinSet:
    """The manifest of a compiled-kernels directory."""

    root: Path
    entries: tuple[dict[str, Any], ...]
    nvidia_cutlass_dsl: str | None = None
    source_sha256: str | None = None

    @classmethod
    def open(cls, root: Path = SHIPPED_DIR) -> CubinSet:
        """Read ``root/manifest.json``; refuse a cubin or PTX file whose sha256 is not the
        one the manifest recorded (a file changed after compiling is not what it says)."""
        path = root / "manifest.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no {path}: compile the kernels first (kvtide kernels compile --out {root})"
            )
        data = json.loads(path.read_text())
        for entry in data["kernels"]:
            for kind in ("cubin", "ptx"):
                want = entry.get(f"{kind}_sha256")
                if want is None:
                    raise ValueError(f"{path}: no {kind}_sha256 for {entry[kind]}; compile again")
                got = file_sha256(root / entry[kind])
                if got != want:
                    raise ValueError(
                        f"{root / entry[kind]}: sha256 {got[:12]} is not the manifest's "
                        f"{want[:12]}; compile again"
                    )
        return cls(
            root=root,
            entries=tuple(data["kernels"]),
            nvidia_cutlass_dsl=data.get("nvidia_cutlass_dsl"),
            source_sha256=data.get("source_sha256"),
        )

    def hashes(self, arch: str) -> dict[str, str]:
        """``{file: sha256}`` of every cubin and PTX file for ``arch`` (what evidence copies)."""
        out: dict[str, str] = {}
        for e in self.entries:
            if e["arch"] == arch:
                out[e["cubin"]] = e["cubin_sha256"]
                out[e["ptx"]] = e["ptx_sha256"]
        return out

    def archs(self) -> set[str]:
        return {e["arch"] for e in self.entries}

    def entry(self, kernel: str, variant: str, arch: str) -> dict[str, Any]:
        for e in self.entries:
            if (e["kernel"], e["variant"], e["arch"]) == (kernel, variant, arch):
                return e
        have = sorted(f"{e['kernel']}/{e['variant']}@{e['arch']}" for e in self.entries)
        raise LookupError(f"no cubin for {kernel}/{variant} on {arch} in {self.root}; have {have}")

    def image(self, kernel: str, variant: str, arch: str) -> KernelImage:
        e = self.entry(kernel, variant, arch)
        ptx = self.root / e["ptx"] if e.get("ptx") else None
        return KernelImage(
            cubin=self.root / e["cubin"],
            ptx=ptx,
            entry=e["entry"],
            param_types=tuple(e["entry_params"]),
            threads=int(e["threads"]),
            smem_bytes=int(e["smem_bytes"]),
        )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _aligned(t: torch.Tensor, name: str, nbytes: int = 16) -> None:
    _require(t.is_contiguous(), f"{name} must be contiguous")
    _require(t.data_ptr() % nbytes == 0, f"{name} must start {nbytes}-byte aligned")


@dataclass
class Kernels:
    """The kernels of ``cubins`` loaded for ``device``.

    ``gpu_arch`` defaults to the device's compute capability; ``loader`` is
    ``kernels.launch.load_kernel`` (tests pass a recording stand-in, and run on CPU).
    """

    cubins: CubinSet
    device: torch.device
    backend: str | None = None
    gpu_arch: str | None = None
    loader: Callable[[KernelImage, int, str | None], LoadedKernel] = load_kernel
    _loaded: dict[tuple[str, str], LoadedKernel] = field(default_factory=dict)

    @property
    def arch(self) -> str:
        if self.gpu_arch is None:
            self.gpu_arch = arch_from_capability(*torch.cuda.get_device_capability(self.device))
        return self.gpu_arch

    def loaded(self, kernel: str, variant: str) -> LoadedKernel:
        key = (kernel, variant)
        if key not in self._loaded:
            image = self.cubins.image(kernel, variant, self.arch)
            index = self.device.index if self.device.index is not None else 0
            self._loaded[key] = self.loader(image, index, self.backend)
        return self._loaded[key]

    @property
    def launched(self) -> list[LoadedKernel]:
        """The kernels loaded so far (their backend and whether cubin or PTX ran)."""
        return list(self._loaded.values())

    def meta(self, kernel: str, variant: str) -> dict[str, Any]:
        """The manifest entry of a variant for this device's arch."""
        return self.cubins.entry(kernel, variant, self.arch)

    def _stream(self) -> int:
        if self.device.type != "cuda":
            return 0  # only a stand-in loader runs off the GPU
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def fused_add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        scale: torch.Tensor | None = None,
        inplace: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, new_residual)`` as ``reference.fused_add_rmsnorm``; FP8 e4m3 output
        when ``scale`` (one fp32) is given. ``inplace`` writes them into x and residual
        (bf16 output only)."""
        _require(x.dim() == 2 and x.shape == residual.shape, "x, residual must be [T, hidden]")
        tokens, hidden = x.shape
        _require(weight.shape == (hidden,), f"weight must be [{hidden}]")
        _require(x.dtype == residual.dtype == weight.dtype == torch.bfloat16, "inputs must be bf16")
        _require(hidden % 8 == 0, f"hidden size {hidden} must be a multiple of 8")
        _require(tokens * hidden <= MAX_ELEMENTS, "x over 2**31 elements")
        for name, t in (("x", x), ("residual", residual), ("weight", weight)):
            _aligned(t, name)
        out_name = "bf16" if scale is None else "fp8_e4m3"
        kernel = self.loaded("fused_add_rmsnorm", f"bf16-{out_name}")
        max_hidden = int(self.meta("fused_add_rmsnorm", f"bf16-{out_name}")["params"]["max_hidden"])
        _require(hidden <= max_hidden, f"hidden size {hidden} over {max_hidden}")
        if scale is not None:
            _require(not inplace, "inplace needs bf16 output (no scale)")
            _require(
                scale.numel() == 1 and scale.dtype == torch.float32 and scale.is_cuda,
                "scale must be one float32 on the GPU",
            )
        if inplace:
            out, residual_out = x, residual
        else:
            out_dtype = torch.bfloat16 if scale is None else torch.float8_e4m3fn
            out = torch.empty_like(x, dtype=out_dtype)
            residual_out = torch.empty_like(residual)
        scale_ptr = (scale if scale is not None else weight).data_ptr()
        kernel(
            tokens,
            (
                x.data_ptr(),
                residual.data_ptr(),
                weight.data_ptr(),
                out.data_ptr(),
                residual_out.data_ptr(),
                scale_ptr,
                hidden,
                float(eps),
            ),
            self._stream(),
        )
        return out, residual_out
