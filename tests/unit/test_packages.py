"""The five top-level package names are shared with unrelated PyPI distributions
(``kernels`` is Hugging Face's kernel hub): each must import from this project."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
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
        "RouterSettings",
        "Turn",
        "TurnReport",
        "TurnSampling",
        "abort_stream",
        "bounded",
    ]


def _modules_importing(package: str) -> set[str]:
    """The project's modules with an ``import package`` or ``from package...`` anywhere."""
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


def _modules_converting_kv_params() -> set[str]:
    """The project's modules that call ``from_vllm`` or ``to_vllm`` (KVTransferParams to
    and from vLLM's dict), bar the one that defines them."""
    found = set()
    for root in ("orchestrator", "engines", "kernels", "placement", "policies"):
        for path in (REPO / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("from_vllm", "to_vllm")
                ):
                    found.add(str(path.relative_to(REPO)))
    found.discard("engines/kv_params.py")
    return found


def test_the_modules_that_convert_kv_transfer_params_are_the_ones_the_architecture_lists() -> None:
    import re

    text = (REPO / "docs" / "architecture.md").read_text()
    heading = "### Where vLLM's kv_transfer_params dict is converted"
    assert heading in text
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    listed = set(re.findall(r"^- `([^`]+\.py)`", section, re.M))
    assert _modules_converting_kv_params() == listed


def _turn_path_classes() -> list[tuple[str, ast.ClassDef]]:
    """Every class under orchestrator/serve/ and orchestrator/router/, with its file."""
    return [
        (str(path.relative_to(REPO)), node)
        for package in ("serve", "router")
        for path in sorted((REPO / "orchestrator" / package).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    ]


def _allowed_base(base: type) -> bool:
    """A base class of the project's own that a turn-path class may have: a protocol
    (an interface, no state), an exception (one error tree), or a pydantic model that
    declares fields, config and validators and no method of its own (a request body's
    shared fields: pydantic's idiom, no behaviour reached through ``self``)."""
    from pydantic import BaseModel

    if getattr(base, "_is_protocol", False) or issubclass(base, BaseException):
        return True
    if not issubclass(base, BaseModel):
        return False
    tree = ast.parse(textwrap.dedent(inspect.getsource(base))).body[0]
    assert isinstance(tree, ast.ClassDef)
    return not any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in tree.body)


def test_turn_path_classes_hold_their_parts_instead_of_inheriting_them() -> None:
    """No class under orchestrator/serve/ or orchestrator/router/ inherits behaviour
    from another of the project's classes (a mixin sharing one ``self``): each base of
    the project's own is a protocol, an exception or a fields-only pydantic model."""
    from pydantic import BaseModel

    from orchestrator.serve.turn_client import TurnEngine

    class ModelWithAMethod(BaseModel):
        def shared(self) -> None:
            pass

    own = {
        node.name
        for root in ("orchestrator", "engines", "kernels", "placement", "policies")
        for path in (REPO / root).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    inherited = [
        (path, node.name, ast.unparse(base))
        for path, node in _turn_path_classes()
        for base in node.bases
        if ast.unparse(base).rsplit(".", 1)[-1] in own
    ]
    assert inherited, "the scan sees the request models' bases"
    refused = []
    for path, name, base_name in inherited:
        found: object = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        for part in base_name.split("."):
            found = getattr(found, part)
        assert isinstance(found, type)
        if not _allowed_base(found):
            refused.append(f"{path}: {name}({base_name})")
    assert refused == []
    # The rule refuses a plain class and a pydantic model with methods of its own.
    assert not _allowed_base(TurnEngine)
    assert not _allowed_base(ModelWithAMethod)


def test_the_turn_path_has_no_untyped_context() -> None:
    """The turn and the vLLM layer's per-request context are typed: no free-form
    ``extra`` dict, no sibling call typed ``Callable[..., Any]``."""
    import dataclasses

    from orchestrator.router import TurnReport
    from orchestrator.serve.turn_client import TurnContext

    for package in ("serve", "router"):
        for path in sorted((REPO / "orchestrator" / package).rglob("*.py")):
            text = path.read_text()
            for untyped in ("Callable[..., Any]", ".extra[", "report.extra"):
                assert untyped not in text, f"{path.name}: {untyped}"
    assert "extra" not in {f.name for f in dataclasses.fields(TurnReport)}
    assert "extra" not in {f.name for f in dataclasses.fields(TurnContext)}


def test_the_routers_turn_is_one_object() -> None:
    """The turn crosses into ``run_turn`` as one ``Turn``."""
    from orchestrator.router import Router

    assert list(inspect.signature(Router.run_turn).parameters) == ["self", "turn"]


def test_the_router_and_the_service_take_their_settings_as_one_object() -> None:
    """``Router`` and ``KVService`` take their collaborators and one frozen settings
    object, built from the config in one place: no setting is a parameter of its own."""
    import dataclasses

    from orchestrator.kv.service import KVService, ServiceSettings
    from orchestrator.router import Router, RouterSettings

    for cls, settings in ((Router, RouterSettings), (KVService, ServiceSettings)):
        params = set(inspect.signature(cls.__init__).parameters)
        assert "settings" in params, cls.__name__
        assert params.isdisjoint(f.name for f in dataclasses.fields(settings)), cls.__name__
