"""kvtide's OpenTelemetry spans: names, attribute keys, set-up and the helpers the router uses.

One HTTP request is one trace::

    kvtide.ingress            SERVER  child of the caller's W3C traceparent, if any
    └─ kvtide.route                   one turn through the pools
       ├─ kvtide.kv_decision          what the KV decider chose, and why
       ├─ kvtide.prefill      CLIENT  the prefill engine request (max_tokens=1)
       │  └─ kvtide.kv_transfer       decode → prefill pull of the previous turn's KV
       ├─ kvtide.decode       CLIENT  the decode engine stream
       │  └─ kvtide.kv_transfer       prefill → decode pull: decode start → first token
       └─ kvtide.send_back            decode's kept blocks handed to the KV lifecycle

Attribute keys reuse the OpenTelemetry GenAI semantic conventions where one exists
(``gen_ai.*``) and use ``kvtide.*`` for the rest; docs/observability.md has the tables.

Set-up. ``configure_tracing`` installs kvtide's *own* ``TracerProvider`` in this module,
never the global one: OpenTelemetry refuses to replace a global provider once set (Ray
Serve may set one), and tests must be able to swap exporters. With ``tracing: off``
nothing is installed and every helper returns OpenTelemetry's non-recording
``INVALID_SPAN`` without touching the context — off costs one ``if``.

Async generators. The router's turn is an async generator whose consumer (the ingress'
SSE stream) may run in another task. Helpers therefore never attach spans to the current
context; parents are passed explicitly (``parent=``). A span attached inside a generator
and detached from a different task is what makes OpenTelemetry log "Failed to detach
context".

The OTLP exporter is an optional dependency, imported only in ``_otlp_exporter``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Literal

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from orchestrator.config import ObservabilityConfig
from orchestrator.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = [
    "CANCELLED",
    "DECODE_TOKENS",
    "DECODE_TTFT_S",
    "DIRECTIONS",
    "ENGINE_ID",
    "ENGINE_POOL",
    "GEN_AI_CONVERSATION_ID",
    "GEN_AI_OPERATION_NAME",
    "GEN_AI_REQUEST_MAX_TOKENS",
    "GEN_AI_REQUEST_MODEL",
    "GEN_AI_RESPONSE_FINISH_REASONS",
    "GEN_AI_RESPONSE_ID",
    "GEN_AI_USAGE_INPUT_TOKENS",
    "GEN_AI_USAGE_OUTPUT_TOKENS",
    "HTTP_REQUEST_METHOD",
    "HTTP_RESPONSE_STATUS_CODE",
    "HTTP_ROUTE",
    "KV_CACHED_TOKENS",
    "KV_PLAN",
    "KV_PLAN_REASON",
    "KV_SOURCE",
    "KV_TRANSFER_BACKEND",
    "KV_TRANSFER_BLOCKS",
    "KV_TRANSFER_BYTES",
    "KV_TRANSFER_DIRECTION",
    "KV_TRANSFER_OFFERED_BYTES",
    "PULL_FALLBACK",
    "SPAN_DECODE",
    "SPAN_INGRESS",
    "SPAN_KV_DECISION",
    "SPAN_KV_TRANSFER",
    "SPAN_PREFILL",
    "SPAN_ROUTE",
    "SPAN_SEND_BACK",
    "AttrValue",
    "Direction",
    "Parent",
    "configure_tracing",
    "extract_context",
    "inject_context",
    "kv_transfer_attrs",
    "now_ns",
    "record_error",
    "record_span",
    "set_attrs",
    "shutdown_tracing",
    "span",
    "start_ingress_span",
    "start_span",
    "tracing_enabled",
]

# ---- span names ------------------------------------------------------------------------

SPAN_INGRESS = "kvtide.ingress"
SPAN_ROUTE = "kvtide.route"
SPAN_KV_DECISION = "kvtide.kv_decision"
SPAN_PREFILL = "kvtide.prefill"
SPAN_KV_TRANSFER = "kvtide.kv_transfer"
SPAN_DECODE = "kvtide.decode"
SPAN_SEND_BACK = "kvtide.send_back"

# ---- attribute keys: OpenTelemetry semantic conventions ---------------------------------

GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # "chat" | "text_completion"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"  # list of str
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"  # kvtide's session id
HTTP_REQUEST_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"

# ---- attribute keys: kvtide's own --------------------------------------------------------

KV_PLAN = "kvtide.kv.plan"  # the KV decider's choice: "pull" | "recompute" | ...
KV_PLAN_REASON = "kvtide.kv.plan_reason"
KV_SOURCE = "kvtide.kv.source"  # where the prompt's KV came from (router.KV_SOURCES)
KV_CACHED_TOKENS = "kvtide.kv.cached_tokens"
KV_TRANSFER_BYTES = "kvtide.kv.transfer.bytes"  # moved, as the reading engine measured
KV_TRANSFER_OFFERED_BYTES = "kvtide.kv.transfer.offered_bytes"  # blocks offered, as bytes
KV_TRANSFER_BLOCKS = "kvtide.kv.transfer.blocks"
KV_TRANSFER_BACKEND = "kvtide.kv.transfer.backend"  # "nixl"
KV_TRANSFER_DIRECTION = "kvtide.kv.transfer.direction"  # see Direction
ENGINE_POOL = "kvtide.engine.pool"  # "prefill" | "decode"
ENGINE_ID = "kvtide.engine.id"
DECODE_TTFT_S = "kvtide.decode.ttft_s"
DECODE_TOKENS = "kvtide.decode.tokens"
PULL_FALLBACK = "kvtide.pull.fallback"  # a failed/hung pull became a plain prefill
CANCELLED = "kvtide.cancelled"  # the span's work was cancelled or its consumer left

AttrValue = str | bool | int | float | Sequence[str] | Sequence[int] | Sequence[float]
"""What OpenTelemetry accepts as an attribute value."""

Direction = Literal["prefill_to_decode", "decode_to_prefill"]
DIRECTIONS: tuple[Direction, ...] = ("prefill_to_decode", "decode_to_prefill")

Parent = Span | Context | None
"""A parent span, a context (e.g. from ``extract_context``), or None: the current context."""

# ---- set-up --------------------------------------------------------------------------

_lock = threading.Lock()
_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None  # from _provider; None while tracing is off
_installed_key: tuple[object, ...] | None = None
_propagator = TraceContextTextMapPropagator()


def configure_tracing(
    config: ObservabilityConfig, *, exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """Install kvtide's tracer for this process; returns its provider, or None when off.

    ``tracing: off`` installs nothing (and removes a provider installed before).
    ``console`` prints spans, ``otlp`` sends them to ``config.otlp_endpoint`` over
    OTLP/HTTP; both through a ``BatchSpanProcessor``. ``exporter`` replaces the exporter
    the mode would pick and exports synchronously (``SimpleSpanProcessor``): tests pass an
    ``InMemorySpanExporter``. Idempotent: the same arguments keep the installed provider;
    different ones shut it down (flushing its spans) and install a new one.
    """
    global _provider, _tracer, _installed_key
    # The exporter itself, not its id(): a collected exporter's id can be reused.
    key = (config.tracing, config.otlp_endpoint, config.service_name, exporter)
    with _lock:
        if key == _installed_key:
            return _provider
        # Build first: a missing exporter package leaves the installed provider in place.
        provider = None if config.tracing == "off" else _new_provider(config, exporter)
        _uninstall()
        _provider, _installed_key = provider, key
        _tracer = provider.get_tracer("kvtide") if provider is not None else None
        return provider


def _new_provider(config: ObservabilityConfig, exporter: SpanExporter | None) -> TracerProvider:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    if exporter is not None:
        processor: SpanProcessor = SimpleSpanProcessor(exporter)
    elif config.tracing == "console":
        processor = BatchSpanProcessor(ConsoleSpanExporter())
    else:
        processor = BatchSpanProcessor(_otlp_exporter(config.otlp_endpoint))
    provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
    provider.add_span_processor(processor)
    return provider


def shutdown_tracing() -> None:
    """Flush and remove kvtide's provider (replica shutdown, tests); tracing is then off."""
    global _installed_key
    with _lock:
        _uninstall()
        _installed_key = None


def _uninstall() -> None:
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
    _provider, _tracer = None, None


def _otlp_exporter(endpoint: str) -> SpanExporter:
    """The OTLP/HTTP span exporter: the one place that imports it."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ConfigError(
            "observability.tracing is 'otlp' but the OTLP/HTTP exporter is not installed: "
            "pip install opentelemetry-exporter-otlp-proto-http (or set tracing to "
            f"'console' or 'off'); import failed with: {exc}",
            field="observability.tracing",
        ) from exc
    return OTLPSpanExporter(endpoint=endpoint)


def tracing_enabled() -> bool:
    """True when spans are recorded (guard attribute work that is not cheap)."""
    return _tracer is not None


def now_ns() -> int:
    """Wall-clock nanoseconds since the epoch, the clock span times use (not monotonic)."""
    return time.time_ns()


# ---- context propagation ----------------------------------------------------------------


def extract_context(headers: Mapping[str, str]) -> Context:
    """The W3C trace context (``traceparent``/``tracestate``) of incoming HTTP headers.

    Header names are matched case-insensitively. Without a valid ``traceparent`` the
    result is an empty context, and a span started under it begins a new trace.
    """
    lowered = {k.lower(): v for k, v in headers.items()}
    return _propagator.extract(carrier=lowered)


def inject_context(carrier: dict[str, str], parent: Parent = None) -> dict[str, str]:
    """Write ``parent``'s trace context into ``carrier`` as W3C headers; returns it.

    Nothing is written for a non-recording parent (tracing off).
    """
    _propagator.inject(carrier, context=_context_of(parent))
    return carrier


def _context_of(parent: Parent) -> Context | None:
    if parent is None or isinstance(parent, Context):
        return parent
    return trace.set_span_in_context(parent)


# ---- spans ----------------------------------------------------------------------------


def start_span(
    name: str,
    attrs: Mapping[str, AttrValue | None] | None = None,
    *,
    parent: Parent = None,
    kind: SpanKind = SpanKind.INTERNAL,
    start_ns: int | None = None,
) -> Span:
    """Start a span the caller ends (``span.end()``); not made current.

    For spans that outlive a ``with`` block, e.g. the ingress span of a streamed
    response, which ends when the stream does. ``None`` attribute values are dropped.
    """
    if _tracer is None:
        return INVALID_SPAN
    return _tracer.start_span(
        name,
        context=_context_of(parent),
        kind=kind,
        attributes=_clean(attrs),
        start_time=start_ns,
    )


class _Scope:
    """Ends its span on exit; an exception marks it ERROR, a cancellation ``CANCELLED``."""

    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def __enter__(self) -> Span:
        return self._span

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, Exception):
            record_error(self._span, exc)
        elif exc is not None:  # CancelledError, GeneratorExit: not a failure of the work
            self._span.set_attribute(CANCELLED, True)
        self._span.end()


_OFF = _Scope(INVALID_SPAN)  # reused: ending INVALID_SPAN does nothing


def span(
    name: str,
    attrs: Mapping[str, AttrValue | None] | None = None,
    *,
    parent: Parent = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> AbstractContextManager[Span]:
    """``with span(SPAN_PREFILL, {ENGINE_POOL: "prefill"}, parent=route) as sp: ...``

    Starts a child of ``parent`` and ends it when the block exits; an exception leaving
    the block is recorded on the span. The span is not made current (see the module
    docstring), so pass it as ``parent=`` to its children. Off: ``INVALID_SPAN``.
    """
    if _tracer is None:
        return _OFF
    return _Scope(start_span(name, attrs, parent=parent, kind=kind))


def start_ingress_span(
    headers: Mapping[str, str], *, method: str, route: str, operation: str, model: str
) -> Span:
    """The root span of one API request, continuing the caller's ``traceparent``; the
    caller ends it when the response (or its stream) has ended."""
    return start_span(
        SPAN_INGRESS,
        {
            HTTP_REQUEST_METHOD: method,
            HTTP_ROUTE: route,
            GEN_AI_OPERATION_NAME: operation,
            GEN_AI_REQUEST_MODEL: model,
            GEN_AI_CONVERSATION_ID: headers.get("x-session-id"),
        },
        parent=extract_context(headers),
        kind=SpanKind.SERVER,
    )


def record_span(
    name: str,
    start_ns: int,
    end_ns: int,
    attrs: Mapping[str, AttrValue | None] | None = None,
    *,
    parent: Parent = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Span:
    """Record a finished span with explicit times (epoch ns, from ``now_ns``).

    For work kvtide only sees the edges of, e.g. the NIXL transfer inside vLLM: from the
    decode request's start until its first token.
    """
    if _tracer is None:
        return INVALID_SPAN
    s = start_span(name, attrs, parent=parent, kind=kind, start_ns=start_ns)
    s.end(end_time=max(end_ns, start_ns))
    return s


def set_attrs(span: Span, attrs: Mapping[str, AttrValue | None]) -> None:
    """Set several attributes; ``None`` values are skipped, so optional facts read plainly."""
    if span.is_recording():
        span.set_attributes(_clean(attrs))


def record_error(span: Span, exc: BaseException) -> None:
    """Mark ``span`` failed by ``exc`` (exception event + ERROR status)."""
    if span.is_recording():
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def _clean(attrs: Mapping[str, AttrValue | None] | None) -> dict[str, AttrValue]:
    return {k: v for k, v in (attrs or {}).items() if v is not None}


# ---- KV transfer attributes --------------------------------------------------------------


def kv_transfer_attrs(
    num_blocks: int,
    block_size_tokens: int,
    kv_bytes_per_token: int,
    direction: Direction,
    moved_bytes: int | None,
) -> dict[str, AttrValue]:
    """Attributes of a ``kvtide.kv_transfer`` span: blocks, bytes, backend, direction.

    ``KV_TRANSFER_BYTES`` is ``moved_bytes``: what the reading engine's NIXL reads moved
    for the request (``GenerateChunk.kv_read_bytes``), absent when the engine did not
    say. ``KV_TRANSFER_BLOCKS`` and ``KV_TRANSFER_OFFERED_BYTES`` are what was offered to
    the read: the blocks the sending engine named (``KVTransferParams.num_blocks``) and
    ``num_blocks * block_size_tokens * kv_bytes_per_token``. The reading engine finds
    most of a session's history in its own prefix cache and reads only the rest, so the
    offered figure grows with the session while the moved one follows the new tokens.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction {direction!r} is not one of {DIRECTIONS}")
    if min(num_blocks, block_size_tokens, kv_bytes_per_token, moved_bytes or 0) < 0:
        raise ValueError(
            f"negative KV size: num_blocks={num_blocks}, block_size_tokens="
            f"{block_size_tokens}, kv_bytes_per_token={kv_bytes_per_token}, "
            f"moved_bytes={moved_bytes}"
        )
    return _clean(
        {
            KV_TRANSFER_BLOCKS: num_blocks,
            KV_TRANSFER_BYTES: moved_bytes,
            KV_TRANSFER_OFFERED_BYTES: num_blocks * block_size_tokens * kv_bytes_per_token,
            KV_TRANSFER_BACKEND: "nixl",
            KV_TRANSFER_DIRECTION: direction,
        }
    )
