"""An engine core that only keeps finished requests' KV waits for input instead of
stepping (``engines.idle_steps``), against a stand-in for vLLM's ``EngineCore``."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import types
from typing import Any

import pytest

from engines import idle_steps
from orchestrator.config import parse_config


class Scheduler:
    def __init__(self, unfinished: int = 0, kept: int = 0, just_finished: int = 0) -> None:
        self.unfinished, self.kept = unfinished, kept
        self.finished_req_ids = {f"f{i}" for i in range(just_finished)}

    def has_unfinished_requests(self) -> bool:
        return self.unfinished > 0

    def has_requests(self) -> bool:
        return self.unfinished + self.kept > 0 or bool(self.finished_req_ids)


def core_class() -> type:
    class Core:
        """What the wrapper uses of vLLM's engine core: a step, an input queue and the
        handler of client messages."""

        def __init__(self, scheduler: Scheduler) -> None:
            self.scheduler = scheduler
            self.input_queue: queue.Queue[tuple[str, Any]] = queue.Queue()
            self.engines_running = False
            self.batch_queue = None
            self.steps = 0
            self.handled: list[tuple[str, Any]] = []

        def _handle_client_request(self, kind: str, request: Any) -> None:
            self.handled.append((kind, request))

        def _process_engine_step(self) -> bool:
            self.steps += 1
            return False

    return Core


def test_a_core_that_only_keeps_kv_handles_the_next_request_before_stepping() -> None:
    Core = core_class()
    assert idle_steps.install(Core, wait_s=60.0)
    core = Core(Scheduler(kept=1))
    core.input_queue.put(("ADD", "r1"))
    # A message is waiting: taken and handled at once (no 60 s wait), then the step.
    core._process_engine_step()
    assert core.handled == [("ADD", "r1")] and core.steps == 1


def test_with_nothing_arriving_it_steps_once_per_wait() -> None:
    Core = core_class()
    idle_steps.install(Core, wait_s=0.01)
    core = Core(Scheduler(kept=1))
    core._process_engine_step()  # waited 10 ms for input, none came: then the step
    assert core.handled == [] and core.steps == 1


@pytest.mark.parametrize(
    "scheduler",
    [
        Scheduler(unfinished=1, kept=1),  # a request to run
        Scheduler(kept=1, just_finished=1),  # a request just finished: its cleanup step
        Scheduler(),  # nothing at all (vLLM does not step then anyway)
    ],
)
def test_a_core_with_work_steps_without_waiting(scheduler: Scheduler) -> None:
    Core = core_class()
    idle_steps.install(Core, wait_s=60.0)
    core = Core(scheduler)
    core.input_queue.put(("ADD", "r1"))
    core._process_engine_step()
    assert core.steps == 1 and core.handled == []  # the message stays for vLLM's loop


def test_it_wraps_once_and_only_a_core_with_the_step_it_knows() -> None:
    Core = core_class()
    assert idle_steps.install(Core, 0.02) and not idle_steps.install(Core, 0.02)
    assert not idle_steps.install(type("Other", (), {}), 0.02)


def test_the_config_turns_it_on_for_cpu_engines_only_unless_set() -> None:
    def env(cfg: dict[str, Any]) -> dict[str, str]:
        config = parse_config(cfg)
        return dict(config.engine_spec(config.decode, "d", side_channel_port=5600).env)

    assert env({})[idle_steps.ENV_VAR] == "20"
    assert idle_steps.ENV_VAR not in env({"kv": {"idle_step_wait_ms": 0}})
    assert env({"kv": {"idle_step_wait_ms": 5}})[idle_steps.ENV_VAR] == "5"


def test_the_plugin_wraps_the_engine_core_process_only_where_the_variable_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    Core = core_class()
    fake = types.ModuleType("vllm.v1.engine.core")
    fake.EngineCoreProc = Core  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", fake)
    for unset in ("0", "", "soon"):
        monkeypatch.setenv(idle_steps.ENV_VAR, unset)
        idle_steps.register()
        assert getattr(Core, "_kvtide_idle_wait_s", None) is None
    monkeypatch.setenv(idle_steps.ENV_VAR, "20")
    idle_steps.register()
    assert Core._kvtide_idle_wait_s == 0.02  # type: ignore[attr-defined]


class Spin:
    """vLLM's ``SpinCondition``'s constructor, as its callers use it."""

    def __init__(
        self, is_reader: bool, context: Any, notify_address: str, busy_loop_s: float = 1
    ) -> None:
        self.busy_loop_s = busy_loop_s


def test_a_message_queue_reader_spins_2_ms_after_a_message_not_a_second() -> None:
    # A core stepping every 20 ms (the idle wait) sends its worker a message each time;
    # with vLLM's 1 s spin after every message, the worker never stopped spinning.
    assert idle_steps.shorten_reader_spin(Spin, idle_steps.READER_SPIN_S)
    assert Spin(is_reader=True, context=None, notify_address="x").busy_loop_s == 0.002
    assert Spin(True, None, "x").busy_loop_s == 0.002
    assert Spin(True, None, "x", 0.5).busy_loop_s == 0.5  # a caller's own value stands
    assert not idle_steps.shorten_reader_spin(Spin, 0.1)  # once


def test_vllms_own_engine_core_and_message_queue_have_what_the_plugin_changes() -> None:
    """In a process of its own (the changes are process-wide), as vLLM loads the plugin."""
    code = (
        "import zmq; from engines import idle_steps; idle_steps.register(); "
        "from vllm.v1.engine.core import EngineCoreProc as C; "
        "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition; "
        "reader = SpinCondition(is_reader=True, context=zmq.Context(), "
        "notify_address='ipc:///tmp/kvtide-spin-test'); "
        "print(getattr(C, '_kvtide_idle_wait_s', None), reader.busy_loop_s)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, idle_steps.ENV_VAR: "20"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert done.stdout.strip().splitlines()[-1] == "0.02 0.002"


def test_the_engine_counts_each_step_it_runs_an_empty_one_too() -> None:
    """``EngineStats.num_steps``: what the engine test of an idle decode engine counts.
    vLLM's scheduler makes one ``SchedulerStats`` per step (an empty batch's too) and
    the front end hands each to the stat loggers; outputs without stats are not steps."""
    from vllm.v1.metrics.stats import SchedulerStats

    from engines.base import EngineSpec
    from engines.vllm_engine import VLLMEngine, _make_stat_logger

    engine = VLLMEngine(
        EngineSpec(engine_id="d-0", role="decode", model_path="/m", served_model_name="m")
    )
    logger = _make_stat_logger(engine._counters)(None)
    for _ in range(3):  # three steps of nothing: a kept request's blocks, no batch
        logger.record(scheduler_stats=SchedulerStats(), iteration_stats=None)
    logger.record(scheduler_stats=None, iteration_stats=None)  # an output without a step
    assert engine.stats().num_steps == 3
