"""The router's prefill side: a turn's prompt computed on a prefill engine, pulling the
previous turn's KV back from the decode engine that kept it when the plan says so (a
failed or slow pull becomes a plain prefill), or recomputed on another engine after a
failure; the transfer's bytes (moved and offered) into the metrics and the report.

A mixin of ``Router`` (the attributes used are the router's).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import msgspec
from opentelemetry.trace import Span

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
from orchestrator.router.turn_report import (
    PoolClient,
    TurnReport,
)
from policies.prefix_routing import RouteChoice

log = logging.getLogger("kvtide.router")

__all__ = ["PrefillSide", "plain_prefill"]


def plain_prefill(request_id: str, fields: Mapping[str, Any]) -> GenerateRequest:
    """A prefill that computes the prompt (nothing pulled back) and keeps its KV for the
    decode engine to read."""
    return GenerateRequest(
        request_id=request_id,
        max_tokens=1,
        kv_transfer_params=KVTransferParams.keep_for_decode(),
        **fields,
    )


async def _last(stream: AsyncIterator[GenerateChunk]) -> GenerateChunk:
    try:
        return await final_chunk(stream)
    except RequestFailed as exc:
        raise EngineUnavailable(f"the prefill engine {exc}") from None


class PrefillSide:
    """``Router``'s prefill side (see the module)."""

    prefill: PoolClient
    kv: KVServiceAPI
    metrics: Metrics
    clock: Callable[[], float]
    pull_timeout_s: float
    max_migrations: int
    block_size_tokens: int
    kv_bytes_per_token: int
    prefill_routes: Callable[[str], RouteChoice | None] | None

    async def _prefill(
        self, req: GenerateRequest, deadline_s: float, pull_timeout_s: float | None = None
    ) -> GenerateChunk:
        """The prefill's last chunk. With ``pull_timeout_s`` (a pull) a timeout within the
        request's deadline raises ``TimeoutError`` (the caller recomputes)."""
        limit = deadline_s
        if pull_timeout_s is not None:
            limit = min(deadline_s, self.clock() + pull_timeout_s)
        try:
            return await _last(bounded(self.prefill.generate(req), limit, self.clock, "prefill"))
        except DeadlineExceeded:
            if limit < deadline_s:
                raise TimeoutError from None  # the pull's own bound, not the request's
            raise

    async def _recompute(
        self, req: GenerateRequest, report: TurnReport, deadline_s: float
    ) -> GenerateChunk:
        """A plain prefill (nothing pulled back); when its engine fails, the prompt is
        prefilled again on another, ``max_migrations`` times at most (the pool's
        balancing sends the retry elsewhere; a dead replica leaves Serve's routing)."""
        attempt = req
        while True:
            try:
                return await self._prefill(attempt, deadline_s)
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
        self,
        span: Span,
        decision: KVDecision,
        params: KVTransferParams,
        base: dict[str, Any],
        rid: str,
        report: TurnReport,
    ) -> GenerateChunk:
        """The prefill, pulling the kept KV back when decided; a failed or hung pull
        becomes a plain prefill."""
        t_start = tr.now_ns()
        deadline_s: float = report.extra["deadline_s"]
        first = GenerateRequest(
            request_id=f"{rid}-p", max_tokens=1, kv_transfer_params=params, **base
        )
        if decision.kind != "pull":
            pre = await self._recompute(first, report, deadline_s)
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
                        self._transfer_attrs(
                            decision.kv_transfer_params, "decode_to_prefill", None
                        ),
                        parent=span,
                    ),
                    exc,
                )
                await self.kv.pull_failed(report.session_id)
                report.pull_fallback = True
                pre = await self._recompute(
                    plain_prefill(f"{rid}-r", base),
                    report,
                    deadline_s,
                )
            else:
                # The prefill engine pulled the previous turn's KV back: its own count of
                # what the pull moved is on its output.
                attrs = self._transfer_attrs(
                    decision.kv_transfer_params, "decode_to_prefill", pre.kv_read_bytes
                )
                tr.record_span(tr.SPAN_KV_TRANSFER, t_start, tr.now_ns(), attrs, parent=span)
                self.metrics.inc("kvtide_kv_send_backs_total")
                self._count_transfer(report, "decode_to_prefill", attrs)
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
        if self.prefill_routes is None:
            return
        route = self.prefill_routes(pre.request_id)
        if route is None:
            report.prefill_route_reason = "unrecorded"
            return
        report.prefill_route_reason = route.reason
        report.prefill_matched_tokens = route.num_matched_tokens

    def _transfer_attrs(
        self, params: KVTransferParams | None, direction: tr.Direction, moved: int | None
    ) -> dict[str, Any]:
        num_blocks = params.num_blocks if params is not None else 0
        return tr.kv_transfer_attrs(
            num_blocks, self.block_size_tokens, self.kv_bytes_per_token, direction, moved
        )

    def _count_transfer(
        self, report: TurnReport, direction: tr.Direction, attrs: Mapping[str, Any]
    ) -> None:
        """A finished transfer into the metrics and the turn's report: the bytes it
        moved (where the reading engine measured them) and those offered."""
        moved: int | None = attrs.get(tr.KV_TRANSFER_BYTES)
        offered = int(attrs[tr.KV_TRANSFER_OFFERED_BYTES])
        if moved is not None:
            self.metrics.add_transfer_bytes(direction, moved)
        self.metrics.add_offered_bytes(direction, offered)
        report.add_transfer(direction, moved, offered)
