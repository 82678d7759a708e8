"""Starting or joining Ray and deploying the Serve app, with progress for long waits."""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from orchestrator.cluster.pool_layout import PoolLayout
from orchestrator.config import KVTideConfig
from orchestrator.errors import KVTideError

if TYPE_CHECKING:
    from orchestrator.cluster.supervisor import PoolSupervisor

__all__ = [
    "APP_NAME",
    "deploy",
    "pool_supervisor",
    "redeploy",
    "shutdown",
    "start_ray",
    "supervise",
]

APP_NAME = "kvtide"


def _say(msg: str) -> None:
    print(f"[kvtide] {msg}", file=sys.stderr, flush=True)


RAY_WITHOUT_METRICS = {"enable_metrics_collection": False}
"""The system config of a local Ray without its metrics agent's Prometheus endpoint."""

SERVE_IN_LOOP_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_LOG_TO_STDERR": "0",
}
"""Ray Serve's throughput-optimized settings but direct ingress (``ray.serve_in_loop``):
for the processes a local Ray starts, not the driver (whose handles are made outside
an event loop)."""

DIRECT_INGRESS_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    # One HAProxy thread: it only forwards bytes, and the box's cores run the engines.
    "RAY_SERVE_HAPROXY_NBTHREAD": "1",
    # An ingress replica that stops stays open this long for HAProxy to deregister it
    # (Ray's default, 30 s, is for load balancers outside the cluster; Serve's own
    # HAProxy is told by the controller and retries refused connections).
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}
"""Ray Serve's direct ingress behind its HAProxy (``ray.direct_ingress``): the ingress
replicas serve HTTP themselves, no Python proxy actor in between."""

HAPROXY_FILES = {
    "CONFIG_FILE_LOC": "haproxy.cfg",
    "SOCKET_PATH": "admin.sock",
    "SERVER_STATE_BASE": "",
    "SERVER_STATE_FILE": "server-state",
    "METRICS_SOCKET_PATH": "metrics.sock",
}
"""HAProxy's files, by the ``RAY_SERVE_HAPROXY_*`` variable that places each."""


def local_ray_env(config: KVTideConfig) -> dict[str, str]:
    """The ``RAY_SERVE_*`` environment of the processes a local Ray starts for ``config``.

    HAProxy's files go to a private directory (Ray's default, ``/tmp/haproxy-serve``, is
    shared by every Ray on the machine); it is short because HAProxy refuses socket paths
    over 97 bytes and Serve adds a 56-character directory to each."""
    from orchestrator.autoscale.options import autoscaling_env
    from orchestrator.serve.http_guard import MIDDLEWARE_ENV

    env: dict[str, str] = dict(MIDDLEWARE_ENV)  # headers checked before Serve reads them
    env.update(autoscaling_env(config))  # how often replicas report their load
    if config.ray.serve_in_loop:
        env.update(SERVE_IN_LOOP_ENV)
    if config.ray.direct_ingress:
        env.update(DIRECT_INGRESS_ENV)
        files = tempfile.mkdtemp(prefix="kvth-", dir="/tmp")
        atexit.register(shutil.rmtree, files, ignore_errors=True)  # goes with this Ray
        for name, file in HAPROXY_FILES.items():
            env[f"RAY_SERVE_HAPROXY_{name}"] = os.path.join(files, file)
        # HAProxy's stats page and Prometheus endpoint listen at fixed ports by default
        # (8404, 9101): a second Ray on the machine would fail to start its HAProxy.
        # Free ports of this Ray's own.
        from orchestrator.cluster.haproxy_front import haproxy_binary, write_wrapper
        from orchestrator.cluster.ports import free_port

        # Never the server's own port: chosen, but bound only once Serve starts, by the
        # same HAProxy (a stats listener on it failed that HAProxy's start).
        stats_port = free_port("0.0.0.0", avoid={config.server.port})
        admin_ports = (stats_port, free_port("0.0.0.0", avoid={config.server.port, stats_port}))
        env["RAY_SERVE_HAPROXY_STATS_PORT"] = str(admin_ports[0])
        env["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(admin_ports[1])
        # Those two on loopback, and a deadline for a request to arrive (Ray has no
        # setting for either: orchestrator.cluster.haproxy_front).
        env["RAY_SERVE_HAPROXY_BINARY_PATH"] = write_wrapper(
            files,
            real_binary=haproxy_binary(),
            admin_ports=admin_ports,
            request_body_timeout_s=config.server.request_body_timeout_s,
        )
    return env


@contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while the block runs (inherited by the
    processes it starts), the previous values after it."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_ray(config: KVTideConfig, *, say: Callable[[str], None] = _say) -> None:
    """Join ``config.ray.address`` or start a private local Ray (own temp dir)."""
    import ray

    if ray.is_initialized():
        return
    # Ray's prestarted workers run at nice 15 and starve beside engines on small boxes.
    os.environ.setdefault("RAY_worker_niceness", "0")
    if config.ray.address:
        say(f"joining Ray at {config.ray.address}")
        ray.init(address=config.ray.address, logging_level="WARNING")
        return
    temp_dir = config.ray.temp_dir or tempfile.mkdtemp(prefix="kvtide-ray-")
    say(f"starting a local Ray (temp dir {temp_dir})")
    with _env(local_ray_env(config)):
        ray.init(
            num_cpus=config.ray.num_cpus or 8,
            _temp_dir=temp_dir,
            include_dashboard=False,
            logging_level="WARNING",
            log_to_driver=bool(os.environ.get("KVTIDE_ENGINE_LOGS")),
            # Ray's Prometheus endpoint listens on every interface without auth: only when
            # kvtide's metrics are to be exported through it (GET /metrics needs none).
            _system_config=None if config.observability.exports_to_ray else RAY_WITHOUT_METRICS,
        )


class DeployProgress:
    """What ``kvtide up`` says about Serve's deploy, from the app's status read every
    second: a replica's start failure at once (the error its traceback ended with; Serve
    retries it), the replicas running every ``every_s``, and once Serve gave up, the
    failure with each failed deployment's own error (Serve's app message names the
    deployments only)."""

    def __init__(self, started_s: float, every_s: float = 10.0) -> None:
        self.started_s = started_s
        self.every_s = every_s
        self._said_s = started_s
        self._told: set[str] = set()

    def read(self, app: Any, now_s: float) -> tuple[list[str], str | None]:
        """Lines to say now about ``app`` (Serve's ``ApplicationStatusOverview``, or None
        before it exists), and the deploy's failure once its status is DEPLOY_FAILED."""
        if app is None:
            return [], None
        lines, parts, failed = [], [], []
        for name, dep in app.deployments.items():
            running = dep.replica_states.get("RUNNING", 0)
            parts.append(f"{name} {running}/{sum(dep.replica_states.values())}")
            failure = replica_failure(dep.message)
            if failure is not None and failure not in self._told:
                self._told.add(failure)
                lines.append(
                    f"{name}: a replica failed to start: {failure} (Serve retries it; the "
                    f"engine's own log: logs/serve/replica_{APP_NAME}_{name}_*.log in Ray's "
                    "session directory)"
                )
            if dep.status == "DEPLOY_FAILED":
                failed.append(f"{name}: {failure or dep.message}")
        if now_s - self._said_s >= self.every_s:
            self._said_s = now_s
            lines.append(f"starting engines ({now_s - self.started_s:.0f}s): " + ", ".join(parts))
        if app.status != "DEPLOY_FAILED":
            return lines, None
        why = "; ".join(failed) or app.message
        return lines, f"app {APP_NAME!r} failed to deploy: {why}"


_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception)\b(:|$)")


def replica_failure(message: str) -> str | None:
    """The error a Serve deployment's status message reports for a replica that failed
    to start (the last ``SomeError: ...`` line of its traceback), or None."""
    if "failed to start" not in message or "Error:" not in message:
        return None
    lines = [ln.strip() for ln in message.split("Error:", 1)[1].splitlines() if ln.strip()]
    errors = [ln for ln in lines if _ERROR_LINE.match(ln)]
    return (errors or lines or [None])[-1]


def deploy(
    config: KVTideConfig, *, say: Callable[[str], None] = _say, layout: PoolLayout | None = None
) -> PoolLayout:
    """Deploy the app and block until every engine is up (engine start is 20-90 s on CPU).

    With engines placed by NVLink domain the wait for Ray to place them is bounded by
    ``placement.timeout_s`` (``EnginesNotPlaced``, the app removed); a config whose
    engines fit in no domain fails before anything is deployed (``EnginesUnplaceable``).
    Returns the layout deployed.
    """
    from ray import serve

    from orchestrator.cluster.ray_nodes import read_node_addresses
    from orchestrator.config.server import check_internal_host
    from orchestrator.serve.app import build_app, layout_for

    # Engines on different hosts dial each other's side channels on internal_host.
    check_internal_host(config.server.internal_host, read_node_addresses())
    if config.model.is_generated:
        say(f"generating the tiny model in {config.model.resolved_path()}")
    layout = layout or layout_for(config)
    if layout.by_domain:
        say("engines placed by NVLink domain:\n" + layout.describe())
    app = build_app(config, layout)
    # One HTTP entry, on the head node: the endpoint kvtide prints and documents (Serve's
    # HAProxy in front of the ingress replicas with ray.direct_ingress, else its proxy).
    serve.start(
        proxy_location="HeadOnly",
        http_options={"host": config.server.host, "port": config.server.port},
    )
    before = _serve_status().applications.get(APP_NAME)
    _start(app, config)
    _release_dropped(before, layout)
    _wait_running(config, layout, say)
    say(f"serving {config.model.name!r} at http://{config.server.host}:{config.server.port}/v1")
    return layout


def _wait_running(config: KVTideConfig, layout: PoolLayout, say: Callable[[str], None]) -> None:
    """Wait for the app Serve is deploying to run, saying its progress (``DeployProgress``);
    a deploy Serve gave up raises with each failed deployment's error. With engines placed
    by NVLink domain, gives up on placement groups Ray leaves pending too long."""
    from ray import serve

    from orchestrator.cluster.ray_nodes import domain_states, read_free_gpus, read_ray_nodes
    from orchestrator.cluster.supervisor import (
        PlacementWatch,
        not_placed_error,
        read_pending_groups,
    )

    progress = DeployProgress(time.monotonic())
    watch = PlacementWatch(config.placement.timeout_s)
    while True:
        status = serve.status().applications.get(APP_NAME)
        lines, failure = progress.read(status, time.monotonic())
        for line in lines:
            say(line)
        if status is not None and status.status == "RUNNING":
            return
        if failure is not None:
            raise KVTideError(failure)
        overdue = watch.overdue(read_pending_groups(APP_NAME)) if layout.by_domain else []
        if overdue:
            domains = domain_states(read_ray_nodes(), read_free_gpus())
            if not _delete_app():
                say(f"app {APP_NAME!r} still stopping after {DELETE_TIMEOUT_S:g} s")
            raise not_placed_error(APP_NAME, overdue, layout, domains, watch.timeout_s)
        time.sleep(1.0)  # Serve's status, read once a second


def _start(app: Any, config: KVTideConfig) -> None:
    """Hand ``app`` to Serve and return without waiting for it (Serve's own
    ``_run``: its public ``serve.run`` waits without a bound)."""
    from ray.serve.api import _run

    _run(app, _blocking=False, name=APP_NAME, route_prefix=config.server.route_prefix)


def redeploy(config: KVTideConfig, layout: PoolLayout) -> None:
    """Deploy ``layout`` over the running app without waiting for it: deployments whose
    placement is unchanged keep their replicas (see ``build_app``); those it drops go
    (``_release_dropped``)."""
    from orchestrator.serve.app import build_app

    before = _serve_status().applications.get(APP_NAME)
    _start(build_app(config, layout), config)
    _release_dropped(before, layout)


def _release_dropped(before: Any, layout: PoolLayout) -> None:
    """Serve deletes the engine deployments of ``before`` (the app's status before a
    deploy) that ``layout`` drops: their replicas Ray never placed are stopped at once
    (``orchestrator.cluster.pending_replicas``, within ``DELETE_TIMEOUT_S``), their
    started ones drain on their own."""
    from orchestrator.cluster.pending_replicas import (
        kill_replica,
        read_pending_of,
        release_while_deleting,
    )
    from orchestrator.serve.ingress import Ingress

    kept = {Ingress.name, *(d.name for d in layout.deployments)}
    dropped = set() if before is None else set(before.deployments) - kept
    if not dropped:
        return

    def let_go() -> bool:  # every replica of theirs stopping, none pending
        app = _serve_status().applications.get(APP_NAME)
        states = [] if app is None else [app.deployments.get(name) for name in dropped]
        starting = any(
            state != "STOPPING" and count
            for status in states
            if status is not None
            for state, count in status.replica_states.items()
        )
        return not starting and not read_pending_of(APP_NAME, dropped)

    if not release_while_deleting(
        deleted=let_go,
        pending=lambda: read_pending_of(APP_NAME, dropped),
        kill=kill_replica,
        within_s=DELETE_TIMEOUT_S,
    ):
        log = logging.getLogger("kvtide")
        log.warning("%s still starting after %g s", sorted(dropped), DELETE_TIMEOUT_S)


def pool_supervisor(config: KVTideConfig, layout: PoolLayout) -> PoolSupervisor:
    """The supervisor of the running app's pools, on the live cluster (needs Ray)."""
    from orchestrator.cluster.supervisor import PoolSupervisor
    from orchestrator.cluster.topology import live_topology

    return PoolSupervisor(
        config,
        layout,
        deploy=lambda new: redeploy(config, new),
        read_topology=live_topology,
    )


def supervise(
    config: KVTideConfig,
    layout: PoolLayout,
    stop: threading.Event,
    *,
    say: Callable[[str], None] = _say,
) -> None:
    """Until ``stop``: every ``placement.supervise_interval_s``, re-place engines that
    lost their node (``PoolSupervisor``). Only waits when placement is off."""
    if not layout.by_domain:
        stop.wait()
        return
    supervisor = pool_supervisor(config, layout)
    while not stop.wait(config.placement.supervise_interval_s):
        try:
            result = supervisor.reconcile()
        except Exception as exc:  # Ray unreachable for a moment: try again next interval
            say(f"checking the pools' placement failed ({type(exc).__name__}: {exc}); retrying")
            continue
        if result.unplaceable:
            say(f"nodes lost {list(result.lost_node_ids)}; {result.unplaceable}")
        elif result.layout is not None:
            say("engines re-placed after lost nodes:\n" + result.layout.describe())


DELETE_TIMEOUT_S = 60.0
"""How long kvtide waits for Serve to delete its app (``shutdown``, a deploy whose engines
Ray did not place; ``serve.delete`` itself gives up after 60 s) or to stop the replicas of
the deployments a redeploy drops."""

STATUS_TIMEOUT_S = 10.0
"""The deadline of one read of Serve's status (a call to its controller)."""


def _serve_status() -> Any:
    """``serve.status()`` within ``STATUS_TIMEOUT_S``."""
    from ray import serve

    from orchestrator.cluster.deadlines import call_within

    return call_within(serve.status, STATUS_TIMEOUT_S, "Serve's status")


def _delete_app() -> bool:
    """Have Serve delete kvtide's app and wait for it, within ``DELETE_TIMEOUT_S``: its
    replicas Ray never placed are stopped at once (``orchestrator.cluster.pending_replicas``),
    its started ones drain. True once the app is gone."""
    from ray import serve

    from orchestrator.cluster.pending_replicas import (
        kill_replica,
        read_pending_of,
        release_while_deleting,
    )

    serve.delete(APP_NAME, _blocking=False)
    return release_while_deleting(
        deleted=lambda: APP_NAME not in _serve_status().applications,
        pending=lambda: read_pending_of(APP_NAME, None),
        kill=kill_replica,
        within_s=DELETE_TIMEOUT_S,
    )


def shutdown() -> None:
    """Delete kvtide's app (its engines stop gracefully, within ``DELETE_TIMEOUT_S``)
    and its KV service, then leave Ray; a Ray that kvtide started goes down with it.

    Serve itself is not shut down: on a joined cluster it may serve other apps, and on
    kvtide's own Ray it goes with Ray. (Killing Serve's controller first made Ray print
    its pending long-poll tasks as failed after the demo's table.)
    """
    import ray
    from ray.serve.exceptions import RayServeException

    from orchestrator.cluster.deadlines import CallTimedOut
    from orchestrator.kv.actor import lookup_app_host_stores, lookup_service

    if not ray.is_initialized():
        return  # stopped before Ray was up: nothing of kvtide's runs
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # not "Deleting app ..."
    try:
        try:
            _delete_app()
        except RayServeException:
            pass  # Serve never started: nothing was deployed
        except CallTimedOut as exc:  # Serve's controller not answering: leave it be
            logging.getLogger("kvtide").warning("deleting the app: %s", exc)
        # Detached, both: they outlive the app on a shared cluster.
        for actor in (lookup_service(APP_NAME), *lookup_app_host_stores(APP_NAME)):
            if actor is not None:
                ray.kill(actor)
    finally:
        _close_handles()
        ray.shutdown()


def _close_handles() -> None:
    """Stop the routers of the Serve handles this process made: each runs background
    tasks on a thread of its own (an autoscaled deployment's handle pushes its metrics
    every few seconds), and a Ray call from one after ``ray.shutdown`` starts a new
    local Ray in the default temp dir, which the next ``ray.init`` here then trips on."""
    from ray.serve import context as serve_context

    client = serve_context._global_client
    if client is None:
        return
    try:
        client.shutdown_cached_handles()
    except Exception as exc:  # Ray may be going down already: nothing left to stop
        logging.getLogger("kvtide").debug("closing Serve handles: %s", exc)
    serve_context._disconnect()


@contextmanager
def running(config: KVTideConfig, *, say: Callable[[str], None] = _say) -> Iterator[str]:
    """Start Ray, deploy ``config`` and yield the base URL; shut everything down after."""
    start_ray(config, say=say)
    try:
        deploy(config, say=say)
        yield f"http://{config.server.host}:{config.server.port}"
    finally:
        shutdown()
