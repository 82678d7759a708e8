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
from typing import Any

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

    def descendants():
        # This driver's process tree: the local Ray it started is below it.
        kids = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            kids.setdefault(int(stat[1]), []).append(pid)
        out, todo = [], [str(os.getpid())]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += kids.get(int(pid), [])
        return out

    def haproxy_listeners(files):
        # ip:port of every listening TCP socket of the HAProxy whose files are in
        # `files` (from /proc, as `ss -ltnp` reads it).
        return listeners(
            pid
            for pid in filter(str.isdigit, os.listdir("/proc"))
            if is_haproxy(pid, files)
        )

    def is_haproxy(pid, files):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            return False
        return any(files.encode() in a for a in cmd) and b"haproxy" in cmd[0]

    def listeners(pids):
        inodes = set()
        for pid in pids:
            try:
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
            except OSError:
                continue
        found = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in open(table).read().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:  # LISTEN
                    addr, port = f[1].split(":")
                    ip = addr
                    if len(addr) == 8:
                        ip = ".".join(str(b) for b in bytes.fromhex(addr)[::-1])
                    found.append(f"{ip}:{int(port, 16)}")
        return sorted(found)

    def stalled_request(port):
        # A request that declares 100 bytes of body and sends 10: what comes back, and
        # after how long.
        import socket
        import time

        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            start = time.monotonic()
            head = b"POST /settings HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 100\\r\\n\\r\\n"
            sock.sendall(head + b"0123456789")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            after_s = time.monotonic() - start
            return {"after_s": after_s, "response": data.decode(errors="replace")}

    config = parse_config(
        {
            "ray": {"num_cpus": 2, "temp_dir": sys.argv[1], "serve_in_loop": sys.argv[3] == "1",
                    "direct_ingress": sys.argv[4] == "1"},
            "server": {"port": int(sys.argv[2]), "request_body_timeout_s": 1.0},
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
    if replica["haproxy"]:
        files = os.path.dirname(replica["haproxy_socket"])
        result["haproxy_listeners"] = haproxy_listeners(files)
        result["ingress_listeners"] = [
            x for x in listeners(descendants()) if 30000 <= int(x.rsplit(":", 1)[1]) <= 31000
        ]
        result["stalled"] = stalled_request(config.server.port)
    print("RESULT " + json.dumps(result))
    runtime.shutdown()
    """
)


def _run(serve_in_loop: bool, direct_ingress: bool) -> dict[str, Any]:
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
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
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
    # HAProxy's stats page and Prometheus endpoint listen on loopback, as the front
    # does here (server.host 127.0.0.1): nothing of it on another interface.
    listeners = got["haproxy_listeners"]
    assert len(listeners) == 3 and all(x.startswith("127.0.0.1:") for x in listeners), listeners
    # So does the ingress replica's own HTTP port (Serve's direct ingress, 30000-31000).
    ingress = got["ingress_listeners"]
    assert ingress and all(x.startswith("127.0.0.1:") for x in ingress), ingress
    # A request whose body stops coming is answered with kvtide's JSON 408 within about
    # server.request_body_timeout_s (1 s here), not held for HAProxy's hour.
    stalled = got["stalled"]
    head, _, body = str(stalled["response"]).partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 408"), stalled
    assert json.loads(body)["error"]["param"] == "server.request_body_timeout_s"
    assert float(stalled["after_s"]) < 10
