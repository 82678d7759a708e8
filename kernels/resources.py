"""What a compiled kernel uses, read from its PTX and cubin on a CPU.

- PTX (text): ``.target``, the entry's name and parameter types, ``.reqntid``, local
  memory (``.local`` / ``ld.local`` / ``st.local``), and the instruction mix a kernel
  promises (``ld.global.v4`` vector loads, ``ex2.approx``).
- cubin, through the CUDA binary tools that pip installs (``nvidia-cuda-cuobjdump``,
  ``nvidia-cuda-nvdisasm``): ``cuobjdump --dump-resource-usage`` gives registers, stack,
  shared and local bytes; ``nvdisasm -c`` gives the SASS, where spills are ``LDL``/``STL``.

The tools are optional: without them the cubin fields are None and callers say so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PTX_TARGET",
    "PTX_VERSION",
    "CubinUsage",
    "PtxEntry",
    "PtxSummary",
    "cubin_usage",
    "find_tool",
    "ptx_summary",
    "sass_opcodes",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class PtxEntry:
    name: str
    params: tuple[str, ...]  # "u64", "u32", "f32", ... in order
    reqntid: tuple[int, ...] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class PtxSummary:
    target: str
    version: str
    entries: tuple[PtxEntry, ...]
    uses_local_memory: bool
    global_vector_loads: int  # ld.global.v4 / .v2 (any width)
    global_v4_loads: int  # 128-bit: four 32-bit lanes
    ex2: int  # ex2.approx.* instructions

    @property
    def entry(self) -> PtxEntry:
        if len(self.entries) != 1:
            raise ValueError(f"expected one .entry, found {len(self.entries)}")
        return self.entries[0]


PTX_TARGET = re.compile(r"^\.target\s+(\S+)", re.M)
"""A PTX file's ``.target`` line; group 1 the target (``sm_90a``)."""
PTX_VERSION = re.compile(r"^\.version\s+(\S+)", re.M)
"""A PTX file's ``.version`` line; group 1 its ISA version (``8.8``)."""
_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(([^)]*)\)([^{]*)\{", re.S)
_PARAM = re.compile(r"\.param\s+\.(\w+)")
_REQNTID = re.compile(r"\.reqntid\s+([\d,\s]+)")


def ptx_summary(ptx: str) -> PtxSummary:
    target = PTX_TARGET.search(ptx)
    version = PTX_VERSION.search(ptx)
    entries = []
    for m in _ENTRY.finditer(ptx):
        params = tuple(p for p in _PARAM.findall(m.group(2)))
        req = _REQNTID.search(m.group(3))
        reqntid = tuple(int(x) for x in req.group(1).replace(",", " ").split()) if req else None
        entries.append(PtxEntry(name=m.group(1), params=params, reqntid=reqntid))
    return PtxSummary(
        target=target.group(1) if target else "",
        version=version.group(1) if version else "",
        entries=tuple(entries),
        uses_local_memory=bool(re.search(r"\.local\b|\b(?:ld|st)\.local\b", ptx)),
        global_vector_loads=len(re.findall(r"\bld\.global(?:\.\w+)*\.v[24]\.", ptx)),
        global_v4_loads=len(re.findall(r"\bld\.global(?:\.\w+)*\.v4\.[bfu]32\b", ptx)),
        ex2=len(re.findall(r"\bex2\.approx", ptx)),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class CubinUsage:
    registers: int
    stack_bytes: int
    shared_bytes: int
    local_bytes: int
    spill_instructions: int | None  # LDL + STL in the SASS; None when not disassembled

    @property
    def spills(self) -> bool:
        return self.local_bytes > 0 or bool(self.spill_instructions)


def find_tool(name: str) -> str | None:
    """``nvdisasm`` / ``cuobjdump``: on PATH, else from the pip ``nvidia-cuda-*`` wheels."""
    found = shutil.which(name)
    if found:
        return found
    for base in map(Path, sys.path):
        nvidia = base / "nvidia"
        if not nvidia.is_dir():
            continue
        for candidate in sorted(nvidia.glob(f"*/bin/{name}"), reverse=True):
            return str(candidate)
    return None


_USAGE = re.compile(
    r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)",
)


def cubin_usage(cubin: Path, sass: bool = False) -> CubinUsage | None:
    """Resource usage of the (single) kernel in ``cubin``; None without cuobjdump.

    ``sass`` also counts spill instructions in the disassembly (~0.5 s per cubin).
    """
    cuobjdump = find_tool("cuobjdump")
    if cuobjdump is None:
        return None
    text = subprocess.run(
        [cuobjdump, "--dump-resource-usage", str(cubin)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    m = _USAGE.search(text)
    if m is None:
        raise ValueError(f"no resource usage line in cuobjdump output for {cubin}")
    opcodes = sass_opcodes(cubin) if sass else None
    spills = None if opcodes is None else opcodes["LDL"] + opcodes["STL"]
    reg, stack, shared, local = (int(g) for g in m.groups())
    return CubinUsage(
        registers=reg,
        stack_bytes=stack,
        shared_bytes=shared,
        local_bytes=local,
        spill_instructions=spills,
    )


_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def sass_opcodes(cubin: Path) -> Counter[str] | None:
    """Opcode counts (without modifiers: ``LDG`` for ``LDG.E.128``); None without nvdisasm."""
    nvdisasm = find_tool("nvdisasm")
    if nvdisasm is None:
        return None
    text = subprocess.run(
        [nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    return Counter(_SASS_LINE.findall(text))
