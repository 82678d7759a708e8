"""The engine tier's own-engines child (``own_engines.py``), once per test session."""

from __future__ import annotations

import pytest
from own_engines import Results, own_engines_for


@pytest.fixture(scope="session")
def own_engines(request: pytest.FixtureRequest) -> Results:
    """Every collected own-engines module's result, from one child: started early by
    the full suite (at the fake-host tier's wait), else at the first test that asks (the
    engines of those modules are started once between them)."""
    return own_engines_for(request.config, request.session.items, request.node.nodeid).results()
