"""``ray.serve_in_loop``: a locally started Ray runs Serve's replicas with user code and
the request router on the replica's own event loop, while the driver keeps Serve's
defaults (its handles are made and used outside an event loop, as the CLI and the
benchmarks do; with the in-loop router they refuse to work there).

The driver runs in a subprocess of its own with a private Ray."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from orchestrator.serve.engine_host import free_port

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]

DRIVER = textwrap.dedent(
    """
    import json
    import os
    import sys
    import urllib.request

    from ray import serve

    from orchestrator import runtime
    from orchestrator.config import parse_config

    config = parse_config(
        {
            "ray": {"num_cpus": 2, "temp_dir": sys.argv[1], "serve_in_loop": sys.argv[3] == "1"},
            "server": {"port": int(sys.argv[2])},
        }
    )
    runtime.start_ray(config, say=lambda _: None)

    @serve.deployment
    class Settings:
        def __call__(self, request=None):
            from ray.serve._private import constants

            return {
                "user_code_in_own_thread": constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD,
                "router_in_own_loop": constants.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP,
            }

    serve.start(http_options={"host": "127.0.0.1", "port": config.server.port})
    serve.run(Settings.bind(), name=runtime.APP_NAME, route_prefix="/settings")
    url = f"http://127.0.0.1:{config.server.port}/settings"
    replica = json.loads(urllib.request.urlopen(url).read())
    # The driver's own handle, outside any event loop.
    via_handle = serve.get_deployment_handle("Settings", runtime.APP_NAME).remote().result()
    driver_env = {k: os.environ.get(k) for k in runtime.SERVE_IN_LOOP_ENV}
    result = {"replica": replica, "via_handle": via_handle, "driver_env": driver_env}
    print("RESULT " + json.dumps(result))
    runtime.shutdown()
    """
)


def _run(serve_in_loop: bool) -> dict[str, dict[str, object]]:
    with tempfile.TemporaryDirectory(prefix="kvt-") as tmp:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                DRIVER,
                str(Path(tmp) / "ray"),
                str(free_port()),
                "1" if serve_in_loop else "0",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=180,
        )
    assert done.returncode == 0, done.stdout[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, dict[str, object]] = json.loads(line.removeprefix("RESULT "))
    return result


def test_replicas_run_in_loop_and_the_driver_keeps_its_handles_working() -> None:
    got = _run(serve_in_loop=True)
    in_loop = {"user_code_in_own_thread": False, "router_in_own_loop": False}
    assert got["replica"] == in_loop
    assert got["via_handle"] == in_loop
    assert set(got["driver_env"].values()) == {None}
