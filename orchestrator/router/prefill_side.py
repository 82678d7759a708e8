"""The router's prefill side: a turn's prompt computed on a prefill engine, pulling the
previous turn's KV back from the decode engine that kept it when the plan says so (a
failed or slow pull becomes a plain prefill), or recomputed on another engine after a
failure; the transfer's bytes (moved and offered) into the metrics and the report
(``Transfers``). Its prefill's facts (time, cached tokens, where the prompt's KV came
from) go into the turn's report.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import msgspec
from opentelemetry.trace import Span, SpanKind

from engines.base import GenerateChunk, GenerateRequest, RequestFailed, final_chunk
from engines.kv_params import KVTransferParams
from orchestrator.errors import (
    DeadlineExceeded,
    EngineUnavailable,
)
from orchestrator.kv.messages import KVDecision
from orchestrator.kv.service import KVServiceAPI
from orchestrator.observability import tracing as tr
from orchestrator.observability.metrics import Metrics
from orchestrator.router.streams import bounded
from orchestrator.router.transfers import Transfers
from orchestrator.router.turn import TurnState
from orchestrator.router.turn_report import PoolClient, TurnReport
from policies.kv_lifecycle import HOST_POOL
from policies.prefix_routing import RouteChoice

log = logging.getLogger("kvtide.router")

__all__ = ["PrefillSide"]


async def _last(stream: AsyncIterator[GenerateChunk]) -> GenerateChunk:
    try:
        return await final_chunk(stream)
    except RequestFailed as exc:
        raise EngineUnavailable(f"the prefill engine {exc}") from None


def carrying_params(pre: GenerateChunk) -> GenerateChunk:
    """``pre``, a prefill's last chunk, once it is known to carry the params its decode
    pulls the prompt's KV with; an engine without a KV connector gives none (503)."""
    if pre.kv_transfer_params is None:
        raise EngineUnavailable(
            "the prefill engine returned no kv_transfer_params; is it configured with "
            "a KV connector (kv_transfer_config)?"
        )
    return pre


class PrefillSide:
    """A turn's prompt on the prefill pool (see the module)."""

    def __init__(
        self,
        *,
        pool: PoolClient,
        service: Callable[[], KVServiceAPI],
        metrics: Metrics,
        clock: Callable[[], float],
        transfers: Transfers,
        pull_timeout_s: float,
        max_migrations: int,
        routes: Callable[[str], RouteChoice | None] | None,
    ) -> None:
        self.pool = pool
        self.service = service
        self.metrics = metrics
        self.clock = clock
        self.transfers = transfers
        self.pull_timeout_s = pull_timeout_s
        # A prefill whose engine fails is run again on another, this many times at most.
        self.max_migrations = max_migrations
        # With prefix-aware prefill routing: where the request router sent a prefill
        # request (by request id) and why (``orchestrator.cluster.route_notes``).
        self.routes = routes

    async def prefill_turn(
        self,
        route: Span,
        state: TurnState,
        decision: KVDecision,
        params: KVTransferParams,
        t0: float,
        t_engine: float,
    ) -> GenerateChunk:
        """The turn's prefill (``t_engine``: when it began, ``t0``: when the turn did),
        its facts in the turn's report; its last chunk carries the params the decode
        engine pulls the prompt's KV with."""
        report = state.report
        with tr.span(
            tr.SPAN_PREFILL, {tr.ENGINE_POOL: "prefill"}, parent=route, kind=SpanKind.CLIENT
        ) as prefill_span:
            pre = await self._prefill_turn(prefill_span, decision, params, state)
        report.prefill_s = self.clock() - t_engine
        # kvtide's own work: deciding before the engines, booking after them.
        report.router_s = t_engine - t0
        report.num_cached_tokens = pre.num_cached_tokens
        # The prompt's log probabilities, when asked: the prefill computed them.
        report.prompt_logprobs = pre.prompt_logprobs
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
        return carrying_params(pre)

    async def _prefill(
        self, req: GenerateRequest, deadline_s: float, pull_timeout_s: float | None = None
    ) -> GenerateChunk:
        """The prefill's last chunk. With ``pull_timeout_s`` (a pull) a timeout within the
        request's deadline raises ``TimeoutError`` (the caller recomputes)."""
        limit = deadline_s
        if pull_timeout_s is not None:
            limit = min(deadline_s, self.clock() + pull_timeout_s)
        try:
            return await _last(bounded(self.pool.generate(req), limit, self.clock, "prefill"))
        except DeadlineExceeded:
            if limit < deadline_s:
                raise TimeoutError from None  # the pull's own bound, not the request's
            raise

    async def recompute(
        self, req: GenerateRequest, report: TurnReport, deadline_s: float
    ) -> GenerateChunk:
        """A plain prefill (nothing pulled back) whose last chunk carries the params
        decode pulls with; when its engine fails, the prompt is prefilled again on
        another, ``max_migrations`` times at most (the pool's balancing sends the retry
        elsewhere; a dead replica leaves Serve's routing)."""
        attempt = req
        while True:
            try:
                return carrying_params(await self._prefill(attempt, deadline_s))
            except EngineUnavailable:
                if report.prefill_retries >= self.max_migrations:
                    raise
            report.prefill_retries += 1
            log.warning("turn %s: prefill failed; prefilling again", report.request_id)
            attempt = msgspec.structs.replace(
                req, request_id=f"{req.request_id}{report.prefill_retries}"
            )
            # A moment for Serve to see the replica gone (bounded by the deadline).
            await asyncio.sleep(
                max(0.0, min(0.1 * report.prefill_retries, deadline_s - self.clock()))
            )

    async def _prefill_turn(
        self, span: Span, decision: KVDecision, params: KVTransferParams, state: TurnState
    ) -> GenerateChunk:
        """The prefill, pulling the kept KV back when decided; a failed or hung pull
        becomes a plain prefill."""
        t_start = tr.now_ns()
        turn, report, deadline_s = state.turn, state.report, state.deadline_s
        rid, prompt = turn.request_id, turn.prompt_token_ids
        first = turn.prefill_request(f"{rid}-p", params, prompt)
        if decision.kind != "pull":
            pre = await self.recompute(first, report, deadline_s)
        else:
            try:
                pre = await self._prefill(first, deadline_s, self.pull_timeout_s)
            except (TimeoutError, EngineUnavailable) as exc:
                # The pull hung or failed: forget those blocks and prefill from scratch.
                assert report.session_id is not None
                self.metrics.inc("kvtide_kv_transfer_failures_total")
                tr.record_error(
                    tr.record_span(
                        tr.SPAN_KV_TRANSFER,
                        t_start,
                        tr.now_ns(),
                        self.transfers.attrs(
                            decision.kv_transfer_params, "decode_to_prefill", None
                        ),
                        parent=span,
                    ),
                    exc,
                )
                await self.service().pull_failed(report.session_id)
                report.pull_fallback = True
                plain = turn.prefill_request(f"{rid}-r", KVTransferParams.keep_for_decode(), prompt)
                pre = await self.recompute(plain, report, deadline_s)
            else:
                # The prefill engine pulled the previous turn's KV back: its own count of
                # what the pull moved is on its output.
                attrs = self.transfers.attrs(
                    decision.kv_transfer_params, "decode_to_prefill", pre.kv_read_bytes
                )
                tr.record_span(tr.SPAN_KV_TRANSFER, t_start, tr.now_ns(), attrs, parent=span)
                self.metrics.inc("kvtide_kv_send_backs_total")
                self.transfers.count(report, "decode_to_prefill", attrs)
        if decision.kind != "pull" or report.pull_fallback:
            self.metrics.inc("kvtide_kv_recomputes_total")
        tr.set_attrs(
            span,
            {tr.KV_CACHED_TOKENS: pre.num_cached_tokens, tr.PULL_FALLBACK: report.pull_fallback},
        )
        self._note_route(pre, report)
        return pre

    def _note_route(self, pre: GenerateChunk, report: TurnReport) -> None:
        """Which prefill engine computed the turn's prompt, and why it was chosen."""
        report.prefill_replica = pre.engine_id
        if self.routes is None:
            return
        route = self.routes(pre.request_id)
        if route is None:
            report.prefill_route_reason = "unrecorded"
            return
        report.prefill_route_reason = route.reason
        report.prefill_matched_tokens = route.num_matched_tokens
