"""A real Prometheus for tests: started on a temporary config scraping one target, asked
through its query API. Tests that use it skip where no ``prometheus`` binary is on PATH
(``apt-get install prometheus``; docs/observability.md#dashboards)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cluster.ports import free_port

needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="no prometheus binary on PATH (apt-get install prometheus; see "
    "docs/observability.md#dashboards)",
)

READY_TIMEOUT_S = 60.0
_LABEL_VALUES = re.compile(r"label_values\((\w+), *(\w+)\)")


@contextlib.contextmanager
def running_prometheus(target: str, tmp_path: Path) -> Iterator[int]:
    """Prometheus scraping ``target`` (host:port, path /metrics) every second; yields the
    port of its API and stops it after."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: kvtide\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n"
    )
    log_path = tmp_path / "prometheus.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_ready(proc, port, log_path)
            yield port
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        if proc.returncode not in (0, -15):
            pytest.fail(f"prometheus exited {proc.returncode}: {log_path.read_text()}")


def _wait_ready(proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
    """Until Prometheus says it is ready: before that its query API answers 503 (the
    TSDB is still opening), which a query would take as a refusal."""
    url = f"http://127.0.0.1:{port}/-/ready"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited {proc.returncode}: {log_path.read_text()}")
        with contextlib.suppress(OSError):  # HTTPError (503 while starting) is an OSError
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            pytest.fail(f"prometheus not ready after {READY_TIMEOUT_S}s: {log_path.read_text()}")
        time.sleep(0.2)


def as_promql(expr: str, window: str) -> str:
    """A dashboard query as Grafana sends it: variables filled in (all pools), Grafana's
    ``label_values`` as the PromQL it runs."""
    variable = _LABEL_VALUES.fullmatch(expr)
    if variable:
        return f"count by ({variable.group(2)}) ({variable.group(1)})"
    return expr.replace("$__rate_interval", window).replace("$pool", ".*")


def query(port: int, expr: str) -> list[dict[str, Any]]:
    """The instant vector ``expr`` gives now (Prometheus is ready: running_prometheus waits
    for it). A query Prometheus refuses fails the test, with Prometheus's reason."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            answer = json.load(response)
    except urllib.error.HTTPError as exc:
        pytest.fail(f"{expr}: {exc.code} {exc.read().decode()}")
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result
