"""One chat request through the running app is one trace, exported over OTLP/HTTP.

A second ingress with ``observability.tracing: otlp`` is deployed under ``/traced`` in
front of the shared app's engines; its exporter sends to an OTLP/HTTP receiver this test
runs (a plain HTTP server decoding ``ExportTraceServiceRequest``), as a collector would.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import httpx
import pytest
from app_calls import pulled, usage_of
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from ray import serve

from orchestrator.observability import tracing as tr
from orchestrator.runtime import APP_NAME
from orchestrator.serve.ingress import Ingress

pytestmark = pytest.mark.engine

TRACE_ID = uuid.uuid4().hex
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class Receiver:
    """An OTLP/HTTP trace receiver: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                with receiver.lock:
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            receiver.spans.extend(scope.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list[Any]:
        with self.lock:
            return [s for s in self.spans if s.trace_id.hex() == trace_id]


@pytest.fixture(scope="module")
def traced(kvtide_app: Any) -> Iterator[tuple[str, Receiver]]:
    receiver = Receiver()
    config = kvtide_app.config
    observability = config.observability.model_copy(
        update={
            "tracing": "otlp",
            "otlp_endpoint": f"http://127.0.0.1:{receiver.port}/v1/traces",
        }
    )
    traced_config = config.model_copy(update={"observability": observability})
    prefill = serve.get_deployment_handle("prefill-pool", app_name=APP_NAME)
    decode = serve.get_deployment_handle("decode-pool", app_name=APP_NAME)
    serve.run(
        Ingress.bind(traced_config, prefill, decode), name="kvtide-traced", route_prefix="/traced"
    )
    yield kvtide_app.base_url + "/traced", receiver
    serve.delete("kvtide-traced")
    receiver.server.shutdown()


def _chat(url: str, messages: list[dict[str, str]], traceparent: str | None) -> dict[str, Any]:
    headers = {"x-session-id": "it-traced"}
    if traceparent:
        headers["traceparent"] = traceparent
    resp = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "kvtide-tiny", "messages": messages, "max_tokens": 8, "temperature": 0},
        headers=headers,
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def test_a_chat_turn_is_one_trace_from_ingress_to_decode(traced: tuple[str, Receiver]) -> None:
    url, receiver = traced
    words = " ".join(f"w{i % 97}" for i in range(400))
    messages = [{"role": "user", "content": words}]
    first = _chat(url, messages, None)
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and then?"},
    ]
    second = _chat(url, messages, TRACEPARENT)  # pulls turn 1's KV back
    pulled(second["kvtide"], usage_of(first))

    # The exporter sends in batches (every few seconds): wait for the whole trace.
    deadline = time.monotonic() + 60
    while len(receiver.trace(TRACE_ID)) < 8:
        assert time.monotonic() < deadline, [s.name for s in receiver.trace(TRACE_ID)]
        time.sleep(0.2)
    spans = receiver.trace(TRACE_ID)
    by_id = {s.span_id: s for s in spans}

    def label(span: Any) -> str:
        """A span's name; a transfer also names its parent (there is one under each)."""
        if span.name != tr.SPAN_KV_TRANSFER:
            return str(span.name)
        return f"{span.name}@{by_id[span.parent_span_id].name}"

    parent_of = {
        label(s): by_id[s.parent_span_id].name if s.parent_span_id in by_id else None for s in spans
    }
    assert parent_of == {
        tr.SPAN_INGRESS: None,  # its parent is the caller's span (from traceparent)
        tr.SPAN_ROUTE: tr.SPAN_INGRESS,
        tr.SPAN_KV_DECISION: tr.SPAN_ROUTE,
        tr.SPAN_PREFILL: tr.SPAN_ROUTE,
        f"{tr.SPAN_KV_TRANSFER}@{tr.SPAN_PREFILL}": tr.SPAN_PREFILL,
        tr.SPAN_DECODE: tr.SPAN_ROUTE,
        f"{tr.SPAN_KV_TRANSFER}@{tr.SPAN_DECODE}": tr.SPAN_DECODE,
        tr.SPAN_SEND_BACK: tr.SPAN_ROUTE,
    }
    ingress = next(s for s in spans if s.name == tr.SPAN_INGRESS)
    assert ingress.parent_span_id.hex() == "00f067aa0ba902b7"
    for span in spans:
        if span.name == tr.SPAN_KV_TRANSFER:
            attrs = {a.key: a.value for a in span.attributes}
            # What moved, as the reading engine measured it, is what the turn reports:
            # the decode engine reads at least the prompt's last (partial) block; the
            # prefill engine reads what it lacked of the history sent back.
            moved = attrs[tr.KV_TRANSFER_BYTES].int_value
            direction = attrs[tr.KV_TRANSFER_DIRECTION].string_value
            assert moved == second["kvtide"]["kv_transfer_bytes"][direction], (direction, attrs)
            if direction == "prefill_to_decode":
                assert by_id[span.parent_span_id].name == tr.SPAN_DECODE and moved > 0
            assert attrs[tr.KV_TRANSFER_OFFERED_BYTES].int_value > 0
            assert attrs[tr.KV_TRANSFER_BLOCKS].int_value > 0
            assert attrs[tr.KV_TRANSFER_BACKEND].string_value == "nixl"
