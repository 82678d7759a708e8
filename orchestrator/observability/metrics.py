"""kvtide's metrics: a local book per process, served in Prometheus format by the
ingress, and optionally Ray's metrics API.

Every metric is declared once in ``METRICS`` (name, type, tag keys, buckets): Ray needs
tag keys up front and rejects a record that misses one, and docs/observability.md lists
the same table.

``Metrics`` is what the ingress, router and KV service call. It always keeps a local
book of counter and gauge values and histogram buckets, counts and sums, read with
``snapshot()``. Every ingress replica reports its book to the KV service each second;
the service sums them with its own (``merge_counters``), and ``GET /metrics`` renders
the sum (``render_prometheus``) and ``/kvtide/stats`` returns it. With
``observability.ray_metrics`` on, ``make_metrics`` also forwards every record to Ray's
metrics API, which exports it from each node's Prometheus endpoint with a ``ray_``
prefix, one series per worker; otherwise (the default, unit tests, pure code) nothing
reaches Ray and Ray is not imported here. Either way the local book checks tags against
the declared keys, so a missing tag fails in unit tests rather than in a replica.

The book is per process (Prometheus sums replicas) and takes a lock per record, so sync
Serve methods running in threads may record too.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from orchestrator.config import ObservabilityConfig

__all__ = [
    "METRICS",
    "REQUEST_STATUSES",
    "MetricSpec",
    "Metrics",
    "http_status",
    "make_metrics",
    "render_prometheus",
    "series_key",
]

MetricKind = Literal["counter", "gauge", "histogram"]

TTFT_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0
)  # fmt: skip
"""Time to first token: a few ms (KV reused, tiny model) to a minute (long prompt, queued)."""

ITL_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5
)  # fmt: skip
"""Inter-token latency: ~1 ms (GPU, batched items) to seconds (a stalled CPU engine)."""

REQUEST_STATUSES = ("ok", "client_error", "server_error", "cancelled")
"""``status`` of ``kvtide_requests_total``: 2xx, 4xx, 5xx, or the client went away."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSpec:
    """One metric: its Prometheus name (before Ray's ``ray_`` prefix), type and tags."""

    name: str
    kind: MetricKind
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries_s: tuple[float, ...] = ()  # histogram buckets (upper bounds)


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        name="kvtide_ttft_seconds",
        kind="histogram",
        description="Time to first token of a turn, from the router's start (s).",
        tag_keys=("pool",),
        boundaries_s=TTFT_BUCKETS_S,
    ),
    MetricSpec(
        name="kvtide_itl_seconds",
        kind="histogram",
        description="Inter-token latency: time between streamed tokens (s).",
        tag_keys=("pool",),
        boundaries_s=ITL_BUCKETS_S,
    ),
    MetricSpec(
        name="kvtide_queue_depth",
        kind="gauge",
        description="Requests in flight at this ingress replica.",
    ),
    MetricSpec(
        name="kvtide_kv_bytes_held",
        kind="gauge",
        description="KV bytes an engine holds for idle sessions (kept for send-back).",
        tag_keys=("engine",),
    ),
    MetricSpec(
        name="kvtide_engines_by_decode_path",
        kind="gauge",
        description="Live engines of a pool running each decode path (stock, or a "
        "specialised path kernels.gate allowed), from the engines' heartbeats.",
        tag_keys=("pool", "path"),
    ),
    MetricSpec(
        name="kvtide_sessions_live",
        kind="gauge",
        description="Sessions whose KV kvtide tracks.",
    ),
    MetricSpec(
        name="kvtide_kv_expiries_total",
        kind="counter",
        description="Kept KV records that expired (TTL) before a turn reused them.",
    ),
    MetricSpec(
        name="kvtide_kv_recomputes_total",
        kind="counter",
        description="Turns whose prompt KV was recomputed instead of pulled back.",
    ),
    MetricSpec(
        name="kvtide_kv_extends_total",
        kind="counter",
        description="Turns that ran on the decode engine holding their session's KV, which "
        "computed only the new tokens (plan extend): nothing moved.",
    ),
    MetricSpec(
        name="kvtide_kv_send_backs_total",
        kind="counter",
        description="Turns that pulled the previous turn's KV back from decode (reused).",
    ),
    MetricSpec(
        name="kvtide_kv_transfer_bytes_total",
        kind="counter",
        description="KV bytes turns moved over NIXL, as the reading engines measured them "
        "(NIXL's transfer telemetry).",
        tag_keys=("direction",),
    ),
    MetricSpec(
        name="kvtide_kv_transfer_offered_bytes_total",
        kind="counter",
        description="KV bytes offered to turns' NIXL reads: the blocks the sending engine "
        "named x block size x KV bytes per token (the reader moves only what its prefix "
        "cache lacks).",
        tag_keys=("direction",),
    ),
    MetricSpec(
        name="kvtide_kv_transfer_failures_total",
        kind="counter",
        description="KV pulls that failed or timed out (the turn fell back to recompute).",
    ),
    MetricSpec(
        name="kvtide_kv_integrity_checks_total",
        kind="counter",
        description="Sampled turns that pulled KV back, by their integrity check's outcome: "
        "match, mismatch (reuse turned off for the pull's engine pair), skipped (not "
        "checkable: the turn did not decode from the pulled KV, no log probabilities, too "
        "many checks running, or the check's request failed).",
        tag_keys=("outcome",),
    ),
    MetricSpec(
        name="kvtide_conversation_turns_total",
        kind="counter",
        description="Requests without x-session-id served as turns of an unnamed session "
        "(outcome: started, continued) or, that session busy, without one (unmatched).",
        tag_keys=("outcome",),
    ),
    MetricSpec(
        name="kvtide_prefix_kv_events_total",
        kind="counter",
        description="Prefill engine blocks the prefix router heard of through the engines' "
        "KV cache events (event: stored, removed, unchained: cached after a block it never "
        "heard of, so not matched).",
        tag_keys=("event",),
    ),
    MetricSpec(
        name="kvtide_admission_refusals_total",
        kind="counter",
        description="Turns refused at once (503 overloaded) because their prefill or "
        "decode pool could not take them (pool: the one that refused).",
        tag_keys=("pool",),
    ),
    MetricSpec(
        name="kvtide_turn_handover_failures_total",
        kind="counter",
        description="Finished turns whose hand-over to the KV service failed (their kept "
        "blocks are freed at the engine's TTL).",
    ),
    MetricSpec(
        name="kvtide_turn_leases_total",
        kind="counter",
        description="Session turns by how they were claimed and planned: under this "
        "replica's turn lease (used), or the lease refused and the turn run again through "
        "the service (refused).",
        tag_keys=("outcome",),
    ),
    MetricSpec(
        name="kvtide_autoscale_desired_replicas",
        kind="gauge",
        description="Engines the autoscaling policy last asked Serve for, per pool.",
        tag_keys=("pool",),
    ),
    MetricSpec(
        name="kvtide_autoscale_replicas",
        kind="gauge",
        description="Engines of the pool running at the policy's last decision.",
        tag_keys=("pool",),
    ),
    MetricSpec(
        name="kvtide_autoscale_driving_signal",
        kind="gauge",
        description="1 for the signal that asked for the most engines at the pool's last "
        "decision (prefill_load, ttft_backlog, running_seqs, kv_use, held_kv, itl, idle), "
        "0 for the others.",
        tag_keys=("pool", "signal"),
    ),
    MetricSpec(
        name="kvtide_autoscale_decisions_total",
        kind="counter",
        description="The policy's decisions that changed a pool's size (action: up, down).",
        tag_keys=("pool", "action"),
    ),
    MetricSpec(
        name="kvtide_requests_total",
        kind="counter",
        description="Finished requests by status: ok, client_error, server_error, cancelled.",
        tag_keys=("status",),
    ),
)

_SPECS = {spec.name: spec for spec in METRICS}


def series_key(name: str, tags: Mapping[str, str] | None = None) -> str:
    """The ``snapshot()`` key of one series: ``name`` or ``name{k="v",...}`` (declared order)."""
    spec = _SPECS[name]
    if not spec.tag_keys:
        return name
    tags = tags or {}
    return name + "{" + ",".join(f'{k}="{tags[k]}"' for k in spec.tag_keys) + "}"


class Metrics:
    """The metrics facade. Build it with ``make_metrics``; ``Metrics()`` is local-only.

    ``ray_instruments`` maps each ``METRICS`` name to its ``ray.util.metrics`` object;
    ``None`` records only into the local book (the null exporter).
    """

    def __init__(self, ray_instruments: Mapping[str, Any] | None = None) -> None:
        self._ray = dict(ray_instruments) if ray_instruments is not None else None
        self._values: dict[str, float] = {
            spec.name: 0.0 for spec in METRICS if spec.kind != "histogram" and not spec.tag_keys
        }
        self._in_flight = 0
        self._decode_paths_seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    @property
    def exports_to_ray(self) -> bool:
        return self._ray is not None

    # ---- the generic three -------------------------------------------------------------

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        """Add ``value`` (>= 0) to counter ``name``; 0 records nothing (Ray rejects it)."""
        self._check(name, "counter", tags)
        if value < 0:
            raise ValueError(f"counter {name} can only grow; got {value}")
        if value == 0:
            return
        key = series_key(name, tags)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + value
        if self._ray is not None:
            self._ray[name].inc(value, tags=tags or None)

    def set_gauge(self, name: str, value: float, **tags: str) -> None:
        self._check(name, "gauge", tags)
        with self._lock:
            self._values[series_key(name, tags)] = float(value)
        if self._ray is not None:
            self._ray[name].set(value, tags=tags or None)

    def observe(self, name: str, value: float, **tags: str) -> None:
        """Record one histogram sample (the book keeps its cumulative ``_bucket``
        counts, ``_count`` and ``_sum``, as Prometheus exposes a histogram)."""
        self._check(name, "histogram", tags)
        labels = series_key(name, tags)[len(name) :]  # '{pool="decode"}' or ''
        count, total = f"{name}_count{labels}", f"{name}_sum{labels}"
        buckets = _bucket_keys(name, labels)
        with self._lock:
            self._values[count] = self._values.get(count, 0.0) + 1
            self._values[total] = self._values.get(total, 0.0) + value
            for bound, key in buckets:
                if value <= bound:
                    self._values[key] = self._values.get(key, 0.0) + 1
                else:  # keep every bucket present, so a scrape shows the whole histogram
                    self._values.setdefault(key, 0.0)
        if self._ray is not None:
            self._ray[name].observe(value, tags=tags or None)

    def _check(self, name: str, kind: MetricKind, tags: Mapping[str, str]) -> None:
        spec = _SPECS.get(name)
        if spec is None or spec.kind != kind:
            known = sorted(s.name for s in METRICS if s.kind == kind)
            raise ValueError(f"{name!r} is not a kvtide {kind}; declared: {known}")
        if tuple(sorted(tags)) != tuple(sorted(spec.tag_keys)):
            raise ValueError(f"{name} takes tags {spec.tag_keys}, got {tuple(tags)}")
        for key, value in tags.items():
            if not isinstance(value, str):  # Ray raises TypeError on a non-str tag value
                raise TypeError(f"{name}: tag {key}={value!r} must be a str")

    # ---- what the ingress, router and KV service call ------------------------------------

    def observe_ttft(self, pool: str, seconds: float) -> None:
        self.observe("kvtide_ttft_seconds", seconds, pool=pool)

    def observe_itl(self, pool: str, seconds: float) -> None:
        self.observe("kvtide_itl_seconds", seconds, pool=pool)

    def request_started(self) -> None:
        """A request entered the ingress (raises ``kvtide_queue_depth``)."""
        with self._lock:
            self._in_flight += 1
            depth = self._in_flight
        self.set_gauge("kvtide_queue_depth", depth)

    def request_finished(self, status: str) -> None:
        """A request left the ingress with ``status`` (one of ``REQUEST_STATUSES``)."""
        if status not in REQUEST_STATUSES:
            raise ValueError(f"request status {status!r} is not one of {REQUEST_STATUSES}")
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            depth = self._in_flight
        self.set_gauge("kvtide_queue_depth", depth)
        self.inc("kvtide_requests_total", status=status)

    def set_bytes_held(self, engine: str, num_bytes: int) -> None:
        self.set_gauge("kvtide_kv_bytes_held", num_bytes, engine=engine)

    def set_engines_by_decode_path(self, counts: Mapping[str, Mapping[str, int]]) -> None:
        """``counts``: pool -> decode path -> live engines (the KV service's view). A
        series set before and absent now reads 0, not its last count."""
        now = {(pool, path): n for pool, paths in counts.items() for path, n in paths.items()}
        for pool, path in sorted(self._decode_paths_seen - now.keys()):
            self.set_gauge("kvtide_engines_by_decode_path", 0, pool=pool, path=path)
        for (pool, path), num in sorted(now.items()):
            self.set_gauge("kvtide_engines_by_decode_path", num, pool=pool, path=path)
        self._decode_paths_seen |= now.keys()

    def set_sessions_live(self, num_sessions: int) -> None:
        self.set_gauge("kvtide_sessions_live", num_sessions)

    def add_transfer_bytes(self, direction: str, num_bytes: int) -> None:
        """KV bytes a transfer moved. ``direction``: "prefill_to_decode" or
        "decode_to_prefill" (as in the spans)."""
        self._add_bytes("kvtide_kv_transfer_bytes_total", direction, num_bytes)

    def add_offered_bytes(self, direction: str, num_bytes: int) -> None:
        """KV bytes offered to a transfer (its blocks, as bytes); see ``add_transfer_bytes``."""
        self._add_bytes("kvtide_kv_transfer_offered_bytes_total", direction, num_bytes)

    def _add_bytes(self, name: str, direction: str, num_bytes: int) -> None:
        if direction not in ("prefill_to_decode", "decode_to_prefill"):
            raise ValueError(f"unknown KV transfer direction {direction!r}")
        self.inc(name, num_bytes, direction=direction)

    def snapshot(self) -> dict[str, float]:
        """Current values by ``series_key`` (histograms as ``name_count{..}``/``name_sum{..}``).

        Untagged counters and gauges are present from the start (0.0); tagged series
        appear once recorded. A copy: callers may keep or serialise it.
        """
        with self._lock:
            return dict(self._values)


_BUCKET_KEYS: dict[tuple[str, str], tuple[tuple[float, str], ...]] = {}


def _bucket_keys(name: str, labels: str) -> tuple[tuple[float, str], ...]:
    """``(upper bound, book key)`` of each bucket of histogram ``name`` at ``labels``
    (``'{pool="decode"}'`` or ``''``), ``+Inf`` last."""
    cached = _BUCKET_KEYS.get((name, labels))
    if cached is None:
        inner = labels[1:-1] + "," if labels else ""
        bounds = [*_SPECS[name].boundaries_s, math.inf]
        cached = tuple(
            (b, f'{name}_bucket{{{inner}le="{"+Inf" if b == math.inf else repr(float(b))}"}}')
            for b in bounds
        )
        _BUCKET_KEYS[(name, labels)] = cached
    return cached


def render_prometheus(book: Mapping[str, float]) -> str:
    """A book (``Metrics.snapshot()``, or several summed) in Prometheus's text format:
    each declared metric's ``# HELP`` and ``# TYPE`` lines, then its series sorted."""
    by_metric: dict[str, list[str]] = {spec.name: [] for spec in METRICS}
    for key, value in book.items():
        base = key.split("{", 1)[0]
        if base not in _SPECS:
            base = base.rsplit("_", 1)[0]  # a histogram's _bucket, _count, _sum
        if base in by_metric:
            by_metric[base].append(f"{key} {float(value)!r}")
    lines: list[str] = []
    for spec in METRICS:
        lines.append(f"# HELP {spec.name} {spec.description}")
        lines.append(f"# TYPE {spec.name} {spec.kind}")
        lines.extend(sorted(by_metric[spec.name], key=_series_order))
    return "\n".join(lines) + "\n"


def _series_order(line: str) -> tuple[str, str, float]:
    """Buckets by their bound (as numbers), then ``_count`` and ``_sum``."""
    key = line.rsplit(" ", 1)[0]
    name, _, labels = key.partition("{")
    bound = math.inf
    if 'le="' in labels:
        text = labels.split('le="', 1)[1].split('"', 1)[0]
        bound = math.inf if text == "+Inf" else float(text)
        labels = labels.split('le="', 1)[0]
    return (labels, name, bound)


def http_status(status_code: int) -> str:
    """The ``kvtide_requests_total`` status of an HTTP status code."""
    if status_code >= 500:
        return "server_error"
    return "client_error" if status_code >= 400 else "ok"


def make_metrics(config: ObservabilityConfig | None) -> Metrics:
    """Metrics that also go to Ray when ``config.ray_metrics`` is on and Ray is up here;
    else local-only (the book ``GET /metrics`` serves).

    Call it where Ray is initialised (a Serve replica's ``__init__``, an actor). Ray only
    exports metrics recorded in a process connected to a Ray cluster.
    """
    if config is None or not config.exports_to_ray:
        return Metrics()
    import ray  # only when metrics are on: pure code and unit tests never import Ray here

    if not ray.is_initialized():
        return Metrics()
    return Metrics(_ray_instruments())


def _ray_instruments() -> dict[str, Any]:
    from ray.util import metrics as ray_metrics

    out: dict[str, Any] = {}
    for spec in METRICS:
        if spec.kind == "histogram":
            out[spec.name] = ray_metrics.Histogram(
                spec.name,
                description=spec.description,
                boundaries=list(spec.boundaries_s),
                tag_keys=spec.tag_keys,
            )
        elif spec.kind == "gauge":
            out[spec.name] = ray_metrics.Gauge(
                spec.name, description=spec.description, tag_keys=spec.tag_keys
            )
        else:
            out[spec.name] = ray_metrics.Counter(
                spec.name, description=spec.description, tag_keys=spec.tag_keys
            )
    return out
