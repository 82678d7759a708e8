"""kvtide's policy as Ray Serve calls it: the deployment options that install it, what an
engine host reports (``LoadMeter``), and ``PoolPolicy`` called with the context Serve's
controller builds (a hand-written fake of ``AutoscalingContext``'s fields)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from engines.base import EngineStats
from orchestrator.autoscale import board
from orchestrator.autoscale.load_meter import STAT_KEYS, LoadMeter
from orchestrator.autoscale.options import PUSH_INTERVAL_ENV, autoscaling_env
from orchestrator.autoscale.serve_policy import PoolPolicy
from orchestrator.config import parse_config
from orchestrator.serve.engine_host import EngineHost, engine_deployment_options

ON = {
    "autoscaling": {
        "enabled": True,
        "prefill": {"min_replicas": 1, "max_replicas": 3},
        "decode": {"min_replicas": 1, "max_replicas": 4},
        "interval_s": 2,
        "scale_down_window_s": 10,
        "headroom": 0,  # the figures below size the load alone
    },
    "prefill": {"max_num_seqs": 8},
    "decode": {"max_num_seqs": 10},
}


def test_autoscaling_off_keeps_the_fixed_size() -> None:
    cfg = parse_config({"decode": {"num_engines": 2}})
    options = engine_deployment_options(cfg, "decode")
    assert options["num_replicas"] == 2 and "autoscaling_config" not in options
    assert autoscaling_env(cfg) == {}


def test_autoscaling_on_installs_kvtides_policy_in_serves_options() -> None:
    cfg = parse_config({**ON, "decode": {"max_num_seqs": 10, "num_engines": 2}})
    options = engine_deployment_options(cfg, "decode")
    assert "num_replicas" not in options
    scaling = options["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["initial_replicas"], scaling["max_replicas"]) == (
        1,
        2,
        4,
    )
    assert scaling["upscale_delay_s"] == scaling["downscale_delay_s"] == 0
    policy = scaling["policy"]
    assert policy["policy_function"] == "orchestrator.autoscale.serve_policy:PoolPolicy"
    assert policy["policy_kwargs"]["pool"] == "decode"
    # Serve itself accepts them: it validates the config and pickles the policy class.
    deployment = EngineHost.options(**options)
    config = deployment._deployment_config.autoscaling_config
    assert config is not None and config.policy.get_serialized_policy_def()
    assert config.initial_replicas == 2
    # Each replica reports at the section's interval.
    assert autoscaling_env(cfg) == {PUSH_INTERVAL_ENV: "2"}


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_the_load_meter_measures_rates_between_readings() -> None:
    clock = FakeClock()
    meter = LoadMeter(clock=clock, engine_start_s=42.0)
    meter.prompt_taken(3000)
    first = meter.report(
        EngineStats(engine_id="p", num_running=2, num_waiting=1, kv_cache_usage=0.25),
        num_kv_blocks=400,
        kv_blocks_kept=30,
    )
    assert set(first) == set(STAT_KEYS)
    assert first["queued_prompt_tokens"] == 3000 and first["prompt_tokens_per_s"] == 0
    assert first["kv_blocks_used"] == 100 and first["kv_blocks_held"] == 30
    assert first["engine_start_s"] == 42.0
    # 2 s later, busy throughout: 2,000 prompt tokens computed, 40 tokens generated for
    # 2 running sequences (each a token every 0.1 s).
    clock.now_s += 2
    second = meter.report(
        EngineStats(
            engine_id="p",
            num_running=2,
            num_prompt_tokens=2000,
            num_generation_tokens=40,
            kv_cache_usage=0.05,
        ),
        num_kv_blocks=400,
        kv_blocks_kept=30,
    )
    assert second["prompt_tokens_per_s"] == 1000 and second["prefill_tokens_per_s"] == 1000
    assert second["itl_s"] == pytest.approx(0.1)
    # Kept blocks the engine no longer uses (a peer read them) are not held.
    assert second["kv_blocks_held"] == 20
    # Idle from then on: the measured rate is kept, not diluted by idle time.
    meter.prompt_done(3000)
    clock.now_s += 2
    third = meter.report(
        EngineStats(engine_id="p", num_prompt_tokens=2100, num_generation_tokens=40),
        num_kv_blocks=400,
        kv_blocks_kept=0,
    )
    assert third["prompt_tokens_per_s"] == 50 and third["prefill_tokens_per_s"] == 1000
    assert third["queued_prompt_tokens"] == 0 and third["itl_s"] == 0


@dataclass
class Context:
    """The fields of Serve's ``AutoscalingContext`` the policy reads."""

    app_name: str
    current_num_replicas: int
    target_num_replicas: int
    aggregated_metrics: dict[str, dict[Any, float]]
    current_time: float
    policy_state: dict[str, Any] = field(default_factory=dict)


def reports(replicas: int, **per_replica: float) -> dict[str, dict[Any, float]]:
    base = {key: 0.0 for key in STAT_KEYS} | {"kv_blocks": 1000.0} | per_replica
    return {key: {f"r{i}": value for i in range(replicas)} for key, value in base.items()}


class SentBooks:
    """The KV service as the policy sees it: ``report_metrics.remote``."""

    def __init__(self) -> None:
        self.books: list[tuple[str, dict[str, float]]] = []
        self.report_metrics = self

    def remote(self, source: str, book: dict[str, float]) -> None:
        self.books.append((source, book))


def policy(pool: str, service: SentBooks) -> PoolPolicy:
    cfg = parse_config(ON)

    class Policy(PoolPolicy):
        find_service = staticmethod(lambda app: service)
        connected = staticmethod(lambda: True)

    return Policy(
        pool=pool,  # type: ignore[arg-type]
        autoscaling=cfg.autoscaling.model_dump(mode="json"),
        max_num_seqs={"prefill": 8, "decode": 10},
    )


def test_the_policy_scales_decode_for_what_prefill_sends_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = SentBooks()
    prefill, decode = policy("prefill", service), policy("decode", service)
    app = "test-decode-sees-prefill"
    # Prefill: 2 engines with 12 sequences each in flight (24 on their way to decode).
    p_ctx = Context(app, 2, 2, reports(2, num_running=8, num_waiting=4), current_time=1000.0)
    assert prefill(p_ctx)[0] == 2
    # Decode: 1 engine running 4 sequences; with prefill's 24: 28 / (10 x 0.8) = 3.5 → 4.
    d_ctx = Context(app, 1, 1, reports(1, num_running=4), current_time=1000.0)
    with caplog.at_level(logging.INFO, logger="ray.serve.kvtide.autoscale"):
        count, state = decode(d_ctx)
    assert count == 4
    assert "autoscale decode: 1 -> 4 (up; running_seqs needs 4" in caplog.text
    assert "num_running_seqs=4" in caplog.text  # the inputs are logged
    # The decision's metrics went to the KV service with the policy's book.
    source, book = service.books[-1]
    assert source == "autoscaler-decode"
    assert book['kvtide_autoscale_desired_replicas{pool="decode"}'] == 4
    assert book['kvtide_autoscale_replicas{pool="decode"}'] == 1
    assert book['kvtide_autoscale_driving_signal{pool="decode",signal="running_seqs"}'] == 1
    assert book['kvtide_autoscale_driving_signal{pool="decode",signal="kv_use"}'] == 0
    assert book['kvtide_autoscale_decisions_total{pool="decode",action="up"}'] == 1
    # Within interval_s (2 s) the last count stands, whatever the load.
    quiet = Context(app, 4, 4, reports(4), current_time=1001.0, policy_state=state)
    assert decode(quiet)[0] == 4


@pytest.fixture
def serve_logger() -> Iterator[None]:
    """Serve's ``ray.serve`` logger as it was, after a test configured it as Serve does."""
    logger = logging.getLogger("ray.serve")
    saved = (logger.level, logger.propagate, list(logger.handlers))
    yield
    for handler in logger.handlers:
        handler.close()
        target = getattr(handler, "target", None)  # Serve's buffer and its file
        if target is not None:
            target.close()
    logger.setLevel(saved[0])
    logger.propagate = saved[1]
    logger.handlers[:] = saved[2]


def test_a_decision_is_in_the_serve_controllers_log_file(
    tmp_path: Path, serve_logger: None
) -> None:
    # The controller's logging, set up by Serve's own function as its controller calls
    # it (docs/autoscaling.md: each decision is logged with its inputs there).
    from ray.serve._private.logging_utils import configure_component_logger
    from ray.serve.schema import LoggingConfig

    configure_component_logger(
        component_name="controller",
        component_id="1",
        logging_config=LoggingConfig(logs_dir=str(tmp_path)),
        max_bytes=2**20,
        backup_count=1,
    )
    decode = policy("decode", SentBooks())
    ctx = Context("test-logged", 1, 1, reports(1, num_running=20), current_time=3000.0)
    assert decode(ctx)[0] > 1
    logged = (tmp_path / "controller_1.log").read_text()
    assert "autoscale decode: 1 -> " in logged and "num_running_seqs=20" in logged


def test_the_policy_scales_in_only_after_the_window() -> None:
    decode = policy("decode", SentBooks())
    app = "test-window"
    board.publish(app, "prefill", board.latest(app, "prefill"))
    state: dict[str, Any] = {}
    counts = []
    for t in range(0, 16, 2):  # a decision every 2 s; the window is 10 s
        ctx = Context(app, 3, 3, reports(3), current_time=2000.0 + t, policy_state=state)
        count, state = decode(ctx)
        counts.append(count)
    assert counts == [3, 3, 3, 3, 3, 1, 1, 1]  # 10 s after the first that wanted 1


def test_no_report_yet_keeps_serves_target() -> None:
    decode = policy("decode", SentBooks())
    ctx = Context("test-none", 1, 2, {}, current_time=0.0)
    assert decode(ctx) == (2, {})


def test_serves_controller_code_runs_the_policy_it_unpickles() -> None:
    # What Serve's controller does with the deployment's config: unpickle the policy,
    # build it from its kwargs, wrap it with Serve's bounds and delays, and call it with
    # a real AutoscalingContext.
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingContext

    cfg = parse_config(ON)
    config = EngineHost.options(**engine_deployment_options(cfg, "decode"))._deployment_config
    scaling = config.autoscaling_config
    assert scaling is not None
    policy = _apply_autoscaling_config(_resolve_policy_callable(scaling.policy))
    board.publish("test-serve-code", "prefill", board.latest("test-serve-code", "prefill"))
    ctx = AutoscalingContext(
        deployment_id=None,  # type: ignore[arg-type]
        deployment_name="decode-pool",
        app_name="test-serve-code",
        current_num_replicas=1,
        target_num_replicas=1,
        running_replicas=[],
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=reports(1, num_running=20),
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=4,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=5000.0,
        config=scaling,
    )
    count, state = policy(ctx)
    # 20 sequences / (10 x 0.8) = 2.5 → 3, at once (Serve's delays are 0).
    assert count == 3 and state["kvtide"]["target"] == 3


def test_a_stopping_autoscaled_decode_replica_gets_its_turns_deadline() -> None:
    # Serve calls the replica's __del__ (which moves its sessions' KV to the host tier)
    # only after its in-flight requests end, within graceful_shutdown_timeout_s; the
    # ingresses end their step streams to it (step_streams.replicas_gone).
    for streams in (True, False):
        on = parse_config({**ON, "server": {"step_streams": streams, "request_timeout_s": 60}})
        assert engine_deployment_options(on, "decode")["graceful_shutdown_timeout_s"] == (
            60 + on.kv.service_timeout_s + 5
        )
        # A prefill replica: its drain, then its KV read by decode, within the lease.
        assert engine_deployment_options(on, "prefill")["graceful_shutdown_timeout_s"] == (
            5 + on.kv.prefill_lease_s
        )
    # Not autoscaled, the same: a redeploy or a removal stops it (test_faults.py).
    fixed = parse_config({"server": {"request_timeout_s": 60}})
    assert engine_deployment_options(fixed, "decode")["graceful_shutdown_timeout_s"] == (
        60 + fixed.kv.service_timeout_s + 5
    )
