"""Starting or joining Ray and deploying the Serve app, with progress for long waits."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from orchestrator.config import KVTideConfig

__all__ = ["APP_NAME", "deploy", "shutdown", "start_ray"]

APP_NAME = "kvtide"


def _say(msg: str) -> None:
    print(f"[kvtide] {msg}", file=sys.stderr, flush=True)


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
    ray.init(
        num_cpus=config.ray.num_cpus or 8,
        _temp_dir=temp_dir,
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=bool(os.environ.get("KVTIDE_ENGINE_LOGS")),
    )


def _progress(stop: threading.Event, say: Callable[[str], None], every_s: float) -> None:
    from ray import serve

    t0 = time.monotonic()
    while not stop.wait(every_s):
        try:
            app = serve.status().applications.get(APP_NAME)
        except Exception:
            continue
        if app is None:
            continue
        parts = []
        for name, dep in app.deployments.items():
            running = dep.replica_states.get("RUNNING", 0)
            total = sum(dep.replica_states.values())
            parts.append(f"{name} {running}/{total}")
        say(f"starting engines ({time.monotonic() - t0:.0f}s): " + ", ".join(parts))


def deploy(config: KVTideConfig, *, say: Callable[[str], None] = _say) -> None:
    """Deploy the app and block until every engine is up (engine start is 20-90 s on CPU)."""
    from ray import serve

    from orchestrator.serve.app import build_app

    if config.model.is_generated:
        say(f"generating the tiny model in {config.model.resolved_path()}")
    app = build_app(config)
    serve.start(http_options={"host": config.server.host, "port": config.server.port})
    stop = threading.Event()
    ticker = threading.Thread(target=_progress, args=(stop, say, 10.0), daemon=True)
    ticker.start()
    try:
        serve.run(app, name=APP_NAME, route_prefix=config.server.route_prefix)
    finally:
        stop.set()
    say(f"serving {config.model.name!r} at http://{config.server.host}:{config.server.port}/v1")


def shutdown() -> None:
    import ray
    from ray import serve

    from orchestrator.kv_service_actor import lookup_service

    try:
        serve.shutdown()
        service = lookup_service(APP_NAME)  # detached: outlives the app on a shared cluster
        if service is not None:
            ray.kill(service)
    finally:
        ray.shutdown()


@contextmanager
def running(config: KVTideConfig, *, say: Callable[[str], None] = _say) -> Iterator[str]:
    """Start Ray, deploy ``config`` and yield the base URL; shut everything down after."""
    start_ray(config, say=say)
    try:
        deploy(config, say=say)
        yield f"http://{config.server.host}:{config.server.port}"
    finally:
        shutdown()
