"""The stream path's defaults and the engine's own step time
(``orchestrator.config``'s server section, ``engines.vllm_engine.engine_step_s``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engines.vllm_engine import engine_step_s
from orchestrator.config import parse_config
from orchestrator.errors import ConfigError


def test_streams_send_each_engine_step_unless_coalescing_is_asked_for() -> None:
    server = parse_config({}).server
    assert server.stream_chunk_window_ms == 0.0  # no token held back by default
    opted = parse_config({"server": {"stream_chunk_window_ms": 50, "stream_chunk_tokens": 8}})
    assert (opted.server.stream_chunk_window_ms, opted.server.stream_chunk_tokens) == (50.0, 8)
    with pytest.raises(ConfigError, match="stream_chunk_window_ms"):
        parse_config({"server": {"stream_chunk_window_ms": -1}})


@dataclass
class Stats:
    """vLLM's ``RequestStateStats`` fields that ``engine_step_s`` reads."""

    num_generation_tokens: int
    first_token_ts: float
    last_token_ts: float


def test_the_engines_step_time_is_its_first_to_last_token_over_the_steps_between() -> None:
    # 33 tokens: 32 steps after the first, 0.48 s on the engine core's clock.
    assert engine_step_s(Stats(33, 100.02, 100.50)) == pytest.approx(0.015)
    assert engine_step_s(Stats(1, 100.0, 100.0)) is None  # one token: no step between
    assert engine_step_s(Stats(5, 0.0, 0.0)) is None  # timestamps never stamped
    assert engine_step_s(None) is None  # stats logging off
