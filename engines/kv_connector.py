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

It also sets how long NIXL's UCX progress thread waits in ``poll()`` between rounds
(``kvtide_progress_wait_ms`` in the connector's extra config; ``kv.nixl_progress_wait_ms``).
NIXL's Python API creates every agent with a wait of 0, so that thread progresses its
workers in a loop that never sleeps: a whole core per engine process, idle or not (on
the 2-core development box, two idle agents in one process held both cores). With a
wait, the thread sleeps until UCX signals its event fd (armed workers) or the wait
ends; a read there was as fast (``benchmarks/nixl_progress.py``).

vLLM loads it from ``kv_transfer_config``: ``kv_connector: NixlConnector`` and
``kv_connector_module_path: engines.kv_connector`` (``engines.vllm_engine.engine_args_for``
writes both). The class is exported under vLLM's name, ``NixlConnector``, so that vLLM's
own checks for a NIXL connector (DCP, state layouts) still see one. Importing this module
does not import vLLM; the class is built on first access, in vLLM's processes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from engines.kv_params import KVTransferParams

if TYPE_CHECKING:
    NixlConnector: type  # built by __getattr__

__all__ = [
    "CONNECTOR_MODULE",
    "CPU_PROGRESS_WAIT_MS",
    "PROGRESS_WAIT_KEY",
    "NixlConnector",
    "progress_wait",
]

CONNECTOR_MODULE = __name__
PROGRESS_WAIT_KEY = "kvtide_progress_wait_ms"
"""The connector's extra-config key for NIXL's progress-thread wait, in ms."""
CPU_PROGRESS_WAIT_MS = 10.0
"""The wait vLLM engines get on CPU (measured there: ``benchmarks/nixl_progress.py``)."""
_classes: dict[str, Any] = {}


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


def _build() -> Any:
    from engines._vllm import require_vllm

    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )

    class KVTideNixlScheduler(NixlPullConnectorScheduler):  # type: ignore[misc]
        """The scheduler side: ``request_finished`` honours ``kvtide_keep``."""

        def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
            params = request.kv_transfer_params
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

    class KVTideNixlConnector(NixlPullConnector):  # type: ignore[misc]
        """vLLM's pull connector with ``KVTideNixlScheduler`` on the scheduler side and
        NIXL's progress-thread wait on the worker side."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            wait_ms = float(
                vllm_config.kv_transfer_config.get_from_extra_config(PROGRESS_WAIT_KEY, 0.0)
            )
            # The worker side makes the NIXL agent.
            with progress_wait(wait_ms if role == KVConnectorRole.WORKER else 0.0):
                super().__init__(vllm_config, role, kv_cache_config)
            if role == KVConnectorRole.SCHEDULER:
                self.connector_scheduler = KVTideNixlScheduler(
                    vllm_config, self.engine_id, kv_cache_config
                )

    # vLLM (and pickle) find it as engines.kv_connector.NixlConnector.
    KVTideNixlConnector.__module__ = __name__
    KVTideNixlConnector.__qualname__ = "NixlConnector"
    return KVTideNixlConnector


def __getattr__(name: str) -> Any:
    if name != "NixlConnector":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _classes:
        _classes[name] = _build()
    return _classes[name]
