"""A vLLM engine run in its placement group: TP workers as Ray actors, one per GPU bundle.

`DomainPlacer` gives an engine a group inside one NVLink domain (`PlacedEngine`):
a CPU bundle for the engine host, then one `{"GPU": 1}` bundle per TP rank. The
host actor runs there (`PlacedEngine.host_actor_options`, which captures child
tasks) and starts vLLM in-process with `distributed_executor_backend="ray"`.
vLLM then does the rest, as under Ray Serve LLM: building its config inside a
Ray actor, it takes the host's group (`ray.util.get_current_placement_group()`)
as `parallel_config.placement_group` and the host's runtime env as the workers'
base, and puts one worker in each bundle holding `GPU`, driver's node first.

On CPU the workers need `KVTIDE_CPU_RAY_PLATFORM=1` (engines.cpu_ray_platform)
before vLLM first resolves its platform in them, which is before vLLM copies
any variable over; so the spec's `env` goes into the host's runtime env, which
Ray hands down to every worker at process start.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engines import cpu_ray_platform
from engines.base import EngineSpec
from orchestrator.cluster.placement_groups import PlacedEngine
from placement.plan import PlacementPlan

__all__ = [
    "placed_engine_host_options",
    "placed_engine_spec",
    "ray_executor_spec",
    "with_cluster_address",
]


def placed_engine_spec(spec: EngineSpec, plan: PlacementPlan) -> EngineSpec:
    """`spec` as the engine `plan` placed (pure).

    The plan's TP size replaces the spec's; vLLM runs its workers as Ray actors;
    on CPU the kvtide platform plugin that lets it do so is switched on.
    """
    if spec.engine_id != plan.engine_id:
        raise ValueError(
            f"engine spec {spec.engine_id!r} does not match plan {plan.engine_id!r}; "
            f"build the spec for the engine that was placed"
        )
    return ray_executor_spec(spec, plan.tp_size)


def ray_executor_spec(spec: EngineSpec, tp_size: int) -> EngineSpec:
    """`spec` with `tp_size` workers as Ray actors in the host's placement group (pure)."""
    env = dict(spec.env)
    if spec.device == "cpu":
        env[cpu_ray_platform.ENV_VAR] = "1"
    extra = dict(spec.extra_engine_args)
    extra["distributed_executor_backend"] = "ray"
    return replace(
        spec,
        tensor_parallel_size=tp_size,
        env=tuple(env.items()),
        extra_engine_args=tuple(extra.items()),
    )


def with_cluster_address(spec: EngineSpec, gcs_address: str) -> EngineSpec:
    """`spec` whose engine joins the Ray cluster at `gcs_address` (pure).

    vLLM's engine core is a process of its own that creates the TP workers after a
    bare `ray.init()`. That call finds a cluster by `RAY_ADDRESS`, else by a GCS process
    on the same host, else by the address file the last `ray start` left under the
    default temp dir, else it starts a new, empty Ray. A worker host runs no GCS, and the
    address file may be missing or name another cluster on a shared machine, so the
    host hands the engine its own cluster's address.
    """
    env = dict(spec.env) | {"RAY_ADDRESS": gcs_address}
    return replace(spec, env=tuple(env.items()))


def placed_engine_host_options(spec: EngineSpec, placed: PlacedEngine) -> dict[str, Any]:
    """Ray actor options for the host of `spec` (from `placed_engine_spec`): its
    bundle of `placed`, and `spec.env` in the runtime env its workers inherit."""
    return placed.host_actor_options(env_vars=dict(spec.env))
