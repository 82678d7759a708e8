"""The disaggregated turn: prefill → NIXL → decode, with the session's KV reused.

``Router.run_turn`` drives one request through the pools:

1. ask the KV lifecycle service what to do with this session's prompt (pull the
   previous turn's KV back from the decode engine that holds it, or plain prefill);
   a pull may become an ``extend`` (``orchestrator.router.extend_plan``): the turn then
   skips 2 and 3's transfer and runs on the decode engine that kept the history, which
   prefills only the new tokens;
2. prefill with ``max_tokens=1`` and ``do_remote_decode`` (plus the pull params when
   reusing), bounded by ``pull_timeout_s``: a hung or failed pull becomes a plain prefill,
   never a lost turn;
3. stream decode with the prefill engine's returned ``kv_transfer_params`` (the decode
   engine pulls the prompt's KV over NIXL);
4. hand the decode engine's final params (its kept blocks) and the tokens the session
   continues from to the service in one ``TurnDone``, off the turn's path: the client's
   last tokens do not wait for it (the service drains what nobody will reuse, and holds
   the session's next ``begin_turn`` until it arrives; see ``orchestrator.kv.service``).

Only a session's decode asks to keep its blocks (``KVTransferParams.for_decode``): with
kvtide's connector (``engines/kv_connector.py``) a sessionless request's decode frees
them when it finishes, and the turn books nothing with the service. An engine without
that connector keeps them anyway; the service then drains them, as it always did.

Every started turn ends with ``turn_done`` or ``turn_abandoned``, also when the client
goes away or the service call that plans it fails. Every wait has a deadline: the whole
turn is bounded by ``request_timeout_s`` (prefill, transfer and decode, each chunk
awaited against what is left), a pull by ``pull_timeout_s``; past it the turn ends with
``DeadlineExceeded`` (503) and its engine streams are closed, which aborts their
requests. An engine that fails surfaces as ``EngineUnavailable`` (503) whose message
names the pool, never the engine's internals (those are logged). Pools and the service
are reached through protocols, so this module has no Ray in it and is tested with
hand-written fakes; ``orchestrator.serve`` passes Serve deployment handles and the
service actor's client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable

from opentelemetry.trace import Span

from engines.base import GenerateChunk
from engines.kv_params import KVTransferParams
from orchestrator.errors import RequestError, ServiceUnavailable
from orchestrator.kv.decider import kv_decision
from orchestrator.kv.service import KVServiceAPI
from orchestrator.kv.session_tokens import SessionTokens
from orchestrator.observability import tracing as tr
from orchestrator.observability.metrics import Metrics
from orchestrator.router.decode_side import DecodePool, DecodePools, DecodeSide, in_place
from orchestrator.router.extend_plan import ExtendPlan
from orchestrator.router.handover import HandOver
from orchestrator.router.held_leases import HeldLeases
from orchestrator.router.integrity import IntegrityCheck
from orchestrator.router.kept_release import KeptRelease
from orchestrator.router.prefill_side import PrefillSide
from orchestrator.router.settings import RouterSettings
from orchestrator.router.transfers import Transfers
from orchestrator.router.turn import LeaseUse, Turn, TurnState
from orchestrator.router.turn_report import (
    KV_SOURCES,
    LeaseRefused,
    PoolClient,
    TurnReport,
)
from policies.admission import EngineLoad
from policies.kv_records import RecomputeReason
from policies.prefix_routing import RouteChoice

__all__ = ["KV_SOURCES", "LeaseRefused", "LeaseUse", "PoolClient", "Router", "Turn", "TurnReport"]

log = logging.getLogger("kvtide.router")


class Router:
    """The turn's path on one ingress replica: it holds its parts, each built with what
    it uses: the prefill side, the decode side (and its pools), the hand-over to the
    service, the integrity check, this replica's turn leases (see the module)."""

    def __init__(
        self,
        *,
        prefill: PoolClient,
        decode: PoolClient,
        kv: KVServiceAPI,
        settings: RouterSettings,
        decode_long: PoolClient | None = None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        prefill_routes: Callable[[str], RouteChoice | None] | None = None,
        session_tokens: SessionTokens | None = None,
        leases: HeldLeases | None = None,
        engine_loads: Callable[[], Iterable[EngineLoad]] | None = None,
    ) -> None:
        s = settings
        if leases is not None and leases.clock is not clock:
            raise ValueError(
                "the turn leases and the router read different clocks: give HeldLeases the "
                "router's clock (one clock on a turn's path)"
            )
        self.metrics = metrics if metrics is not None else Metrics()
        self.request_timeout_s = s.request_timeout_s
        self.clock = clock
        pools = DecodePools(decode, decode_long, s.long_context_threshold_tokens)
        transfers = Transfers(
            metrics=self.metrics,
            block_size_tokens=s.block_size_tokens,
            kv_bytes_per_token=s.kv_bytes_per_token,
        )
        # Finished turns on their way to the service; this replica's turn leases
        # (``orchestrator.kv.turn_leases``; None: none asked) go with them.
        self.handover = HandOver(
            kv=kv,
            metrics=self.metrics,
            clock=clock,
            eos_token_id=s.eos_token_id,
            session_tokens=session_tokens,
            leases=leases,
            release=KeptRelease(
                pool=lambda n: self.decode_side.pools.for_prompt(n).pool,
                timeout_s=s.pull_timeout_s,
                clock=clock,
            ),
        )
        # A sample of the turns that pull KV back, computed again without reuse off the
        # turn's path (``orchestrator.router.integrity``); none without ``integrity``.
        self.integrity = IntegrityCheck(
            prefill=prefill,
            service=lambda: self.kv,
            metrics=self.metrics,
            clock=clock,
            settings=s.integrity,
        )
        # A pull run instead where its history is: on the decode engine that kept it
        # (``engine_loads``: the engines' latest reports; None: no turn extends).
        self.extend = ExtendPlan(
            settings=s.extend,
            loads=engine_loads,
            decode_max_running=s.decode_max_running,
            decode_chunk_tokens=s.decode_chunk_tokens,
            block_size_tokens=s.block_size_tokens,
        )
        self.prefill_side = PrefillSide(
            pool=prefill,
            service=lambda: self.kv,
            metrics=self.metrics,
            clock=clock,
            transfers=transfers,
            pull_timeout_s=s.pull_timeout_s,
            max_migrations=s.max_migrations,
            routes=prefill_routes,
        )
        self.decode_side = DecodeSide(
            pools=pools,
            prefill=self.prefill_side,
            handover=self.handover,
            integrity=self.integrity,
            transfers=transfers,
            metrics=self.metrics,
            clock=clock,
            max_migrations=s.max_migrations,
        )
        # The sessions with a turn generating here: session id -> (request id, owner).
        # From the turn's start to its last item (or its end otherwise).
        self._generating: dict[str, tuple[str, str | None]] = {}
        # The sessions with a turn the ingress is opening here (``opening``: tokenizing,
        # its lease or its service call), until it starts or does not run.
        self._opening: dict[str, tuple[str, str | None]] = {}

    # The pools, as the parts hold them (an ingress's tests put fakes in their place).
    @property
    def prefill(self) -> PoolClient:
        return self.prefill_side.pool

    @prefill.setter
    def prefill(self, pool: PoolClient) -> None:
        self.prefill_side.pool = pool

    @property
    def decode(self) -> PoolClient:
        return self.decode_side.pools.decode

    @decode.setter
    def decode(self, pool: PoolClient) -> None:
        self.decode_side.pools.decode = pool

    @property
    def max_migrations(self) -> int:
        return self.decode_side.max_migrations

    # The service, the caller's copy of each session's last turn (the ingress tokenizes
    # the next one from it; written once the service has booked the turn) and the turn
    # leases: the hand-over's, read and set through the router.
    @property
    def kv(self) -> KVServiceAPI:
        return self.handover.kv

    @kv.setter
    def kv(self, kv: KVServiceAPI) -> None:
        self.handover.kv = kv

    @property
    def session_tokens(self) -> SessionTokens | None:
        return self.handover.session_tokens

    @session_tokens.setter
    def session_tokens(self, tokens: SessionTokens | None) -> None:
        self.handover.session_tokens = tokens

    @property
    def leases(self) -> HeldLeases | None:
        return self.handover.leases

    @leases.setter
    def leases(self, leases: HeldLeases | None) -> None:
        self.handover.leases = leases

    @property
    def eos_token_id(self) -> int | None:
        return self.handover.eos_token_id

    async def handed_over(self, session_id: str) -> float:
        """Wait for the hand-over of the session's last turn here (``HandOver``)."""
        return await self.handover.handed_over(session_id)

    async def settled(self) -> None:
        """Wait until every turn that finished here has been handed to the service."""
        await self.handover.settled()

    def generating(self, session_id: str) -> bool:
        """Whether a turn of the session is generating here (not yet at its last item):
        the service's question when a turn of it arrives at another replica."""
        return session_id in self._generating

    def generating_for(self, session_id: str, owner: str | None) -> bool:
        """Whether ``owner``'s (a key's name, None for anonymous) turn of the session is
        generating or opening here: a second turn of it is refused at once, with no call
        to the service and no hand-over wait."""
        running = self._generating.get(session_id) or self._opening.get(session_id)
        return running is not None and running[1] == owner

    def opening(self, session_id: str, request_id: str, owner: str | None) -> None:
        """The ingress opens turn ``request_id`` of the session here (its tokenizing,
        lease or service call still to come): from now a second turn of it here is
        refused at once (``generating_for``). Not what the service is told
        (``generating``): it has not claimed the turn yet. Nothing is booked over a turn
        of the session already here. ``run_turn`` with the same request id takes it
        over; ``not_opened`` ends it when the turn does not run."""
        if session_id not in self._generating and session_id not in self._opening:
            self._opening[session_id] = (request_id, owner)

    def not_opened(self, session_id: str | None, request_id: str) -> None:
        """The turn the ingress was ``opening`` does not run (refused, failed, or run
        without its session)."""
        _forget(self._opening, session_id, request_id)

    def _generated(self, session_id: str | None, request_id: str) -> None:
        """The turn ``request_id`` of the session is at its last item (or ended)."""
        _forget(self._generating, session_id, request_id)

    def decode_pool_for(self, num_prompt_tokens: int) -> DecodePool:
        """The decode pool of a prompt (``DecodePools.for_prompt``)."""
        return self.decode_side.pools.for_prompt(num_prompt_tokens)

    async def run_turn(self, turn: Turn) -> AsyncGenerator[tuple[GenerateChunk, TurnReport], None]:
        """Stream ``turn``'s decode chunks; each comes with the (growing) turn report.

        Under a turn lease (``turn.lease``) the service's answer to its use is awaited
        before the first item: when it refuses, the turn ends with ``LeaseRefused``
        before any output and reports nothing.
        """
        report = TurnReport(
            request_id=turn.request_id,
            session_id=turn.session_id,
            num_prompt_tokens=len(turn.prompt_token_ids),
        )
        state = TurnState(
            turn=turn,
            report=report,
            deadline_s=self.clock() + self.request_timeout_s,
            lease_pending=None if turn.lease is None else turn.lease.used,
        )
        with tr.span(
            tr.SPAN_ROUTE,
            {tr.GEN_AI_RESPONSE_ID: turn.request_id, tr.GEN_AI_CONVERSATION_ID: turn.session_id},
            parent=turn.trace_parent,
        ) as route:
            async for item in self._turn(route, state):
                yield item
            tr.set_attrs(route, {tr.KV_SOURCE: report.kv_source})

    async def _turn(
        self, route: Span, state: TurnState
    ) -> AsyncIterator[tuple[GenerateChunk, TurnReport]]:
        turn, report = state.turn, state.report
        rid, session_id = turn.request_id, turn.session_id
        t0 = self.clock()
        done = False
        if session_id is not None:
            self.not_opened(session_id, rid)  # opened: now it runs
            self._generating[session_id] = (rid, turn.owner)
        try:
            with tr.span(tr.SPAN_KV_DECISION, parent=route) as decision_span:
                if turn.decision is not None:
                    decision = turn.decision
                elif session_id is None:
                    decision = kv_decision(RecomputeReason.NO_SESSION)
                else:
                    decision = await self.kv.decide_turn(session_id, turn.prompt_token_ids)
                # A mismatch found here refuses its source's reuse before the service
                # has heard of it.
                decision = self.integrity.vetted(decision)
                if turn.may_extend:
                    num_prompt = len(turn.prompt_token_ids)
                    decision, choice = self.extend.plan(
                        decision, num_prompt, self.decode_pool_for(num_prompt).name, self.clock()
                    )
                    if choice is not None:
                        report.extend_reason = choice.reason.value
                        report.extend_prefill_tokens = choice.num_prefill_tokens
                tr.set_attrs(
                    decision_span,
                    {tr.KV_PLAN: decision.kind, tr.KV_PLAN_REASON: decision.reason_text},
                )
            report.kv_plan, report.kv_plan_reason = decision.kind, decision.reason_text
            state.integrity = self.integrity.sample(decision)

            params = KVTransferParams.keep_for_decode()
            if decision.kind == "pull" and decision.kv_transfer_params is not None:
                params = decision.kv_transfer_params.pull_back(keep=True)
            t_engine = self.clock()
            if decision.kind == "extend":
                pre = in_place(state, decision)
                state.extended = decision.kv_transfer_params
                report.router_s = t_engine - t0
                self.metrics.inc("kvtide_kv_extends_total")
            else:
                pre = await self.prefill_side.prefill_turn(
                    route, state, decision, params, t0, t_engine
                )
            async for item in self.decode_side.stream(route, state, pre, t0):
                if state.lease_pending is not None:
                    await self._lease_confirmed(state)
                if item[0].finished:
                    done = True
                    # Before the client's last token: its next turn is not refused here.
                    self._generated(session_id, rid)
                yield item
        finally:
            self._generated(session_id, rid)
            if not done:
                await self._turn_unfinished(state)

    async def _turn_unfinished(self, state: TurnState) -> None:
        """A turn that failed, was cancelled or whose client went away: its lease ends,
        and the service hears it was abandoned (no record kept)."""
        turn = state.turn
        session_id = turn.session_id
        if turn.lease is not None:
            assert session_id is not None
            if self.leases is not None:
                self.leases.ended(session_id, turn.lease.lease_id)
            if state.lease_pending is not None:  # ended before its first item
                with contextlib.suppress(LeaseRefused, RequestError):
                    await asyncio.shield(self._lease_confirmed(state))
        if session_id is not None and not state.lease_refused:
            try:
                # An extended turn read nothing of its record, and its engine frees
                # it only once a turn is booked: the record stays whole.
                unread = state.extended is not None
                await asyncio.shield(self.kv.turn_abandoned(session_id, unread=unread))
            except RequestError:  # the service is unreachable: its tick ends the turn
                log.warning("could not report turn %s of %s abandoned", turn.request_id, session_id)

    async def _lease_confirmed(self, state: TurnState) -> None:
        """Wait for the service's answer to the turn's lease use; ``LeaseRefused`` when it
        refused (the lease was given up: another turn may own the session now). An
        unreachable service is not a refusal: the turn ends as any, reported abandoned."""
        used = state.lease_pending
        assert used is not None
        state.lease_pending = None
        try:
            ok = await used
        except RequestError:
            raise ServiceUnavailable(
                "the KV lifecycle service did not answer in time; retry the request",
                retry_after_s=1.0,
            ) from None
        if not ok:
            state.lease_refused = True
            raise LeaseRefused(state.report.session_id or "")


def _forget(book: dict[str, tuple[str, str | None]], session_id: str | None, rid: str) -> None:
    """The session's entry in ``book`` gone, if it is turn ``rid``'s."""
    if session_id is not None and book.get(session_id, ("",))[0] == rid:
        del book[session_id]
