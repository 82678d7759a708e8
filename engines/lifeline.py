"""A vLLM engine core ends when the process that started it is gone.

vLLM's ``AsyncLLM`` runs its engine core in a child process; the core's own workers
follow it (vLLM's death pipe for the multiprocessing executor; Ray ends the TP actors
a dead owner made). Nothing ends the core itself when its parent — kvtide's engine host,
a Serve replica — is killed without a shutdown (SIGKILL, the OOM killer, ``ray stop
--force``, a replica Serve gives up on): the core is reparented and keeps its memory, its
KV cache and its NIXL registrations (on a GPU, the GPU's memory) with nobody to serve.
Seen on the development box: after ``kvtide up`` was killed, both engines' cores and
workers ran on, one at a full core.

The engine host names itself in ``ENV_VAR`` before it starts the engine. vLLM calls
``register()`` (entry point group ``vllm.general_plugins``) in every process it starts;
in a process whose parent is the named one (the engine core) it starts a daemon thread
that checks the parent every ``CHECK_INTERVAL_S`` and ends the process when the parent
is gone (reparenting changes ``os.getppid()``). Other processes — the workers, whose
parent is the core, or Ray's — start nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time

__all__ = ["CHECK_INTERVAL_S", "ENV_VAR", "register", "watch_parent"]

log = logging.getLogger("kvtide.engine")

ENV_VAR = "KVTIDE_ENGINE_PARENT_PID"
"""The pid of the engine host; set by ``engines.vllm_engine`` before vLLM starts."""

CHECK_INTERVAL_S = 1.0
EXIT_CODE = 3

_watching = threading.Event()


def register() -> bool:
    """vLLM general-plugin hook: in the engine core of an engine kvtide started, watch
    the engine host. Returns whether this process now watches its parent."""
    named = os.environ.get(ENV_VAR, "")
    if not named.isdigit() or os.getppid() != int(named) or _watching.is_set():
        return False
    watch_parent(int(named))
    return True


def watch_parent(parent_pid: int) -> threading.Thread:
    """Start the daemon thread that ends this process at once (exit code
    ``EXIT_CODE``) when its parent is no longer ``parent_pid``."""
    _watching.set()

    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(CHECK_INTERVAL_S)
        log.error("engine host (pid %d) is gone: ending this engine process", parent_pid)
        logging.shutdown()
        os._exit(EXIT_CODE)

    thread = threading.Thread(target=run, name="kvtide-lifeline", daemon=True)
    thread.start()
    return thread
