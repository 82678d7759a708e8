"""kvtide's dashboards read a running kvtide through a real Prometheus.

Prometheus scrapes the shared app's ``GET /metrics`` every second while a session runs
three chat turns (the second and third pull the previous turn's KV back). Every query
of every dashboard is then accepted by Prometheus, and the panels those turns feed
(latency, throughput, KV held, sessions, send-backs, bytes moved) show them.
Panels of what did not happen here (refusals, failures, integrity mismatches) have no
series yet: tests/unit/test_dashboards.py runs every query against series of each.
Skipped without a ``prometheus`` binary on PATH.
"""

from __future__ import annotations

import contextlib
import math
import random
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from app_calls import chat
from polling import wait_for
from prometheus_server import as_promql, needs_prometheus, query, running_prometheus

from orchestrator.observability.dashboards import DASHBOARDS, queries_of

pytestmark = [pytest.mark.engine, needs_prometheus]

WINDOW = "2m"
# Panel queries the turns below must make non-empty and above zero.
FED = {
    "Time to first token",
    "Inter-token latency",
    "Finished requests by status",
    "Turns and streamed tokens",
    "Sessions tracked",
    "KV held for idle sessions, per engine",
    "KV held per engine",
    "Send-backs and recomputes",
    "Reuse ratio",
    "KV bytes moved per turn",
    "KV transfer rate",
}


def _values(result: list[dict[str, Any]]) -> list[float]:
    return [float(series["value"][1]) for series in result]


def _shown(values: list[float]) -> bool:
    return any(v > 0 and math.isfinite(v) for v in values)


def _turns_served(app: Any) -> float:
    """``kvtide_ttft_seconds_count`` as kvtide's ``GET /metrics`` has it now."""
    text = httpx.get(app.base_url + "/metrics", timeout=30).text
    return sum(float(n) for n in re.findall(r"^kvtide_ttft_seconds_count\{.*\} (\S+)$", text, re.M))


def test_the_dashboards_show_a_running_kvtides_turns(
    kvtide_app: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    target = kvtide_app.base_url.removeprefix("http://")
    with running_prometheus(target, tmp_path) as port:

        def scraped(num_turns: float) -> bool:
            """Prometheus has ``num_turns`` turns (kvtide's ``/metrics`` shows a turn up to a
            second after it ends, and three turns can run within one scrape interval: each
            turn waits for the one before to be scraped, so each is an increase)."""
            return sum(_values(query(port, "kvtide_ttft_seconds_count"))) == num_turns and bool(
                _values(query(port, 'up{job="kvtide"}'))
            )

        before = _turns_served(kvtide_app)
        wait_for(lambda: scraped(before), 60, "a first scrape")
        rng = random.Random(7)
        vocabulary = ("tide", "cache", "block", "pool", "lease")
        words = " ".join(rng.choice(vocabulary) for _ in range(600))
        messages = [{"role": "user", "content": words + "\nSummarise."}]
        session = f"dashboards-{rng.random()}"
        # Closed at the end, as a client that is done does: the tests after this one
        # share the decode engine's idle budget (kv.idle_budget_mib_per_engine).
        request.addfinalizer(
            lambda: httpx.delete(f"{kvtide_app.base_url}/kvtide/sessions/{session}", timeout=30)
        )
        for turn, question in enumerate(("Which pool?", "Which engine?", None), start=1):
            answer = chat(kvtide_app, messages, session, max_tokens=8)
            wait_for(lambda t=turn: scraped(before + t), 60, f"Prometheus to scrape turn {turn}")
            if question is None:
                assert answer["kvtide"]["kv_plan"] == "pull", answer["kvtide"]
                break
            messages += [
                {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                {"role": "user", "content": question},
            ]

        panels = [p for d in DASHBOARDS for p in d.panels if p.title in FED]
        assert {p.title for p in panels} == FED
        shown: dict[str, list[list[float]]] = {}

        def every_fed_panel_shows_the_turns() -> bool:
            for panel in panels:
                shown[panel.title] = [
                    _values(query(port, as_promql(q.expr, WINDOW))) for q in panel.queries
                ]
            return all(any(_shown(vs) for vs in shown[p.title]) for p in panels)

        with contextlib.suppress(AssertionError):  # the assertion below names what is missing
            wait_for(every_fed_panel_shows_the_turns, 60, "the turns on every panel they feed")
        missing = {t: vs for t, vs in shown.items() if not any(_shown(v) for v in vs)}
        assert not missing, f"panels without the turns: {missing}"
        # Every other query is valid PromQL over kvtide's series: query fails the test on
        # a query Prometheus refuses, with Prometheus's reason.
        for dashboard in DASHBOARDS:
            for expr in queries_of(dashboard):
                query(port, as_promql(expr, WINDOW))
