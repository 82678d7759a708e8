"""The router's real turn, traced: one request is one trace, continuing the caller's.

The engines are the fake pools of test_router.py; the root span is the one the ingress
starts (``tracing.start_ingress_span``); everything below it is the router's own code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_router import FakePool, Script, decode_script, make_router, prefill_script

from engines.base import GenerateChunk, GenerateRequest
from orchestrator.config import parse_config
from orchestrator.observability import tracing as tr
from orchestrator.router import Router, Turn

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
        Turn(prompt_token_ids=prompt, max_tokens=3, session_id="s1", trace_parent=root)
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


BLOCK_BYTES = 16 * 4096  # a block of 16 tokens at 4096 B per token


def reading_decode_script(read_bytes: int | None) -> Script:
    """``decode_script``, whose engine says on its first chunk what its pull read."""

    def run(req: GenerateRequest) -> list[GenerateChunk]:
        chunks = decode_script(req)
        chunks[0] = msgspec.structs.replace(chunks[0], kv_read_bytes=read_bytes)
        return chunks

    return run


def test_a_pulled_back_turn_is_one_trace_with_transfer_bytes(
    spans: InMemorySpanExporter,
) -> None:
    # The engines offer whole histories but read only what their prefix caches lack:
    # the prefill engine one block of the 3 decode kept, the decode engine one of 2.
    router = make_router(
        FakePool(prefill_script(cached=101, read_bytes=BLOCK_BYTES)),
        FakePool(reading_decode_script(BLOCK_BYTES)),
        block_size_tokens=16,
        kv_bytes_per_token=4096,
    )
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
    # The fake decode engine kept 3 blocks (pulled back); the prefill engine 2 blocks:
    # offered. Each engine read one block: moved.
    back, forth = transfers["decode_to_prefill"], transfers["prefill_to_decode"]
    assert (
        back[tr.KV_TRANSFER_BLOCKS],
        back[tr.KV_TRANSFER_OFFERED_BYTES],
        back[tr.KV_TRANSFER_BYTES],
    ) == (3, 3 * BLOCK_BYTES, BLOCK_BYTES)
    assert (
        forth[tr.KV_TRANSFER_BLOCKS],
        forth[tr.KV_TRANSFER_OFFERED_BYTES],
        forth[tr.KV_TRANSFER_BYTES],
    ) == (2, 2 * BLOCK_BYTES, BLOCK_BYTES)
    assert back[tr.KV_TRANSFER_BACKEND] == "nixl"
    decode = by_name[tr.SPAN_DECODE].attributes or {}
    assert decode[tr.DECODE_TOKENS] == 3 and decode[tr.DECODE_TTFT_S] > 0


def test_metrics_count_what_the_turns_did(spans: InMemorySpanExporter) -> None:
    router = make_router(
        FakePool(prefill_script(cached=101, read_bytes=BLOCK_BYTES)),
        FakePool(reading_decode_script(BLOCK_BYTES)),
        block_size_tokens=16,
        kv_bytes_per_token=4096,
    )
    asyncio.run(traced_turn(router, PROMPT, {}))
    asyncio.run(traced_turn(router, [*PROMPT, 11, 12, 13, 50], {}))
    snap = router.metrics.snapshot()
    assert snap["kvtide_kv_recomputes_total"] == 1
    assert snap["kvtide_kv_send_backs_total"] == 1
    # Moved: what the engines read (one send-back, two forward reads of a block each);
    # offered, apart: the blocks named (3 sent back; 2 offered to each decode).
    assert snap['kvtide_kv_transfer_bytes_total{direction="decode_to_prefill"}'] == BLOCK_BYTES
    assert snap['kvtide_kv_transfer_bytes_total{direction="prefill_to_decode"}'] == (
        2 * BLOCK_BYTES
    )
    offered = "kvtide_kv_transfer_offered_bytes_total"
    assert snap[f'{offered}{{direction="decode_to_prefill"}}'] == 3 * BLOCK_BYTES
    assert snap[f'{offered}{{direction="prefill_to_decode"}}'] == 2 * 2 * BLOCK_BYTES
    assert snap['kvtide_ttft_seconds_count{pool="decode"}'] == 2


async def reports(router: Router, prompt: list[int]) -> dict[str, object]:
    """The turn's ``kvtide`` object, as the client gets it."""
    last = None
    async for _, report in router.run_turn(
        Turn(prompt_token_ids=prompt, max_tokens=3, session_id="s1")
    ):
        last = report
    await router.settled()
    assert last is not None
    return last.as_dict()


def test_the_turn_reports_the_bytes_moved_and_offered_apart() -> None:
    router = make_router(
        FakePool(prefill_script(cached=101, read_bytes=BLOCK_BYTES)),
        FakePool(reading_decode_script(2 * BLOCK_BYTES)),
        block_size_tokens=16,
        kv_bytes_per_token=4096,
    )
    first = asyncio.run(reports(router, PROMPT))
    # Turn 1: nothing sent back; decode read both blocks prefill offered.
    assert first["kv_transfer_bytes"] == {
        "prefill_to_decode": 2 * BLOCK_BYTES,
        "decode_to_prefill": 0,
    }
    assert first["kv_offered_bytes"] == {
        "prefill_to_decode": 2 * BLOCK_BYTES,
        "decode_to_prefill": 0,
    }
    second = asyncio.run(reports(router, [*PROMPT, 11, 12, 13, 50]))
    # Turn 2: 3 blocks offered back, one read; the forward read as before.
    assert second["kv_transfer_bytes"] == {
        "prefill_to_decode": 2 * BLOCK_BYTES,
        "decode_to_prefill": BLOCK_BYTES,
    }
    assert second["kv_offered_bytes"] == {
        "prefill_to_decode": 2 * BLOCK_BYTES,
        "decode_to_prefill": 3 * BLOCK_BYTES,
    }


def test_a_send_back_that_moved_nothing_reports_the_prefix_cache_as_the_source() -> None:
    # The prefill engine had every block of the history already: its pull read 0 bytes.
    router = make_router(
        FakePool(prefill_script(cached=101, read_bytes=0)),
        FakePool(reading_decode_script(2 * BLOCK_BYTES)),
        block_size_tokens=16,
        kv_bytes_per_token=4096,
    )
    asyncio.run(reports(router, PROMPT))
    second = asyncio.run(reports(router, [*PROMPT, 11, 12, 13, 50]))
    assert second["kv_plan"] == "pull"
    assert second["kv_source"] == "prefix_cache"
    assert second["kv_transfer_bytes"]["decode_to_prefill"] == 0


def test_bytes_an_engine_does_not_measure_are_null_never_the_offered_figure() -> None:
    # Engines that cannot say whose their reads were (vLLM's own connector).
    router = make_router(
        FakePool(prefill_script(cached=101, read_bytes=None)),
        FakePool(reading_decode_script(None)),
        block_size_tokens=16,
        kv_bytes_per_token=4096,
    )
    asyncio.run(reports(router, PROMPT))
    second = asyncio.run(reports(router, [*PROMPT, 11, 12, 13, 50]))
    assert second["kv_transfer_bytes"] == {"prefill_to_decode": None, "decode_to_prefill": None}
    assert second["kv_offered_bytes"] == {
        "prefill_to_decode": 2 * BLOCK_BYTES,
        "decode_to_prefill": 3 * BLOCK_BYTES,
    }
    snap = router.metrics.snapshot()
    assert not [key for key in snap if key.startswith("kvtide_kv_transfer_bytes_total")]
    assert snap['kvtide_kv_transfer_offered_bytes_total{direction="decode_to_prefill"}'] == (
        3 * BLOCK_BYTES
    )
