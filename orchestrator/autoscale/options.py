"""The Serve options that put a pool deployment under kvtide's autoscaling policy
(pure; tested without a cluster)."""

from __future__ import annotations

from typing import Any

from orchestrator.config import KVTideConfig

__all__ = ["AUTOSCALED_POOLS", "PUSH_INTERVAL_ENV", "autoscaling_env", "autoscaling_options"]

AUTOSCALED_POOLS = ("prefill", "decode")
POLICY_PATH = "orchestrator.autoscale.serve_policy:PoolPolicy"
SERVE_METRICS_INTERVAL_S = 10.0  # AutoscalingConfig.metrics_interval_s's default
PUSH_INTERVAL_ENV = "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"


def autoscaling_options(config: KVTideConfig, pool_name: str) -> dict[str, Any] | None:
    """``autoscaling_config`` for the pool's deployment; ``None``: a fixed size (off, or
    a pool the policy does not size)."""
    scaling = config.autoscaling
    if not scaling.enabled or pool_name not in AUTOSCALED_POOLS:
        return None
    bounds = scaling.prefill if pool_name == "prefill" else scaling.decode
    return {
        "min_replicas": bounds.min_replicas,
        "max_replicas": bounds.max_replicas,
        "initial_replicas": config.pool(pool_name).num_engines,
        # The policy's own hysteresis decides; Serve's delays would add to it.
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        # Two reports per replica: averaged, a report lost in the window does not drop it
        # (and longer than Serve's deprecated metrics_interval_s, which it checks).
        "look_back_period_s": max(2 * scaling.interval_s, SERVE_METRICS_INTERVAL_S + 1),
        "policy": {
            "policy_function": POLICY_PATH,
            "policy_kwargs": {
                "pool": pool_name,
                "autoscaling": scaling.model_dump(mode="json"),
                "max_num_seqs": {p: config.pool(p).max_num_seqs for p in AUTOSCALED_POOLS},
                "ray_metrics": config.observability.ray_metrics,
            },
        },
    }


def autoscaling_env(config: KVTideConfig) -> dict[str, str]:
    """The environment of the replicas (a local Ray's processes, or ``ray start`` on a
    cluster): how often each reports its load to Serve's controller."""
    if not config.autoscaling.enabled:
        return {}
    return {PUSH_INTERVAL_ENV: f"{config.autoscaling.interval_s:g}"}
