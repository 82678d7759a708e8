"""How long each test tier took in a run, printed at its end (``tests/conftest.py``).

A test's tier comes from its markers: ``netns`` (the fake-host tier: its tests in
``tests/netns`` and ``tests/test_netns_tier.py``, which runs them in a child pytest),
else ``engine``, else ``ray``, else ``unit``. A tier's time is the sum of its tests'
setup, call and teardown: the suite runs one test at a time, so that is the tier's wall
time, a session fixture's start (the shared app, ~2-4 minutes) included in the setup of
the first test that asks for it.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass

__all__ = ["TIERS", "Phase", "summary_lines", "tier_of", "tier_seconds"]

TIERS = ("unit", "ray", "netns", "engine")


def tier_of(keywords: Container[str]) -> str:
    """The tier of a test with these keywords (markers among them)."""
    for tier in ("netns", "engine", "ray"):
        if tier in keywords:
            return tier
    return "unit"


@dataclass(frozen=True, slots=True, kw_only=True)
class Phase:
    """One phase of one test (pytest's report of it): setup, call or teardown."""

    nodeid: str
    tier: str
    when: str
    duration_s: float


def tier_seconds(phases: Iterable[Phase]) -> dict[str, float]:
    """Seconds spent in each tier (every tier of ``TIERS``, 0.0 where none ran)."""
    out = dict.fromkeys(TIERS, 0.0)
    for phase in phases:
        out[phase.tier] = out.get(phase.tier, 0.0) + phase.duration_s
    return out


def summary_lines(phases: Iterable[Phase], num_setups: int = 5) -> list[str]:
    """Each tier's time and test count, the total, then the ``num_setups`` slowest setups."""
    phases = list(phases)
    seconds = tier_seconds(phases)
    tests: dict[str, set[str]] = {tier: set() for tier in seconds}
    for phase in phases:
        tests[phase.tier].add(phase.nodeid)
    lines = [
        f"{tier:<7} {_minutes(s):>9}  {len(tests[tier])} tests"
        for tier, s in seconds.items()
        if tests[tier]
    ]
    lines.append(f"{'total':<7} {_minutes(sum(seconds.values())):>9}")
    setups = sorted((p for p in phases if p.when == "setup"), key=lambda p: -p.duration_s)
    slow = [p for p in setups[:num_setups] if p.duration_s >= 1.0]
    if slow:
        lines.append("slowest setups (a session fixture's start is in its first test's):")
        lines.extend(f"  {_minutes(p.duration_s):>9}  {p.nodeid}" for p in slow)
    return lines


def _minutes(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else f"{int(seconds // 60)}m{seconds % 60:04.1f}s"
