"""The engine tier's own-engines child (``own_engines.py``), once per test session."""

from __future__ import annotations

import pytest
from own_engines import MODULES, Results, run_own_engines


@pytest.fixture(scope="session")
def own_engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Results:
    """Every collected own-engines module's result, from one child started at the first
    test that asks (the engines of those modules are started once between them)."""
    selected = {
        item.path.stem
        for item in request.session.items
        if "own_engines" in getattr(item, "fixturenames", ())
    }
    return run_own_engines(tmp_path_factory.mktemp("own-engines"), sorted(selected & set(MODULES)))
