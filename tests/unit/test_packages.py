"""The five top-level package names are shared with unrelated PyPI distributions
(``kernels`` is Hugging Face's kernel hub): each must import from this project."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from fresh_python import printed_by_fresh_python

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["orchestrator", "engines", "kernels", "placement", "policies"])
def test_top_level_package_is_this_projects(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__file__ is not None
    assert Path(module.__file__).resolve().parent == REPO / name


def test_importing_the_orchestrator_does_not_import_vllm() -> None:
    code = (
        "import sys, orchestrator.cli.main, orchestrator.router, orchestrator.config, "
        "engines.registry; print('vllm' in sys.modules, 'torch' in sys.modules)"
    )
    assert printed_by_fresh_python(code) == ["False", "False"]


def test_public_names_are_pinned() -> None:
    import engines.base
    import orchestrator.errors
    import orchestrator.router

    assert sorted(engines.base.__all__) == sorted(
        [
            "EngineRole",
            "EngineSpec",
            "KVTransferSpec",
            "GenerateRequest",
            "Sampling",
            "TokenLogprob",
            "GenerateChunk",
            "EngineInfo",
            "EngineHealth",
            "EngineStats",
            "EngineAdapter",
            "RequestFailed",
            "final_chunk",
        ]
    )
    assert sorted(orchestrator.errors.__all__) == sorted(
        [
            "KVTideError",
            "ConfigError",
            "RequestError",
            "InvalidRequest",
            "ContextLengthExceeded",
            "ModelNotFound",
            "NotFound",
            "AuthenticationFailed",
            "PermissionDenied",
            "SessionNotFound",
            "TurnInProgress",
            "LimitExceeded",
            "PayloadTooLarge",
            "UnsupportedMediaType",
            "UnsupportedParameter",
            "IdempotencyKeyReused",
            "RequestTimeout",
            "ResponseNotFound",
            "Unavailable",
            "EngineUnavailable",
            "ServiceUnavailable",
            "ServingLayerRefused",
            "DeadlineExceeded",
            "Overloaded",
        ]
    )
    assert sorted(orchestrator.router.__all__) == [
        "KV_SOURCES",
        "LeaseRefused",
        "LeaseUse",
        "PoolClient",
        "Router",
        "Turn",
        "TurnReport",
        "TurnSampling",
        "abort_stream",
        "bounded",
    ]


def _modules_importing(package: str) -> set[str]:
    """The project's modules with an ``import package`` or ``from package...`` anywhere."""
    import ast

    found = set()
    for root in ("orchestrator", "engines", "kernels", "placement", "policies"):
        for path in (REPO / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and node.level == 0
                    else []
                )
                if any(n == package or n.startswith(package + ".") for n in names):
                    found.add(str(path.relative_to(REPO)))
    return found


def test_the_modules_that_import_vllm_are_the_ones_the_architecture_lists() -> None:
    import re

    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("### Where vLLM is imported", 1)[1].split("\n#", 1)[0]
    listed = set(re.findall(r"^- `([^`]+\.py)`", section, re.M))
    assert _modules_importing("vllm") == listed


def test_the_routers_parts_are_held_and_its_turn_is_one_object() -> None:
    """The router holds its parts (built with what they use) instead of inheriting
    them: no class under orchestrator/router/ has a base class of the project's own
    (protocols and exceptions aside), no sibling call is typed ``Callable[..., Any]``,
    the turn crosses into ``run_turn`` as one ``Turn`` and its report has no free-form
    ``extra``."""
    import ast
    import dataclasses
    import inspect

    from orchestrator.router import Router, TurnReport

    own = set()
    classes: list[tuple[str, ast.ClassDef]] = []
    for path in sorted((REPO / "orchestrator" / "router").glob("*.py")):
        text = path.read_text()
        assert "Callable[..., Any]" not in text, path.name
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                own.add(node.name)
                classes.append((path.name, node))
    inherited = [
        f"{name}: {node.name}({ast.unparse(base)})"
        for name, node in classes
        for base in node.bases
        if ast.unparse(base) in own
    ]
    assert inherited == []
    assert list(inspect.signature(Router.run_turn).parameters) == ["self", "turn"]
    assert "extra" not in {f.name for f in dataclasses.fields(TurnReport)}
