"""An engine simulated with kvtide's capacity and decode models: no weights, no GPU.

``SimulatedEngine`` speaks the engine interface (``engines/base.py``) as one vLLM
engine of a model (a built-in name such as ``deepseek-v3``, or a ``config.json`` path,
in ``EngineSpec.model_path``) on a catalog device (``engines/simulated_config.py``):

* **time**: a scheduler loop batches continuously. Each step samples one token for
  every running request and lasts the prefill of newly admitted prompts
  (``prefill_tokens_per_s``) plus ``placement.decode_model.decode_step`` for the batch
  already decoding, at its mean context. Time passes only through the injected
  ``sleep`` (``asyncio.sleep`` by default, ``VirtualClock.sleep`` in tests);
* **memory**: ``num_kv_blocks`` from the memory model; blocks are reserved, filled,
  freed or kept for peers by ``engines/simulated_kv.KVBlockPool``, so
  ``stats().kv_cache_usage`` is the share of blocks filled or kept;
* **KV hand-off**: ``kv_transfer_params`` work as with vLLM's NixlConnector. A
  prefill with ``do_remote_decode`` keeps its blocks for ``prefill_lease_s`` (vLLM's
  ``kv_lease_duration``: unread, they are freed then) and returns params
  naming them; a decode given them pulls the prompt's KV (transfer time from
  ``kv_transfer_gbps``; ``num_cached_tokens`` reports it, the first chunk's
  ``kv_read_bytes`` the bytes it copies: every token it reads, as pulls do not
  consult its prefix cache) and, with
  ``bidirectional_kv_xfer``, keeps its own blocks for ``decoder_kv_blocks_ttl_s`` and
  returns params for the send-back; a prefill given those reads them back, except
  within 5 s of their expiry or under ``kv_recompute_threshold_tokens``. Engines in
  other processes (Serve replicas) are not on the fabric: with ``simulated_remote_reads``
  a prefill reads a decode's kept blocks there by their params, and the decode frees them
  when its host is told (``peers_read``, through the KV service). With
  ``per_request_keep`` (kvtide's connector, ``engines/kv_connector.py``) a request
  whose params say ``kvtide_keep: False`` keeps nothing: its blocks are freed when it
  finishes and it returns no params; one whose params name a kept request
  (``kvtide_release``) frees that request's blocks when it finishes, nothing read.
  Engines find
  each other by engine id on a ``SimulatedFabric`` (one process); engines that
  exchange KV should share one clock;
* **prefix cache** (``spec.enable_prefix_caching``): the engine remembers the chained
  hashes of the full prompt blocks it computed, the most recent ``num_kv_blocks`` of
  them; a prompt computed here (not pulled) skips its longest remembered prefix, reports
  it as ``num_cached_tokens`` and in ``stats().num_prefix_cache_hits``, as vLLM does. It
  models what vLLM's cache can hold, not which free blocks it reuses first;
* **tokens**: each is a hash of every token before it, so a prefill/decode pair
  produces what one engine would. Stop strings and EOS are not modelled.

Errors::

    ValueError
    └── RequestRejected     a request this engine can never run (too long for it)
    RuntimeError
    └── KVTransferFailed    a KV pull failed under kv_load_failure_policy="fail"
"""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from engines.base import (
    EngineAdapter,
    EngineHealth,
    EngineInfo,
    EngineSpec,
    EngineStats,
    GenerateChunk,
    GenerateRequest,
)
from engines.kv_params import KVTransferParams
from engines.simulated_config import SimulatedEngineConfig, simulated_config
from engines.simulated_kv import (
    KeptBlocks,
    KVBlockPool,
    PrefixCache,
    SimulatedFabric,
    nixl_params,
)
from placement.decode_model import decode_step
from placement.model_spec import ModelSpec

__all__ = [
    "KVTransferFailed",
    "RequestRejected",
    "SimulatedEngine",
    "SimulatedFabric",
    "VirtualClock",
]

EXPIRY_MARGIN_S = 5.0  # a prefill declines to read decode blocks this close to their expiry


class RequestRejected(ValueError):
    """A request this engine can never run."""


class KVTransferFailed(RuntimeError):
    """A KV pull failed and the engine's kv_load_failure_policy is "fail"."""


class VirtualClock:
    """Time that moves only when someone sleeps on it: ``sleep(d)`` adds d to ``now_s``
    and yields to the event loop. Give each engine its own, or share one between
    engines that take turns (concurrent sleepers would each move it)."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def time(self) -> float:
        return self.now_s

    async def sleep(self, delay_s: float) -> None:
        self.now_s += max(0.0, delay_s)
        await asyncio.sleep(0)

    def advance(self, delay_s: float) -> None:
        self.now_s += delay_s


DEFAULT_FABRIC = SimulatedFabric()


@dataclass(slots=True, eq=False)
class _Request:
    request: GenerateRequest
    out: asyncio.Queue[GenerateChunk | BaseException]
    params: KVTransferParams | None  # kv_transfer_params in (None without a connector)
    worst_case_blocks: int
    digest: int  # hash of every token so far; the next token is derived from it
    num_cached: int = 0  # prompt tokens whose KV was pulled or found in the prefix cache
    num_output: int = 0
    ready_s: float = 0.0  # when its pull completes
    read_bytes: int = 0  # the KV bytes its pull copies (reported on its first chunk)
    pull_from: tuple[SimulatedEngine, str] | None = None  # peer, and its request id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_computed(self) -> int:
        """Tokens whose KV exists: the prompt, then each output token but the newest."""
        return self.prompt_len + max(0, self.num_output - 1)


class SimulatedEngine(EngineAdapter):
    """One simulated vLLM engine (see the module docstring). Use from one event loop."""

    def __init__(
        self,
        spec: EngineSpec,
        *,
        model: ModelSpec | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        fabric: SimulatedFabric = DEFAULT_FABRIC,
    ) -> None:
        self.spec = spec
        self.config: SimulatedEngineConfig = simulated_config(spec, model)
        self.kv = KVBlockPool(self.config.num_kv_blocks)
        self.prefix_cache = (
            PrefixCache(self.config.block_size, self.config.num_kv_blocks)
            if spec.enable_prefix_caching
            else None
        )
        self._sleep, self._clock, self._fabric = sleep, clock, fabric
        self._info: EngineInfo | None = None
        self._waiting: list[_Request] = []
        self._pulling: list[_Request] = []
        self._running: list[_Request] = []
        self._requests: dict[str, _Request] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._counts: dict[str, int] = {}

    # ---- lifecycle -------------------------------------------------------------
    async def start(self) -> EngineInfo:
        spec, kv = self.spec, self.spec.kv_transfer
        self._info = EngineInfo(
            engine_id=spec.engine_id,
            role=spec.role,
            backend=spec.backend,
            served_model_name=spec.served_model_name,
            max_model_len=spec.max_model_len,
            block_size=self.config.block_size,
            num_kv_blocks=self.config.num_kv_blocks,
            vocab_size=self.config.model.vocab_size,
            kv_side_channel=f"{kv.side_channel_host}:{kv.side_channel_port}" if kv else None,
        )
        self._fabric.register(self)
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self._info

    async def shutdown(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for req in list(self._requests.values()):
                self._finish(req, "abort")
            self._fabric.unregister(self)

    # ---- control plane: side-effect free queries ---------------------------------
    @property
    def is_running(self) -> bool:
        """Started, and its scheduler loop alive (a closed event loop ends it)."""
        return self._task is not None and not self._task.done()

    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError(f"engine {self.spec.engine_id} is not started; call start()")
        return self._info

    async def health(self) -> EngineHealth:
        ok = self.is_running
        return EngineHealth(
            engine_id=self.spec.engine_id, healthy=ok, detail="" if ok else "stopped"
        )

    def stats(self) -> EngineStats:
        c = self._counts
        return EngineStats(
            engine_id=self.spec.engine_id,
            num_running=len(self._running) + len(self._pulling),
            num_waiting=len(self._waiting),
            kv_cache_usage=self.kv.num_used(self._clock()) / self.kv.num_blocks,
            num_requests=c.get("requests", 0),
            num_prompt_tokens=c.get("prompt_tokens", 0),
            num_generation_tokens=c.get("generation_tokens", 0),
            num_prefix_cache_queries=c.get("prefix_queries", 0),
            num_prefix_cache_hits=c.get("prefix_hits", 0),
            kv_transfer_bytes=c.get("kv_bytes", 0),
            num_kv_transfers=c.get("kv_transfers", 0),
            num_kv_transfer_failures=c.get("kv_failures", 0),
            num_kv_expired_reads=c.get("kv_expired", 0),
            num_steps=c.get("steps", 0),
            decode_path=self.spec.decode_path.name,
            decode_path_reason=self.spec.decode_path.reason,
        )

    # ---- data plane ------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        if self._task is None:
            raise RuntimeError(f"engine {self.spec.engine_id} is not started; call start()")
        req = self._new_request(request)
        self._requests[request.request_id] = req
        self._waiting.append(req)
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await req.out.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the caller stopped reading: free the request's blocks
                await self.abort(request.request_id)
                self._unclaimed(req)

    async def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            self._finish(req, "abort")

    def _new_request(self, request: GenerateRequest) -> _Request:
        length = len(request.prompt_token_ids) + request.max_tokens
        blocks = math.ceil((length - 1) / self.config.block_size)
        if not request.prompt_token_ids or request.max_tokens < 1:
            raise RequestRejected("a request needs at least one prompt token and max_tokens >= 1")
        if request.request_id in self._requests:
            raise RequestRejected(f"request id {request.request_id!r} is already running here")
        vocab = self.config.model.vocab_size
        outside = next((t for t in request.prompt_token_ids if not 0 <= t < vocab), None)
        if outside is not None:  # as vLLM's input processor
            raise RequestRejected(f"Token id {outside} is out of vocabulary")
        if length > self.spec.max_model_len or blocks > self.kv.num_blocks:
            raise RequestRejected(
                f"request {request.request_id!r} needs {length} tokens ({blocks} blocks); "
                f"engine {self.spec.engine_id} holds max_model_len={self.spec.max_model_len} "
                f"and {self.kv.num_blocks} blocks: shorten the prompt or max_tokens."
            )
        params = request.kv_transfer_params if self.spec.kv_transfer is not None else None
        digest = zlib.crc32(array("I", request.prompt_token_ids).tobytes())
        if request.sampling.temperature > 0:
            digest = zlib.crc32(str(request.sampling.seed or 0).encode(), digest)
        return _Request(
            request=request,
            out=asyncio.Queue(),
            params=None if params == KVTransferParams() else params,  # {} asks for nothing
            worst_case_blocks=blocks,
            digest=digest,
        )

    # ---- the scheduler loop ------------------------------------------------------------
    async def _run(self) -> None:
        cfg = self.config
        while True:
            now = self._clock()
            self.kv.expire(now)
            self._admit(now)
            for req in [r for r in self._pulling if r.ready_s <= now]:
                self._pulling.remove(req)
                if req.pull_from is not None:  # the read is done: the peer frees its copy
                    peer, remote_id = req.pull_from
                    peer._release_kept(remote_id)
                self._running.append(req)
            if not self._running:
                # Idle until a pull completes, kept blocks expire (a waiting request may
                # need them), a request arrives or a peer's read frees blocks.
                due = [r.ready_s for r in self._pulling]
                expiry = self.kv.next_expiry_s()
                if self._waiting and expiry is not None:
                    due.append(expiry)
                self._wake.clear()
                await self._idle(min(due) - now if due else None)
                continue
            new = [r for r in self._running if r.num_output == 0]
            old = [r for r in self._running if r.num_output > 0]
            step_s = sum(r.prompt_len - r.num_cached for r in new) / cfg.prefill_tokens_per_s
            if old:
                context = sum(r.num_computed for r in old) / len(old)
                step_s += decode_step(
                    cfg.model, cfg.device, cfg.shape, batch_size=len(old),
                    context_tokens=context, memory=cfg.memory,
                ).step_s  # fmt: skip
            await self._sleep(step_s)
            self._count("steps")
            for req in list(self._running):
                self._emit(req)

    async def _idle(self, delay_s: float | None) -> None:
        """Wait for ``_wake``, or ``delay_s`` on the engine's clock, whichever is first."""
        waking = asyncio.ensure_future(self._wake.wait())
        if delay_s is None:
            await waking
            return
        sleeping = asyncio.ensure_future(self._sleep(delay_s))
        try:
            await asyncio.wait({waking, sleeping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (waking, sleeping):
                task.cancel()
            await asyncio.gather(waking, sleeping, return_exceptions=True)

    def _admit(self, now: float) -> None:
        """Move waiting requests in, oldest first, while seats and blocks allow."""
        while self._waiting:
            req = self._waiting[0]
            seats = len(self._running) + len(self._pulling)
            if seats >= self.spec.max_num_seqs or not self.kv.can_admit(req.worst_case_blocks):
                return
            self._waiting.pop(0)
            request_id = req.request.request_id
            self.kv.admit(request_id, req.worst_case_blocks)
            self.kv.fill(request_id, math.ceil(req.prompt_len / self.config.block_size))
            if not self._start_pull(req, now):
                self._find_prefix(req)
                self._running.append(req)

    def _find_prefix(self, req: _Request) -> None:
        """Skip the longest prefix of the prompt whose blocks this engine computed."""
        if self.prefix_cache is None:
            return
        num_blocks = self.prefix_cache.match(req.request.prompt_token_ids)
        # A full hit recomputes the last prompt token so that the next can be sampled.
        req.num_cached = min(num_blocks * self.config.block_size, req.prompt_len - 1)
        self._count("prefix_queries", req.prompt_len)
        self._count("prefix_hits", req.num_cached)

    def _cache_prompt(self, req: _Request) -> None:
        """Remember the prompt's full blocks (computed or pulled) for later prompts."""
        if self.prefix_cache is not None:
            self.prefix_cache.remember(req.request.prompt_token_ids)

    def _start_pull(self, req: _Request, now: float) -> bool:
        """Begin reading a peer's blocks if the params ask for it; False: compute here."""
        p, kv = req.params, self.spec.kv_transfer
        # A pull needs the blocks and their engine's side channel, as NixlConnector checks.
        target = p.read_target() if p is not None else None
        if p is None or kv is None or target is None or None in (p.remote_host, p.remote_port):
            return False
        engine_id, remote_id = target
        if p.do_remote_prefill:  # decode reads the prompt a prefill computed
            count = req.prompt_len
        elif p.do_remote_decode:  # prefill reads back what a decode kept
            count = min(p.remote_num_tokens or 0, req.prompt_len)
            if count < max(1, kv.kv_recompute_threshold_tokens):
                return False  # not worth a transfer; the peer keeps its blocks to the TTL
            expiry = p.remote_blocks_expiry_time
            if expiry is not None and now >= expiry - EXPIRY_MARGIN_S:
                self._count("kv_expired")
                return False
        else:
            return False
        peer = self._fabric.get(engine_id)
        kept = peer.kv.kept(remote_id, now) if peer else None
        remote = peer is None and self.config.remote_reads and p.do_remote_decode
        if remote:  # in another process: read by its params; its host is told after
            kept = KeptBlocks(block_ids=(), num_tokens=p.remote_num_tokens or 0, expires_s=math.inf)
        if kept is None:
            self._count("kv_failures")
            if kv.kv_load_failure_policy == "recompute":
                return False
            self._finish(req, "error", error=KVTransferFailed(
                f"request {req.request.request_id!r}: engine {engine_id!r} no "
                f"longer holds the KV of {remote_id!r} (read, expired or never "
                "kept); send the turn again without kv_transfer_params."
            ))  # fmt: skip
            return True
        count = min(count, kept.num_tokens)
        # A full hit recomputes the last prompt token so that the next can be sampled.
        req.num_cached = min(count, req.prompt_len - 1)
        req.pull_from = None if peer is None else (peer, remote_id)
        per_gpu = count * self.config.kv_bytes_per_token_per_gpu
        req.ready_s = now + per_gpu / (self.config.kv_transfer_gbps * 1e9)
        req.read_bytes = round(per_gpu * self.config.num_gpus)
        self._count("kv_transfers")
        self._count("kv_bytes", req.read_bytes)
        self._pulling.append(req)
        return True

    def _emit(self, req: _Request) -> None:
        """One token for ``req``: a hash of every token before it, the prompt included."""
        if req.num_output == 0:
            self._count("prompt_tokens", req.prompt_len)
            self._cache_prompt(req)
        token = req.digest % self.config.model.vocab_size
        req.digest = zlib.crc32(token.to_bytes(4, "little"), req.digest)
        req.num_output += 1
        self._count("generation_tokens")
        request_id = req.request.request_id
        self.kv.fill(request_id, math.ceil(req.num_computed / self.config.block_size))
        chunk = GenerateChunk(
            request_id=request_id,
            text=f" w{token}",
            token_ids=[token],
            num_prompt_tokens=req.prompt_len,
            num_cached_tokens=req.num_cached,
            kv_read_bytes=req.read_bytes if req.num_output == 1 else None,
        )
        if req.num_output < req.request.max_tokens:
            req.out.put_nowait(chunk)
        else:
            self._finish(req, "length", last=chunk)

    def _finish(
        self,
        req: _Request,
        reason: str,
        *,
        error: BaseException | None = None,
        last: GenerateChunk | None = None,
    ) -> None:
        """End a request: keep its blocks for a peer or free them, and close its stream."""
        request_id = req.request.request_id
        if self._requests.pop(request_id, None) is None:
            return
        for queue in (self._waiting, self._pulling, self._running):
            if req in queue:
                queue.remove(req)
        self._count("requests")
        params, keep_until_s = self._kept_params(req) if reason == "length" else (None, None)
        self.kv.finish(request_id, keep_until_s=keep_until_s, num_tokens=req.num_computed)
        released = req.params.kvtide_release if req.params is not None else None
        if released is not None and self.spec.kv_transfer is not None:
            self.kv.release_kept(released)  # engines.kv_connector: freed, nothing read
        self._wake.set()  # freed blocks may admit a waiting request
        if error is not None:
            req.out.put_nowait(error)
            return
        req.out.put_nowait(
            GenerateChunk(
                request_id=request_id,
                text=last.text if last else "",
                token_ids=last.token_ids if last else [],
                finished=True,
                finish_reason=reason,
                num_prompt_tokens=req.prompt_len,
                num_cached_tokens=req.num_cached,
                kv_transfer_params=params,
                kv_read_bytes=last.kv_read_bytes if last else None,
            )
        )

    def _kept_params(self, req: _Request) -> tuple[KVTransferParams | None, float | None]:
        """What NixlConnector.request_finished returns: params naming the blocks kept
        for a peer, and until when (None, None: the blocks are freed)."""
        p, kv, cfg = req.params, self.spec.kv_transfer, self.config
        request_id = req.request.request_id
        block_ids = self.kv.blocks_of(request_id)
        is_prefill = p is not None and p.do_remote_decode
        if not p or kv is None or not block_ids or not (is_prefill or kv.bidirectional_kv_xfer):
            return None, None
        if kv.per_request_keep and p.kvtide_keep is False:
            return None, None  # engines.kv_connector: nobody will read them
        expires_s = self._clock() + (
            float(kv.prefill_lease_s) if is_prefill else float(kv.decoder_kv_blocks_ttl_s)
        )
        params = nixl_params(
            engine_id=self.spec.engine_id,
            request_id=request_id,
            kv=kv,
            shape=cfg.shape,
            block_ids=block_ids,
            num_tokens=req.num_computed,
            is_prefill=is_prefill,
            expires_s=expires_s,
        )
        return params, expires_s

    async def peers_read(self, request_ids: Sequence[str]) -> None:
        """Peers in other processes read these kept blocks (``simulated_remote_reads``):
        free them, as NIXL's read notification frees them in vLLM."""
        for request_id in request_ids:
            self._release_kept(request_id)

    def _unclaimed(self, req: _Request) -> None:
        """A request whose caller stopped reading before its last chunk: if it finished
        meanwhile and kept blocks for a peer, free them. The params naming them pass
        with the last chunk, which nobody took: nobody can ever read the blocks."""
        while not req.out.empty():
            item = req.out.get_nowait()
            if isinstance(item, GenerateChunk) and item.kv_transfer_params is not None:
                self._release_kept(req.request.request_id)

    def _release_kept(self, request_id: str) -> None:
        if self.kv.release_kept(request_id):
            self._wake.set()

    def _count(self, key: str, amount: int = 1) -> None:
        self._counts[key] = self._counts.get(key, 0) + amount
