"""``ray.serve_in_loop`` and ``ray.direct_ingress``: a locally started Ray runs Serve's
replicas with user code and the request router on the replica's own event loop, and its
ingress replicas serve HTTP behind Serve's HAProxy, while the driver keeps Serve's
defaults (its handles are made and used outside an event loop, as the CLI and the
benchmarks do; with the in-loop router they refuse to work there).

The driver runs in a subprocess of its own with a private Ray."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from orchestrator.cluster.ports import free_port

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]

HAPROXY_DEFAULT_PORTS = (8404, 9101)  # Ray Serve's HAProxy stats page and Prometheus

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
            "ray": {"num_cpus": 2, "temp_dir": sys.argv[1], "serve_in_loop": sys.argv[3] == "1",
                    "direct_ingress": sys.argv[4] == "1"},
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
                "direct_ingress": constants.RAY_SERVE_ENABLE_DIRECT_INGRESS,
                "haproxy": constants.RAY_SERVE_ENABLE_HA_PROXY,
                "haproxy_socket": constants.RAY_SERVE_HAPROXY_SOCKET_PATH,
            }

    serve.start(http_options={"host": "127.0.0.1", "port": config.server.port})
    serve.run(Settings.bind(), name=runtime.APP_NAME, route_prefix="/settings")
    url = f"http://127.0.0.1:{config.server.port}/settings"
    replica = json.loads(urllib.request.urlopen(url).read())
    # The driver's own handle, outside any event loop.
    via_handle = serve.get_deployment_handle("Settings", runtime.APP_NAME).remote().result()
    keys = {**runtime.SERVE_IN_LOOP_ENV, **runtime.DIRECT_INGRESS_ENV}
    driver_env = {k: os.environ.get(k) for k in keys}
    result = {"replica": replica, "via_handle": via_handle, "driver_env": driver_env}
    print("RESULT " + json.dumps(result))
    runtime.shutdown()
    """
)


def _run(serve_in_loop: bool, direct_ingress: bool) -> dict[str, dict[str, object]]:
    with tempfile.TemporaryDirectory(prefix="kvt-") as tmp:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                DRIVER,
                str(Path(tmp) / "ray"),
                str(free_port()),
                "1" if serve_in_loop else "0",
                "1" if direct_ingress else "0",
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
    got = _run(serve_in_loop=True, direct_ingress=False)
    in_loop = {
        "user_code_in_own_thread": False,
        "router_in_own_loop": False,
        "direct_ingress": False,
        "haproxy": False,
        "haproxy_socket": "/tmp/haproxy-serve/admin.sock",
    }
    assert got["replica"] == in_loop
    assert got["via_handle"] == in_loop
    assert set(got["driver_env"].values()) == {None}


def test_by_default_the_ingress_replica_serves_http_behind_a_private_haproxy() -> None:
    """The endpoint answers at ``server.port`` through Serve's HAProxy (direct ingress),
    whose sockets and ports are this Ray's own: not the machine-wide
    ``/tmp/haproxy-serve``, and it starts while another program (here: this test) holds
    HAProxy's default stats and metrics ports, as a second Ray on the machine would."""
    with contextlib.ExitStack() as held:
        for port in HAPROXY_DEFAULT_PORTS:
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("0.0.0.0", port))
            sock.listen()
        got = _run(serve_in_loop=True, direct_ingress=True)
    replica = got["replica"]
    admin = str(replica.pop("haproxy_socket"))
    assert replica == {
        "user_code_in_own_thread": False,
        "router_in_own_loop": False,
        "direct_ingress": True,
        "haproxy": True,
    }
    assert admin.startswith("/tmp/kvth-") and admin.endswith("/admin.sock")
    assert set(got["driver_env"].values()) == {None}
