"""kvtide's Grafana dashboards, generated from code: ``kvtide dashboards export DIR``.

Three dashboards (serving, the KV lifecycle, the autoscaler), each a tuple of rows of
panels (small frozen values); ``dashboard_json`` turns one into Grafana's dashboard model
(schema 39: ``timeseries`` panels with Prometheus targets, a ``${datasource}`` variable
of type Prometheus, a ``$pool`` variable). Every query reads only metrics declared in
``metrics.METRICS`` (tests/unit/test_dashboards.py parses each ``expr`` and checks), and
docs/observability.md lists every panel with its query.

``source`` picks the names the queries use: ``kvtide`` for kvtide's own ``GET /metrics``
(one endpoint that already sums every replica), ``ray`` for Ray's per-node endpoints
(``ray_`` prefix, one series per worker; ``for_source`` renames). Every query
aggregates (``sum by``), so the same query reads either.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "DASHBOARDS",
    "POOL_VARIABLE_QUERY",
    "SOURCES",
    "Dashboard",
    "Panel",
    "Query",
    "Row",
    "dashboard_json",
    "export_dashboards",
    "for_source",
    "queries_of",
]

Source = Literal["kvtide", "ray"]
SOURCES: tuple[Source, ...] = ("kvtide", "ray")

RATE = "$__rate_interval"
"""Grafana's rate window: at least four scrape intervals."""

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Query:
    """One PromQL target. ``expr`` names metrics as ``kvtide_...``: ```` becomes the
    source's prefix (empty, or ``ray_``)."""

    expr: str
    legend: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"  # Grafana's unit id: s, Bps, bytes, reqps, percentunit, short
    stack: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]

    @property
    def file_name(self) -> str:
        return f"{self.uid}.json"

    @property
    def panels(self) -> tuple[Panel, ...]:
        return tuple(p for row in self.rows for p in row.panels)

    @property
    def by_pool(self) -> bool:
        """Whether a query filters by the ``$pool`` variable (the dashboard has it)."""
        return any("$pool" in q.expr for p in self.panels for q in p.queries)


POOL = 'pool=~"$pool"'
POOL_VARIABLE_QUERY = "label_values(kvtide_ttft_seconds_count, pool)"
"""The ``$pool`` variable's choices: the decode pools that reported a first token."""


def _quantiles(metric: str, what: str) -> tuple[Query, ...]:
    return tuple(
        Query(
            expr=f"histogram_quantile({q}, sum by (pool, le) "
            f"(rate({metric}_bucket{{{POOL}}}[{RATE}])))",
            legend=f"{{{{pool}}}} p{round(q * 100)} {what}",
        )
        for q in (0.5, 0.95, 0.99)
    )


SERVING = Dashboard(
    uid="kvtide-serving",
    title="kvtide: serving",
    description="Latency, throughput, queue, KV use, admission and errors, per pool.",
    rows=(
        Row(
            title="Latency",
            panels=(
                Panel(
                    title="Time to first token",
                    description="From the router's start of a turn to its first token, "
                    "by decode pool (kvtide_ttft_seconds).",
                    queries=_quantiles("kvtide_ttft_seconds", "TTFT"),
                    unit="s",
                ),
                Panel(
                    title="Inter-token latency",
                    description="Time between streamed tokens, by decode pool "
                    "(kvtide_itl_seconds).",
                    queries=_quantiles("kvtide_itl_seconds", "ITL"),
                    unit="s",
                ),
            ),
        ),
        Row(
            title="Throughput and queue",
            panels=(
                Panel(
                    title="Finished requests by status",
                    description="Requests per second leaving the ingress: ok, "
                    "client_error (4xx), server_error (5xx), cancelled.",
                    queries=(
                        Query(
                            expr=f"sum by (status) (rate(kvtide_requests_total[{RATE}]))",
                            legend="{{status}}",
                        ),
                    ),
                    unit="reqps",
                    stack=True,
                ),
                Panel(
                    title="Turns and streamed tokens",
                    description="Turns that reached a first token, and tokens streamed "
                    "after it (one ITL sample each), per second by decode pool.",
                    queries=(
                        Query(
                            expr="sum by (pool) "
                            f"(rate(kvtide_ttft_seconds_count{{{POOL}}}[{RATE}]))",
                            legend="{{pool}} turns/s",
                        ),
                        Query(
                            expr="sum by (pool) "
                            f"(rate(kvtide_itl_seconds_count{{{POOL}}}[{RATE}]))",
                            legend="{{pool}} tokens/s",
                        ),
                    ),
                ),
                Panel(
                    title="Requests in flight",
                    description="Requests in flight at the ingress, summed over replicas "
                    "(kvtide_queue_depth).",
                    queries=(Query(expr="sum(kvtide_queue_depth)", legend="in flight"),),
                ),
            ),
        ),
        Row(
            title="KV use and engines",
            panels=(
                Panel(
                    title="KV held for idle sessions, per engine",
                    description="KV bytes each decode engine keeps for sessions between "
                    "turns (kvtide_kv_bytes_held).",
                    queries=(
                        Query(expr="sum by (engine) (kvtide_kv_bytes_held)", legend="{{engine}}"),
                    ),
                    unit="bytes",
                    stack=True,
                ),
                Panel(
                    title="Live engines by decode path",
                    description="Engines of each pool answering heartbeats, by the decode "
                    "path they run (stock, or a specialised path kernels.gate allowed).",
                    queries=(
                        Query(
                            expr=f"sum by (pool, path) (kvtide_engines_by_decode_path{{{POOL}}})",
                            legend="{{pool}} {{path}}",
                        ),
                    ),
                ),
            ),
        ),
        Row(
            title="Admission and errors",
            panels=(
                Panel(
                    title="Admission refusals",
                    description="Turns refused at once (503 overloaded) by the pool that "
                    "could not take them.",
                    queries=(
                        Query(
                            expr=f"sum by (pool) (rate(kvtide_admission_refusals_total[{RATE}]))",
                            legend="{{pool}}",
                        ),
                    ),
                    unit="reqps",
                ),
                Panel(
                    title="Error ratio",
                    description="Share of finished requests that were server errors (5xx) "
                    "and client errors (4xx).",
                    queries=tuple(
                        Query(
                            expr=f'sum(rate(kvtide_requests_total{{status="{status}"}}'
                            f"[{RATE}])) / sum(rate(kvtide_requests_total[{RATE}]))",
                            legend=status,
                        )
                        for status in ("server_error", "client_error")
                    ),
                    unit="percentunit",
                ),
                Panel(
                    title="Unnamed-session turns",
                    description="Requests without x-session-id matched to an unnamed "
                    "session (started, continued) or not (unmatched).",
                    queries=(
                        Query(
                            expr="sum by (outcome) "
                            f"(rate(kvtide_conversation_turns_total[{RATE}]))",
                            legend="{{outcome}}",
                        ),
                    ),
                    unit="reqps",
                ),
                Panel(
                    title="Prefix router's KV events",
                    description="Prefill engine blocks the prefix router heard of: stored, "
                    "removed, unchained.",
                    queries=(
                        Query(
                            expr=f"sum by (event) (rate(kvtide_prefix_kv_events_total[{RATE}]))",
                            legend="{{event}}",
                        ),
                    ),
                ),
            ),
        ),
    ),
)

_TURNS = (
    f"(sum(rate(kvtide_kv_send_backs_total[{RATE}])) "
    f"+ sum(rate(kvtide_kv_recomputes_total[{RATE}])))"
)
"""Turns through a prefill engine per second: each is a send-back or a recompute."""
_PER_TURN = f"/ ignoring(direction) group_left() {_TURNS}"
"""Divides a ``direction`` series by the (label-less) turns."""

KV_LIFECYCLE = Dashboard(
    uid="kvtide-kv-lifecycle",
    title="kvtide: KV lifecycle",
    description="Sessions' KV: kept, leased, expired, sent back or recomputed, moved, checked.",
    rows=(
        Row(
            title="Kept and leased",
            panels=(
                Panel(
                    title="Sessions tracked",
                    description="Sessions whose KV the KV lifecycle service tracks "
                    "(kvtide_sessions_live).",
                    queries=(Query(expr="sum(kvtide_sessions_live)", legend="sessions"),),
                ),
                Panel(
                    title="KV held per engine",
                    description="KV bytes each decode engine keeps for idle sessions.",
                    queries=(
                        Query(expr="sum by (engine) (kvtide_kv_bytes_held)", legend="{{engine}}"),
                        Query(expr="sum(kvtide_kv_bytes_held)", legend="all engines"),
                    ),
                    unit="bytes",
                ),
                Panel(
                    title="Turn leases",
                    description="Session turns claimed under an ingress replica's turn "
                    "lease (used) or whose lease was refused and that ran through the "
                    "service (refused).",
                    queries=(
                        Query(
                            expr=f"sum by (outcome) (rate(kvtide_turn_leases_total[{RATE}]))",
                            legend="{{outcome}}",
                        ),
                    ),
                    unit="reqps",
                ),
            ),
        ),
        Row(
            title="Reused or recomputed",
            panels=(
                Panel(
                    title="Send-backs and recomputes",
                    description="Turns that pulled the previous turn's KV back, turns that "
                    "recomputed their prompt, pulls that failed (then recomputed), and turns "
                    "extended on the decode engine holding their KV (nothing moved).",
                    queries=(
                        Query(
                            expr=f"sum(rate(kvtide_kv_send_backs_total[{RATE}]))",
                            legend="sent back",
                        ),
                        Query(
                            expr=f"sum(rate(kvtide_kv_extends_total[{RATE}]))",
                            legend="extended",
                        ),
                        Query(
                            expr=f"sum(rate(kvtide_kv_recomputes_total[{RATE}]))",
                            legend="recomputed",
                        ),
                        Query(
                            expr=f"sum(rate(kvtide_kv_transfer_failures_total[{RATE}]))",
                            legend="pull failed",
                        ),
                    ),
                    unit="reqps",
                ),
                Panel(
                    title="Reuse ratio",
                    description="Share of turns whose prompt KV was pulled back.",
                    queries=(
                        Query(
                            expr=f"sum(rate(kvtide_kv_send_backs_total[{RATE}])) / {_TURNS}",
                            legend="sent back / turns",
                        ),
                    ),
                    unit="percentunit",
                ),
                Panel(
                    title="Expiries and lost hand-overs",
                    description="Kept KV that expired (TTL) unused, and finished turns "
                    "whose hand-over to the KV service failed, per interval.",
                    queries=(
                        Query(
                            expr=f"sum(increase(kvtide_kv_expiries_total[{RATE}]))",
                            legend="expired",
                        ),
                        Query(
                            expr=f"sum(increase(kvtide_turn_handover_failures_total[{RATE}]))",
                            legend="hand-over failed",
                        ),
                    ),
                ),
            ),
        ),
        Row(
            title="Bytes moved",
            panels=(
                Panel(
                    title="KV bytes moved per turn",
                    description="NIXL bytes the reading engines measured, by direction, "
                    "per turn through prefill; offered bytes for comparison.",
                    queries=(
                        Query(
                            expr="sum by (direction) "
                            f"(rate(kvtide_kv_transfer_bytes_total[{RATE}])) {_PER_TURN}",
                            legend="{{direction}} moved",
                        ),
                        Query(
                            expr="sum by (direction) "
                            f"(rate(kvtide_kv_transfer_offered_bytes_total[{RATE}])) "
                            f"{_PER_TURN}",
                            legend="{{direction}} offered",
                        ),
                    ),
                    unit="bytes",
                ),
                Panel(
                    title="KV transfer rate",
                    description="NIXL bytes moved per second, by direction.",
                    queries=(
                        Query(
                            expr="sum by (direction) "
                            f"(rate(kvtide_kv_transfer_bytes_total[{RATE}]))",
                            legend="{{direction}}",
                        ),
                    ),
                    unit="Bps",
                ),
            ),
        ),
        Row(
            title="Integrity",
            panels=(
                Panel(
                    title="Integrity checks by outcome",
                    description="Sampled pulled-back turns checked against a recompute: "
                    "match, mismatch, skipped.",
                    queries=(
                        Query(
                            expr="sum by (outcome) "
                            f"(rate(kvtide_kv_integrity_checks_total[{RATE}]))",
                            legend="{{outcome}}",
                        ),
                    ),
                    stack=True,
                ),
                Panel(
                    title="Engine pairs turned off",
                    description="Integrity mismatches: each turns KV reuse off for the "
                    "pull's engine pair (`kvtide integrity list` names them).",
                    queries=(
                        Query(
                            expr="sum(increase(kvtide_kv_integrity_checks_total"
                            f'{{outcome="mismatch"}}[{RATE}]))',
                            legend="mismatches",
                        ),
                    ),
                ),
            ),
        ),
    ),
)

AUTOSCALER = Dashboard(
    uid="kvtide-autoscaler",
    title="kvtide: autoscaler",
    description="The pools' engines, desired and running, and the signal that drove each "
    "decision (docs/autoscaling.md).",
    rows=(
        Row(
            title="Replicas",
            panels=(
                Panel(
                    title="Engines desired and running",
                    description="What the policy last asked Serve for, and the engines "
                    "running then, per pool.",
                    queries=(
                        Query(
                            expr="sum by (pool) (kvtide_autoscale_desired_replicas)",
                            legend="{{pool}} desired",
                        ),
                        Query(
                            expr="sum by (pool) (kvtide_autoscale_replicas)",
                            legend="{{pool}} running",
                        ),
                    ),
                ),
                Panel(
                    title="Scaling events",
                    description="Decisions that changed a pool's size, by pool and direction.",
                    queries=(
                        Query(
                            expr="sum by (pool, action) "
                            f"(increase(kvtide_autoscale_decisions_total[{RATE}]))",
                            legend="{{pool}} {{action}}",
                        ),
                    ),
                    stack=True,
                ),
            ),
        ),
        Row(
            title="Signals",
            panels=(
                Panel(
                    title="Driving signal",
                    description="The signal that asked for the most engines at each "
                    "pool's last decision (1 while it drives).",
                    queries=(
                        Query(
                            expr="max by (pool, signal) (kvtide_autoscale_driving_signal) > 0",
                            legend="{{pool}} {{signal}}",
                        ),
                    ),
                ),
                Panel(
                    title="KV held for paused sessions",
                    description="KV bytes engines hold for sessions between turns: "
                    "decode demand the policy will not scale in under.",
                    queries=(Query(expr="sum(kvtide_kv_bytes_held)", legend="held"),),
                    unit="bytes",
                ),
            ),
        ),
    ),
)

DASHBOARDS: tuple[Dashboard, ...] = (SERVING, KV_LIFECYCLE, AUTOSCALER)


def for_source(expr: str, source: Source) -> str:
    """``expr`` as it reads ``source``: kvtide's own names, or Ray's (``ray_kvtide_...``)."""
    if source not in SOURCES:
        raise ValueError(f"unknown metrics source {source!r}; one of {SOURCES}")
    return _METRIC_NAME.sub("ray_kvtide_", expr) if source == "ray" else expr


_METRIC_NAME = re.compile(r"(?<![\w])kvtide_")


def queries_of(dashboard: Dashboard, source: Source = "kvtide") -> list[str]:
    """Every PromQL expression ``dashboard`` sends: its panels' targets and its
    ``$pool`` variable's query, if it has one."""
    exprs = [q.expr for panel in dashboard.panels for q in panel.queries]
    if dashboard.by_pool:
        exprs.append(POOL_VARIABLE_QUERY)
    return [for_source(e, source) for e in exprs]


_WIDTH = 24  # Grafana's grid is 24 columns wide


def _panel_json(
    panel: Panel, panel_id: int, x: int, y: int, w: int, source: Source
) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": w, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {
                "unit": panel.unit,
                "custom": {"stacking": {"mode": "normal" if panel.stack else "none"}},
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": for_source(q.expr, source),
                "legendFormat": q.legend,
                "range": True,
            }
            for i, q in enumerate(panel.queries)
        ],
    }


def dashboard_json(dashboard: Dashboard, source: Source = "kvtide") -> dict[str, Any]:
    """Grafana's dashboard model for ``dashboard``: one collapsible row per ``Row``, its
    panels side by side (ids unique, from 1, in reading order)."""
    panels: list[dict[str, Any]] = []
    y = 0
    for row in dashboard.rows:
        panels.append(
            {
                "id": len(panels) + 1,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": _WIDTH, "x": 0, "y": y},
                "panels": [],
            }
        )
        y += 1
        w = _WIDTH // len(row.panels)
        for i, panel in enumerate(row.panels):
            panels.append(_panel_json(panel, len(panels) + 1, i * w, y, w, source))
        y += 8
    return {
        "uid": dashboard.uid if source == "kvtide" else f"{dashboard.uid}-ray",
        "title": dashboard.title if source == "kvtide" else f"{dashboard.title} (Ray)",
        "description": dashboard.description,
        "tags": ["kvtide"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "templating": {"list": _variables(dashboard, source)},
        "panels": panels,
    }


def _variables(dashboard: Dashboard, source: Source) -> list[dict[str, Any]]:
    """``$datasource`` (a Prometheus), and ``$pool`` where a query filters by it."""
    variables: list[dict[str, Any]] = [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
        }
    ]
    if dashboard.by_pool:
        pools = for_source(POOL_VARIABLE_QUERY, source)
        variables.append(
            {
                "name": "pool",
                "label": "Pool",
                "type": "query",
                "datasource": DATASOURCE,
                "definition": pools,
                "query": {"query": pools, "refId": "pool"},
                "includeAll": True,
                "allValue": ".*",
                "multi": True,
                "current": {"text": "All", "value": "$__all"},
                "refresh": 2,
                "hide": 0,
            }
        )
    return variables


def export_dashboards(directory: str | Path, source: Source = "kvtide") -> list[Path]:
    """Write every dashboard as ``<uid>.json`` under ``directory`` (made if missing)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for dashboard in DASHBOARDS:
        path = out / dashboard.file_name
        path.write_text(json.dumps(dashboard_json(dashboard, source), indent=2) + "\n")
        written.append(path)
    return written
