"""The router's real turn, traced: one request is one trace, continuing the caller's.

The engines are the fake pools of test_router.py; the root span is the one the ingress
starts (``tracing.start_ingress_span``); everything below it is the router's own code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_router import FakePool, decode_script, make_router, prefill_script

from orchestrator.config import parse_config
from orchestrator.observability import tracing as tr
from orchestrator.router import Router

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
PROMPT = list(range(100))


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    config = parse_config({"observability": {"tracing": "console"}}).observability
    tr.configure_tracing(config, exporter=exporter)
    yield exporter
    tr.shutdown_tracing()


async def traced_turn(router: Router, prompt: list[int], headers: dict[str, str]) -> None:
    root = tr.start_ingress_span(
        headers, method="POST", route="/v1/completions", operation="text_completion", model="m"
    )
    async for _ in router.run_turn(
        prompt_token_ids=prompt, max_tokens=3, session_id="s1", trace_parent=root
    ):
        pass
    await router.settled()
    root.end()


def tree(spans: list[ReadableSpan]) -> dict[str, list[str]]:
    """Span name → names of its children (in start order)."""
    by_id = {s.context.span_id: s for s in spans}
    children: dict[str, list[str]] = {s.name: [] for s in spans}
    for s in sorted(spans, key=lambda s: s.start_time or 0):
        if s.parent is not None and s.parent.span_id in by_id:
            children[by_id[s.parent.span_id].name].append(s.name)
    return children


def test_a_pulled_back_turn_is_one_trace_with_transfer_bytes(
    spans: InMemorySpanExporter,
) -> None:
    router = make_router(FakePool(prefill_script(cached=101)), FakePool(decode_script))
    router.block_size_tokens, router.kv_bytes_per_token = 16, 4096
    asyncio.run(traced_turn(router, PROMPT, {}))  # turn 1: keeps KV on decode
    spans.clear()
    asyncio.run(traced_turn(router, [*PROMPT, 11, 12, 13, 50], {"traceparent": TRACEPARENT}))

    finished = list(spans.get_finished_spans())
    assert {format(s.context.trace_id, "032x") for s in finished} == {TRACE_ID}
    assert tree(finished) == {
        tr.SPAN_INGRESS: [tr.SPAN_ROUTE],
        tr.SPAN_ROUTE: [tr.SPAN_KV_DECISION, tr.SPAN_PREFILL, tr.SPAN_DECODE, tr.SPAN_SEND_BACK],
        tr.SPAN_KV_DECISION: [],
        tr.SPAN_PREFILL: [tr.SPAN_KV_TRANSFER],
        tr.SPAN_DECODE: [tr.SPAN_KV_TRANSFER],
        tr.SPAN_KV_TRANSFER: [],
        tr.SPAN_SEND_BACK: [],
    }
    by_name = {s.name: s for s in finished if s.name != tr.SPAN_KV_TRANSFER}
    decision = by_name[tr.SPAN_KV_DECISION].attributes or {}
    assert (decision[tr.KV_PLAN], decision[tr.KV_PLAN_REASON]) == ("pull", "reuse")
    assert (by_name[tr.SPAN_ROUTE].attributes or {})[tr.KV_SOURCE] == "sent_back"
    transfers = {
        (s.attributes or {})[tr.KV_TRANSFER_DIRECTION]: s.attributes or {}
        for s in finished
        if s.name == tr.SPAN_KV_TRANSFER
    }
    # The fake decode engine kept 3 blocks (pulled back); the prefill engine 2 blocks.
    back, forth = transfers["decode_to_prefill"], transfers["prefill_to_decode"]
    assert (back[tr.KV_TRANSFER_BLOCKS], back[tr.KV_TRANSFER_BYTES]) == (3, 3 * 16 * 4096)
    assert (forth[tr.KV_TRANSFER_BLOCKS], forth[tr.KV_TRANSFER_BYTES]) == (2, 2 * 16 * 4096)
    assert back[tr.KV_TRANSFER_BACKEND] == "nixl"
    decode = by_name[tr.SPAN_DECODE].attributes or {}
    assert decode[tr.DECODE_TOKENS] == 3 and decode[tr.DECODE_TTFT_S] > 0


def test_metrics_count_what_the_turns_did(spans: InMemorySpanExporter) -> None:
    router = make_router(FakePool(prefill_script(cached=101)), FakePool(decode_script))
    router.block_size_tokens, router.kv_bytes_per_token = 16, 4096
    asyncio.run(traced_turn(router, PROMPT, {}))
    asyncio.run(traced_turn(router, [*PROMPT, 11, 12, 13, 50], {}))
    snap = router.metrics.snapshot()
    assert snap["kvtide_kv_recomputes_total"] == 1
    assert snap["kvtide_kv_send_backs_total"] == 1
    assert snap['kvtide_kv_transfer_bytes_total{direction="decode_to_prefill"}'] == 3 * 16 * 4096
    assert snap['kvtide_ttft_seconds_count{pool="decode"}'] == 2
