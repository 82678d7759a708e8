"""`kvtide up` ending: the app and its KV service go, Ray goes, and nothing is printed
after the caller's own output (Ray used to print Serve's killed controller's pending
tasks as failed after the demo's table).

The driver runs in a subprocess of its own, as `kvtide up` does, with a private Ray.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import yaml
from polling import wait_for

from orchestrator.cluster.ports import free_port

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]

DRIVER = textwrap.dedent(
    """
    import sys
    import urllib.request

    from ray import serve

    from orchestrator import runtime
    from orchestrator.config import parse_config
    from orchestrator.kv.actor import get_or_create_service, lookup_service
    from orchestrator.kv.decider import kv_lifecycle_config

    config = parse_config(
        {"ray": {"num_cpus": 2, "temp_dir": sys.argv[1]}, "server": {"port": int(sys.argv[2])}}
    )
    runtime.start_ray(config, say=lambda _: None)

    @serve.deployment
    class Hello:
        def __call__(self, request):
            return "hello"

    serve.start(http_options={"host": "127.0.0.1", "port": config.server.port})
    serve.run(Hello.bind(), name=runtime.APP_NAME, route_prefix="/hello")
    lifecycle = kv_lifecycle_config(
        ttl_s=480,
        safety_margin_s=15,
        recompute_threshold_tokens=4,
        kv_bytes_per_token=100,
        block_size_tokens=16,
    )
    get_or_create_service(
        runtime.APP_NAME, lifecycle, None, drain_timeout_s=5.0, num_prefill_engines=1
    )
    url = f"http://127.0.0.1:{config.server.port}/hello"
    assert urllib.request.urlopen(url).read() == b"hello"
    # A handle call too: the driver then long-polls Serve's controller, as the CLI does.
    assert serve.get_deployment_handle("Hello", runtime.APP_NAME).remote(None).result() == "hello"
    assert lookup_service(runtime.APP_NAME) is not None
    print("=== the caller's last line", flush=True)
    runtime.shutdown()
    """
)


def test_shutdown_prints_nothing_after_the_callers_output() -> None:
    with tempfile.TemporaryDirectory(prefix="kvt-") as tmp:
        done = subprocess.run(
            [sys.executable, "-c", DRIVER, str(Path(tmp) / "ray"), str(free_port())],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # one stream, in the order it was written
            text=True,
            timeout=180,
        )
    out = done.stdout
    assert done.returncode == 0, out[-2000:]
    after = out[out.index("=== the caller's last line") :].splitlines()[1:]
    assert [line for line in after if line.strip()] == []


def _processes_with(text: str) -> list[str]:
    """The command lines of running processes that mention ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(cmd)
    return found


def test_sigterm_while_the_engines_start_stops_cleanly() -> None:
    """`kvtide up` sent SIGTERM while it deploys (as a service manager stopping it
    does) takes the app and Ray down and exits 143, without Ray's C++ stack trace and
    SIGABRT."""
    with tempfile.TemporaryDirectory(prefix="kvt-") as tmp:  # short: Ray's socket paths
        _sigterm_while_starting(Path(tmp))


def _sigterm_while_starting(tmp_path: Path) -> None:
    from engines.tiny_model import generate_tiny_model

    generate_tiny_model(tmp_path / "tiny")
    ray_dir = tmp_path / "ray"
    config = tmp_path / "kvtide.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "backend": "simulated",
                "model": {"path": str(tmp_path / "tiny")},
                "prefill": {"cpu_threads_bind": None},
                "decode": {"cpu_threads_bind": None},
                "server": {"port": free_port()},
                "ray": {"temp_dir": str(ray_dir), "num_cpus": 4},
            }
        )
    )
    up = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from orchestrator.cli.main import main; sys.exit(main())",
            "up",
            str(config),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # Serve's controller has started: the deploy is under way.
        wait_for(
            lambda: any((ray_dir / "session_latest" / "logs" / "serve").glob("controller_*")),
            timeout_s=120,
            what="Serve's controller to start",
        )
        up.send_signal(signal.SIGTERM)
        out, _ = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 143, out[-3000:]
    assert "stopped while starting" in out
    for crash in ("SIGABRT", "*** SIGTERM", "Traceback", "Aborted"):
        assert crash not in out, out[-3000:]
    # Ray went with it: no process of this Ray is left.
    wait_for(lambda: not _processes_with(str(ray_dir)), timeout_s=30, what="Ray to stop")
