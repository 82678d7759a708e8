"""NIXL's UCX progress thread waits for a wake-up instead of spinning in vLLM engines on
CPU (``engines/kv_connector.py``, ``kv.nixl_progress_wait_ms``): what the config hands
vLLM, and what the connector does with it, on NIXL's real agents."""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest
import torch
from nixl._api import nixl_agent, nixl_agent_config

from engines.kv_connector import CPU_PROGRESS_WAIT_MS, PROGRESS_WAIT_KEY, progress_wait
from engines.vllm_engine import engine_args_for
from orchestrator.config import ConfigError, parse_config

BINDINGS: Any = sys.modules[nixl_agent.__module__].nixlBind


def wait_handed_to_vllm(raw: dict[str, Any]) -> float:
    config = parse_config({"backend": "vllm", **raw})
    spec = config.engine_spec(config.pool("decode"), "d0", 5600)
    extra = engine_args_for(spec)["kv_transfer_config"]["kv_connector_extra_config"]
    wait: float = extra[PROGRESS_WAIT_KEY]
    return wait


def test_cpu_engines_wait_gpu_engines_keep_nixls_busy_polling_and_config_overrides() -> None:
    assert wait_handed_to_vllm({}) == CPU_PROGRESS_WAIT_MS == 10.0
    assert wait_handed_to_vllm({"device": "cuda"}) == 0.0
    assert wait_handed_to_vllm({"kv": {"nixl_progress_wait_ms": 0}}) == 0.0
    assert wait_handed_to_vllm({"device": "cuda", "kv": {"nixl_progress_wait_ms": 2}}) == 2.0


def test_agent_configs_made_in_the_block_keep_the_wait_and_later_ones_do_not() -> None:
    base = BINDINGS.nixlAgentConfig
    with progress_wait(CPU_PROGRESS_WAIT_MS):
        config = BINDINGS.nixlAgentConfig()
        config.pthrDelay = 0  # what NIXL's Python API sets, whatever it is given
        assert config.pthrDelay == 10_000  # us
        config.pthrDelay = 50_000
        assert config.pthrDelay == 50_000  # a longer wait stays
    assert BINDINGS.nixlAgentConfig is base
    after = BINDINGS.nixlAgentConfig()
    after.pthrDelay = 0
    assert after.pthrDelay == 0
    with progress_wait(0):  # 0: NIXL's own busy polling, nothing replaced
        assert BINDINGS.nixlAgentConfig is base


def test_a_read_completes_while_both_agents_progress_threads_wait() -> None:
    # The target agent never calls into NIXL here: only its progress thread, which now
    # sleeps in poll(), can serve the read, so this checks that UCX wakes it.
    with progress_wait(CPU_PROGRESS_WAIT_MS):
        reader = nixl_agent("reader", nixl_agent_config(num_threads=1))
        target = nixl_agent("target", nixl_agent_config(num_threads=1))
    dst, src = torch.zeros(1 << 16), torch.arange(1 << 16, dtype=torch.float32)
    reader.register_memory(dst)
    target.register_memory(src)
    reader.add_remote_agent(target.get_agent_metadata())
    target.add_remote_agent(reader.get_agent_metadata())
    handle = reader.initialize_xfer(
        "READ", reader.get_xfer_descs(dst), target.get_xfer_descs(src), "target", b"done"
    )
    assert reader.transfer(handle) in ("PROC", "DONE")
    deadline = time.monotonic() + 30
    while (state := reader.check_xfer_state(handle)) == "PROC":
        assert time.monotonic() < deadline, "the read did not complete"
        time.sleep(0.001)
    assert state == "DONE"
    assert torch.equal(dst, src)
    reader.release_xfer_handle(handle)


def test_a_negative_wait_is_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match="nixl_progress_wait_ms"):
        parse_config({"kv": {"nixl_progress_wait_ms": -1}})
