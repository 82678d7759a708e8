"""Launching precompiled cubins: what can be checked here, and (gpu tier) the real thing.

The shipped manifest must describe cubins that exist with an entry the launcher can pack
arguments for, and a cubin that is not the file the manifest hashed is refused; a launch
checks its argument count. On a GPU, the kernels run from the shipped (or freshly
compiled) cubins and match the torch references.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kernels import reference
from kernels.compile import SHIPPED_ARCHS, SHIPPED_DIR
from kernels.launch import KernelImage, LaunchError, LoadedKernel, candidate_images
from kernels.ops import CubinSet, Kernels


def test_shipped_manifest_points_at_real_files() -> None:
    cubins = CubinSet.open(SHIPPED_DIR)
    assert cubins.archs() == set(SHIPPED_ARCHS)
    norm = cubins.image("fused_add_rmsnorm", "bf16-fp8_e4m3", "sm_90a")
    assert norm.cubin.is_file() and norm.ptx is not None and norm.ptx.is_file()
    assert norm.param_types == ("u64",) * 6 + ("u32", "f32")
    assert norm.smem_bytes == 32 and norm.threads == 256
    hashes = cubins.hashes("sm_90a")
    assert set(hashes) == {
        f"sm_90a/fused_add_rmsnorm-bf16-{o}.{x}"
        for o in ("bf16", "fp8_e4m3")
        for x in ("cubin", "ptx")
    }


def test_a_cubin_changed_after_compiling_is_refused(tmp_path: Path) -> None:
    copy = tmp_path / "cubins"
    shutil.copytree(SHIPPED_DIR, copy)
    CubinSet.open(copy)  # an intact copy opens
    ptx = copy / "sm_90a" / "fused_add_rmsnorm-bf16-bf16.ptx"
    ptx.write_text(ptx.read_text() + "// edited\n")
    with pytest.raises(
        ValueError, match=r"fused_add_rmsnorm-bf16-bf16.ptx: sha256 .* not the manifest's"
    ):
        CubinSet.open(copy)


def test_a_missing_cubin_names_what_there_is() -> None:
    with pytest.raises(LookupError, match=r"no cubin for fused_add_rmsnorm/bf16-bf16 on sm_80a"):
        CubinSet.open(SHIPPED_DIR).image("fused_add_rmsnorm", "bf16-bf16", "sm_80a")


def test_image_refuses_parameter_types_it_cannot_pack(tmp_path: object) -> None:
    with pytest.raises(ValueError, match=r"unsupported parameter types \['b8'\]"):
        KernelImage(
            cubin=SHIPPED_DIR,
            ptx=None,
            entry="k",
            param_types=("u64", "b8"),
            threads=1,
            smem_bytes=0,
        )


def test_launch_checks_argument_count_and_skips_empty_grids() -> None:
    calls: list[tuple[int, Sequence[int | float], int]] = []
    image = KernelImage(
        cubin=SHIPPED_DIR, ptx=None, entry="k", param_types=("u64", "u32"), threads=32, smem_bytes=0
    )
    kernel = LoadedKernel(image, "fake", "cubin", lambda g, a, s: calls.append((g, a, s)))
    kernel(4, (1234, 7), 0)
    kernel(0, (1234, 7), 0)  # nothing to do: no launch
    assert calls == [(4, (1234, 7), 0)]
    with pytest.raises(LaunchError, match="takes 2 arguments, got 1"):
        kernel(1, (1,), 0)


@pytest.mark.gpu
def test_kernels_from_cubins_match_the_references_on_a_gpu() -> None:
    from kernels.cli import _cubins_for
    from kernels.scope import arch_from_capability

    device = torch.device("cuda", 0)
    arch = arch_from_capability(*torch.cuda.get_device_capability(device))
    cubin_dir, _ = _cubins_for(arch, None)
    kernels = Kernels(CubinSet.open(cubin_dir), device)

    x = torch.randn(5, 7168, device=device, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.randn(7168, device=device, dtype=torch.bfloat16)
    normed, new_residual = kernels.fused_add_rmsnorm(x, residual, weight, 1e-6)
    want_normed, want_residual = reference.fused_add_rmsnorm(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, want_residual)
    assert torch.allclose(normed.float(), want_normed.float(), atol=1e-2, rtol=1.6e-2)


class Recorder:
    """A loader whose kernels record their launches instead of running."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, int, tuple[int | float, ...]]] = []

    def __call__(self, image: KernelImage, device_index: int, backend: str | None) -> LoadedKernel:
        def launch(grid: int, args: Sequence[int | float], stream: int) -> None:
            self.launches.append((image.entry, grid, tuple(args)))

        return LoadedKernel(image, "recorder", "cubin", launch)


def _cpu_kernels(recorder: Recorder) -> Kernels:
    cubins = CubinSet.open(SHIPPED_DIR)
    return Kernels(cubins, torch.device("cpu"), gpu_arch="sm_90a", loader=recorder)


def test_rmsnorm_launch_passes_scale_hidden_and_eps() -> None:
    rec = Recorder()
    kernels = _cpu_kernels(rec)
    x = torch.zeros(5, 7168, dtype=torch.bfloat16)
    residual, weight = torch.zeros_like(x), torch.ones(7168, dtype=torch.bfloat16)
    scale = torch.tensor([0.5])  # on the CPU: refused, the kernel reads it on the GPU
    with pytest.raises(ValueError, match="scale must be one float32 on the GPU"):
        kernels.fused_add_rmsnorm(x, residual, weight, 1e-6, scale)
    normed, new_residual = kernels.fused_add_rmsnorm(x, residual, weight, 1e-5, inplace=True)
    assert normed is x and new_residual is residual
    ((_, grid, args),) = rec.launches
    assert grid == 5
    assert args[:5] == (
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        x.data_ptr(),
        residual.data_ptr(),
    )
    assert args[6:] == (7168, 1e-5)


def _ptxas() -> str | None:
    """A ptxas to assemble PTX with here: on PATH, or the one Triton's wheel carries."""
    import importlib.util
    import shutil

    found = shutil.which("ptxas")
    spec = importlib.util.find_spec("triton")
    if found is None and spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
        found = str(candidate) if candidate.is_file() else None
    return found


def test_older_drivers_are_offered_the_ptx_with_the_oldest_isa_for_its_target(
    tmp_path: Path,
) -> None:
    # The DSL writes PTX ISA 8.8 (CUDA 12.9); an H200 whose driver predates it may still
    # JIT the same instructions declared as ISA 8.0, the first that knows sm_90a.
    cubins = CubinSet.open(SHIPPED_DIR)
    ptxas = _ptxas()
    lowest = {"sm_90a": "8.0", "sm_100a": "8.6", "sm_103a": None}  # sm_103a: 8.8 already
    for entry in cubins.entries:
        image = cubins.image(entry["kernel"], entry["variant"], entry["arch"])
        kinds = candidate_images(image)
        isa = lowest[entry["arch"]]
        if isa is None:
            assert [k for k, _ in kinds] == ["cubin", "ptx"]
            continue
        assert [k for k, _ in kinds] == ["cubin", "ptx", f"ptx-isa-{isa}"]
        lowered = kinds[2][1]
        assert lowered.endswith(b"\0") and f"\n.version {isa}\n".encode() in lowered
        assert lowered.replace(f".version {isa}".encode(), b"") == kinds[1][1].replace(
            b".version 8.8", b""
        )
        if ptxas is not None:
            src = tmp_path / f"{entry['variant']}.ptx"
            src.write_bytes(lowered[:-1])
            out = subprocess.run(
                [ptxas, f"-arch={entry['arch']}", str(src), "-o", str(tmp_path / "k.cubin")],
                capture_output=True,
                text=True,
            )
            assert out.returncode == 0, out.stderr
