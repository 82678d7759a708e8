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
- the batch range (decode requests per step for the combine, tokens for the norm);
- ``variants()``: the compile units (one cubin per variant and arch);
- ``cases()``: what one validation run checks, named by stable ``case_id`` strings that
  evidence files record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ALL_ARCHS",
    "COMBINE",
    "RMSNORM",
    "SCOPES",
    "AddRmsNormScope",
    "CombineCase",
    "KernelScope",
    "LseCombineScope",
    "RmsNormCase",
    "ValidationCase",
    "Variant",
    "arch_from_capability",
    "scope_named",
]

ALL_ARCHS: tuple[str, ...] = ("sm_90a", "sm_100a", "sm_103a")

# Empty-shard layouts a combine case can exercise:
#   full       every rank saw tokens
#   empty_rank rank 0 saw none (its LSE is -inf, its partial output is garbage)
#   short_seq  seq_len < ranks, so the ranks past seq_len saw none
#   all_empty  no rank saw a token (seq_len 0): output 0, LSE -inf
ShardLayout = Literal["full", "empty_rank", "short_seq", "all_empty"]
SHARD_LAYOUTS: tuple[ShardLayout, ...] = ("full", "empty_rank", "short_seq", "all_empty")

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
class CombineCase:
    """Merge ``num_ranks`` partials of ``batch`` x ``num_heads`` rows of ``head_dim``."""

    num_ranks: int
    batch: int
    num_heads: int
    head_dim: int
    dtype: str
    shards: ShardLayout = "full"
    kernel: str = "dcp_lse_combine"

    @property
    def case_id(self) -> str:
        return (
            f"{self.kernel}/n{self.num_ranks}-b{self.batch}-h{self.num_heads}"
            f"-d{self.head_dim}-{self.dtype}-{self.shards}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RmsNormCase:
    """Residual add + RMSNorm of ``batch`` tokens of ``hidden_size``, output ``out_dtype``."""

    batch: int
    hidden_size: int
    dtype: str
    out_dtype: str
    kernel: str = "fused_add_rmsnorm"

    @property
    def case_id(self) -> str:
        return f"{self.kernel}/b{self.batch}-h{self.hidden_size}-{self.dtype}-{self.out_dtype}"


ValidationCase = CombineCase | RmsNormCase


@dataclass(frozen=True, slots=True, kw_only=True)
class LseCombineScope:
    """DCP LSE combine: ``[N, B, H, D]`` partials and ``[N, B, H]`` LSEs → ``[B, H, D]``.

    LSEs are natural-log, fp32. An LSE of -inf, +inf or NaN marks a rank that saw no token
    (FlashAttention 2 reports +inf there, FlashAttention 3 -inf); its partial is ignored.
    """

    name: str = "dcp_lse_combine"
    archs: tuple[str, ...] = ALL_ARCHS
    dtypes: tuple[str, ...] = ("bf16", "fp16")
    head_dims: tuple[int, ...] = (128, 512)
    num_ranks: tuple[int, ...] = (2, 4, 8, 16)
    max_heads: int = 128
    min_batch: int = 1
    max_batch: int = 256

    def variants(self) -> tuple[Variant, ...]:
        # The rank count is a runtime argument: one cubin serves every N in scope.
        return tuple(
            Variant(
                kernel=self.name,
                name=f"d{d}-{dt}",
                params=(("head_dim", d), ("dtype", dt), ("max_ranks", max(self.num_ranks))),
            )
            for d in self.head_dims
            for dt in self.dtypes
        )

    def cases(self) -> tuple[CombineCase, ...]:
        out: list[CombineCase] = []
        for n in self.num_ranks:
            for d in self.head_dims:
                for dt in self.dtypes:
                    for b in (self.min_batch, 64, self.max_batch):
                        out.append(
                            CombineCase(num_ranks=n, batch=b, num_heads=16, head_dim=d, dtype=dt)
                        )
                for shards in SHARD_LAYOUTS[1:]:
                    out.append(
                        CombineCase(
                            num_ranks=n,
                            batch=8,
                            num_heads=16,
                            head_dim=d,
                            dtype=self.dtypes[0],
                            shards=shards,
                        )
                    )
        return tuple(out)

    def refuse(
        self, *, arch: str, dtype: str, head_dim: int, num_ranks: int, num_heads: int, batch: int
    ) -> str | None:
        """Why these inputs are outside the scope, or None when they are inside."""
        if arch not in self.archs:
            return f"arch {arch} not in {list(self.archs)}"
        if dtype not in self.dtypes:
            return f"dtype {dtype} not in {list(self.dtypes)}"
        if head_dim not in self.head_dims:
            return f"head dim {head_dim} not in {list(self.head_dims)}"
        if num_ranks not in self.num_ranks:
            return f"{num_ranks} DCP ranks not in {list(self.num_ranks)}"
        if not 1 <= num_heads <= self.max_heads:
            return f"{num_heads} heads per rank outside 1..{self.max_heads}"
        if not self.min_batch <= batch <= self.max_batch:
            return f"batch {batch} outside {self.min_batch}..{self.max_batch}"
        if num_ranks * batch * num_heads * head_dim > MAX_ELEMENTS:
            return "partials exceed 2**31 elements (32-bit offsets)"
        return None


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
        return tuple(
            RmsNormCase(batch=b, hidden_size=h, dtype=dt, out_dtype=out)
            for h in self.hidden_sizes
            for dt in self.dtypes
            for out in self.out_dtypes
            for b in (self.min_batch, 64, self.max_batch)
        )

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


KernelScope = LseCombineScope | AddRmsNormScope

COMBINE = LseCombineScope()
RMSNORM = AddRmsNormScope()
SCOPES: tuple[KernelScope, ...] = (COMBINE, RMSNORM)


def scope_named(name: str) -> KernelScope:
    for scope in SCOPES:
        if scope.name == name:
            return scope
    raise KeyError(f"no kernel scope named {name!r}; known: {[s.name for s in SCOPES]}")
