"""vLLM's NixlConnector, keeping a finished request's KV only when the request asks.

With ``bidirectional_kv_xfer`` vLLM 0.32/0.33's ``NixlConnector`` keeps every finished
request's blocks for a peer: a decode's for ``decoder_kv_blocks_ttl`` (a later turn's
prefill may pull them back), a prefill's under a lease until a decode reads them. Two
kinds of request leave blocks nobody will read:

* a decode of a sessionless request (no later turn): kept until the TTL, unless kvtide
  reads them back into a prefill engine (one more engine request) to free them;
* that read-back (a *drain*): the prefill keeps its copy for a decode that never comes,
  until the lease runs out ("Releasing expired KV blocks ... retrieved by 0 remote
  worker(s)", counted as an expired read).

This subclass frees such a request's blocks when it finishes, as vLLM does for a
request without a peer, when its ``kv_transfer_params`` say ``kvtide_keep: false``
(``KVTransferParams.frees_at_once``). Everything else, the pulls included, is vLLM's.
The router asks for keeping on a session's turns only; drains never keep.

It frees kept blocks nobody will read without reading them: a request that finished
(stopped or at its length, not aborted) whose params name a kept request of the same
engine (``kvtide_release``, ``KVTransferParams.releases``) has the scheduler pass that
id to the worker with the next step's metadata (``RELEASE_META``), and the worker
reports it done sending, as a reader's notification would make it, so the scheduler
frees its blocks. An id the worker no longer holds for a peer (read, or expired) is
ignored.

It also says which request each NIXL read belonged to. vLLM's connector worker records
every finished read's bytes (NIXL's transfer telemetry, ``NixlKVConnectorStats``) but not
whose they were; kvtide's worker side runs vLLM's ``_pop_done_transfers`` one request at a time,
so that its stats (``NixlStats``) list each read's request id beside its bytes
(``READ_REQUESTS_KEY``, ``READ_BYTES_KEY`` in the stats' data). The stats reach the
engine's front end with the scheduler stats, where ``engines.vllm_engine``'s stat logger
gives each request the bytes its engine read for it. Reads are pulled by the engine
that receives the KV, so a decode engine's stats carry what moved prefill to decode,
and a prefill engine's what moved back (send-back, drains).

It also sets how long NIXL's UCX progress thread waits in ``poll()`` between rounds
(``kvtide_progress_wait_ms`` in the connector's extra config; ``kv.nixl_progress_wait_ms``).
NIXL's Python API creates every agent with a wait of 0, so that thread progresses its
workers in a loop that never sleeps: a whole core per engine process, idle or not (on
the 2-core development box, two idle agents in one process held both cores). With a
wait, the thread sleeps until UCX signals its event fd (armed workers) or the wait
ends; a read there was as fast (``benchmarks/nixl_progress.py``).

**Fault injection, for tests only** (``FAULT_CORRUPT_ENV``, unset by default): when the
engine's environment sets ``KVTIDE_FAULT_CORRUPT_PULLED_KV`` to a request id prefix, the
worker scrambles the first block of every finished NIXL read whose request id starts
with it (``corrupt_blocks``): a pulled block whose KV is wrong, as a faulty transfer would
leave it. The engine tier sets it on the prefill engine of the pair its own-engines
child shares (``tests/engine/own_engines.py``), for the integrity test
(``tests/engine/test_kv_integrity.py``); nothing else in kvtide sets it.

vLLM loads it from ``kv_transfer_config``: ``kv_connector: NixlConnector`` and
``kv_connector_module_path: engines.kv_connector`` (``engines.vllm_engine.engine_args_for``
writes both). The class is exported under vLLM's name, ``NixlConnector``, so that vLLM's
own checks for a NIXL connector (DCP, state layouts) still see one. Importing this module
does not import vLLM; the class is built on first access, in vLLM's processes.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from engines.kv_params import KVTransferParams

if TYPE_CHECKING:
    NixlConnector: type  # built by __getattr__
    NixlStats: type

__all__ = [
    "CONNECTOR_MODULE",
    "CPU_PROGRESS_WAIT_MS",
    "FAULT_CORRUPT_ENV",
    "NON_PAGED_STATE_MOVED",
    "PROGRESS_WAIT_KEY",
    "READ_BYTES_KEY",
    "READ_REQUESTS_KEY",
    "RELEASE_META",
    "NixlConnector",
    "NixlStats",
    "corrupt_blocks",
    "pop_done_per_request",
    "progress_wait",
]

CONNECTOR_MODULE = __name__
NON_PAGED_STATE_MOVED: dict[str, frozenset[str]] = {
    "kvtide's NixlConnector": frozenset(),
    "vLLM's NixlConnector": frozenset(),
}
"""What each connector kvtide runs declares it moves besides paged KV blocks (kinds of
``placement.kv_state``: "linear_attention", ...). Both move paged blocks only: P/D of a
model with linear-attention or SSM layers is refused (``orchestrator.config.pd_state``)."""
PROGRESS_WAIT_KEY = "kvtide_progress_wait_ms"
"""The connector's extra-config key for NIXL's progress-thread wait, in ms."""
CPU_PROGRESS_WAIT_MS = 10.0
"""The wait vLLM engines get on CPU (measured there: ``benchmarks/nixl_progress.py``)."""
RELEASE_META = "kvtide_release"
"""The connector metadata's attribute: the kept requests the worker frees unread."""
READ_REQUESTS_KEY = "kvtide_read_request_ids"
"""The stats' list of the (engine-internal) request id of each finished NIXL read."""
READ_BYTES_KEY = "kvtide_read_bytes"
"""The stats' list of each finished read's bytes, beside ``READ_REQUESTS_KEY``: NIXL's
telemetry (``totalBytes``), or None where NIXL gave none."""
FAULT_CORRUPT_ENV = "KVTIDE_FAULT_CORRUPT_PULLED_KV"
"""Fault injection (tests only): the request id prefix whose pulled KV is scrambled."""
_classes: dict[str, Any] = {}
log = logging.getLogger("kvtide.engine")

DoneTransfers = tuple[set[str], set[str]]


class ReadNotes(Protocol):
    """What ``pop_done_per_request`` tells the stats: whose reads are being polled."""

    reading: str | None


def pop_done_per_request(
    pop: Callable[[dict[str, list[int]]], DoneTransfers],
    transfers: dict[str, list[int]],
    notes: ReadNotes,
) -> DoneTransfers:
    """vLLM's ``_pop_done_transfers`` (``pop``), run on one request's handles at a time
    with ``notes.reading`` set to that request: what ``pop`` records then is that
    request's. ``transfers`` is updated in place as ``pop`` would (a request whose
    handles are all released leaves it), and the same done and failed ids come back:
    ``pop`` treats each request's handles on their own."""
    done: set[str] = set()
    failed: set[str] = set()
    for req_id in list(transfers):
        one = {req_id: transfers[req_id]}
        notes.reading = req_id
        try:
            one_done, one_failed = pop(one)
        finally:
            notes.reading = None
        if req_id in one:
            transfers[req_id] = one[req_id]
        else:
            del transfers[req_id]
        done |= one_done
        failed |= one_failed
    return done, failed


@contextmanager
def progress_wait(wait_ms: float, bindings: Any = None) -> Iterator[None]:
    """NIXL agents created in this block wait up to ``wait_ms`` in their progress
    thread's ``poll()`` (NIXL's Python API sets its config's ``pthrDelay``, in us, to 0
    whatever it is given; this block's config class keeps the larger of the two).
    ``bindings``: NIXL's compiled module (default: the one ``nixl._api`` uses). Not
    thread-safe: vLLM makes its agent while the worker starts, on one thread."""
    if wait_ms <= 0:
        yield
        return
    if bindings is None:
        from nixl._api import nixl_agent

        bindings = sys.modules[nixl_agent.__module__].nixlBind
    base = bindings.nixlAgentConfig
    floor_us = round(wait_ms * 1000)

    class _WaitingConfig(base):  # type: ignore[misc,valid-type]
        @property
        def pthrDelay(self) -> int:
            value: int = base.pthrDelay.__get__(self)
            return value

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            base.pthrDelay.__set__(self, max(value, floor_us))

    bindings.nixlAgentConfig = _WaitingConfig
    try:
        yield
    finally:
        bindings.nixlAgentConfig = base


def corrupt_blocks(pages: Any, block_ids: list[int], dtype: Any) -> None:
    """Scramble the KV of ``block_ids`` in one region (``pages``: one row of bytes per
    block, as vLLM's connector views a region): every value negated and scaled, so the
    block still holds finite numbers, but not the ones read. Fault injection only."""
    for block in block_ids:
        pages[block].view(dtype).mul_(-4.0)


def _results_with_fault(worker: Any, get_results: Callable[[], Any]) -> Any:
    """vLLM's worker's ``get_transfer_results``, with ``FAULT_CORRUPT_ENV``'s reads
    scrambled once they finished (fault injection; unset, just vLLM's)."""
    prefix = os.environ.get(FAULT_CORRUPT_ENV)
    if not prefix:
        return get_results()
    reading = {rid: m for rid, m in worker._recving_metadata.items() if rid.startswith(prefix)}
    results = get_results()
    for rid in set(results.finished_recving) - set(results.failed_recving):
        if rid in reading:
            _scramble_read(worker, rid, reading[rid])
    return results


def _scramble_read(worker: Any, rid: str, meta: Any) -> None:
    """Scramble the first block a finished read filled, in every region, viewed as vLLM's
    connector views them (``_zero_region_blocks``). Fault injection only."""
    import torch

    first = [group[0] for group in meta.local_physical_block_ids[:1] if group]
    bases = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]
    for region, name in enumerate(worker.region_names):
        cache = worker.device_kv_caches[name]
        storage = cache.untyped_storage()
        pages = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(
            storage,
            bases[region] - storage.data_ptr(),
            (worker.region_num_blocks[region], worker.block_len_per_layer[region]),
            (worker.block_stride_per_layer[region], 1),
        )
        corrupt_blocks(pages, first, cache.dtype)
    log.warning("fault injection: scrambled pulled block %s of request %s", first, rid)


def _stats_and_worker() -> tuple[type, type]:
    """vLLM's NIXL stats and pull worker, saying which request each read was for."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    class KVTideNixlStats(NixlKVConnectorStats):  # type: ignore[misc]
        """vLLM's NIXL stats, plus each finished read's request id and bytes."""

        reading: str | None = None  # the request whose reads are being polled

        def reset(self) -> None:
            super().reset()
            self.data[READ_REQUESTS_KEY] = []
            self.data[READ_BYTES_KEY] = []

        def record_transfer(self, res: Any) -> None:
            super().record_transfer(res)
            if self.reading is not None:
                self.data[READ_REQUESTS_KEY].append(self.reading)
                self.data[READ_BYTES_KEY].append(None if res is None else int(res.totalBytes))

        def is_empty(self) -> bool:
            # A read NIXL gave no telemetry for is still news.
            empty: bool = super().is_empty()
            return empty and not self.data.get(READ_REQUESTS_KEY)

    class KVTideNixlWorker(NixlPullConnectorWorker):  # type: ignore[misc]
        """vLLM's pull worker, whose stats say which request each read was for."""

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.xfer_stats = KVTideNixlStats()
            self._kvtide_release: set[str] = set()  # kept requests to free unread

        def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> DoneTransfers:
            return pop_done_per_request(super()._pop_done_transfers, transfers, self.xfer_stats)

        def start_load_kv(self, metadata: Any) -> None:
            super().start_load_kv(metadata)
            self._kvtide_release.update(getattr(metadata, RELEASE_META, ()))

        def get_transfer_results(self) -> Any:
            results = _results_with_fault(self, super().get_transfer_results)
            for req_id in self._kvtide_release:
                # Kept for a peer still: done, as a reader's notification would make it.
                if self._reqs_to_send.pop(req_id, None) is not None:
                    self._reqs_to_process.discard(req_id)
                    self.consumer_notification_counts_by_req.pop(req_id, None)
                    self.expected_consumer_notifications_by_req.pop(req_id, None)
                    results.finished_sending.add(req_id)
            self._kvtide_release = set()
            return results

    return KVTideNixlStats, KVTideNixlWorker


def _scheduler() -> type:
    """vLLM's pull scheduler, whose ``request_finished`` honours ``kvtide_keep`` and
    ``kvtide_release``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )
    from vllm.v1.request import RequestStatus

    finished = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)

    class KVTideNixlScheduler(NixlPullConnectorScheduler):  # type: ignore[misc]
        """The scheduler side: ``request_finished`` honours ``kvtide_keep``, passes a
        ``kvtide_release`` to the worker (``build_connector_meta``), and a new request's
        ``kvtide_prefill_chunk`` becomes the scheduler's chunk
        (``get_num_new_matched_tokens``)."""

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self._kvtide_release: set[str] = set()  # for the next step's metadata

        def get_num_new_matched_tokens(
            self, request: Any, num_computed_tokens: int
        ) -> tuple[int, bool]:
            chunk = KVTransferParams.prefill_chunk(request.kv_transfer_params)
            if chunk is not None:
                # The scheduler holds this same config and reads the threshold each step.
                self.vllm_config.scheduler_config.long_prefill_token_threshold = chunk
            matched: tuple[int, bool] = super().get_num_new_matched_tokens(
                request, num_computed_tokens
            )
            return matched

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            meta = super().build_connector_meta(scheduler_output)
            setattr(meta, RELEASE_META, self._kvtide_release)
            self._kvtide_release = set()
            return meta

        def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
            params = request.kv_transfer_params
            released = KVTransferParams.releases(params)
            if released is not None and request.status in finished:
                # Finished, not aborted: as the engine host's ledger sees it.
                self._kvtide_release.add(released)
            # A decode whose pull never started (still do_remote_prefill) is vLLM's to
            # clean up: it tells the prefill to free its blocks.
            if not KVTransferParams.frees_at_once(params) or params.get("do_remote_prefill"):
                kept: tuple[bool, Any] = super().request_finished(request, block_ids)
                return kept
            # Free now and return no params (nothing is offered to a peer), the way
            # vLLM ends an aborted request: the worker stops tracking it, so no lease
            # runs out later.
            req_id = request.request_id
            self._stop_heartbeat(req_id)
            self._reqs_not_processed.add(req_id)
            self._reqs_need_save.pop(req_id, None)
            return False, None

    return KVTideNixlScheduler


def _build() -> dict[str, Any]:
    from engines._vllm import require_vllm

    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlBaseConnector,
        NixlPullConnector,
    )

    KVTideNixlStats, KVTideNixlWorker = _stats_and_worker()
    KVTideNixlScheduler = _scheduler()

    class KVTideNixlConnector(NixlPullConnector):  # type: ignore[misc]
        """vLLM's pull connector with ``KVTideNixlScheduler`` on the scheduler side and
        ``KVTideNixlWorker``, whose NIXL agent's progress thread waits, on the worker
        side. It makes its sides as ``NixlPullConnector.__init__`` does, with kvtide's
        classes (the worker is not made twice: it starts a NIXL agent)."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            # vLLM's base leaves both sides to its subclasses.
            NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
            if role == KVConnectorRole.SCHEDULER:
                self.connector_scheduler = KVTideNixlScheduler(
                    vllm_config, self.engine_id, kv_cache_config
                )
            elif role == KVConnectorRole.WORKER:
                wait_ms = float(
                    vllm_config.kv_transfer_config.get_from_extra_config(PROGRESS_WAIT_KEY, 0.0)
                )
                with progress_wait(wait_ms):  # the worker makes the NIXL agent
                    self.connector_worker = KVTideNixlWorker(
                        vllm_config, self.engine_id, kv_cache_config
                    )

        @classmethod
        def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
            # The front end's loggers rebuild the stats from their data: with kvtide's
            # keys, so that aggregating them finds those lists.
            return KVTideNixlStats(data=data) if data is not None else KVTideNixlStats()

    # vLLM (and pickle) find them as engines.kv_connector.NixlConnector and
    # engines.kv_connector.NixlStats: the stats cross from TP workers to the engine core.
    built = {"NixlConnector": KVTideNixlConnector, "NixlStats": KVTideNixlStats}
    for name, cls in built.items():
        cls.__module__, cls.__qualname__ = __name__, name
    return built


def __getattr__(name: str) -> Any:
    if name not in ("NixlConnector", "NixlStats"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _classes:
        _classes.update(_build())
    return _classes[name]
