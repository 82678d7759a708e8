"""How a checkpoint stores its weights: bits per weight plus the scales that go with them.

`QuantScheme.from_hf(quantization_config, dtype_bytes)` reads the `quantization_config`
block of a Hugging Face `config.json`. Only linear layers are quantized; embeddings,
norms and router gates stay in the checkpoint dtype, and so does every module the
checkpoint lists in `ignore` / `modules_to_not_convert` / `exclude_modules`.

Storage per quantized matrix of shape (rows = out_features, cols = in_features):

| scheme       | data          | scales                                              |
| ------------ | ------------- | --------------------------------------------------- |
| fp8 block    | 1 B / weight  | one fp32 per 128 x 128 block (`weight_block_size`)  |
| fp8 tensor   | 1 B / weight  | one fp32 per matrix                                 |
| int4 group   | 0.5 B / weight| one bf16/fp16 per `group_size` inputs, + a 4-bit    |
|              |               | zero point per group when asymmetric (AWQ, GPTQ)    |
| mxfp4        | 0.5 B / weight| one e8m0 byte per 32 inputs (OCP MX spec)           |
| nvfp4        | 0.5 B / weight| one fp8 byte per 16 inputs + one fp32 per matrix    |
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from placement.model_errors import UnsupportedModel

__all__ = ["WEIGHT_PRECISIONS", "QuantScheme", "module_matches", "stored_as"]


@dataclass(frozen=True, slots=True, kw_only=True)
class QuantScheme:
    """Bytes of one stored linear weight, and which modules keep the plain dtype.

    Invariant: `weight_bits == 8 * dtype_bytes` and no scales means "not quantized".
    """

    name: str
    weight_bits: int
    dtype_bytes: int  # bytes per weight of everything left unquantized
    group_size: int = 0  # inputs per scale along in_features; 0 = no group scales
    block_shape: tuple[int, int] = (0, 0)  # 2-D block scales (rows, cols); (0, 0) = none
    scale_bytes: int = 0  # bytes of one group or block scale
    zero_point_bits: int = 0  # per group; 0 = symmetric
    per_row_scale_bytes: int = 0  # per-channel scales
    per_matrix_bytes: int = 0  # per-tensor scales (and input scales) of one matrix
    per_column_bytes: int = 0  # GPTQ act-order g_idx (int32 per input)
    ignore: tuple[str, ...] = ()

    @property
    def is_quantized(self) -> bool:
        return self.weight_bits < 8 * self.dtype_bytes

    def matrix_bytes(self, rows: int, cols: int) -> int:
        """Stored bytes of one quantized (rows x cols) weight with its scales."""
        data = math.ceil(rows * cols * self.weight_bits / 8)
        scales = 0
        block_rows, block_cols = self.block_shape
        if block_rows:
            scales = math.ceil(rows / block_rows) * math.ceil(cols / block_cols) * self.scale_bytes
        elif self.group_size:
            groups = rows * math.ceil(cols / self.group_size)
            scales = groups * self.scale_bytes + math.ceil(groups * self.zero_point_bits / 8)
        extra = (
            rows * self.per_row_scale_bytes + self.per_matrix_bytes + cols * self.per_column_bytes
        )
        return data + scales + extra

    def plain_bytes(self, num_params: int) -> int:
        return num_params * self.dtype_bytes

    def keeps_unquantized(self, module: str) -> bool:
        return any(module_matches(pattern, module) for pattern in self.ignore)

    @classmethod
    def unquantized(cls, dtype_bytes: int) -> QuantScheme:
        name = {1: "fp8", 2: "bf16", 4: "fp32"}.get(dtype_bytes, f"{8 * dtype_bytes}-bit")
        return cls(name=name, weight_bits=8 * dtype_bytes, dtype_bytes=dtype_bytes)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | None, *, dtype_bytes: int) -> QuantScheme:
        """Read a `quantization_config` block; None means the weights are stored as-is."""
        if not config:
            return cls.unquantized(dtype_bytes)
        method = str(config.get("quant_method", "")).lower()
        ignore = _ignore_list(config)
        reader = _READERS.get(method)
        if reader is None:
            raise UnsupportedModel(
                f"quant_method {method!r} is not modelled; known methods are "
                f"{sorted(_READERS)}. Describe the checkpoint as one of them or add a reader."
            )
        return reader(config, dtype_bytes, ignore)


def module_matches(pattern: str, module: str) -> bool:
    """Whether an ignore-list entry names `module`.

    `re:`-prefixed entries are regular expressions matched from the start of the
    module name (compressed-tensors' rule); plain entries match the whole name, a
    dotted suffix, or a substring (what `modules_to_not_convert` lists in practice).
    """
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern) or pattern in module


def _ignore_list(config: Mapping[str, Any]) -> tuple[str, ...]:
    names: list[str] = []
    for key in ("ignore", "modules_to_not_convert", "ignored_layers", "exclude_modules", "exclude"):
        value = config.get(key)
        if isinstance(value, list | tuple):
            names.extend(str(item) for item in value)
    return tuple(names)


def _fp8(config: Mapping[str, Any], dtype_bytes: int, ignore: tuple[str, ...]) -> QuantScheme:
    block = config.get("weight_block_size")
    if block:
        rows, cols = int(block[0]), int(block[1])
        return QuantScheme(
            name="fp8-block",
            weight_bits=8,
            dtype_bytes=dtype_bytes,
            block_shape=(rows, cols),
            scale_bytes=4,
            ignore=ignore,
        )
    return _fp8_tensor(ignore, dtype_bytes)


def _fp8_tensor(
    ignore: tuple[str, ...], dtype_bytes: int, per_matrix_bytes: int = 4
) -> QuantScheme:
    # fp32 scales per matrix: the weight's (4 bytes), plus the input's where a reader counts it.
    return QuantScheme(
        name="fp8-tensor",
        weight_bits=8,
        dtype_bytes=dtype_bytes,
        per_matrix_bytes=per_matrix_bytes,
        ignore=ignore,
    )


def _int_group(
    name: str,
    bits: int,
    group: int,
    *,
    dtype_bytes: int,
    symmetric: bool,
    act_order: bool,
    ignore: tuple[str, ...],
) -> QuantScheme:
    if group <= 0:  # -1 in GPTQ: one scale per output channel
        return QuantScheme(
            name=name,
            weight_bits=bits,
            dtype_bytes=dtype_bytes,
            per_row_scale_bytes=2,
            ignore=ignore,
        )
    return QuantScheme(
        name=name,
        weight_bits=bits,
        dtype_bytes=dtype_bytes,
        group_size=group,
        scale_bytes=2,
        zero_point_bits=0 if symmetric else bits,
        per_column_bytes=4 if act_order else 0,
        ignore=ignore,
    )


def _awq(config: Mapping[str, Any], dtype_bytes: int, ignore: tuple[str, ...]) -> QuantScheme:
    bits = int(config.get("bits", config.get("w_bit", 4)))
    group = int(config.get("group_size", config.get("q_group_size", 128)))
    symmetric = not bool(config.get("zero_point", True))
    return _int_group(
        f"int{bits}-awq-g{group}",
        bits,
        group,
        dtype_bytes=dtype_bytes,
        symmetric=symmetric,
        act_order=False,
        ignore=ignore,
    )


def _gptq(config: Mapping[str, Any], dtype_bytes: int, ignore: tuple[str, ...]) -> QuantScheme:
    bits = int(config.get("bits", 4))
    group = int(config.get("group_size", 128))
    # GPTQ checkpoints store packed zero points even when symmetric.
    return _int_group(
        f"int{bits}-gptq-g{group}",
        bits,
        group,
        dtype_bytes=dtype_bytes,
        symmetric=False,
        act_order=bool(config.get("desc_act", False)),
        ignore=ignore,
    )


def _mxfp4(ignore: tuple[str, ...], dtype_bytes: int) -> QuantScheme:
    return QuantScheme(
        name="mxfp4",
        weight_bits=4,
        dtype_bytes=dtype_bytes,
        group_size=32,
        scale_bytes=1,
        ignore=ignore,
    )


def _nvfp4(ignore: tuple[str, ...], dtype_bytes: int, group: int = 16) -> QuantScheme:
    # fp8 (e4m3) scale per 16 inputs, plus fp32 global weight scale and input scale.
    return QuantScheme(
        name="nvfp4",
        weight_bits=4,
        dtype_bytes=dtype_bytes,
        group_size=group,
        scale_bytes=1,
        per_matrix_bytes=8,
        ignore=ignore,
    )


def _compressed_tensors(
    config: Mapping[str, Any], dtype_bytes: int, ignore: tuple[str, ...]
) -> QuantScheme:
    groups = config.get("config_groups") or {}
    weights: Mapping[str, Any] = {}
    for group in groups.values():  # the first group that targets linear layers
        if "Linear" in (group.get("targets") or ["Linear"]) and group.get("weights"):
            weights = group["weights"]
            break
    if not weights:
        raise UnsupportedModel(
            "compressed-tensors config has no config_groups entry with `weights` for Linear "
            "targets; add one or describe the checkpoint as unquantized."
        )
    bits = int(weights.get("num_bits", 8))
    kind = str(weights.get("type", "int"))
    strategy = str(weights.get("strategy", "group"))
    group = int(weights.get("group_size") or 0)
    fmt = str(config.get("format", ""))
    if kind == "float" and bits == 4:
        return (
            _nvfp4(ignore, dtype_bytes, group or 16)
            if "nv" in fmt or group == 16
            else (_mxfp4(ignore, dtype_bytes))
        )
    if kind == "float" and bits == 8:
        if strategy == "block":
            rows, cols = weights.get("block_structure") or (128, 128)
            return QuantScheme(
                name="fp8-block",
                weight_bits=8,
                dtype_bytes=dtype_bytes,
                block_shape=(int(rows), int(cols)),
                scale_bytes=dtype_bytes,
                ignore=ignore,
            )
        if strategy == "channel":
            return QuantScheme(
                name="fp8-channel",
                weight_bits=8,
                dtype_bytes=dtype_bytes,
                per_row_scale_bytes=dtype_bytes,
                ignore=ignore,
            )
        return _fp8_tensor(ignore, dtype_bytes)
    if kind == "int":
        return _int_group(
            f"int{bits}-g{group}",
            bits,
            group if strategy == "group" else 0,
            dtype_bytes=dtype_bytes,
            symmetric=bool(weights.get("symmetric", True)),
            act_order=False,
            ignore=ignore,
        )
    raise UnsupportedModel(
        f"compressed-tensors weights of type {kind!r} with {bits} bits are not modelled; "
        "supported are int (any bits, group/channel), float8 and float4."
    )


def _modelopt(config: Mapping[str, Any], dtype_bytes: int, ignore: tuple[str, ...]) -> QuantScheme:
    algo = str(config.get("quant_algo", "")).upper()
    if algo == "NVFP4":
        return _nvfp4(ignore, dtype_bytes, int(config.get("group_size", 16)))
    if algo == "FP8":
        return _fp8_tensor(ignore, dtype_bytes, per_matrix_bytes=8)
    raise UnsupportedModel(f"modelopt quant_algo {algo!r} is not modelled; use FP8 or NVFP4.")


def _quark(config: Mapping[str, Any], dtype_bytes: int, ignore: tuple[str, ...]) -> QuantScheme:
    weight = (config.get("global_quant_config") or {}).get("weight") or {}
    dtype = str(weight.get("dtype", ""))
    if dtype == "fp4":
        return _mxfp4(ignore, dtype_bytes)
    if dtype.startswith("fp8"):
        return _fp8_tensor(ignore, dtype_bytes)
    raise UnsupportedModel(f"quark weight dtype {dtype!r} is not modelled; use fp4 or fp8.")


_READERS = {
    "fp8": _fp8,
    "awq": _awq,
    "gptq": _gptq,
    "compressed-tensors": _compressed_tensors,
    "mxfp4": lambda config, dtype_bytes, ignore: _mxfp4(ignore, dtype_bytes),
    "modelopt": _modelopt,
    "quark": _quark,
}


WEIGHT_PRECISIONS = ("bf16", "fp16", "fp8", "int8", "int4")
"""What ``stored_as`` (``kvtide plan --weights``) knows."""


def stored_as(precision: str, checkpoint: QuantScheme) -> QuantScheme:
    """The weights of a checkpoint (quantized as ``checkpoint``) stored at ``precision``
    instead, scales included, e.g. to plan an FP8 or INT4 build of a BF16 release:

    - ``bf16`` / ``fp16``: 2 bytes a weight, no scales;
    - ``fp8``: 1 byte a weight and an fp32 scale per matrix (per-tensor FP8);
    - ``int8``: 1 byte a weight and a 2-byte scale per output row (per-channel);
    - ``int4``: half a byte a weight and a 2-byte scale per 64 inputs (group-quantized,
      symmetric): 4.25 bits a weight.

    Modules the checkpoint keeps unquantized (its ignore list: routers, some
    projections) stay so; embeddings and norms are never quantized (``ModelSpec``).
    """
    keep, plain = checkpoint.ignore, checkpoint.dtype_bytes
    if precision in ("bf16", "fp16"):
        return QuantScheme(name=precision, weight_bits=16, dtype_bytes=2, ignore=keep)
    if precision == "fp8":
        return _fp8_tensor(keep, plain)
    if precision in ("int8", "int4"):
        bits, group = (8, -1) if precision == "int8" else (4, 64)  # -1: per output row
        name = "int8-channel" if precision == "int8" else "int4-g64"
        return _int_group(
            name, bits, group, dtype_bytes=plain, symmetric=True, act_order=False, ignore=keep
        )
    raise ValueError(
        f"unknown weight precision {precision!r}: one of {', '.join(WEIGHT_PRECISIONS)}"
    )
