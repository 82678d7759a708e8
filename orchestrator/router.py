"""The disaggregated turn: prefill → NIXL → decode, with the session's KV reused.

``Router.run_turn`` drives one request through the pools:

1. ask the KV planner what to do with this session's prompt (pull the previous turn's KV
   back from the decode engine that holds it, or plain prefill);
2. prefill with ``max_tokens=1`` and ``do_remote_decode`` (plus the pull params when
   reusing), bounded by ``pull_timeout_s``: a hung or failed pull becomes a plain prefill,
   never a lost turn;
3. stream decode with the prefill engine's returned ``kv_transfer_params`` (the decode
   engine pulls the prompt's KV over NIXL);
4. hand the decode engine's final params (its kept blocks) back to the planner.

Draining. vLLM 0.32's decode engine pins every P/D request's blocks until its TTL
(``decoder_kv_blocks_ttl``) unless a prefill engine reads them; only a completed read
frees them early. So the router *drains* blocks nobody will reuse — a request without a
session, a session closed or evicted by the memory budget — with a ``max_tokens=1``
pull into the prefill engine (where the KV lands in its evictable prefix cache). A drain
needs the exact tokens the blocks hold (checked against the record's prefix hash): KV
pulled under the wrong tokens would poison the prefill engine's prefix cache.

Pools are reached through ``PoolClient`` so this module has no Ray in it and is tested
with hand-written fakes; ``orchestrator.serve`` passes Serve deployment handles.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engines.base import GenerateChunk, GenerateRequest
from orchestrator.errors import EngineUnavailable
from orchestrator.kv_planner import Effect, KVPlanner, TurnPlan
from policies.kv_lifecycle import prefix_hash

__all__ = ["KV_SOURCES", "PoolClient", "Router", "TurnReport"]

log = logging.getLogger("kvtide.router")

# Where a turn's prompt KV came from, as reported to clients.
KV_SOURCES = {
    "sent_back": "pulled back from the decode engine (previous turn)",
    "prefix_cache": "prefix cache on the prefill engine",
    "recomputed": "computed on the prefill engine",
}


class PoolClient(Protocol):
    """How the router reaches a pool. ``generate`` streams one engine's output."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]: ...


@dataclass(slots=True, kw_only=True)
class TurnReport:
    """Per-turn facts, returned to the client in the response's ``kvtide`` object."""

    request_id: str
    session_id: str | None
    num_prompt_tokens: int
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    kv_source: str = "recomputed"
    kv_plan: str = "recompute"
    kv_plan_reason: str = ""
    pull_fallback: bool = False
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    router_s: float = 0.0
    finish_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "session_id": self.session_id,
            "kv_source": self.kv_source,
            "kv_plan": self.kv_plan,
            "kv_plan_reason": self.kv_plan_reason,
            "pull_fallback": self.pull_fallback,
            "num_cached_tokens": self.num_cached_tokens,
            "prefill_s": round(self.prefill_s, 6),
            "ttft_s": round(self.ttft_s, 6),
            "router_s": round(self.router_s, 6),
        }


async def _last(stream: AsyncIterator[GenerateChunk]) -> GenerateChunk:
    last: GenerateChunk | None = None
    async for chunk in stream:
        last = chunk
    if last is None or not last.finished:
        raise EngineUnavailable("the prefill engine ended the request without a result")
    if last.finish_reason == "error":
        raise EngineUnavailable("the prefill engine failed the request (KV load failed?)")
    return last


class Router:
    def __init__(
        self,
        *,
        prefill: PoolClient,
        decode: PoolClient,
        planner: KVPlanner,
        pull_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        tokens_of: Callable[[str], Sequence[int] | None] = lambda _: None,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.planner = planner
        self.pull_timeout_s = pull_timeout_s
        self.clock = clock
        self.tokens_of = tokens_of  # a session's exact token ids, for draining
        self._drains: set[asyncio.Task[None]] = set()
        self.num_drains = 0
        self.num_drain_failures = 0
        self.num_undrainable = 0

    # ---- draining -------------------------------------------------------------------

    def apply(self, effects: Sequence[Effect]) -> None:
        """Apply the planner's effects: drain records nobody will reuse, when possible."""
        for effect in effects:
            if not effect.drainable:
                continue  # expiring anyway: the engine frees the blocks at its TTL
            record = effect.record
            ids = self.tokens_of(record.session_id)
            if (
                ids is None
                or len(ids) <= record.num_tokens
                or prefix_hash(ids, record.num_tokens) != record.prefix_hash
            ):
                self.num_undrainable += 1
                continue
            self.drain(dict(record.transfer_params), ids[: record.num_tokens + 1])

    def drain(self, params: dict[str, Any], token_ids: Sequence[int]) -> None:
        """Free a decode engine's kept blocks by reading them into a prefill engine."""
        if not params.get("do_remote_decode") or not params.get("remote_block_ids"):
            return
        task = asyncio.get_running_loop().create_task(self._drain(params, list(token_ids)))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def _drain(self, params: dict[str, Any], token_ids: list[int]) -> None:
        req = GenerateRequest(
            request_id=f"drain-{uuid.uuid4().hex}",
            prompt_token_ids=token_ids,
            max_tokens=1,
            kv_transfer_params={**params, "do_remote_decode": True, "do_remote_prefill": False},
        )
        try:
            await self._prefill(req, self.pull_timeout_s)
            self.num_drains += 1
        except Exception as exc:
            self.num_drain_failures += 1
            log.warning("drain of %s failed: %s", params.get("remote_request_id"), exc)

    async def wait_drains(self) -> None:
        """Wait for the drains in flight (tests and shutdown)."""
        while self._drains:
            await asyncio.gather(*list(self._drains), return_exceptions=True)

    async def _prefill(self, req: GenerateRequest, timeout_s: float | None) -> GenerateChunk:
        try:
            return await asyncio.wait_for(_last(self.prefill.generate(req)), timeout_s)
        except (TimeoutError, EngineUnavailable):
            raise
        except Exception as exc:  # an engine/actor failure, surfaced as 503
            raise EngineUnavailable(f"prefill failed: {type(exc).__name__}: {exc}") from exc

    async def run_turn(
        self,
        *,
        prompt_token_ids: list[int],
        max_tokens: int,
        session_id: str | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = False,
        request_id: str | None = None,
    ) -> AsyncIterator[tuple[GenerateChunk, TurnReport]]:
        """Stream decode chunks; each comes with the (growing) turn report."""
        rid = request_id or uuid.uuid4().hex
        t0 = self.clock()
        report = TurnReport(
            request_id=rid, session_id=session_id, num_prompt_tokens=len(prompt_token_ids)
        )
        plan: TurnPlan = self.planner.plan_turn(session_id, prompt_token_ids, t0)
        report.kv_plan, report.kv_plan_reason = plan.kind, plan.reason

        base = {
            "prompt_token_ids": prompt_token_ids,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "stop": list(stop),
            "ignore_eos": ignore_eos,
        }
        params: dict[str, Any] = {"do_remote_decode": True}
        if plan.kind == "pull" and plan.kv_transfer_params is not None:
            params = {
                **plan.kv_transfer_params,
                "do_remote_decode": True,
                "do_remote_prefill": False,
            }
        t_engine = self.clock()
        done = False
        try:
            async for item in self._stream(
                plan, params, base, rid, max_tokens, report, t0, t_engine
            ):
                if item[0].finished:
                    done = True
                yield item
        finally:
            if not done:  # failed, cancelled or the client went away: no record kept
                self.apply(self.planner.abandon(session_id, self.clock()))

    async def _stream(
        self,
        plan: TurnPlan,
        params: dict[str, Any],
        base: dict[str, Any],
        rid: str,
        max_tokens: int,
        report: TurnReport,
        t0: float,
        t_engine: float,
    ) -> AsyncIterator[tuple[GenerateChunk, TurnReport]]:
        session_id = report.session_id
        prompt_token_ids: list[int] = base["prompt_token_ids"]
        try:
            pre = await self._prefill(
                GenerateRequest(
                    request_id=f"{rid}-p", max_tokens=1, kv_transfer_params=params, **base
                ),
                self.pull_timeout_s if plan.kind == "pull" else None,
            )
        except (TimeoutError, EngineUnavailable):
            if plan.kind != "pull":
                raise
            # The pull hung or failed: forget those blocks and prefill from scratch.
            self.apply(self.planner.pull_failed(session_id, self.clock()))
            report.pull_fallback = True
            pre = await self._prefill(
                GenerateRequest(
                    request_id=f"{rid}-r",
                    max_tokens=1,
                    kv_transfer_params={"do_remote_decode": True},
                    **base,
                ),
                None,
            )
        report.prefill_s = self.clock() - t_engine
        report.num_cached_tokens = pre.num_cached_tokens
        if pre.num_cached_tokens > 0:
            pulled = plan.kind == "pull" and not report.pull_fallback
            report.kv_source = "sent_back" if pulled else "prefix_cache"
        if pre.kv_transfer_params is None:
            raise EngineUnavailable(
                "the prefill engine returned no kv_transfer_params; is it configured with "
                "a KV connector (kv_transfer_config)?"
            )
        decode_req = GenerateRequest(
            request_id=f"{rid}-d",
            max_tokens=max_tokens,
            kv_transfer_params=pre.kv_transfer_params,
            **base,
        )
        output_ids: list[int] = []
        first = True
        # kvtide's own work: planning before the engines, booking after them.
        report.router_s = t_engine - t0
        async for chunk in self.decode.generate(decode_req):
            now = self.clock()
            if first and (chunk.token_ids or chunk.finished):
                report.ttft_s = now - t0
                first = False
            output_ids.extend(chunk.token_ids)
            report.num_completion_tokens = len(output_ids)
            if chunk.finished:
                report.finish_reason = chunk.finish_reason
                report.total_s = now - t0
                covered = prompt_token_ids + output_ids
                if session_id is None and chunk.kv_transfer_params:
                    # Nobody will pull these blocks back: free them now, not at the TTL.
                    self.drain(dict(chunk.kv_transfer_params), covered)
                self.apply(
                    self.planner.turn_finished(session_id, covered, chunk.kv_transfer_params, now)
                )
                report.router_s += self.clock() - now
            yield chunk, report
