"""What binds evidence to the code it measured: digests of everything a run depends on.

Standard library only (the gate reads these). A kernel evidence file records a
``binding`` (``binding_for``), and stays current only while today's is the same
(``shipped_binding``):

- ``source_sha256``: the CuTe sources and the variants they compile for
  (``source_digest``);
- ``harness_sha256``: the harness that judged and timed the kernels and the launcher
  that ran them (``HARNESS_FILES``: cases' inputs, the reference, the tolerance rule,
  baselines, timing, the cubin loader and the torch call; ``harness_digest``);
- ``launch_sha256``: the manifest's launch settings of the arch's kernels (entry,
  parameter types, threads, rows per CTA, shared memory, compile parameters;
  ``launch_digest``): a manifest edited after the run no longer matches;
- ``files_sha256``: the sha256 of every cubin and PTX file of the arch, as the manifest
  records them (``kernels.ops.CubinSet.open`` refuses a file that is not that).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

__all__ = [
    "CUTE_DIR",
    "EVIDENCE_DIR",
    "HARNESS_FILES",
    "LAUNCH_FIELDS",
    "SHIPPED_DIR",
    "binding_for",
    "file_sha256",
    "harness_digest",
    "launch_digest",
    "shipped_binding",
    "source_digest",
]

KERNELS_DIR = Path(__file__).resolve().parent
CUTE_DIR = KERNELS_DIR / "cute"
SHIPPED_DIR = KERNELS_DIR / "cubins"
EVIDENCE_DIR = KERNELS_DIR / "evidence"
HARNESS_FILES: tuple[str, ...] = (
    "validate.py",
    "reference.py",
    "tolerance.py",
    "baselines.py",
    "timing.py",
    "launch.py",
    "ops.py",
)
LAUNCH_FIELDS: tuple[str, ...] = (
    "kernel",
    "variant",
    "arch",
    "params",
    "entry",
    "entry_params",
    "threads",
    "rows_per_cta",
    "smem_bytes",
)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@cache
def source_digest() -> str:
    """sha256 over the CuTe sources and the variants of every scope (read once)."""
    from kernels.scope import SCOPES

    h = hashlib.sha256()
    for path in sorted(CUTE_DIR.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    for scope in SCOPES:
        for variant in scope.variants():
            h.update(repr(variant).encode())
    return h.hexdigest()


def harness_digest(root: Path | None = None) -> str:
    """sha256 over the harness and launcher files (``HARNESS_FILES``) under ``root``
    (default: this package)."""
    h = hashlib.sha256()
    for name in HARNESS_FILES:
        h.update(name.encode())
        h.update(((root or KERNELS_DIR) / name).read_bytes())
    return h.hexdigest()


def launch_digest(entries: Iterable[Mapping[str, Any]]) -> str:
    """sha256 over the launch settings (``LAUNCH_FIELDS``) of manifest ``entries``."""
    settings = sorted(
        json.dumps({k: e.get(k) for k in LAUNCH_FIELDS}, sort_keys=True) for e in entries
    )
    return hashlib.sha256("\n".join(settings).encode()).hexdigest()


def binding_for(
    arch: str, manifest: Mapping[str, Any], sources: str | None = None
) -> dict[str, Any] | None:
    """The binding of ``arch``'s kernels in a cubin ``manifest`` (None: none for it);
    ``sources``: the kernel source digest (default: the manifest's)."""
    entries = [e for e in manifest.get("kernels", ()) if e.get("arch") == arch]
    if not entries:
        return None
    files: dict[str, Any] = {}
    for e in entries:
        files[e["cubin"]], files[e["ptx"]] = e.get("cubin_sha256"), e.get("ptx_sha256")
    return {
        "source_sha256": manifest.get("source_sha256") if sources is None else sources,
        "harness_sha256": harness_digest(),
        "launch_sha256": launch_digest(entries),
        "files_sha256": files,
    }


def shipped_binding(arch: str, root: Path | None = None) -> dict[str, Any] | None:
    """Today's binding of ``arch``: the shipped manifest's kernels, today's sources and
    harness (None: no cubins are shipped for ``arch``)."""
    path = (root or SHIPPED_DIR) / "manifest.json"
    if not path.is_file():
        return None
    return binding_for(arch, json.loads(path.read_text()), sources=source_digest())
