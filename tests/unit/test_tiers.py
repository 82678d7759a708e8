"""The time per tier that every test run ends with (tests/tiers.py)."""

from __future__ import annotations

from tiers import Phase, summary_lines, tier_of, tier_seconds


def _phase(nodeid: str, tier: str, when: str, duration_s: float) -> Phase:
    return Phase(nodeid=nodeid, tier=tier, when=when, duration_s=duration_s)


PHASES = [
    # The first engine test's setup starts the shared app: 150 s.
    _phase("e.py::a", "engine", "setup", 150.0),
    _phase("e.py::a", "engine", "call", 4.0),
    _phase("e.py::a", "engine", "teardown", 0.5),
    _phase("e.py::b", "engine", "call", 2.5),
    _phase("r.py::a", "ray", "setup", 30.0),
    _phase("r.py::a", "ray", "call", 12.0),
    _phase("u.py::a", "unit", "setup", 0.125),
    _phase("u.py::a", "unit", "call", 0.375),
]


def test_a_tests_tier_comes_from_its_markers_netns_first() -> None:
    assert tier_of({"test_x", "unit"}) == "unit"
    assert tier_of({"ray"}) == "ray"
    assert tier_of({"engine", "gpu"}) == "engine"
    # The fake-host tier's tests are marked ray or engine as well; and the test that
    # runs that tier in a child pytest is marked ray and netns.
    assert tier_of({"ray", "netns"}) == "netns"
    assert tier_of({"engine", "netns"}) == "netns"


def test_each_tiers_time_sums_its_tests_setup_call_and_teardown() -> None:
    assert tier_seconds(PHASES) == {"unit": 0.5, "ray": 42.0, "netns": 0.0, "engine": 157.0}


def test_the_summary_names_each_tier_that_ran_and_the_slowest_setups() -> None:
    assert summary_lines(PHASES, num_setups=3) == [
        "unit         0.5s  1 tests",
        "ray         42.0s  1 tests",
        "engine    2m37.0s  2 tests",
        "total     3m19.5s",
        # Setups under a second are left out.
        "slowest setups (a session fixture's start is in its first test's):",
        "    2m30.0s  e.py::a",
        "      30.0s  r.py::a",
    ]
