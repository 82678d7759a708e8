"""What each specialised kernel claims to handle, and the cases that check the claim.

A scope is the largest set of inputs a kernel is written and compiled for. Being in scope
is necessary, never sufficient: ``kernels.gate`` enables a kernel only inside a scope that
a validation run on a real GPU has covered (an evidence file under ``kernels/evidence/``).

Pure on purpose (standard library only, no torch): the orchestrator reads scopes while
planning engines, and tests read them without a GPU.

Each kernel scope lists:

- ``archs``: the PTX targets it is compiled for (H100/H200 ``sm_90a``, B200/GB200
  ``sm_100a``, GB300 ``sm_103a``);
- the dtypes and model dimensions it handles;
- the batch range (tokens per decode step);
- ``variants()``: the compile units (one cubin per variant and arch);
- ``cases()``: what one validation run checks, named by stable ``case_id`` strings that
  evidence files record.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ALL_ARCHS",
    "KIMI_K3",
    "ODD_BATCHES",
    "RMSNORM",
    "SCOPES",
    "AbCase",
    "AddRmsNormScope",
    "KernelScope",
    "RmsNormCase",
    "ValidationCase",
    "Variant",
    "VllmPathScope",
    "arch_from_capability",
    "scope_named",
    "version_matches",
]

ALL_ARCHS: tuple[str, ...] = ("sm_90a", "sm_100a", "sm_103a")

# Token counts that are not a multiple of anything a kernel tiles by, between the
# smallest and the largest batch every scope checks.
ODD_BATCHES: tuple[int, ...] = (3, 77)

# Offsets inside the kernels are 32-bit: a case or an engine must keep every tensor a
# kernel touches under this many elements.
MAX_ELEMENTS = 2**31 - 1


def arch_from_capability(major: int, minor: int) -> str:
    """The PTX target kvtide compiles for a CUDA compute capability ("sm_90a" for 9.0).

    The ``a`` targets use arch-specific features and run only on that exact capability.
    """
    return f"sm_{major}{minor}a"


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    """One compile unit: a kernel specialised for its compile-time parameters."""

    kernel: str
    name: str  # e.g. "d128-bf16"; unique within the kernel
    params: tuple[tuple[str, int | str], ...]

    @property
    def variant_id(self) -> str:
        return f"{self.kernel}/{self.name}"

    def param(self, key: str) -> int | str:
        return dict(self.params)[key]


@dataclass(frozen=True, slots=True, kw_only=True)
class RmsNormCase:
    """Residual add + RMSNorm of ``batch`` tokens of ``hidden_size``, output ``out_dtype``.

    ``inputs``: "normal" rows, "saturating" (FP8 out, ~7 % of outputs clamped to ±448)
    or "outliers" (a few channels far above the rest); ``kernels.validate`` makes them.
    """

    batch: int
    hidden_size: int
    dtype: str
    out_dtype: str
    inputs: str = "normal"
    kernel: str = "fused_add_rmsnorm"

    @property
    def case_id(self) -> str:
        shape = f"{self.kernel}/b{self.batch}-h{self.hidden_size}-{self.dtype}-{self.out_dtype}"
        return shape if self.inputs == "normal" else f"{shape}-{self.inputs}"


ValidationCase = RmsNormCase


@dataclass(frozen=True, slots=True, kw_only=True)
class AddRmsNormScope:
    """Fused ``residual += x; y = rmsnorm(residual) * weight`` on ``[T, hidden]`` rows.

    Returns ``(normed, new_residual)``; ``normed`` is bf16, or FP8 e4m3 of ``y / scale``.
    """

    name: str = "fused_add_rmsnorm"
    archs: tuple[str, ...] = ALL_ARCHS
    dtypes: tuple[str, ...] = ("bf16",)
    out_dtypes: tuple[str, ...] = ("bf16", "fp8_e4m3")
    hidden_sizes: tuple[int, ...] = (4096, 5120, 6144, 7168, 8192)
    min_batch: int = 1
    max_batch: int = 1024

    def variants(self) -> tuple[Variant, ...]:
        # The hidden size is a runtime argument (a multiple of 8, at most max(hidden_sizes)).
        return tuple(
            Variant(
                kernel=self.name,
                name=f"{dt}-{out}",
                params=(("dtype", dt), ("out_dtype", out), ("max_hidden", max(self.hidden_sizes))),
            )
            for dt in self.dtypes
            for out in self.out_dtypes
        )

    def cases(self) -> tuple[RmsNormCase, ...]:
        """Every hidden size x output dtype at both ends of the batch range, odd counts
        and 64; then outlier-channel rows (77 tokens) for each, and saturating FP8 (64)."""
        shapes = [
            (h, dt, out) for h in self.hidden_sizes for dt in self.dtypes for out in self.out_dtypes
        ]
        normal = [
            RmsNormCase(batch=b, hidden_size=h, dtype=dt, out_dtype=out)
            for h, dt, out in shapes
            for b in (self.min_batch, *ODD_BATCHES, 64, self.max_batch)
        ]
        odd = min(max(ODD_BATCHES[-1], self.min_batch), self.max_batch)
        mid = min(max(64, self.min_batch), self.max_batch)
        outliers = [
            RmsNormCase(batch=odd, hidden_size=h, dtype=dt, out_dtype=out, inputs="outliers")
            for h, dt, out in shapes
        ]
        saturating = [
            RmsNormCase(batch=mid, hidden_size=h, dtype=dt, out_dtype=out, inputs="saturating")
            for h, dt, out in shapes
            if out == "fp8_e4m3"
        ]
        return tuple(normal + outliers + saturating)

    def refuse(self, *, arch: str, dtype: str, hidden_size: int, batch: int) -> str | None:
        """Why these inputs are outside the scope, or None when they are inside."""
        if arch not in self.archs:
            return f"arch {arch} not in {list(self.archs)}"
        if dtype not in self.dtypes:
            return f"dtype {dtype} not in {list(self.dtypes)}"
        if hidden_size not in self.hidden_sizes:
            return f"hidden size {hidden_size} not in {list(self.hidden_sizes)}"
        if not self.min_batch <= batch <= self.max_batch:
            return f"batch {batch} outside {self.min_batch}..{self.max_batch}"
        return None


KernelScope = AddRmsNormScope


def version_matches(version: str, allowed: tuple[str, ...]) -> bool:
    """``version`` is one of ``allowed`` or inside one of them ("0.33" covers "0.33.1")."""
    return any(version == v or version.startswith(v + ".") for v in allowed)


@dataclass(frozen=True, slots=True, kw_only=True)
class AbCase:
    """One engine-level A/B measurement: ``batch`` concurrent greedy requests."""

    path: str
    batch: int

    @property
    def case_id(self) -> str:
        return f"{self.path}/b{self.batch}"


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmPathScope:
    """A decode path inside vLLM itself, switched on by ``additional_config``.

    kvtide cannot check such a path kernel by kernel: its evidence is an engine-level A/B
    (``kvtide kernels ab``: the same prompts through vLLM's stock path and this one). The
    declared scope is vLLM's own limits; a validated scope is what an A/B covered:
    ``archs``, ``(tp, dcp)`` pairs, the batch range and the vLLM versions it ran on.
    """

    name: str
    additional_config: tuple[tuple[str, str], ...]
    model_types: tuple[str, ...]
    archs: tuple[str, ...]
    parallel: tuple[tuple[int, int], ...]  # (TP, DCP) pairs
    vllm_versions: tuple[str, ...]
    min_batch: int = 1
    max_batch: int = 1024

    def cases(self) -> tuple[AbCase, ...]:
        """Batch sizes an A/B measures: both ends of the range and powers of 4 between."""
        sizes = {self.min_batch, self.max_batch}
        sizes |= {4**i for i in range(1, 6) if self.min_batch < 4**i < self.max_batch}
        return tuple(AbCase(path=self.name, batch=b) for b in sorted(sizes))

    def refuse(
        self,
        *,
        model_type: str,
        arch: str,
        tp: int,
        dcp: int,
        pp: int,
        ep: int,
        batch: int,
        vllm_version: str | None,
    ) -> str | None:
        """Why this engine is outside the scope, or None when it is inside."""
        if model_type not in self.model_types:
            return f"model type {model_type!r} not in {list(self.model_types)}"
        if arch not in self.archs:
            return f"arch {arch} not in {list(self.archs)}"
        if (tp, dcp) not in self.parallel:
            return f"TP {tp} / DCP {dcp} not in (TP, DCP) {list(self.parallel)}"
        if pp != 1 or ep != 1:
            return f"PP {pp} / EP {ep}: the path runs without pipeline or expert parallelism"
        if not self.min_batch <= batch <= self.max_batch:
            return f"batch {batch} outside {self.min_batch}..{self.max_batch}"
        if vllm_version is None:
            return "vLLM version unknown"
        if not version_matches(vllm_version, self.vllm_versions):
            return f"vLLM {vllm_version} not in {list(self.vllm_versions)}"
        return None


KIMI_K3 = VllmPathScope(
    name="kimi_k3_latency_specialized",
    additional_config=(("decode_backend", "latency_specialized"),),
    model_types=("kimi_k3",),
    # vLLM's own limits (vllm/models/kimi_k3/nvidia/specialized_decode/, from 0.33).
    archs=("sm_100a", "sm_103a"),
    parallel=((8, 1), (8, 8), (16, 1), (16, 16)),
    vllm_versions=("0.33",),
)

RMSNORM = AddRmsNormScope()
SCOPES: tuple[KernelScope, ...] = (RMSNORM,)


def scope_named(name: str) -> KernelScope:
    for scope in SCOPES:
        if scope.name == name:
            return scope
    raise KeyError(f"no kernel scope named {name!r}; known: {[s.name for s in SCOPES]}")
