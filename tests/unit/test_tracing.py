"""kvtide's spans, recorded by an in-memory exporter: one turn is one trace.

``serve_turn`` below builds a turn with the helpers exactly the way the ingress and the
router use them (a pulled-back turn: the prefill engine reads the previous turn's KV
from decode, then decode reads the prompt's KV from prefill).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from fresh_python import printed_by_fresh_python
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN, SpanKind, StatusCode

from engines.kv_params import KVTransferParams
from orchestrator.config import ObservabilityConfig, parse_config
from orchestrator.errors import ConfigError
from orchestrator.observability import tracing as tr

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"

BLOCK_SIZE = 16
KV_BYTES_PER_TOKEN = 4096


def observability(tracing: str) -> ObservabilityConfig:
    return parse_config({"observability": {"tracing": tracing}}).observability


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    assert tr.configure_tracing(observability("console"), exporter=exporter) is not None
    yield exporter
    tr.shutdown_tracing()


def serve_turn(headers: dict[str, str]) -> None:
    """Ingress → route → decision, prefill (+pull), decode (+transfer), send-back."""
    root = tr.start_span(
        tr.SPAN_INGRESS,
        {
            tr.HTTP_REQUEST_METHOD: "POST",
            tr.HTTP_ROUTE: "/v1/chat/completions",
            tr.GEN_AI_OPERATION_NAME: "chat",
            tr.GEN_AI_REQUEST_MODEL: "kvtide-tiny",
            tr.GEN_AI_REQUEST_MAX_TOKENS: 3,
            tr.GEN_AI_CONVERSATION_ID: "s1",
        },
        parent=tr.extract_context(headers),
        kind=SpanKind.SERVER,
    )
    try:
        with tr.span(tr.SPAN_ROUTE, {tr.GEN_AI_RESPONSE_ID: "r1"}, parent=root) as route:
            # Spans are never made current: an async generator may end them in another task.
            assert trace.get_current_span() is INVALID_SPAN
            with tr.span(tr.SPAN_KV_DECISION, parent=route) as decision:
                tr.set_attrs(decision, {tr.KV_PLAN: "pull", tr.KV_PLAN_REASON: "fresh"})
            with tr.span(
                tr.SPAN_PREFILL, {tr.ENGINE_POOL: "prefill"}, parent=route, kind=SpanKind.CLIENT
            ) as prefill:
                start = tr.now_ns()
                # Decode offered the 4 blocks it kept (64 tokens); the prefill engine
                # had 3 in its prefix cache and read one.
                params = KVTransferParams(remote_block_ids=((5, 6, 7, 8),), remote_engine_id="D0")
                pull = tr.kv_transfer_attrs(
                    params.num_blocks,
                    BLOCK_SIZE,
                    KV_BYTES_PER_TOKEN,
                    "decode_to_prefill",
                    1 * BLOCK_SIZE * KV_BYTES_PER_TOKEN,
                )
                tr.record_span(tr.SPAN_KV_TRANSFER, start, tr.now_ns(), pull, parent=prefill)
                tr.set_attrs(prefill, {tr.KV_CACHED_TOKENS: 64, tr.PULL_FALLBACK: False})
            with tr.span(
                tr.SPAN_DECODE, {tr.ENGINE_POOL: "decode"}, parent=route, kind=SpanKind.CLIENT
            ) as decode:
                start = tr.now_ns()
                first_token = start + 2_000_000  # decode's first token 2 ms after its start
                # Decode reads the whole 80-token prompt (5 blocks) from prefill; its
                # engine did not say what moved.
                fwd = tr.kv_transfer_attrs(
                    5, BLOCK_SIZE, KV_BYTES_PER_TOKEN, "prefill_to_decode", None
                )
                tr.record_span(tr.SPAN_KV_TRANSFER, start, first_token, fwd, parent=decode)
                tr.set_attrs(decode, {tr.DECODE_TTFT_S: 0.002, tr.DECODE_TOKENS: 3})
            with tr.span(tr.SPAN_SEND_BACK, {tr.ENGINE_ID: "D0"}, parent=route) as send_back:
                tr.set_attrs(send_back, {tr.KV_TRANSFER_BLOCKS: 6})
            tr.set_attrs(route, {tr.KV_SOURCE: "sent_back", tr.GEN_AI_CONVERSATION_ID: None})
        tr.set_attrs(
            root,
            {
                tr.GEN_AI_USAGE_INPUT_TOKENS: 80,
                tr.GEN_AI_USAGE_OUTPUT_TOKENS: 3,
                tr.GEN_AI_RESPONSE_FINISH_REASONS: ["length"],
                tr.HTTP_RESPONSE_STATUS_CODE: 200,
            },
        )
    finally:
        root.end()  # the ingress ends its span when the (streamed) response ends


def by_name(finished: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for s in finished:
        out.setdefault(s.name, []).append(s)
    return out


def parent_of(s: ReadableSpan) -> int | None:
    return s.parent.span_id if s.parent is not None else None


def test_a_turn_is_one_trace_continuing_the_callers_traceparent(
    spans: InMemorySpanExporter,
) -> None:
    serve_turn({"TraceParent": TRACEPARENT})  # header names match in any case
    finished = spans.get_finished_spans()
    named = by_name(finished)
    assert sorted(named) == sorted(
        [
            tr.SPAN_INGRESS,
            tr.SPAN_ROUTE,
            tr.SPAN_KV_DECISION,
            tr.SPAN_PREFILL,
            tr.SPAN_KV_TRANSFER,
            tr.SPAN_DECODE,
            tr.SPAN_SEND_BACK,
        ]
    )
    # One trace: the caller's.
    assert {f"{s.context.trace_id:032x}" for s in finished} == {TRACE_ID}

    (ingress,) = named[tr.SPAN_INGRESS]
    (route,) = named[tr.SPAN_ROUTE]
    assert ingress.kind is SpanKind.SERVER and f"{parent_of(ingress):016x}" == CALLER_SPAN_ID
    assert ingress.parent is not None and ingress.parent.is_remote
    assert parent_of(route) == ingress.context.span_id
    for name in (tr.SPAN_KV_DECISION, tr.SPAN_PREFILL, tr.SPAN_DECODE, tr.SPAN_SEND_BACK):
        (child,) = named[name]
        assert parent_of(child) == route.context.span_id, name

    (prefill,) = named[tr.SPAN_PREFILL]
    (decode,) = named[tr.SPAN_DECODE]
    # One transfer under prefill (the pull back), one under decode (the forward read).
    transfers = {parent_of(s): s for s in named[tr.SPAN_KV_TRANSFER]}
    assert set(transfers) == {prefill.context.span_id, decode.context.span_id}
    pull, fwd = transfers[prefill.context.span_id], transfers[decode.context.span_id]
    # Back to prefill: 4 blocks x 16 tokens x 4096 B offered, one block's bytes moved.
    assert dict(pull.attributes or {}) == {
        tr.KV_TRANSFER_BLOCKS: 4,
        tr.KV_TRANSFER_BYTES: 1 * 16 * 4096,
        tr.KV_TRANSFER_OFFERED_BYTES: 4 * 16 * 4096,
        tr.KV_TRANSFER_BACKEND: "nixl",
        tr.KV_TRANSFER_DIRECTION: "decode_to_prefill",
    }
    # Forward to decode: 5 blocks offered; what moved unknown, so no moved bytes at all.
    assert fwd.attributes is not None
    assert (
        fwd.attributes[tr.KV_TRANSFER_BLOCKS],
        fwd.attributes[tr.KV_TRANSFER_OFFERED_BYTES],
    ) == (5, 5 * 16 * 4096)
    assert tr.KV_TRANSFER_BYTES not in fwd.attributes
    # The forward transfer covers decode's start until its first token, inside decode.
    assert fwd.start_time is not None and fwd.end_time is not None
    assert fwd.end_time - fwd.start_time == 2_000_000
    assert decode.start_time is not None and decode.start_time <= fwd.start_time

    (decision,) = named[tr.SPAN_KV_DECISION]
    assert decision.attributes is not None and decision.attributes[tr.KV_PLAN] == "pull"
    assert route.attributes is not None and tr.GEN_AI_CONVERSATION_ID not in route.attributes
    assert ingress.attributes is not None
    assert ingress.attributes[tr.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    assert ingress.attributes[tr.HTTP_RESPONSE_STATUS_CODE] == 200
    assert ingress.resource.attributes["service.name"] == "kvtide"


def test_without_a_traceparent_the_ingress_starts_a_new_trace(
    spans: InMemorySpanExporter,
) -> None:
    serve_turn({})
    finished = spans.get_finished_spans()
    (ingress,) = by_name(finished)[tr.SPAN_INGRESS]
    assert ingress.parent is None
    assert len({s.context.trace_id for s in finished}) == 1


def test_inject_writes_a_traceparent_that_extract_reads_back(
    spans: InMemorySpanExporter,
) -> None:
    with tr.span(tr.SPAN_ROUTE) as route:
        headers = tr.inject_context({}, parent=route)
    ctx = route.get_span_context()
    assert (
        headers["traceparent"] == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    )
    child = tr.start_span(tr.SPAN_PREFILL, parent=tr.extract_context(headers))
    child.end()
    assert child.get_span_context().trace_id == ctx.trace_id


def test_errors_and_cancellations_are_recorded_on_the_span(
    spans: InMemorySpanExporter,
) -> None:
    with pytest.raises(RuntimeError), tr.span(tr.SPAN_PREFILL):
        raise RuntimeError("NIXL read declined")
    with pytest.raises(GeneratorExit), tr.span(tr.SPAN_DECODE):
        raise GeneratorExit  # the client went away mid-stream
    named = by_name(spans.get_finished_spans())
    (failed,) = named[tr.SPAN_PREFILL]
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.status.description == "RuntimeError: NIXL read declined"
    assert [e.name for e in failed.events] == ["exception"]
    (left,) = named[tr.SPAN_DECODE]
    assert left.status.status_code is StatusCode.UNSET
    assert left.attributes is not None and left.attributes[tr.CANCELLED] is True


def test_off_records_nothing_and_never_touches_the_context() -> None:
    exporter = InMemorySpanExporter()
    assert tr.configure_tracing(observability("off"), exporter=exporter) is None
    try:
        assert not tr.tracing_enabled()
        serve_turn({"traceparent": TRACEPARENT})
        with tr.span(tr.SPAN_ROUTE, {tr.KV_PLAN: "pull"}) as route:
            assert route is INVALID_SPAN and not route.is_recording()
        assert tr.start_span(tr.SPAN_INGRESS) is INVALID_SPAN
        assert tr.record_span(tr.SPAN_KV_TRANSFER, 1, 2) is INVALID_SPAN
        assert tr.inject_context({}, parent=route) == {}
        assert exporter.get_finished_spans() == ()
    finally:
        tr.shutdown_tracing()


def test_off_does_not_even_import_the_sdk() -> None:
    code = (
        "import sys\n"
        "from orchestrator.observability import tracing as tr\n"
        "from orchestrator.config import parse_config\n"
        "tr.configure_tracing(parse_config(None).observability)\n"
        "with tr.span(tr.SPAN_ROUTE) as s:\n"
        "    tr.set_attrs(s, {tr.KV_PLAN: 'pull'})\n"
        "print('opentelemetry.sdk' in sys.modules)\n"
    )
    assert printed_by_fresh_python(code) == ["False"]


def test_configure_is_idempotent_and_leaves_the_global_provider_alone() -> None:
    exporter = InMemorySpanExporter()
    cfg = observability("console")
    try:
        first = tr.configure_tracing(cfg, exporter=exporter)
        assert tr.configure_tracing(cfg, exporter=exporter) is first
        assert trace.get_tracer_provider() is not first
        # Another exporter replaces the provider; the old one is shut down (flushed).
        other = InMemorySpanExporter()
        second = tr.configure_tracing(cfg, exporter=other)
        assert second is not first
        with tr.span(tr.SPAN_ROUTE):
            pass
        assert len(other.get_finished_spans()) == 1 and exporter.get_finished_spans() == ()
    finally:
        tr.shutdown_tracing()
    assert not tr.tracing_enabled()


def test_otlp_mode_uses_the_http_exporter_and_names_the_package_when_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    cfg = parse_config(
        {"observability": {"tracing": "otlp", "otlp_endpoint": "http://collector:4318/v1/traces"}}
    ).observability
    try:
        provider = tr.configure_tracing(cfg)
        assert provider is not None
        processor = provider._active_span_processor._span_processors[0]
        exporter = processor._batch_processor._exporter  # type: ignore[attr-defined]
        assert isinstance(exporter, OTLPSpanExporter)
        assert exporter._endpoint == "http://collector:4318/v1/traces"
    finally:
        tr.shutdown_tracing()  # no spans: nothing is sent

    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    tr.configure_tracing(observability("console"), exporter=InMemorySpanExporter())
    try:
        with pytest.raises(ConfigError, match="pip install opentelemetry-exporter-otlp-proto-http"):
            tr.configure_tracing(cfg)
        assert tr.tracing_enabled()  # the provider installed before stays in place
    finally:
        tr.shutdown_tracing()


def test_config_rejects_an_unknown_mode_and_a_non_http_endpoint() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"observability": {"tracing": "jaeger"}})
    assert err.value.field == "observability.tracing"
    with pytest.raises(ConfigError) as err:
        parse_config({"observability": {"otlp_endpoint": "collector:4317"}})
    assert err.value.field == "observability.otlp_endpoint"
    default = parse_config(None).observability
    assert (default.tracing, default.otlp_endpoint, default.service_name, default.metrics) == (
        "off",
        "http://127.0.0.1:4318/v1/traces",
        "kvtide",
        True,
    )


def test_a_transfer_has_a_known_direction() -> None:
    # (Blocks are counted by KVTransferParams.num_blocks: tests/unit/test_kv_params.py.)
    with pytest.raises(ValueError, match="direction"):
        tr.kv_transfer_attrs(1, 16, 1, "sideways", 16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="moved_bytes=-1"):
        tr.kv_transfer_attrs(1, 16, 1, "decode_to_prefill", -1)
