"""The custom autoscaling policy Ray Serve calls for kvtide's prefill and decode pools.

Serve's controller calls ``PoolPolicy`` (one instance per pool deployment, built from its
``policy_kwargs``) on each pass of its control loop with the deployment's
``AutoscalingContext``: the replicas running and the target, and what each engine host
reported (``load_meter``), averaged over the look-back window. Every ``interval_s`` the
policy sums those reports into the pool's ``PoolSignals`` and asks
``policies.autoscale.decide`` for both pools at once (decode counts the sequences in
prefill as its own next load: each pool's policy leaves its signals on a board the
other reads, ``board``); between decisions it keeps the last count. Serve applies the
count within the deployment's min/max (its own delays are set to 0: the hysteresis is
the policy's).

Application-level policies (Ray 2.60's ``autoscaling_policy`` of an application) are
registered only by a Serve config file, not by ``serve.run`` from Python, which is how
``kvtide up`` deploys; per-deployment policies with a shared board work for both.

Each decision is logged with its inputs (logger ``ray.serve.kvtide.autoscale``, in the
Serve controller's log) and exported as metrics (``kvtide_autoscale_*``): kept in a book of
the policy's own, sent to the KV service with the ingress replicas' books (``GET
/metrics`` sums them), and with ``observability.ray_metrics`` to Ray's metrics too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from orchestrator.autoscale import board
from orchestrator.cluster.deadlines import GCS_TIMEOUT_S, call_within
from orchestrator.config import AutoscalingConfig, ObservabilityConfig
from orchestrator.kv.actor import lookup_service
from orchestrator.observability.metrics import Metrics, make_metrics
from policies.autoscale import POOLS, Pool, PoolDecision, PoolSignals, PoolState, Signal, decide

__all__ = ["SIGNALS", "PoolPolicy", "pool_signals"]

# Under Serve's logger: the controller gives ``ray.serve`` its log file (at INFO) and no
# other; a logger of kvtide's own gets no handler there, and its INFO lines were dropped.
log = logging.getLogger("ray.serve.kvtide.autoscale")

SIGNALS: tuple[Signal, ...] = (
    "prefill_load",
    "ttft_backlog",
    "running_seqs",
    "kv_use",
    "held_kv",
    "itl",
    "idle",
)
STATE_KEY = "kvtide"
DECIDED_KEY = "kvtide_decided_s"
LOOKUP_RETRY_S = 10.0


def pool_signals(
    pool: Pool,
    reports: Mapping[str, Mapping[Any, float]],
    *,
    num_replicas: int,
    max_num_seqs: int,
    prefill_tokens_per_s: float,
) -> PoolSignals:
    """One pool's signals from its replicas' reports (``metric → replica → value``, as
    ``AutoscalingContext.aggregated_metrics`` holds them): counts and rates summed, the
    measured prefill rate and ITL averaged over the replicas that measured one."""

    def total(key: str) -> float:
        return sum(reports.get(key, {}).values())

    def mean_measured(key: str) -> float | None:
        values = [v for v in reports.get(key, {}).values() if v > 0]
        return sum(values) / len(values) if values else None

    replicas = max(1, len(reports.get("kv_blocks", {})))
    measured_rate = mean_measured("prefill_tokens_per_s")
    return PoolSignals(
        num_replicas=num_replicas,
        queued_prompt_tokens=round(total("queued_prompt_tokens")),
        prompt_tokens_per_s=total("prompt_tokens_per_s"),
        prefill_tokens_per_s_per_engine=measured_rate or prefill_tokens_per_s,
        num_running_seqs=round(total("num_running")),
        num_waiting_seqs=round(total("num_waiting")),
        max_num_seqs_per_engine=max_num_seqs,
        kv_blocks_per_engine=round(total("kv_blocks") / replicas),
        kv_blocks_running=round(total("kv_blocks_used") - total("kv_blocks_held")),
        kv_blocks_held=round(total("kv_blocks_held")),
        itl_s=mean_measured("itl_s") if pool == "decode" else None,
    )


class PoolPolicy:
    """Serve's policy for one pool's deployment (``policy_kwargs``: ``pool``, the
    ``autoscaling`` section as a dict, the pool's ``max_num_seqs``, and whether Ray's
    metrics are on)."""

    # How the KV service is found, and whether to look (a test's fakes replace them;
    # outside Ray a lookup would start one).
    find_service = staticmethod(lookup_service)
    connected = staticmethod(board.in_ray)

    def __init__(
        self,
        *,
        pool: Pool,
        autoscaling: dict[str, Any],
        max_num_seqs: dict[str, int],
        ray_metrics: bool = False,
    ) -> None:
        self.pool = pool
        self.config = AutoscalingConfig.model_validate(autoscaling)
        self.max_num_seqs = max_num_seqs
        self.metrics: Metrics = make_metrics(
            ObservabilityConfig(metrics=True, ray_metrics=ray_metrics)
        )
        self._service: Any = None
        self._looked_up_s = float("-inf")

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        state = dict(ctx.policy_state or {})
        now = float(ctx.current_time)
        decided_s = state.get(DECIDED_KEY)
        reports = ctx.aggregated_metrics or {}
        if not reports.get("kv_blocks") or (
            decided_s is not None and now - float(decided_s) < self.config.interval_s
        ):
            return int(ctx.target_num_replicas), state  # no report yet, or not time yet
        own = self._signals(reports, int(ctx.current_num_replicas))
        app = str(ctx.app_name or "")
        board.publish(app, self.pool, own)
        signals = {p: own if p == self.pool else board.latest(app, p) for p in POOLS}
        starts = [v for v in reports.get("engine_start_s", {}).values() if v > 0]
        targets = self.config.targets(engine_start_s=max(starts) if starts else None)
        mine = PoolState.from_dict(state.get(STATE_KEY) or {})
        if mine.target == 0:
            mine = PoolState(target=int(ctx.target_num_replicas))
        decision = decide(signals, targets, {self.pool: mine}, now)[self.pool]
        state[STATE_KEY] = decision.state.as_dict()
        state[DECIDED_KEY] = now
        self._record(app, decision, own)
        return decision.desired_replicas, state

    def _signals(self, reports: Mapping[str, Mapping[Any, float]], replicas: int) -> PoolSignals:
        return pool_signals(
            self.pool,
            reports,
            num_replicas=replicas,
            max_num_seqs=self.max_num_seqs[self.pool],
            prefill_tokens_per_s=self.config.prefill_tokens_per_s,
        )

    def _record(self, app: str, decision: PoolDecision, signals: PoolSignals) -> None:
        log.info(
            "autoscale %s: %d -> %d (%s; %s) from %s",
            self.pool,
            decision.num_replicas,
            decision.desired_replicas,
            decision.action,
            decision.reason,
            signals,
        )
        m, pool = self.metrics, self.pool
        m.set_gauge("kvtide_autoscale_desired_replicas", decision.desired_replicas, pool=pool)
        m.set_gauge("kvtide_autoscale_replicas", decision.num_replicas, pool=pool)
        for signal in SIGNALS:
            driving = 1.0 if signal == decision.signal else 0.0
            m.set_gauge("kvtide_autoscale_driving_signal", driving, pool=pool, signal=signal)
        if decision.action != "hold":
            m.inc("kvtide_autoscale_decisions_total", pool=pool, action=decision.action)
        self._send(app)

    def _send(self, app: str) -> None:
        """The book to the KV service, unanswered (the next decision sends it again)."""
        if self._service is None:
            if not self.connected() or board.now_s() - self._looked_up_s < LOOKUP_RETRY_S:
                return
            self._looked_up_s = board.now_s()
            try:
                self._service = call_within(
                    lambda: self.find_service(app), GCS_TIMEOUT_S, "the KV service's lookup"
                )
            except Exception as exc:  # the next decision tries again
                log.warning("autoscale %s: no KV service for its metrics: %s", self.pool, exc)
            if self._service is None:
                return
        try:
            self._service.report_metrics.remote(f"autoscaler-{self.pool}", self.metrics.snapshot())
        except Exception as exc:  # a restarted service: found again at the next lookup
            log.warning("autoscale %s: metrics not sent: %s", self.pool, exc)
            self._service = None
