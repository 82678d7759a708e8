"""The sections of kvtide's config file, each declared once as a frozen pydantic model
(see ``orchestrator.config``): the model, the engine pools, KV lifecycle, Ray, tracing
and metrics, routing, placement. The server section is in ``orchestrator.config.server``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.config.server import StrictSection
from policies.admission import AdmissionSettings
from policies.prefix_routing import PrefixRoutingSettings

__all__ = [
    "AdmissionConfig",
    "KVConfig",
    "ModelConfig",
    "ObservabilityConfig",
    "PlacementConfig",
    "PoolSection",
    "RayConfig",
    "RoutingConfig",
    "default_model_dir",
]


def default_model_dir() -> Path:
    """Where the embedded default's tiny model is generated (``$KVTIDE_HOME`` or ~/.cache)."""
    home = os.environ.get("KVTIDE_HOME") or os.path.join(Path.home(), ".cache", "kvtide")
    return Path(home) / "tiny-model"


class ModelConfig(StrictSection):
    path: str | None = Field(
        None,
        description="Local directory of a Hugging Face checkpoint. Empty: generate kvtide's "
        "tiny model (random weights, local tokenizer) and serve that.",
    )
    name: str = Field(
        "kvtide-tiny",
        min_length=1,
        max_length=256,
        description="Model name clients send: printable text (no newline or other control "
        "character), at most 256 characters.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="Weight and KV dtype. float32 keeps greedy output exact on CPU."
    )
    max_model_len: int = Field(8192, ge=16, le=2**24, description="Context length in tokens.")
    # The OpenAI API's model-specific options, as vLLM's server takes them.
    tool_call_parser: str | None = Field(
        None,
        pattern=r"^[a-z0-9_]{1,64}$",
        description="vLLM's tool-call parser for the model's tool calls in text "
        "(vllm serve --tool-call-parser, e.g. hermes, llama3_json, kimi_k2). Empty: "
        "'hermes' for the tiny model, none otherwise (tool_choice 'auto' refused).",
    )
    enable_auto_tool_choice: bool | None = Field(
        None,
        description="Let the model choose to call tools (tool_choice 'auto'; needs a "
        "tool_call_parser). Empty: on when a tool_call_parser is set.",
    )
    reasoning_parser: str | None = Field(
        None,
        pattern=r"^[a-z0-9_]{1,64}$",
        description="vLLM's reasoning parser (vllm serve --reasoning-parser, e.g. "
        "deepseek_r1, qwen3): the model's reasoning in its own field.",
    )
    chat_template: str | None = Field(
        None,
        description="A chat template (a file path or the template itself) in place of "
        "the tokenizer's (vllm serve --chat-template).",
    )

    structured_outputs_backend: Literal["auto", "xgrammar", "guidance", "outlines"] = Field(
        "auto",
        description="vLLM's structured-output backend on the decode engines (vllm serve "
        "--structured-outputs-config.backend).",
    )
    compact_structured_outputs: bool | None = Field(
        None,
        description="Structured outputs and tool-call arguments without free whitespace "
        "(vLLM's disable_any_whitespace): a small model cannot then fill its output with "
        "whitespace. Empty: on for the tiny model, off otherwise.",
    )

    tool_call_structural_tags: bool | None = Field(
        None,
        description="Sample tool_choice 'required' and named calls in the model's own "
        "tool-call format (vLLM's structural tags, VLLM_ENFORCE_STRICT_TOOL_CALLING; "
        "their JSON keeps free whitespace). Off: by the tools' JSON schema, which "
        "compact_structured_outputs holds to no free whitespace. Empty: off when "
        "compact_structured_outputs is on, on otherwise (vLLM's default).",
    )

    @property
    def tool_structural_tags(self) -> bool:
        if self.tool_call_structural_tags is None:
            return not self.structured_outputs_compact
        return self.tool_call_structural_tags

    @model_validator(mode="after")
    def _compact_needs_its_backend(self) -> ModelConfig:
        if self.compact_structured_outputs and self.structured_outputs_backend == "outlines":
            raise ValueError(
                "compact_structured_outputs needs structured_outputs_backend xgrammar or "
                "guidance (vLLM holds whitespace with those two only)"
            )
        return self

    @property
    def structured_outputs_compact(self) -> bool:
        if self.compact_structured_outputs is None:
            return self.is_generated
        return self.compact_structured_outputs

    @property
    def tool_parser(self) -> str | None:
        """The tool-call parser in force (the tiny model's chat template is Hermes's)."""
        if self.tool_call_parser is None and self.is_generated:
            return "hermes"
        return self.tool_call_parser

    @property
    def auto_tool_choice(self) -> bool:
        if self.enable_auto_tool_choice is None:
            return self.tool_parser is not None
        return self.enable_auto_tool_choice

    @field_validator("name")
    @classmethod
    def _printable(cls, value: str) -> str:
        # It is echoed in every response and header-like place (/v1/models, logs).
        if not value.isprintable() or value != value.strip():
            raise ValueError(
                f"model name {value[:40]!r} must be printable text without a newline, "
                "control character or surrounding spaces; name the model e.g. 'qwen3-8b'"
            )
        return value

    @property
    def is_generated(self) -> bool:
        return self.path is None

    def resolved_path(self) -> str:
        return self.path if self.path is not None else str(default_model_dir())


class PoolSection(StrictSection):
    """A pool as the file gives it; ``PoolConfig`` adds its name and role."""

    num_engines: int = Field(1, ge=1, le=1024, description="Engines (replicas) in the pool.")
    tensor_parallel_size: int = Field(1, ge=1, le=16, description="TP size of each engine.")
    max_num_seqs: int = Field(64, ge=1, le=65536, description="Concurrent sequences per engine.")
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        le=2**24,
        description="Tokens one engine step schedules (vLLM's max_num_batched_tokens; at "
        "least max_num_seqs). Empty: vLLM's default, except on decode pools of CPU engines "
        "with kv.extend on, where an in-place prefill is bounded by the ITL budget "
        "(docs/config.md).",
    )
    cpu_threads_bind: str | None = Field(
        None,
        description="vllm-cpu: cores for this pool's engines (VLLM_CPU_OMP_THREADS_BIND, "
        "e.g. '0' or '0-3'). Give each pool its own cores: two engines on the same cores "
        "decode several times slower. Left out of a pool section given, the pool's default "
        "holds ('0' prefill, '1' decode); null leaves the engines unbound (vllm-cpu with "
        "NIXL then decodes ~20x slower on the development box).",
    )
    kv_cache_space_gib: int = Field(
        1,
        ge=1,
        le=65536,
        description="vllm-cpu: KV cache size per engine in whole GiB "
        "(VLLM_CPU_KVCACHE_SPACE; vllm-cpu reads it as an integer).",
    )
    num_cpus: float = Field(1.0, ge=0, le=4096, description="Ray CPUs reserved per engine actor.")
    num_gpus: float = Field(0.0, ge=0, le=64, description="Ray GPUs per engine actor (TP=1).")
    decode_context_parallel_size: int = Field(
        1,
        ge=1,
        le=16,
        description="Decode context parallelism (vLLM's decode_context_parallel_size): "
        "shard the KV cache along tokens across the TP ranks. Decode pools on CUDA only; "
        "must divide tensor_parallel_size. `kvtide plan` says when it pays.",
    )
    num_kv_blocks: int | None = Field(
        None,
        ge=1,
        le=2**31 - 1,
        description="KV cache blocks per engine, in place of what the engine sizes from its "
        "memory (vLLM's num_gpu_blocks_override). For capacity tests and small-cache "
        "experiments; empty: the engine's own size.",
    )


class KVConfig(StrictSection):
    bidirectional_kv_xfer: bool = Field(
        True, description="Decode sends finished KV back to prefill for the next turn."
    )
    per_request_keep: bool = Field(
        True,
        description="vLLM engines run kvtide's NixlConnector subclass (engines/kv_connector.py): "
        "decode keeps a finished request's KV for send-back only for session turns, and a "
        "drain frees the prefill engine's copy at once. Off: vLLM's own NixlConnector, which "
        "keeps every finished request's KV (kvtide then drains sessionless requests' "
        "blocks, one more prefill request each).",
    )
    decoder_kv_blocks_ttl_s: int = Field(
        480,
        ge=10,
        le=86400,
        description="How long decode keeps a finished turn's KV for send-back.",
    )
    kv_recompute_threshold_tokens: int = Field(
        64, ge=0, le=2**24, description="Reusable remainders shorter than this are recomputed."
    )
    block_size_tokens: int | None = Field(
        None,
        ge=16,
        le=1024,
        description="Tokens per KV block in every engine (vLLM's block_size; all pools share "
        "it, since NIXL moves whole blocks between them). Empty: the engine's default "
        "(vllm-cpu 128, vLLM on GPUs 16). Smaller blocks move less KV for a turn whose new "
        "tokens fill a block partly, in more pieces; vllm-cpu takes multiples of 32, CUDA "
        "attention multiples of 16. `benchmarks/agentic.py --block-size` measures it.",
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
    prefill_lease_s: int = Field(
        30,
        ge=5,
        le=3600,
        description="How long a prefill engine keeps a prompt's KV for a decode engine that "
        "has not started reading it (vLLM's kv_lease_duration; a reading decode renews it). "
        "Raise it where a cold decode engine may take longer to start its first read.",
    )
    nixl_progress_wait_ms: float | None = Field(
        None,
        ge=0,
        le=1000,
        description="vLLM engines: how long NIXL's UCX progress thread waits in poll() for a "
        "wake-up before it progresses its workers anyway. 0: NIXL's own busy polling (its "
        "Python API's choice), which holds a core per engine process even when idle. "
        "Unset: 10 ms on CPU (measured there: idle agents from a core each to ~1 %, a read "
        "as fast; `benchmarks/nixl_progress.py`), NIXL's busy polling on GPUs (not measured "
        "there). Needs kvtide's connector (kv.per_request_keep).",
    )
    idle_step_wait_ms: float | None = Field(
        None,
        ge=0,
        le=1000,
        description="vLLM engines: when an engine only keeps finished requests' KV (nothing "
        "to run), its core waits this long for a new request before its next empty step "
        "(a new request wakes it at once). 0: vLLM's own loop, which steps back to back "
        "while it keeps any KV. Unset: 20 ms on CPU (measured there), vLLM's loop on GPUs "
        "(not measured there).",
    )
    warm_up: bool = Field(
        True,
        description="Each vLLM decode engine runs one turn with the prefill pool, and sends "
        "it back, before it takes traffic: NIXL's handshakes both ways and each engine's "
        "first request are paid then, not by the first user's turns.",
    )
    integrity_sample_fraction: float = Field(
        0.01,
        ge=0,
        le=1,
        description="Fraction of the turns that reuse kept KV (pull it back, or extend it "
        "on the decode engine that kept it) which are checked: after the turn, off the "
        "client's path, its prompt and first integrity_num_tokens output tokens are "
        "computed again without reuse on the prefill pool and the log probabilities "
        "compared; a mismatch turns reuse off for the engine pair until an operator "
        "turns it back on (docs/kv_lifecycle.md#integrity-check). 0: no check.",
    )
    integrity_logprob_tolerance: float = Field(
        0.1,
        gt=0,
        le=100,
        description="Largest difference (nats) between a checked turn's log probability of "
        "one of its first tokens and the recomputed one that still counts as a match. fp32 "
        "engines agree to ~1e-5; bf16 ones differ more between prefill and decode paths.",
    )
    integrity_num_tokens: int = Field(
        4,
        ge=1,
        le=256,
        description="How many of a checked turn's first output tokens are compared.",
    )
    extend: bool = Field(
        True,
        description="A session's turn whose history a decode engine kept may run on that "
        "engine (plan extend), which prefills only the new tokens against its own prefix "
        "cache; nothing moves. Chosen per turn against a pull by the kv.extend_* bounds "
        "(docs/kv_lifecycle.md#three-plans-for-a-turn). Off: such turns always pull.",
    )
    extend_max_new_tokens: int = Field(
        512,
        ge=0,
        le=2**24,
        description="Most prompt tokens a turn extended on a decode engine may compute there "
        "(its increment after the kept history, plus the history after its last whole KV "
        "block, which the engine's prefix cache does not hold); longer ones are pulled to the "
        "prefill pool, unless its engines have kv.extend_prefill_queue_waiting requests "
        "waiting.",
    )
    extend_prefill_queue_waiting: int = Field(
        2,
        ge=1,
        le=2**20,
        description="Requests waiting on the prefill pool's engines from which an increment "
        "longer than kv.extend_max_new_tokens still extends (within the ITL budget).",
    )
    extend_itl_budget_ms: float = Field(
        50.0,
        ge=0,
        le=60_000,
        description="Extra step time one turn's in-place prefill may add for the decode "
        "engine's other running sequences (the tokens it computes in a step, of the new "
        "tokens and the history after its last whole block, x the engine's measured prefill "
        "time per token, else kv.extend_prefill_ms_per_token); over it the turn is pulled. An "
        "engine running nothing else is not bounded by it.",
    )
    extend_prefill_ms_per_token: float = Field(
        1.4,
        gt=0,
        le=1000,
        description="A decode engine's time to prefill one token in place, where the engine "
        "reported none of its own (a vLLM decode engine measures its own at start and "
        "reports it with its load). 1.4 ms: vllm-cpu, the tiny model, one core (3.57 s for "
        "2,604 tokens). Also sizes the decode pool's step (decode.max_num_batched_tokens).",
    )
    extend_max_kv_cache_usage: float = Field(
        0.9,
        gt=0,
        le=1,
        description="A decode engine whose KV cache use (0-1) is at or above this takes no "
        "in-place prefill; the turn is pulled.",
    )
    pull_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Bound on a prefill that pulls KV; past it kvtide recomputes.",
    )
    idle_budget_mib_per_engine: float | None = Field(
        None,
        gt=0,
        le=2**30,
        description="Most KV (MiB) idle sessions may keep on one decode engine; "
        "past it the idle sessions nearest expiry are drained back to prefill. Empty: no bound "
        "(blocks still expire at the TTL).",
    )
    host_tier_mib: float = Field(
        0.0,
        ge=0,
        le=2**30,
        description="Host memory (MiB) for a host-memory KV tier: a session whose kept KV "
        "the idle budget (idle_budget_mib_per_engine) evicts from a decode engine is copied "
        "there over NIXL instead of drained, and its next turn pulls it from there. One "
        "store, on the KV service's node. 0: no tier.",
    )
    host_tier_ttl_s: float = Field(
        600.0,
        gt=30,
        le=86_400,
        description="How long the host tier keeps a session's copy (it is freed sooner "
        "when its next turn reads it or the session closes).",
    )
    service_timeout_s: float = Field(
        30.0,
        gt=0,
        le=600,
        description="Deadline of one call to the KV lifecycle service (a Ray actor). Past "
        "it the request gets 503 service_unavailable with Retry-After; calls to a restarting "
        "service wait for the new instance up to this long.",
    )
    kept_check_grace_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="How old a decode engine's kept KV must be before its host asks the KV "
        "service whether a turn's hand-over booked it; KV nobody booked (the turn's deadline "
        "passed as it finished, its ingress died) is then drained instead of pinned until "
        "decoder_kv_blocks_ttl_s. Longer than a hand-over takes (service_timeout_s).",
    )
    service_start_timeout_s: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="How long a new ingress replica waits for the KV lifecycle service to "
        "start (or to answer, when it runs already) before its start fails and Serve tries "
        "again. The first start runs a new Ray worker process on the head host.",
    )
    turn_lease_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="How long a session's next turn stays held for the ingress replica "
        "that ran its last one (a turn lease): a turn there within this time is claimed and "
        "planned without a call to the KV lifecycle service on its path. A turn elsewhere "
        "revokes the lease first (one more round trip); while held, the session's kept KV "
        "is not evicted under idle_budget_mib_per_engine. 0: every turn asks the service.",
    )
    session_state_max_mib: float = Field(
        1024.0,
        gt=0,
        le=1_048_576,
        description="Most MiB of sessions' last turns (token ids and text) the KV "
        "lifecycle service keeps, for every session together; past it the least recently "
        "used go first (such a session's next turn is tokenized from scratch and its kept "
        "KV, if any, is reused only when the prefix check still matches).",
    )
    replay_max_mib: float = Field(
        64.0,
        gt=0,
        le=65_536,
        description="Most MiB of completed responses kept for Idempotency-Key replays (and "
        "written to Ray's GCS so they survive a service restart); the oldest go first.",
    )

    @model_validator(mode="after")
    def _margin_below_ttl(self) -> KVConfig:
        if self.safety_margin_s >= self.decoder_kv_blocks_ttl_s:
            raise ValueError(
                f"safety_margin_s ({self.safety_margin_s}) must be below "
                f"decoder_kv_blocks_ttl_s ({self.decoder_kv_blocks_ttl_s})"
            )
        return self


class RayConfig(StrictSection):
    address: str | None = Field(
        None, description="Join this Ray cluster ('auto' or host:port); empty: start one."
    )
    num_cpus: int | None = Field(
        None, ge=1, le=65536, description="Logical CPUs of a locally started Ray (default: 8)."
    )
    temp_dir: str | None = Field(None, description="Ray temp dir of a locally started Ray.")
    serve_in_loop: bool = Field(
        True,
        description="A locally started Ray runs Serve's replicas and proxy with user code "
        "and the request router on the replica's own event loop (Ray Serve's "
        "throughput-optimized settings other than direct ingress).",
    )
    direct_ingress: bool = Field(
        True,
        description="A locally started Ray serves HTTP from the ingress replicas "
        "themselves, behind Serve's HAProxy on server.host:server.port (Ray Serve's "
        "direct ingress), instead of through Serve's Python HTTP proxy actor.",
    )


class ObservabilityConfig(StrictSection):
    """Tracing and metrics (see ``orchestrator.observability``)."""

    tracing: Literal["off", "console", "otlp"] = Field(
        default="off",
        description="OpenTelemetry spans: 'off' (no-op, costs nothing), 'console' (printed), "
        "or 'otlp' (sent to otlp_endpoint; needs opentelemetry-exporter-otlp-proto-http).",
    )
    otlp_endpoint: str = Field(
        default="http://127.0.0.1:4318/v1/traces",
        pattern=r"^https?://",
        description="OTLP/HTTP traces endpoint of a collector (used when tracing is 'otlp').",
    )
    service_name: str = Field(
        default="kvtide", min_length=1, description="OpenTelemetry service.name of kvtide's spans."
    )
    metrics: bool = Field(
        default=True,
        description="Record kvtide_* metrics and serve them at GET /metrics on the API port "
        "(Prometheus text format, summed over every ingress replica and the KV service, "
        "behind the API keys like every route); see docs/observability.md.",
    )
    ray_metrics: bool = Field(
        default=False,
        description="Also export kvtide_* metrics through Ray's metrics API, from every "
        "Ray node's Prometheus endpoint (it listens on all interfaces, without auth). Off: "
        "a local Ray started by kvtide runs without that endpoint.",
    )

    @property
    def exports_to_ray(self) -> bool:
        """Whether kvtide's metrics go through Ray's metrics API too."""
        return self.metrics and self.ray_metrics


class RoutingConfig(StrictSection):
    long_context_threshold_tokens: int | None = Field(
        None,
        ge=1,
        le=2**24,
        description="Prompts longer than this decode on the decode_long pool, the rest on "
        "decode. `kvtide plan --pools` proposes it for a workload. Needs decode_long.",
    )
    prefix_aware: bool = Field(
        False,
        description="Send each prefill to the prefill replica that most recently computed "
        "the longest prefix of its prompt (its vLLM prefix cache likely holds it), unless "
        "that replica's queue is longer than the least loaded one's by more than "
        "prefix_imbalance_threshold; off: Serve's power-of-two choice by load alone.",
    )
    prefix_kv_events: bool = Field(
        True,
        description="With prefix_aware: the prefill engines (vLLM) publish their KV cache "
        "events (blocks cached and evicted, vLLM's kv_events_config on a free port of "
        "their host) and each ingress's prefix router subscribes, so its index holds what "
        "the engines report besides the prompts it sent, and forgets what they evicted. "
        "Off: the index holds only the prompts the ingress sent.",
    )
    reuse_without_session: bool = Field(
        True,
        description="Give a chat that carries its history (an assistant message) but no "
        "x-session-id a session of its own, found again by its text: its decode keeps the "
        "turn's KV and the next request that extends the conversation pulls it back, as a "
        "named session's turn would. Off: such requests keep nothing on decode.",
    )
    prefix_block_size_tokens: int = Field(
        16,
        ge=1,
        le=4096,
        description="Tokens per hashed prompt block: the prefill engines' KV block size or "
        "a divisor of it (vLLM on GPUs: 16; kvtide's simulated engine on CPU: 128).",
    )
    prefix_imbalance_threshold: int = Field(
        4,
        ge=0,
        le=65536,
        description="Requests the best-matching replica's queue may exceed the least "
        "loaded one's by before load wins over the prefix match.",
    )
    prefix_index_max_blocks: int = Field(
        200_000,
        ge=1,
        le=2**26,
        description="Block hashes the prefix index remembers per ingress replica, all "
        "prefill replicas together; the least recently used go first.",
    )
    prefix_index_ttl_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="A block computed longer ago than this no longer counts as held.",
    )

    def prefix_settings(self) -> PrefixRoutingSettings:
        """The prefix router's settings (the one conversion to the policy's type)."""
        return PrefixRoutingSettings(
            block_size_tokens=self.prefix_block_size_tokens,
            imbalance_threshold=self.prefix_imbalance_threshold,
            max_index_entries=self.prefix_index_max_blocks,
            ttl_s=self.prefix_index_ttl_s,
        )


class PlacementConfig(StrictSection):
    """How engine pools are placed. In a ``KVTideConfig`` ``mode`` is resolved: ``domain``
    or ``off``, never ``auto``."""

    mode: Literal["auto", "domain", "off"] = Field(
        "auto",
        description="'domain': kvtide plans every engine into one NVLink domain and pins "
        "its Ray placement group there (one Serve deployment per pool and domain; see "
        "docs/placement.md). 'off': Serve places each engine as one actor with the pool's "
        "num_cpus/num_gpus. 'auto': domain when device is cuda, off on cpu.",
    )
    timeout_s: float = Field(
        120.0,
        gt=0,
        le=86400,
        description="Bound on waiting for Ray to place an engine's placement group; past "
        "it kvtide stops and lists each domain's free GPUs against what was asked.",
    )
    num_cpus_per_shard: float = Field(
        1.0, ge=0, le=1024, description="Ray CPUs reserved beside each GPU (TP rank) of an engine."
    )
    supervise_interval_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="How often `kvtide up` checks for lost nodes and re-places the engines "
        "that used them.",
    )

    @property
    def by_domain(self) -> bool:
        return self.mode == "domain"


class AdmissionConfig(StrictSection):
    """Admission control in front of the pools (``policies.admission``): a turn that a
    pool cannot take now is refused at once with 503 ``overloaded`` and Retry-After,
    judged from the load each engine reports with its heartbeat."""

    enabled: bool = Field(
        True, description="Refuse turns a pool cannot take now (off: every turn queues)."
    )
    max_waiting_per_engine: int = Field(
        64,
        ge=1,
        le=2**20,
        description="An engine with this many requests waiting is full; a pool whose "
        "engines are all full refuses turns.",
    )
    max_kv_cache_usage: float = Field(
        0.95,
        gt=0,
        le=1,
        description="An engine with requests waiting and this share of its KV cache in use "
        "is full.",
    )
    stall_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="An engine with requests waiting, none running and none finished for "
        "this long makes no progress: it is full, and /health says degraded.",
    )
    max_report_age_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="Engine reports older than this are not used (engines report every "
        "second); a pool with no recent report admits.",
    )
    retry_after_s: float = Field(
        2.0, gt=0, le=3600, description="Retry-After of a refused turn, in seconds."
    )

    def settings(self) -> AdmissionSettings:
        """The policy's settings (the one conversion to its type)."""
        return AdmissionSettings(
            enabled=self.enabled,
            max_waiting_per_engine=self.max_waiting_per_engine,
            max_kv_cache_usage=self.max_kv_cache_usage,
            stall_s=self.stall_s,
            max_report_age_s=self.max_report_age_s,
            retry_after_s=self.retry_after_s,
        )
