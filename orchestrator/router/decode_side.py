"""The router's decode side: a turn's tokens streamed from a decode engine that pulls
the prompt's KV from the prefill engine, and, when that engine fails mid-stream, the
turn continued on another (its prompt and the tokens streamed so far prefilled again),
``max_migrations`` times at most; the finished turn handed to the KV service.

A mixin of ``Router`` (the attributes used are the router's).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from opentelemetry.trace import Span, SpanKind

from engines.base import GenerateChunk, GenerateRequest
from engines.kv_params import KVTransferParams
from orchestrator.errors import (
    EngineUnavailable,
)
from orchestrator.kv.messages import KVDecision
from orchestrator.observability import tracing as tr
from orchestrator.observability.metrics import Metrics
from orchestrator.router.handover import HandOver
from orchestrator.router.integrity import IntegrityCheck, take_logprobs
from orchestrator.router.prefill_side import plain_prefill
from orchestrator.router.streams import bounded
from orchestrator.router.turn_report import (
    PoolClient,
    Streamed,
    TurnReport,
)
from policies.kv_lifecycle import HOST_POOL

log = logging.getLogger("kvtide.router")

__all__ = ["DecodeSide"]


class DecodeSide:
    """``Router``'s decode side (see the module)."""

    metrics: Metrics
    clock: Callable[[], float]
    max_migrations: int
    handover: HandOver
    integrity: IntegrityCheck
    decode_pool_for: Callable[[int], tuple[str, PoolClient]]
    _prefill_turn: Callable[..., Any]
    _recompute: Callable[..., Any]
    _transfer_attrs: Callable[..., dict[str, Any]]
    _count_transfer: Callable[..., None]

    async def _stream(
        self,
        route: Span,
        decision: KVDecision,
        params: KVTransferParams,
        base: dict[str, Any],
        rid: str,
        max_tokens: int,
        report: TurnReport,
        t0: float,
        t_engine: float,
        prompt_text: str | None,
    ) -> AsyncIterator[tuple[GenerateChunk, TurnReport]]:
        prompt_token_ids: list[int] = base["prompt_token_ids"]
        with tr.span(
            tr.SPAN_PREFILL, {tr.ENGINE_POOL: "prefill"}, parent=route, kind=SpanKind.CLIENT
        ) as prefill_span:
            pre = await self._prefill_turn(prefill_span, decision, params, base, rid, report)
        report.prefill_s = self.clock() - t_engine
        # kvtide's own work: deciding before the engines, booking after them.
        report.router_s = t_engine - t0
        report.num_cached_tokens = pre.num_cached_tokens
        # The prompt's log probabilities, when asked: the prefill computed them.
        report.extra["prompt_logprobs"] = pre.prompt_logprobs
        if pre.num_cached_tokens > 0:
            # A pull whose engine says it read nothing found every block in its own
            # prefix cache: the KV came from there, not back from decode.
            pulled = decision.kind == "pull" and not report.pull_fallback
            report.kv_source = (
                "prefix_cache"
                if not pulled or pre.kv_read_bytes == 0
                else "host_tier"
                if decision.source_pool == HOST_POOL
                else "sent_back"
            )
        if pre.kv_transfer_params is None:
            raise EngineUnavailable(
                "the prefill engine returned no kv_transfer_params; is it configured with "
                "a KV connector (kv_transfer_config)?"
            )
        report.decode_pool, decode = self.decode_pool_for(len(prompt_token_ids))
        # Only a session's decode keeps its blocks for the next turn to pull back; a
        # sessionless one frees them when it finishes (engines/kv_connector.py).
        keep = report.session_id is not None
        out = Streamed()
        # A turn sampled for the integrity check: its decode gives each token's log
        # probability (``orchestrator.router.integrity``).
        checked = report.extra.get("integrity") is not None
        while True:
            decode_req = GenerateRequest(
                request_id=f"{rid}-d" if not report.migrations else f"{rid}-d{report.migrations}",
                max_tokens=max_tokens - len(out.ids),
                kv_transfer_params=pre.kv_transfer_params.for_decode(keep=keep),
                sampling_params=report.extra["sampling_params"],
                **{
                    **base,
                    "prompt_token_ids": [*prompt_token_ids, *out.ids],
                    "prompt_logprobs": None,
                },
                logprobs=0 if checked else None,
            )
            try:
                with tr.span(
                    tr.SPAN_DECODE,
                    {tr.ENGINE_POOL: report.decode_pool},
                    parent=route,
                    kind=SpanKind.CLIENT,
                ) as decode_span:
                    async for item in self._decode(
                        route, decode_span, decode, decode_req, pre, report, t0, out, prompt_text
                    ):
                        yield item
                return
            except EngineUnavailable:
                if report.migrations >= self.max_migrations or len(out.ids) >= max_tokens:
                    raise
            # The decode engine died mid-turn: continue on another. Prefill the prompt
            # and the tokens already streamed, decode the rest; nothing is sent twice.
            report.migrations += 1
            log.warning("turn %s: decode failed after %d tokens; migrating", rid, len(out.ids))
            resumed = {**base, "prompt_token_ids": [*prompt_token_ids, *out.ids]}
            pre = await self._recompute(
                plain_prefill(f"{rid}-m{report.migrations}", resumed),
                report,
                report.extra["deadline_s"],
            )

    async def _decode(
        self,
        route: Span,
        span: Span,
        decode: PoolClient,
        decode_req: GenerateRequest,
        pre: GenerateChunk,
        report: TurnReport,
        t0: float,
        out: Streamed,
        prompt_text: str | None,
    ) -> AsyncIterator[tuple[GenerateChunk, TurnReport]]:
        """Stream one decode request; ``out`` holds what the turn streamed so far (also
        from engines before this one, when the turn migrated)."""
        session_id = report.session_id
        prompt_token_ids = decode_req.prompt_token_ids[: report.num_prompt_tokens]
        output_ids, output_text = out.ids, out.text
        first = not output_ids and report.ttft_s == 0.0
        # What this decode engine read for the request: its first chunk says. Each decode
        # request's read is the turn's, also after a migration (a new prompt read).
        read_bytes: int | None = None
        said = pulled = False
        prev = self.clock()
        t_start = tr.now_ns()
        deadline_s: float = report.extra["deadline_s"]
        # Closed with the turn: a consumer that stops reading (the client went away)
        # aborts the decode request now, not when the generator is collected.
        stream = bounded(decode.generate(decode_req), deadline_s, self.clock, report.decode_pool)
        async with contextlib.aclosing(stream):
            async for engine_chunk in stream:
                now = self.clock()
                chunk = take_logprobs(report, engine_chunk)
                if not said:
                    read_bytes, said = chunk.kv_read_bytes, True
                if not pulled and (chunk.token_ids or chunk.finished):
                    pulled = True
                    # The decode engine pulled the prompt's KV before its first token.
                    attrs = self._transfer_attrs(
                        pre.kv_transfer_params, "prefill_to_decode", read_bytes
                    )
                    tr.record_span(tr.SPAN_KV_TRANSFER, t_start, tr.now_ns(), attrs, parent=span)
                    self._count_transfer(report, "prefill_to_decode", attrs)
                if first and (chunk.token_ids or chunk.finished):
                    report.ttft_s = now - t0
                    first = False
                    self.metrics.observe_ttft(report.decode_pool, report.ttft_s)
                elif chunk.token_ids:  # a stream item may carry several tokens
                    self.metrics.observe_itl(
                        report.decode_pool, (now - prev) / len(chunk.token_ids)
                    )
                prev = now
                output_ids.extend(chunk.token_ids)
                output_text.append(chunk.text)
                report.num_completion_tokens = len(output_ids)
                if chunk.finished:
                    report.finish_reason = chunk.finish_reason
                    report.total_s = now - t0
                    report.decode_step_s = chunk.engine_step_s
                    tr.set_attrs(
                        span,
                        {
                            tr.DECODE_TTFT_S: report.ttft_s,
                            tr.DECODE_TOKENS: len(output_ids),
                            tr.GEN_AI_RESPONSE_FINISH_REASONS: (chunk.finish_reason or "",),
                        },
                    )
                    kept = chunk.kv_transfer_params
                    # A sessionless turn whose decode kept nothing leaves nothing to book
                    # or drain: no call to the service.
                    if session_id is not None or (kept is not None and kept.kept_blocks()):
                        done = self.handover.message(
                            report, chunk, prompt_token_ids, out, prompt_text
                        )
                        self.handover.give(route, report, done)
                    report.extra["decode_engine_id"] = chunk.engine_id
                    self.integrity.after_turn(
                        report,
                        prompt_token_ids,
                        output_ids,
                        report.extra.get("integrity_logprobs", []),
                    )
                    report.router_s += self.clock() - now
                yield chunk, report
