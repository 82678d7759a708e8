"""The server's exceptions have one root, ``KVTideError``, whose docstring draws them all:
an operator (or a handler) that catches the root catches every error kvtide raises on
purpose, and the tree says where each comes from. Read from the source (no import of
Ray or vLLM): every exception class under ``orchestrator/`` but the client's (the SDK,
the CLI) and private ones."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

from orchestrator.errors import KVTideError

ROOT = Path(__file__).resolve().parents[2] / "orchestrator"
CLIENT_SIDE = ("sdk", "cli")


def _exception_bases() -> dict[str, list[str]]:
    """Each public exception class of the server side, by name, with its bases' names."""
    bases: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).parts[0] in CLIENT_SIDE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
    builtin = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)}

    def is_exception(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name in builtin:
            return issubclass(getattr(builtins, name), BaseException)
        return name not in seen and any(is_exception(b, seen | {name}) for b in bases.get(name, []))

    return {
        name: parents
        for name, parents in bases.items()
        if not name.startswith("_") and is_exception(name)
    }


def test_every_server_exception_is_under_the_root_and_drawn_in_its_tree() -> None:
    found = _exception_bases()

    def under_root(name: str) -> bool:
        return name == "KVTideError" or any(
            under_root(b) for b in found.get(name, []) if b in found
        )

    # The project's own, found in the source: the turn path's, the cluster's, the KV's.
    assert {"LeaseRefused", "CallTimedOut", "HostReadPending", "PlacementTimeout"} <= set(found)
    assert [name for name in found if not under_root(name)] == []
    doc = KVTideError.__doc__ or ""
    assert [name for name in found if f"── {name} " not in doc and name != "KVTideError"] == []
