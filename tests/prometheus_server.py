"""A real Prometheus for tests: started on a temporary config scraping one target, asked
through its query API. Tests that use it skip where no ``prometheus`` binary is on PATH
(``apt-get install prometheus``; docs/observability.md#dashboards)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
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
            yield port
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        if proc.returncode not in (0, -15):
            pytest.fail(f"prometheus exited {proc.returncode}: {log_path.read_text()}")


def as_promql(expr: str, window: str) -> str:
    """A dashboard query as Grafana sends it: variables filled in (all pools), Grafana's
    ``label_values`` as the PromQL it runs."""
    variable = _LABEL_VALUES.fullmatch(expr)
    if variable:
        return f"count by ({variable.group(2)}) ({variable.group(1)})"
    return expr.replace("$__rate_interval", window).replace("$pool", ".*")


def query(port: int, expr: str) -> list[dict[str, Any]] | None:
    """The instant vector ``expr`` gives now; None while Prometheus is not listening.
    A query Prometheus refuses fails the test, with Prometheus's reason."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            answer = json.load(response)
    except urllib.error.HTTPError as exc:
        pytest.fail(f"{expr}: {exc.code} {exc.read().decode()}")
    except OSError:
        return None
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result
