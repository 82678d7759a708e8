"""The ``autoscaling`` section: the prefill and decode pools sized by Ray Serve's
autoscaler with kvtide's policy (``policies.autoscale``; docs/autoscaling.md)."""

from __future__ import annotations

from pydantic import Field, model_validator

from orchestrator.config.server import StrictSection
from policies.autoscale import AutoscaleTargets, PoolBounds

__all__ = ["AutoscalingConfig", "PoolReplicas"]


class PoolReplicas(StrictSection):
    """How far the autoscaler may size one pool."""

    min_replicas: int = Field(1, ge=1, le=1024, description="Fewest engines of the pool.")
    max_replicas: int = Field(4, ge=1, le=1024, description="Most engines of the pool.")

    @model_validator(mode="after")
    def _min_within_max(self) -> PoolReplicas:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) is above max_replicas "
                f"({self.max_replicas}); set max_replicas to at least {self.min_replicas}"
            )
        return self


class AutoscalingConfig(StrictSection):
    """Off by default: the pools keep ``num_engines`` engines each. On: each pool starts
    with ``num_engines`` (within its min/max) and Ray Serve's autoscaler asks kvtide's
    policy for its count every ``interval_s``."""

    enabled: bool = Field(False, description="Size the prefill and decode pools to the load.")
    ttft_p90_s: float = Field(
        2.0, gt=0, le=3600, description="TTFT target (p90), seconds: sizes the prefill pool."
    )
    itl_p90_s: float = Field(
        0.1, gt=0, le=60, description="Inter-token latency target (p90), seconds: decode."
    )
    prefill: PoolReplicas = PoolReplicas(min_replicas=1, max_replicas=4)
    decode: PoolReplicas = PoolReplicas(min_replicas=1, max_replicas=4)
    engine_start_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="How long a new engine takes to serve, until one has been measured "
        "(each engine host reports its own start time; the policy uses the latest): the "
        "policy sizes a growing prefill backlog, and decode's sequences rising over the "
        "last two decisions, for when a new engine is up.",
    )
    scale_down_window_s: float = Field(
        60.0,
        ge=0,
        le=86400,
        description="A pool scales in only after every decision this long wanted fewer "
        "engines (it scales out at once).",
    )
    scale_up_utilization: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Share of an engine's sequences, KV blocks and prefill rate the load "
        "may fill before the pool scales out.",
    )
    scale_down_utilization: float = Field(
        0.6,
        gt=0,
        le=1,
        description="The pool scales in only when the load fits the smaller pool at this "
        "share (below scale_up_utilization: the band between holds).",
    )
    headroom: float = Field(
        0.5,
        ge=0,
        le=10,
        description="Spare capacity kept for bursts, as a share of the load: the prefill "
        "rate and the sequences are sized for (1 + headroom) x the load (0: none). A "
        "burst arriving faster than a new engine starts is served by the headroom alone.",
    )
    prefill_tokens_per_s: float = Field(
        2000.0,
        gt=0,
        le=1e9,
        description="Prompt tokens per second one prefill engine computes, until the "
        "engines have measured it.",
    )
    interval_s: float = Field(
        5.0,
        ge=1,
        le=30,
        description="How often engines report their load to Serve's autoscaler and the "
        "policy decides (at most 30 s: the KV service drops a metric book older than "
        "60 s, and the policy's goes with each decision).",
    )

    @model_validator(mode="after")
    def _band(self) -> AutoscalingConfig:
        if self.scale_down_utilization > self.scale_up_utilization:
            raise ValueError(
                f"scale_down_utilization ({self.scale_down_utilization}) is above "
                f"scale_up_utilization ({self.scale_up_utilization}); a pool would scale "
                "in to a size it scales out of: set it at or below scale_up_utilization"
            )
        return self

    def targets(self, engine_start_s: float | None = None) -> AutoscaleTargets:
        """The policy's targets (the one conversion to its type); ``engine_start_s``: the
        start time measured at the last start, when there is one."""
        return AutoscaleTargets(
            ttft_p90_s=self.ttft_p90_s,
            itl_p90_s=self.itl_p90_s,
            prefill=PoolBounds(
                min_replicas=self.prefill.min_replicas, max_replicas=self.prefill.max_replicas
            ),
            decode=PoolBounds(
                min_replicas=self.decode.min_replicas, max_replicas=self.decode.max_replicas
            ),
            engine_start_s=self.engine_start_s if engine_start_s is None else engine_start_s,
            scale_down_window_s=self.scale_down_window_s,
            scale_up_utilization=self.scale_up_utilization,
            scale_down_utilization=self.scale_down_utilization,
            headroom=self.headroom,
        )
