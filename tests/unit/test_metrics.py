"""kvtide's metrics: the facade's local book counts exactly; Ray exports the same names.

The unit tests use the local-only facade (no Ray). The ``ray``-marked test starts a
one-CPU local Ray with a Prometheus export port and scrapes it: ~20 s.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from fresh_python import printed_by_fresh_python

from orchestrator.cluster.ports import free_port
from orchestrator.config import parse_config
from orchestrator.kv.service import merge_counters
from orchestrator.observability.metrics import (
    ITL_BUCKETS_S,
    METRICS,
    REQUEST_STATUSES,
    TTFT_BUCKETS_S,
    Metrics,
    http_status,
    make_metrics,
    render_prometheus,
)

REPO = Path(__file__).resolve().parents[2]


def test_a_few_turns_are_counted_exactly() -> None:
    m = Metrics()
    assert not m.exports_to_ray
    # Three requests arrive: the queue is 3 deep.
    for _ in range(3):
        m.request_started()
    assert m.snapshot()["kvtide_queue_depth"] == 3
    # Turn 1 recomputes; turns 2 and 3 pull the previous turn's KV back (4 blocks each).
    m.inc("kvtide_kv_recomputes_total")
    m.inc("kvtide_kv_send_backs_total", 2)
    m.add_transfer_bytes("decode_to_prefill", 2 * 4 * 16 * 4096)
    m.add_transfer_bytes("prefill_to_decode", 5 * 16 * 4096)
    m.add_transfer_bytes("prefill_to_decode", 0)  # nothing moved: no record
    m.observe_ttft("decode", 0.25)
    m.observe_ttft("decode", 0.05)
    for gap_s in (0.01, 0.02, 0.03):
        m.observe_itl("decode", gap_s)
    m.set_bytes_held("decode-0", 1_048_576)
    m.set_bytes_held("decode-0", 524_288)  # a gauge keeps the last value
    m.set_sessions_live(2)
    # Two finish, one client leaves mid-stream.
    m.request_finished("ok")
    m.request_finished(http_status(200))
    m.request_finished("cancelled")

    snap = m.snapshot()
    buckets = {k: snap.pop(k) for k in list(snap) if "_bucket{" in k}
    # Cumulative, as Prometheus reads them: 0.05 <= 0.05 < 0.1 < 0.25 <= 0.25.
    assert buckets['kvtide_ttft_seconds_bucket{pool="decode",le="0.025"}'] == 0
    assert buckets['kvtide_ttft_seconds_bucket{pool="decode",le="0.05"}'] == 1
    assert buckets['kvtide_ttft_seconds_bucket{pool="decode",le="0.1"}'] == 1
    assert buckets['kvtide_ttft_seconds_bucket{pool="decode",le="0.25"}'] == 2
    assert buckets['kvtide_ttft_seconds_bucket{pool="decode",le="+Inf"}'] == 2
    assert buckets['kvtide_itl_seconds_bucket{pool="decode",le="0.02"}'] == 2
    assert len(buckets) == len(TTFT_BUCKETS_S) + len(ITL_BUCKETS_S) + 2
    assert snap == {
        "kvtide_queue_depth": 0.0,
        "kvtide_sessions_live": 2.0,
        "kvtide_kv_expiries_total": 0.0,
        "kvtide_kv_recomputes_total": 1.0,
        "kvtide_kv_send_backs_total": 2.0,
        "kvtide_kv_extends_total": 0.0,
        "kvtide_kv_transfer_failures_total": 0.0,
        "kvtide_turn_handover_failures_total": 0.0,
        'kvtide_kv_transfer_bytes_total{direction="decode_to_prefill"}': 524_288.0,
        'kvtide_kv_transfer_bytes_total{direction="prefill_to_decode"}': 327_680.0,
        'kvtide_ttft_seconds_count{pool="decode"}': 2.0,
        'kvtide_ttft_seconds_sum{pool="decode"}': pytest.approx(0.30),
        'kvtide_itl_seconds_count{pool="decode"}': 3.0,
        'kvtide_itl_seconds_sum{pool="decode"}': pytest.approx(0.06),
        'kvtide_kv_bytes_held{engine="decode-0"}': 524_288.0,
        'kvtide_requests_total{status="ok"}': 2.0,
        'kvtide_requests_total{status="cancelled"}': 1.0,
    }
    snap["kvtide_queue_depth"] = 99  # a copy
    assert m.snapshot()["kvtide_queue_depth"] == 0


def test_two_replicas_books_summed_render_as_prometheus_reads_them() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    books = []
    for ttft_s, status in ((0.04, "ok"), (3.0, "client_error")):
        m = Metrics()
        m.observe_ttft("decode", ttft_s)
        m.request_finished(status)
        m.set_bytes_held("decode-0", 100)
        books.append(m.snapshot())
    text = render_prometheus(merge_counters(books))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {spec.name.removesuffix("_total") for spec in METRICS} <= set(families)
    ttft = families["kvtide_ttft_seconds"]
    assert ttft.type == "histogram"
    samples = {(s.name, s.labels.get("le")): s.value for s in ttft.samples}
    assert samples[("kvtide_ttft_seconds_bucket", "0.05")] == 1
    assert samples[("kvtide_ttft_seconds_bucket", "5.0")] == 2
    assert samples[("kvtide_ttft_seconds_count", None)] == 2
    assert samples[("kvtide_ttft_seconds_sum", None)] == pytest.approx(3.04)
    # Buckets in rising order, as Prometheus requires.
    bounds = [float(s.labels["le"]) for s in ttft.samples if s.name.endswith("_bucket")]
    assert bounds == sorted(bounds) and bounds[-1] == float("inf")
    requests = {s.labels["status"]: s.value for s in families["kvtide_requests"].samples}
    assert requests == {"ok": 1, "client_error": 1}
    assert "# TYPE kvtide_requests_total counter" in text


def test_records_ray_would_reject_fail_here_too() -> None:
    m = Metrics()
    with pytest.raises(ValueError, match="not a kvtide counter"):
        m.inc("kvtide_ttft_seconds")
    with pytest.raises(ValueError, match=r"takes tags \('status',\)"):
        m.inc("kvtide_requests_total")
    with pytest.raises(ValueError, match="takes tags"):
        m.set_gauge("kvtide_sessions_live", 1, engine="decode-0")
    with pytest.raises(TypeError, match="must be a str"):
        m.set_gauge("kvtide_kv_bytes_held", 1, engine=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="can only grow"):
        m.inc("kvtide_kv_expiries_total", -1)
    with pytest.raises(ValueError, match="not one of"):
        m.request_finished("teapot")
    with pytest.raises(ValueError, match="direction"):
        m.add_transfer_bytes("sideways", 1)
    assert m.snapshot()["kvtide_kv_expiries_total"] == 0


def test_http_status_classes() -> None:
    assert [http_status(c) for c in (200, 400, 404, 429, 500, 503)] == [
        "ok",
        "client_error",
        "client_error",
        "client_error",
        "server_error",
        "server_error",
    ]
    assert set(REQUEST_STATUSES) >= {http_status(c) for c in (200, 404, 503)}


def test_declared_metrics_are_kvtide_names_and_documented() -> None:
    doc = (REPO / "docs" / "observability.md").read_text()
    for spec in METRICS:
        assert re.fullmatch(r"kvtide_[a-z_]+", spec.name), spec.name
        assert (spec.kind == "counter") == spec.name.endswith("_total"), spec.name
        assert (spec.kind == "histogram") == bool(spec.boundaries_s), spec.name
        assert list(spec.boundaries_s) == sorted(spec.boundaries_s), spec.name
        assert f"`{spec.name}`" in doc, f"docs/observability.md does not describe {spec.name}"
        for tag in spec.tag_keys:
            assert f"`{tag}`" in doc, f"docs/observability.md does not describe tag {tag}"


def test_without_ray_or_with_metrics_off_the_facade_is_local_and_ray_stays_unimported() -> None:
    # A fresh interpreter: this one may have imported Ray for another test.
    code = (
        "import sys\n"
        "from orchestrator.config import parse_config\n"
        "from orchestrator.observability.metrics import make_metrics\n"
        "off = parse_config({'observability': {'metrics': False}}).observability\n"
        "assert not make_metrics(off).exports_to_ray and not make_metrics(None).exports_to_ray\n"
        "print('ray' in sys.modules)\n"
        "on = parse_config({'observability': {'ray_metrics': True}}).observability\n"
        "print(make_metrics(on).exports_to_ray)\n"  # Ray imported, but not initialised
    )
    assert printed_by_fresh_python(code) == ["False", "False"]


# ---- with Ray ---------------------------------------------------------------------------


@pytest.fixture
def local_ray() -> Iterator[int]:
    """A one-CPU local Ray with a Prometheus export port; yields the port."""
    import ray

    if ray.is_initialized():
        pytest.skip("this process is already connected to a Ray; run the ray tier on its own")
    tmp = tempfile.mkdtemp(prefix="kvt-")  # short: Ray's socket paths must stay < ~100 chars
    port = free_port()
    try:
        ray.init(
            num_cpus=1,
            include_dashboard=False,
            _temp_dir=tmp,
            _metrics_export_port=port,
            log_to_driver=False,
        )
        yield port
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _scrape(port: int, want: list[str], timeout_s: float = 60.0) -> dict[str, str]:
    """Poll Ray's Prometheus endpoint until every name in ``want`` has a sample line."""
    deadline = time.monotonic() + timeout_s
    found: dict[str, str] = {}
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                body = r.read().decode()
        except OSError:
            body = ""
        for line in body.splitlines():
            for name in want:
                if line.startswith(name + "{") and name not in found:
                    found[name] = line
        if len(found) == len(want):
            return found
        time.sleep(1.0)
    missing = sorted(set(want) - set(found))
    raise AssertionError(f"Ray's metrics endpoint :{port} never exported {missing}")


@pytest.mark.ray
def test_ray_exports_kvtide_metrics_with_the_declared_tags(local_ray: int) -> None:
    assert not make_metrics(parse_config(None).observability).exports_to_ray  # the default
    metrics = make_metrics(parse_config({"observability": {"ray_metrics": True}}).observability)
    assert metrics.exports_to_ray
    # Every metric exists in Ray with the tag keys (and buckets) declared in METRICS.
    for spec in METRICS:
        info = metrics._ray[spec.name].info  # type: ignore[index]
        assert info["name"] == spec.name and tuple(info["tag_keys"]) == spec.tag_keys
        if spec.kind == "histogram":
            assert info["boundaries"] == list(spec.boundaries_s)

    metrics.request_started()
    metrics.observe_ttft("decode", 0.2)
    metrics.add_transfer_bytes("prefill_to_decode", 4096)
    metrics.request_finished("ok")
    metrics.request_finished("ok")
    metrics.set_bytes_held("decode-0", 1024)

    # Ray adds its ``ray_`` prefix; counters keep a single ``_total`` (``name{`` matched).
    lines = _scrape(
        local_ray,
        [
            "ray_kvtide_requests_total",
            "ray_kvtide_ttft_seconds_count",
            "ray_kvtide_kv_transfer_bytes_total",
            "ray_kvtide_kv_bytes_held",
            "ray_kvtide_queue_depth",
        ],
    )
    assert 'status="ok"' in lines["ray_kvtide_requests_total"]
    assert lines["ray_kvtide_requests_total"].endswith(" 2.0")
    assert 'pool="decode"' in lines["ray_kvtide_ttft_seconds_count"]
    assert lines["ray_kvtide_ttft_seconds_count"].endswith(" 1.0")
    assert lines["ray_kvtide_kv_transfer_bytes_total"].endswith(" 4096.0")
    assert 'engine="decode-0"' in lines["ray_kvtide_kv_bytes_held"]
