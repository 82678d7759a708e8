"""A finished turn handed to the KV lifecycle service, off the turn's path.

``HandOver.message`` builds the turn's ``TurnDone`` (the decode's kept blocks and the
session's next tokens: as sent, only what the turn added, and whole) and updates this
replica's copy of the session's last turn; ``give`` sends it in a task of its own, so the
client's last tokens do not wait for the booking. With turn leases the hand-over
proposes the next turn's lease, and its task holds that lease here before it sends
(``HeldLeases.propose``): the session's next turn here runs under it without waiting
for the answer. Otherwise it waits for the hand-over here (``handed_over``) or in the
service's ``begin_turn``; ``settled`` waits for every hand-over under way (a read of the
books after a turn, shutdown). A turn extended on the decode engine that kept its
history has that engine free the previous turn's kept blocks, unread, once the service
booked it (``orchestrator.router.kept_release``), in a task of its own: the session's
next turn does not wait for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from opentelemetry.trace import Span

from engines.base import GenerateChunk, GenerateRequest
from orchestrator.errors import RequestError
from orchestrator.kv.messages import TurnDone
from orchestrator.kv.service import KVServiceAPI
from orchestrator.kv.session_tokens import SessionTokens, prefix_digest
from orchestrator.observability import tracing as tr
from orchestrator.observability.metrics import Metrics
from orchestrator.router.held_leases import HeldLeases
from orchestrator.router.kept_release import KeptRelease, release_request
from orchestrator.router.turn import TurnState
from orchestrator.router.turn_report import Streamed, TurnReport

__all__ = ["HandOver", "HandOverMessage"]

log = logging.getLogger("kvtide.router")


@dataclass(frozen=True, slots=True)
class HandOverMessage:
    """A finished turn for the service: ``sent``, only what the turn added (the prompt's
    start is the session's last turn, which the service holds), and ``whole``, sent in
    its place when the service holds another last turn; ``release``: an extended turn's
    release of the previous turn's kept blocks, sent once it is booked, and its prompt's
    length (its decode pool's)."""

    sent: TurnDone
    whole: TurnDone
    release: tuple[GenerateRequest, int] | None = None


class HandOver:
    """One ingress replica's hand-overs (see the module)."""

    def __init__(
        self,
        *,
        kv: KVServiceAPI,
        metrics: Metrics,
        clock: Callable[[], float],
        eos_token_id: int | None,
        session_tokens: SessionTokens | None,
        leases: HeldLeases | None,
        release: KeptRelease | None = None,
    ) -> None:
        self.kv = kv
        self.release = release
        self.metrics = metrics
        self.clock = clock
        self.eos_token_id = eos_token_id
        self.session_tokens = session_tokens
        self.leases = leases
        # Finished turns on their way to the service (``give``), by session too.
        self._handovers: set[asyncio.Task[None]] = set()
        self._releases: set[asyncio.Task[bool]] = set()  # booked extended turns' releases
        self._handing: dict[str, asyncio.Task[None]] = {}

    def message(self, state: TurnState, chunk: GenerateChunk, out: Streamed) -> HandOverMessage:
        """The decode's kept blocks and the session's next tokens, for the service: as
        sent (what the turn added) and whole. This replica's copy of the session's last
        turn is updated at once (a next turn here tokenizes from it; ``begin_turn``
        checks it against the service's)."""
        turn, report = state.turn, state.report
        prompt_token_ids, prompt_text = turn.prompt_token_ids, turn.prompt_text
        next_text, next_ids = self._continuation(
            prompt_text, list(prompt_token_ids), out.text, out.ids, chunk.finish_reason
        )
        sid, tokens = report.session_id, self.session_tokens
        ids = [*prompt_token_ids, *out.ids]
        # Only what the turn added travels: the prompt starts with the session's last
        # turn (this replica's copy, which begin_turn checked), the next turn's ids are
        # this turn's, cut (``TurnDone``).
        prefix_len, digest = 0, None
        if sid is not None and tokens is not None:
            last, digest = tokens.token_ids(sid), tokens.digest(sid)
            if last and len(last) <= len(prompt_token_ids):
                if prefix_digest(prompt_token_ids[: len(last)]) == digest:
                    prefix_len = len(last)
            if next_ids is None:
                tokens.forget(sid)
            else:
                tokens.remember(sid, next_text, next_ids, self.clock())
        next_len = None
        if next_ids is not None and len(next_ids) <= len(ids) and next_ids == ids[: len(next_ids)]:
            next_len = len(next_ids)
        owner = turn.owner
        # The next turn's lease, proposed; held here provisionally by the hand-over's task
        # (``_turn_done``), off the path of this turn's last token.
        proposed = None
        if sid is not None and next_ids is not None and self.leases is not None:
            proposed = self.leases.proposal_id()
        whole = TurnDone(
            session_id=sid,
            token_ids=ids,
            kv_transfer_params=chunk.kv_transfer_params,
            kv_expires_in_s=chunk.kv_expires_in_s,
            next_text=next_text,
            next_token_ids=next_ids,
            owner=owner,
            holder=None if sid is None or self.leases is None else self.leases.holder,
            lease_id=None if turn.lease is None else turn.lease.lease_id,
            next_lease_id=proposed,
        )
        sent = msgspec.structs.replace(
            whole,
            token_ids=ids[prefix_len:],
            next_token_ids=None if next_len is not None else next_ids,
            prefix_len=prefix_len,
            prefix_digest=digest if prefix_len else None,
            next_len=next_len,
        )
        release = None
        if sid is not None and state.extended is not None:
            req = release_request(turn.request_id, list(prompt_token_ids), state.extended)
            release = None if req is None else (req, len(prompt_token_ids))
        return HandOverMessage(sent, whole, release)

    def give(self, route: Span, report: TurnReport, done: HandOverMessage) -> None:
        """Give the finished turn to the service off the turn's path: the client gets its
        last tokens without waiting for the booking. The session's next turn waits for it
        in ``begin_turn`` (the service holds a turn's claim until its ``turn_done``)."""
        task = asyncio.get_running_loop().create_task(
            self._turn_done(route, report, done.sent, done.whole, done.release)
        )
        self._handovers.add(task)
        task.add_done_callback(self._handovers.discard)
        sid = report.session_id
        if sid is not None:
            self._handing[sid] = task
            task.add_done_callback(
                lambda t: self._handing.pop(sid, None) if self._handing.get(sid) is t else None
            )

    async def handed_over(self, session_id: str) -> float:
        """Wait for the hand-over of the session's last turn here, if one is on its way
        (its answer may hold the next turn's lease); the seconds waited."""
        task = self._handing.get(session_id)
        if task is None:
            return 0.0
        t0 = self.clock()
        await asyncio.shield(task)
        return self.clock() - t0

    async def _turn_done(
        self,
        route: Span,
        report: TurnReport,
        done: TurnDone,
        whole: TurnDone,
        release: tuple[GenerateRequest, int] | None,
    ) -> None:
        kept = done.kv_transfer_params
        with tr.span(
            tr.SPAN_SEND_BACK,
            {
                tr.ENGINE_ID: kept.remote_engine_id if kept is not None else None,
                tr.KV_TRANSFER_BLOCKS: kept.num_blocks if kept is not None else 0,
            },
            parent=route,
        ):
            sid, lease_id = done.session_id, done.lease_id
            if sid is not None and lease_id is not None and self.leases is not None:
                self.leases.ended(sid, lease_id)  # the service ends it with the turn
            proposed = whole.next_lease_id
            if sid is not None and proposed is not None and self.leases is not None:
                self._propose(sid, proposed, whole)
            # On the one clock the leases share: a lease's times count from here.
            asked_s = self.clock()
            try:
                answer = await self.kv.turn_done(done)
                if not answer.accepted:
                    # The service holds another last turn (it restarted meanwhile, or
                    # this replica's copy was stale): the turn, whole.
                    answer = await self.kv.turn_done(whole)
                if self.leases is not None:
                    if answer.lease is not None:
                        self.leases.add(answer.lease, asked_s)
                    elif sid is not None and done.next_lease_id is not None:
                        self.leases.unconfirmed(sid, done.next_lease_id)
                if answer.accepted and release is not None and self.release is not None:
                    # Booked: the previous turn's blocks are the new record's prefix.
                    task = asyncio.get_running_loop().create_task(self.release.release(*release))
                    self._releases.add(task)
                    task.add_done_callback(self._releases.discard)
            except RequestError as exc:
                if sid is not None and done.next_lease_id is not None and self.leases:
                    self.leases.unconfirmed(sid, done.next_lease_id)
                # The service is unreachable (its client's deadline passed): end the
                # claim if it can be reached now; otherwise its tick ends it. The kept
                # blocks stay with their engine until its host's check finds them
                # unbooked and the service drains them (``orchestrator.kv.kept_check``).
                self.metrics.inc("kvtide_turn_handover_failures_total")
                log.warning(
                    "turn %s: could not hand over to the service: %s", report.request_id, exc
                )
                if done.session_id is not None:
                    try:
                        # Not booked, so not released: an extended turn's record
                        # is whole.
                        unread = release is not None
                        await self.kv.turn_abandoned(done.session_id, unread=unread)
                    except RequestError:
                        pass

    def _propose(self, sid: str, lease_id: int, whole: TurnDone) -> None:
        """Hold the session's next turn here under the lease ``whole`` proposes, from
        this replica's copy of what the service will book (``HeldLeases.propose``)."""
        assert self.leases is not None and whole.next_token_ids is not None
        tokens = self.session_tokens
        digest = tokens.digest(sid) if tokens is not None else None
        self.leases.propose(
            sid,
            lease_id,
            whole.owner,
            prefix_digest(whole.next_token_ids) if digest is None else digest,
            whole.kv_transfer_params,
            whole.token_ids,
            whole.kv_expires_in_s,
        )

    async def settled(self) -> None:
        """Wait until every turn that finished here before this call has been handed to
        the service (a read of the books after a turn sees it; shutdown), and the releases
        those hand-overs started. Each hand-over is bounded by the service client's
        deadline, each release by its own."""
        if self._handovers:
            await asyncio.gather(*list(self._handovers), return_exceptions=True)
        if self._releases:
            await asyncio.gather(*list(self._releases), return_exceptions=True)

    def _continuation(
        self,
        prompt_text: str | None,
        prompt_ids: list[int],
        output_text: list[str],
        output_ids: list[int],
        finish_reason: str | None,
    ) -> tuple[str | None, list[int] | None]:
        """What the session's next turn continues tokenizing from: this turn's text and
        exact ids (see ``orchestrator.kv.session_tokens``). A stop string cuts text and
        tokens apart: then nothing (the next turn tokenizes from scratch)."""
        ids = list(output_ids)
        if finish_reason == "stop":
            if not ids or ids[-1] != self.eos_token_id:
                return None, None
            ids.pop()  # the chat template writes the end-of-turn token itself
        text = None if prompt_text is None else prompt_text + "".join(output_text)
        return text, prompt_ids + ids
