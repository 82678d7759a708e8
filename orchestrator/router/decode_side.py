"""The router's decode side: a turn's tokens streamed from a decode engine that pulls
the prompt's KV from the prefill engine, and, when that engine fails mid-stream, the
turn continued on another (its prompt and the tokens streamed so far prefilled again
by the prefill side), ``max_migrations`` times at most; the finished turn handed to the
KV service (``HandOver``) and, when sampled, checked (``IntegrityCheck``). The decode
pool of a prompt is ``DecodePools``' choice.

A turn planned ``extend`` (``orchestrator.router.extend_plan``) has no prefill: its
decode request carries no remote prefill (``in_place``), asks for the engine that kept
the session's history (``GenerateRequest.engine_id``) and computes the prompt itself,
its history found in that engine's prefix cache; its report's ``kv_source`` is
``extended`` where the engine says so (cached tokens above 0).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

from opentelemetry.trace import Span, SpanKind

from engines.base import GenerateChunk, GenerateRequest
from engines.kv_params import KVTransferParams
from orchestrator.errors import EngineUnavailable
from orchestrator.kv.messages import KVDecision
from orchestrator.observability import tracing as tr
from orchestrator.observability.metrics import Metrics
from orchestrator.router.handover import HandOver
from orchestrator.router.integrity import IntegrityCheck, take_logprobs
from orchestrator.router.prefill_side import PrefillSide
from orchestrator.router.streams import bounded
from orchestrator.router.transfers import Transfers
from orchestrator.router.turn import TurnState
from orchestrator.router.turn_report import PoolClient, Streamed, TurnReport

log = logging.getLogger("kvtide.router")

__all__ = ["DecodePool", "DecodePools", "DecodeSide", "in_place"]


def in_place(state: TurnState, decision: KVDecision) -> GenerateChunk:
    """An ``extend`` turn's stand-in for a prefill's last chunk: no remote prefill for
    its decode to read (its engine computes the prompt), and the engine that kept the
    session's history, which its decode asks for."""
    params = decision.kv_transfer_params
    assert decision.kind == "extend" and params is not None
    return GenerateChunk(
        request_id=f"{state.turn.request_id}-x",
        kv_transfer_params=KVTransferParams(),
        engine_id=params.remote_engine_id,
    )


class DecodePool(NamedTuple):
    """The decode pool a prompt goes to, and its name (the report's ``decode_pool``)."""

    name: str
    pool: PoolClient


class DecodePools:
    """The decode pools: the TP-only pool, and the long-context pool (TP+DCP) with the
    pool planner's threshold (``placement.pools.PoolPlan.threshold_tokens``)."""

    def __init__(
        self, decode: PoolClient, long: PoolClient | None, threshold_tokens: int | None
    ) -> None:
        if (long is None) != (threshold_tokens is None):
            raise ValueError(
                "a long-context decode pool needs long_context_threshold_tokens, and the "
                "threshold needs the pool: give both or neither"
            )
        self.decode = decode
        self.long = long
        self.threshold_tokens = threshold_tokens

    def for_prompt(self, num_prompt_tokens: int) -> DecodePool:
        """The long-context pool above the threshold, the TP-only pool up to it."""
        threshold = self.threshold_tokens
        if self.long is not None and threshold is not None and num_prompt_tokens > threshold:
            return DecodePool("decode_long", self.long)
        return DecodePool("decode", self.decode)


class DecodeSide:
    """A turn's tokens on the decode pools (see the module)."""

    def __init__(
        self,
        *,
        pools: DecodePools,
        prefill: PrefillSide,
        handover: HandOver,
        integrity: IntegrityCheck,
        transfers: Transfers,
        metrics: Metrics,
        clock: Callable[[], float],
        max_migrations: int,
    ) -> None:
        self.pools = pools
        # Prefills a migrated turn's prompt and the tokens streamed so far again.
        self.prefill = prefill
        self.handover = handover
        self.integrity = integrity
        self.transfers = transfers
        self.metrics = metrics
        self.clock = clock
        # A turn whose decode engine dies continues on another, this many times at most.
        self.max_migrations = max_migrations

    async def stream(
        self, route: Span, state: TurnState, pre: GenerateChunk, t0: float
    ) -> AsyncIterator[tuple[GenerateChunk, TurnReport]]:
        """The turn's tokens, decoded from the prefill's last chunk ``pre``, each with
        the turn's report (``t0``: when the turn began)."""
        turn, report = state.turn, state.report
        rid, prompt_token_ids, max_tokens = turn.request_id, turn.prompt_token_ids, turn.max_tokens
        report.decode_pool, decode = self.pools.for_prompt(len(prompt_token_ids))
        # Only a session's decode keeps its blocks for the next turn to pull back; a
        # sessionless one frees them when it finishes (engines/kv_connector.py).
        keep = report.session_id is not None
        out = Streamed()
        # A turn sampled for the integrity check: its decode gives each token's log
        # probability (``orchestrator.router.integrity``).
        checked = state.integrity is not None
        # An extended turn's decode runs where the session's history is kept.
        engine_id = pre.engine_id if report.kv_plan == "extend" else None
        while True:
            assert pre.kv_transfer_params is not None  # every prefill is checked (carrying_params)
            decode_req = turn.decode_request(
                f"{rid}-d" if not report.migrations else f"{rid}-d{report.migrations}",
                [*prompt_token_ids, *out.ids],
                max_tokens - len(out.ids),
                pre.kv_transfer_params.for_decode(keep=keep),
                logprobs=0 if checked else None,
                engine_id=None if report.migrations else engine_id,
            )
            try:
                with tr.span(
                    tr.SPAN_DECODE,
                    {tr.ENGINE_POOL: report.decode_pool},
                    parent=route,
                    kind=SpanKind.CLIENT,
                ) as decode_span:
                    async for item in self._decode(
                        route, decode_span, decode, decode_req, pre, state, t0, out
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
            resumed = turn.prefill_request(
                f"{rid}-m{report.migrations}",
                KVTransferParams.keep_for_decode(),
                [*prompt_token_ids, *out.ids],
            )
            pre = await self.prefill.recompute(resumed, report, state.deadline_s)

    async def _decode(
        self,
        route: Span,
        span: Span,
        decode: PoolClient,
        decode_req: GenerateRequest,
        pre: GenerateChunk,
        state: TurnState,
        t0: float,
        out: Streamed,
    ) -> AsyncIterator[tuple[GenerateChunk, TurnReport]]:
        """Stream one decode request; ``out`` holds what the turn streamed so far (also
        from engines before this one, when the turn migrated)."""
        report = state.report
        session_id = report.session_id
        output_ids, output_text = out.ids, out.text
        first = not output_ids and report.ttft_s == 0.0
        # What this decode engine read for the request: its first chunk says. Each decode
        # request's read is the turn's, also after a migration (a new prompt read).
        read_bytes: int | None = None
        said = pulled = False
        prev = self.clock()
        t_start = tr.now_ns()
        deadline_s = state.deadline_s
        # Closed with the turn: a consumer that stops reading (the client went away)
        # aborts the decode request now, not when the generator is collected.
        stream = bounded(decode.generate(decode_req), deadline_s, self.clock, report.decode_pool)
        async with contextlib.aclosing(stream):
            async for engine_chunk in stream:
                now = self.clock()
                chunk = take_logprobs(state, engine_chunk)
                if not said:
                    read_bytes, said = chunk.kv_read_bytes, True
                if not pulled and (chunk.token_ids or chunk.finished):
                    pulled = True
                    # The decode engine pulled the prompt's KV before its first token.
                    attrs = self.transfers.attrs(
                        pre.kv_transfer_params, "prefill_to_decode", read_bytes
                    )
                    tr.record_span(tr.SPAN_KV_TRANSFER, t_start, tr.now_ns(), attrs, parent=span)
                    self.transfers.count(report, "prefill_to_decode", attrs)
                if first and report.kv_plan == "extend" and not report.migrations:
                    # The decode engine computed the prompt: its cache hit (on every
                    # output, the first that the serving layer's usage reads included)
                    # is the history it kept.
                    report.num_cached_tokens = chunk.num_cached_tokens
                    if chunk.num_cached_tokens > 0:
                        report.kv_source = "extended"
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
                        done = self.handover.message(state, chunk, out)
                        self.handover.give(route, report, done)
                    state.decode_engine_id = chunk.engine_id
                    self.integrity.after_turn(state, output_ids)
                    report.router_s += self.clock() - now
                yield chunk, report
