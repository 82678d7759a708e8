"""A vLLM engine core that only keeps finished requests' KV waits instead of stepping.

vLLM's engine core steps while its scheduler has requests, and a finished request whose
blocks are kept for a peer (a decode's for the next turn, a prefill's under a lease) is
one until the peer reads it or its TTL ends. With nothing to run, each step schedules
nothing and executes an empty batch, then sleeps 1 ms: on the development box a decode
engine holding one session's KV idle used 1.28 cores that way, its core process 0.28
and its worker 0.97 (0.12 in all with a 20 ms wait and the shorter spin below;
``benchmarks/idle_steps.py``), for as long as it held it (the TTL: minutes), on a
2-core machine where the prefill engine needed it.

With ``ENV_VAR`` set (ms, > 0) in the engine core's environment, ``register()`` (entry
point group ``vllm.general_plugins``, called in every process vLLM starts) wraps
``EngineCoreProc._process_engine_step`` (the core's own process): when the scheduler has
no request to run, none just finished and no batch is in flight — only kept blocks — the
core first waits up to that
long for the next client message (a new request, an abort) and handles it at once. A
read of the kept blocks needs no step on their side (NIXL reads them from the peer);
the step after it frees them, at most the wait later. Everything else is vLLM's.

Each such step still hands the worker process (vLLM's multiprocessing executor, always
used on CPU) an empty batch through vLLM's shared-memory message queue, and a reader of
that queue busy-waits (``sched_yield``) for a second after every message before it
sleeps on its notification socket (``SpinCondition.busy_loop_s``, 1 s in vLLM
0.32/0.33). A step every 20 ms therefore kept the worker spinning without end: 0.77 of
a core on the development box, while the core process itself used 0.05. So the same
setting also shortens the readers' busy wait to ``READER_SPIN_S`` (2 ms, the value the
upstream proposals to make it configurable use): a message within 2 ms of the last is
still taken without a wake-up; later ones cost one wake-up of the socket (tens of µs,
against a CPU engine's 10+ ms step). A vLLM that reads its own setting
(``VLLM_SHM_BROADCAST_BUSY_LOOP_S``) is left to it.

``kv.idle_step_wait_ms`` sets it (20 ms on CPU, where it was measured; off on GPUs
unless set). Patches private parts of vLLM (0.32/0.33): on a vLLM without them,
``register()`` logs and leaves the engine as it is.
"""

from __future__ import annotations

import inspect
import logging
import os
import queue
from typing import Any

__all__ = [
    "CPU_WAIT_MS",
    "ENV_VAR",
    "READER_SPIN_S",
    "install",
    "only_kept_blocks",
    "register",
    "shorten_reader_spin",
]

log = logging.getLogger("kvtide.engine")

ENV_VAR = "KVTIDE_IDLE_STEP_WAIT_MS"
CPU_WAIT_MS = 20.0
"""The wait vLLM engines get on CPU (``benchmarks/sendback.py`` measures its effect)."""


def only_kept_blocks(core: Any) -> bool:
    """The core's scheduler holds requests, but only finished ones whose blocks wait for
    a peer: nothing to run, nothing just finished, no batch in flight."""
    scheduler = core.scheduler
    return (
        not getattr(core, "engines_running", False)
        and not getattr(core, "batch_queue", None)
        and not scheduler.has_unfinished_requests()
        and not scheduler.finished_req_ids
        and scheduler.has_requests()
    )


def install(core_class: type, wait_s: float) -> bool:
    """Wrap ``core_class._process_engine_step`` (once); False when it has none."""
    original = getattr(core_class, "_process_engine_step", None)
    if original is None or getattr(core_class, "_kvtide_idle_wait_s", None) is not None:
        return False

    def _process_engine_step(self: Any) -> Any:
        if only_kept_blocks(self):
            try:
                message = self.input_queue.get(timeout=wait_s)
            except queue.Empty:
                pass
            else:
                self._handle_client_request(*message)
        return original(self)

    core_class._process_engine_step = _process_engine_step  # type: ignore[attr-defined]
    core_class._kvtide_idle_wait_s = wait_s  # type: ignore[attr-defined]
    return True


READER_SPIN_S = 0.002
"""How long a reader of vLLM's shared-memory message queue busy-waits after a message."""
VLLM_SPIN_ENV = "VLLM_SHM_BROADCAST_BUSY_LOOP_S"


def shorten_reader_spin(spin_class: type, busy_loop_s: float) -> bool:
    """Make ``busy_loop_s`` the default of ``spin_class`` (vLLM's ``SpinCondition``)
    (once); False when its constructor takes no such argument."""
    init = spin_class.__init__
    if getattr(spin_class, "_kvtide_busy_loop_s", None) is not None:
        return False
    try:
        if "busy_loop_s" not in inspect.signature(init).parameters:
            return False
    except (TypeError, ValueError):
        return False

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) < 4:  # (is_reader, context, notify_address, busy_loop_s)
            kwargs.setdefault("busy_loop_s", busy_loop_s)
        init(self, *args, **kwargs)

    spin_class.__init__ = __init__  # type: ignore[misc]
    spin_class._kvtide_busy_loop_s = busy_loop_s  # type: ignore[attr-defined]
    return True


def register() -> None:
    """vLLM's plugin hook: wrap the engine core's step where ``ENV_VAR`` asks for it."""
    try:
        wait_ms = float(os.environ.get(ENV_VAR) or 0)
    except ValueError:
        log.warning(
            "%s=%r is not a number of ms: engine steps as vLLM's", ENV_VAR, os.environ[ENV_VAR]
        )
        return
    if wait_ms <= 0:
        return
    try:
        from vllm.v1.engine.core import EngineCoreProc
    except ImportError:
        return
    if not install(EngineCoreProc, wait_ms / 1000):
        if getattr(EngineCoreProc, "_kvtide_idle_wait_s", None) is None:
            log.warning("this vLLM's engine core has no _process_engine_step: idle steps as vLLM's")
    if VLLM_SPIN_ENV in os.environ:
        return  # a vLLM that has the setting reads it; the operator chose
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return
    if not shorten_reader_spin(SpinCondition, READER_SPIN_S):
        if getattr(SpinCondition, "_kvtide_busy_loop_s", None) is None:
            log.warning("this vLLM's SpinCondition has no busy_loop_s: its readers spin as vLLM's")
