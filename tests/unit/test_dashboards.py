"""kvtide's Grafana dashboards query only metrics kvtide exports, and Prometheus answers
every query.

Metric names are read out of each PromQL ``expr`` (strings, label matchers, ranges and
``by (...)``-style groupings removed; what is left is identifiers, and those not called
as functions or aggregations are metric names) and checked against ``METRICS``, the one
declaration of kvtide's metrics. The last test runs the queries in a real Prometheus
(the ``prometheus`` binary on PATH: ``apt-get install prometheus``) scraping kvtide's own
exposition format; it is skipped where the binary is missing.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from polling import wait_for
from prometheus_server import as_promql, needs_prometheus, query, running_prometheus

from orchestrator.cli.main import main
from orchestrator.cluster.ports import free_port
from orchestrator.observability.dashboards import (
    DASHBOARDS,
    SOURCES,
    queries_of,
)
from orchestrator.observability.metrics import METRICS, Metrics, render_prometheus

DECLARED = {spec.name: spec.kind for spec in METRICS}

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w.$])([A-Za-z_:][\w:]*)\b(?!\s*\()")
_KEYWORDS = {"offset", "bool", "and", "or", "unless", "group_left", "group_right"}
_LABEL_VALUES = re.compile(r"label_values\((\w+), *(\w+)\)")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or Grafana ``label_values``) reads."""
    variable = _LABEL_VALUES.fullmatch(expr)
    if variable:
        return {variable.group(1)}
    bare = _GROUPING.sub(" ", _RANGES.sub(" ", _MATCHERS.sub(" ", _STRINGS.sub(" ", expr))))
    return {name for name in _IDENT.findall(bare) if name not in _KEYWORDS}


def declared_name(name: str) -> str | None:
    """The ``METRICS`` name a queried series name belongs to (Ray's prefix and a
    histogram's ``_bucket``/``_sum``/``_count`` removed), or None."""
    name = name.removeprefix("ray_")
    if name in DECLARED and DECLARED[name] != "histogram":
        return name
    base, _, suffix = name.rpartition("_")
    if suffix in ("bucket", "sum", "count") and DECLARED.get(base) == "histogram":
        return base
    return None


def test_the_parser_finds_each_metric_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (pool, le) (rate(kvtide_ttft_seconds_bucket{pool=~"$pool"}'
        "[$__rate_interval]))) / ignoring(pool) group_left sum(kvtide_queue_depth offset 5m)"
    )
    assert metric_names(expr) == {"kvtide_ttft_seconds_bucket", "kvtide_queue_depth"}
    # A misspelled name is read as a name, and is not one kvtide declares.
    assert metric_names("sum(rate(kvtide_ttft_second_bucket[5m]))") == {"kvtide_ttft_second_bucket"}
    assert declared_name("kvtide_ttft_second_bucket") is None
    assert declared_name("kvtide_requests_total_count") is None  # a counter has no _count
    assert declared_name("ray_kvtide_itl_seconds_sum") == "kvtide_itl_seconds"


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dashboard", DASHBOARDS, ids=lambda d: d.uid)
def test_every_queried_metric_is_one_kvtide_exports(dashboard: Any, source: Any) -> None:
    for expr in queries_of(dashboard, source):
        names = metric_names(expr)
        assert names, expr
        for name in names:
            assert name.startswith("ray_") == (source == "ray"), (name, source)
            assert declared_name(name), f"{dashboard.uid}: {name} is not a kvtide metric: {expr}"


def test_every_declared_metric_has_a_panel() -> None:
    queried = {
        declared_name(name)
        for dashboard in DASHBOARDS
        for expr in queries_of(dashboard)
        for name in metric_names(expr)
    }
    assert queried == set(DECLARED)


def test_the_cli_writes_valid_grafana_dashboards(tmp_path: Path, capsys: Any) -> None:
    assert main(["dashboards", "export", str(tmp_path / "boards")]) == 0
    files = sorted((tmp_path / "boards").iterdir())
    assert [f.name for f in files] == [
        "kvtide-autoscaler.json",
        "kvtide-kv-lifecycle.json",
        "kvtide-serving.json",
    ]
    assert capsys.readouterr().out.count("wrote ") == 3
    for path in files:
        board = json.loads(path.read_text())
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), path.name
        [datasource] = [v for v in board["templating"]["list"] if v["name"] == "datasource"]
        assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")
        graphs = [p for p in board["panels"] if p["type"] != "row"]
        assert graphs and all(p["type"] == "timeseries" for p in graphs)
        for panel in graphs:
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["expr"] and target["datasource"]["uid"] == "${datasource}"
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs))
        # Every variable a query uses is defined (Grafana's own are $__...).
        defined = {v["name"] for v in board["templating"]["list"]}
        used = {
            name
            for panel in graphs
            for target in panel["targets"]
            for name in re.findall(r"\$(\w+)", target["expr"])
            if not name.startswith("__")
        }
        assert used <= defined, (path.name, used - defined)
    assert main(["dashboards", "export", str(tmp_path / "ray"), "--source", "ray"]) == 0
    ray_board = json.loads((tmp_path / "ray" / "kvtide-serving.json").read_text())
    assert "ray_kvtide_ttft_seconds_bucket" in ray_board["panels"][1]["targets"][0]["expr"]


# ---- a real Prometheus ----------------------------------------------------------------


def _one_tick(m: Metrics) -> None:
    """Traffic of one scrape interval, touching every series the dashboards read."""
    for status in ("ok", "ok", "client_error", "server_error", "cancelled"):
        m.request_started()
        m.request_finished(status)
    m.request_started()  # one stays in flight
    m.observe_ttft("decode", 0.2)
    m.observe_itl("decode", 0.02)
    m.inc("kvtide_admission_refusals_total", pool="prefill")
    m.inc("kvtide_kv_send_backs_total", 3)
    m.inc("kvtide_kv_recomputes_total")
    m.inc("kvtide_kv_transfer_failures_total")
    m.inc("kvtide_kv_expiries_total")
    m.inc("kvtide_turn_handover_failures_total")
    for direction in ("prefill_to_decode", "decode_to_prefill"):
        m.add_transfer_bytes(direction, 1 << 20)
        m.add_offered_bytes(direction, 4 << 20)
    for outcome in ("match", "mismatch", "skipped"):
        m.inc("kvtide_kv_integrity_checks_total", outcome=outcome)
    for outcome in ("started", "continued", "unmatched"):
        m.inc("kvtide_conversation_turns_total", outcome=outcome)
    for event in ("stored", "removed", "unchained"):
        m.inc("kvtide_prefix_kv_events_total", event=event)
    for outcome in ("used", "refused"):
        m.inc("kvtide_turn_leases_total", outcome=outcome)
    m.set_bytes_held("decode-0", 1 << 22)
    m.set_sessions_live(4)
    m.set_engines_by_decode_path({"decode": {"stock": 1}, "prefill": {"stock": 1}})
    for pool in ("prefill", "decode"):
        m.set_gauge("kvtide_autoscale_desired_replicas", 2, pool=pool)
        m.set_gauge("kvtide_autoscale_replicas", 1, pool=pool)
        m.set_gauge("kvtide_autoscale_driving_signal", 1, pool=pool, signal="running_seqs")
        m.set_gauge("kvtide_autoscale_driving_signal", 0, pool=pool, signal="idle")
        m.inc("kvtide_autoscale_decisions_total", pool=pool, action="up")


@pytest.fixture
def kvtide_exporter() -> Iterator[int]:
    """An HTTP endpoint serving kvtide's ``render_prometheus`` of a book that grows by
    one tick of traffic per scrape (so every rate is above zero)."""
    book = Metrics()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            _one_tick(book)
            body = render_prometheus(book.snapshot()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@needs_prometheus
def test_prometheus_answers_every_panel_from_kvtides_exposition(
    kvtide_exporter: int, tmp_path: Path
) -> None:
    exprs = {
        expr: as_promql(expr, "10s") for dashboard in DASHBOARDS for expr in queries_of(dashboard)
    }
    answers: dict[str, list[dict[str, Any]]] = {}

    def every_query_answers() -> bool:
        answers.update({expr: query(port, promql) for expr, promql in exprs.items()})
        return all(answers.values())

    with running_prometheus(f"127.0.0.1:{kvtide_exporter}", tmp_path) as port:
        # Every rate needs two scrapes in its window (1 s apart).
        with contextlib.suppress(AssertionError):  # the assertion below names what is empty
            wait_for(every_query_answers, 60, "every dashboard query to return data")
    empty = [expr for expr in exprs if not answers.get(expr)]
    assert not empty, f"no data for: {empty}"
    for expr, result in answers.items():
        for series in result:
            assert math.isfinite(float(series["value"][1])), (expr, series)


def test_the_docs_list_every_panel_with_its_query() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text()
    section = docs.split("\n## Dashboards\n", 1)[1]
    for dashboard in DASHBOARDS:
        assert f"`{dashboard.file_name}`" in section
        for row in dashboard.rows:
            for panel in row.panels:
                assert f"| {row.title} | {panel.title} | " in section, panel.title
                for q in panel.queries:
                    assert f"`{q.expr}`" in section, q.expr
