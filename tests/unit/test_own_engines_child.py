"""The engine tier starts the engines its modules need besides the shared app in one
child per test session (``tests/engine/own_engines.py``, docs/testing.md#engines-started-once):
a module that started engines for itself would pay their start (20-90 s each on the
2-core box) again. Read from the modules' text (importing them needs ``tests/engine``
on the path)."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE_TESTS = Path(__file__).resolve().parents[1] / "engine"
# What starts an engine, or a child process that does.
STARTS = ("start_pair(", "VLLMEngine(", "run_side(", "AsyncLLM", "child_result(")
SEPARATE = {
    # A TP=2 engine whose workers are actors of a three-node Ray of its own, vLLM's driver
    # in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): another process model, kept apart.
    "test_tp2_ray_executor",
}
# What the child calls in each kind of module.
ENTRY = {"PAIR_STORIES": "_story", "CAPACITY": "_probe", "KERNELS_AB": "_child"}


def _own_engines_names() -> dict[str, tuple[str, ...]]:
    """``own_engines``'s module lists, by name, read from its source."""
    tree = ast.parse((ENGINE_TESTS / "own_engines.py").read_text())
    out: dict[str, tuple[str, ...]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in ENTRY:
                value = ast.literal_eval(node.value)
                out[name] = tuple(value) if isinstance(value, tuple) else (value,)
    return out


def _starters() -> set[str]:
    return {
        path.stem
        for path in ENGINE_TESTS.glob("test_*.py")
        if any(start in path.read_text() for start in STARTS)
    }


def test_every_engine_module_that_starts_engines_of_its_own_runs_in_the_one_child() -> None:
    lists = _own_engines_names()
    shared = {module for modules in lists.values() for module in modules}
    assert _starters() - SEPARATE <= shared


def test_each_module_in_the_child_has_what_the_child_calls() -> None:
    for kind, modules in _own_engines_names().items():
        for module in modules:
            tree = ast.parse((ENGINE_TESTS / f"{module}.py").read_text())
            defined = {
                node.name
                for node in tree.body
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            }
            assert ENTRY[kind] in defined, (module, kind)
            # ... and it asks for the session's child, not a child of its own.
            assert "own_engines.of(__file__)" in (ENGINE_TESTS / f"{module}.py").read_text()
