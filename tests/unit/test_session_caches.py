"""The caches engines write go to the test session's own directory, not HOME's
(tests/conftest.py), so a fresh HOME runs the suite as a warm one does."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tests.conftest import SESSION_CACHES


def test_vllms_cache_root_in_the_tests_processes_is_the_sessions_own() -> None:
    root = Path(os.environ["KVTIDE_TEST_CACHE_ROOT"])
    assert root.is_dir() and not root.is_relative_to(Path.home())
    # vLLM's own settings module, as every engine process reads it (loaded from its file:
    # importing the vllm package costs seconds), in the environment they inherit.
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    envs_file = Path(spec.origin).parent / "envs.py"
    envs_spec = importlib.util.spec_from_file_location("vllm_envs_as_read", envs_file)
    assert envs_spec is not None and envs_spec.loader is not None
    envs = importlib.util.module_from_spec(envs_spec)
    envs_spec.loader.exec_module(envs)
    assert Path(envs.VLLM_CACHE_ROOT) == root / SESSION_CACHES["VLLM_CACHE_ROOT"]
