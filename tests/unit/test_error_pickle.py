"""kvtide's errors cross process boundaries as pickles: Ray and Serve pickle what an
actor or a replica raises (a router's ``LimitExceeded`` reaches the ingress that way, a
GCS call's ``CallTimedOut`` the caller of an actor), and an SDK error may leave a worker
process. Each error whose ``__init__`` takes fields beyond the message comes back from a
round trip as the same class with the same message and fields, not as a ``TypeError``
from calling that ``__init__`` with the message alone. The classes are found in the
source, so a new one with its own ``__init__`` must be added here."""

from __future__ import annotations

import ast
import importlib
import pickle
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2] / "orchestrator"
ROOTS = ("KVTideError", "KVTideSDKError")

# One instance of each, built as the code that raises it does.
SAMPLES: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "CallTimedOut": (("ray.get_actor('kvtide-kv')", 5.0), {}),
    "PlacementGroupError": (("not placed",), {"engine_id": "decode-0"}),
    "PlacementTimeout": (
        ("not placed in 30 s",),
        {"engine_id": "decode-0", "timeout_s": 30.0, "scheduling_state": "PENDING", "domains": ()},
    ),
    "EnginesUnplaceable": (("no domain has room",), {"domains": ()}),
    "EnginesNotPlaced": (("decode-1 not placed",), {"domains": ()}),
    "ConfigError": (("kv.ttl_s must be positive",), {"field": "kv.ttl_s"}),
    "RequestError": (("bad",), {"param": "messages"}),
    "ServingLayerRefused": (
        ("bad tool",),
        {"param": "tools", "status_code": 400, "error_type": "BadRequestError"},
    ),
    "LimitExceeded": (
        ("over the key's token rate",),
        {"code": "token_rate_limit_exceeded", "param": "max_tokens", "retry_after_s": 2.5},
    ),
    "Unavailable": (("no decode engine",), {"retry_after_s": 3.0}),
    "StructuredOutputError": (("not JSON",), {"text": "{", "result": None}),
    "KVTideAPIError": (
        ("turn in progress",),
        {"status_code": 409, "code": "turn_in_progress", "request_id": "r-1", "retryable": True},
    ),
    "APIConnectionError": (("connection reset",), {"retryable": True}),
}


def _with_own_init() -> dict[str, str]:
    """Each exception class under the roots that defines ``__init__``, by name, with its
    module: read from the source."""
    classes: dict[str, tuple[str, list[str], bool]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                own_init = any(
                    isinstance(b, ast.FunctionDef) and b.name == "__init__" for b in node.body
                )
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                classes[node.name] = (module, bases, own_init)

    def under_a_root(name: str) -> bool:
        return name in ROOTS or any(under_a_root(b) for b in classes.get(name, ("", [], False))[1])

    return {
        name: module
        for name, (module, _, own_init) in classes.items()
        if own_init and under_a_root(name)
    }


def test_every_error_with_its_own_init_has_a_sample() -> None:
    assert sorted(_with_own_init()) == sorted(SAMPLES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_an_error_comes_back_from_a_pickle_as_it_was_raised(name: str) -> None:
    cls = getattr(importlib.import_module(_with_own_init()[name]), name)
    args, kwargs = SAMPLES[name]
    error = cls(*args, **kwargs)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert (str(back), back.args, vars(back)) == (str(error), error.args, vars(error))
