"""How the ingress opens a turn, for kvtide's own OpenAI layer and vLLM's alike
(``TurnOpener.open``: the session by header or by the conversation's text, the prompt
tokenized from this replica's copy of the session's last turn, the key's limits,
admission, the turn lease or the KV service's ``begin_turn``, the first item), under
the guard of ``request_guard``.

``TurnOpener`` is built by ``Ingress`` with what it uses and held by both OpenAI layers
(``own_layer``, ``vllm_routes``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from engines.base import GenerateChunk
from orchestrator.config import KVTideConfig
from orchestrator.errors import (
    EngineUnavailable,
    LimitExceeded,
    NotFound,
    TurnInProgress,
)
from orchestrator.kv.messages import KVDecision, TurnLease
from orchestrator.kv.ownership import Principal
from orchestrator.kv.service import KVServiceAPI
from orchestrator.kv.session_tokens import SessionTokens, prefix_digest
from orchestrator.observability import tracing as tr
from orchestrator.observability.metrics import Metrics
from orchestrator.router import LeaseRefused, LeaseUse, Router, Turn, TurnReport
from orchestrator.serve.admission import AdmissionGate
from orchestrator.serve.prompts import PromptEncoder
from orchestrator.serve.responses import raise_unclaimed
from orchestrator.serve.turns import OpenedTurn, OpenTurn

__all__ = ["REQUEST_ID_HEADER", "TurnOpener"]

REQUEST_ID_HEADER = "x-kvtide-request-id"
"""The response header naming kvtide's request id (the completion's ``id``)."""

INLINE_MAX_CHARS = 8192
"""Text up to this many characters is rendered or tokenized on the event loop: it takes
well under a millisecond, less than the hop to a worker thread and back."""

_T = TypeVar("_T")


async def maybe_in_thread(size: int, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)``: inline for ``size`` up to ``INLINE_MAX_CHARS``, else in a
    worker thread (off the event loop)."""
    if size <= INLINE_MAX_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


def owner_of(principal: Principal) -> str | None:
    """The owner the router books a turn under: the key's name (None: no keys)."""
    return None if principal.is_anonymous else principal.name


def _extends(ids: Sequence[int], prefix: Sequence[int]) -> bool:
    """Whether ``ids`` start with ``prefix`` (a non-empty one)."""
    n = len(prefix)
    return 0 < n <= len(ids) and list(ids[:n]) == list(prefix)


@dataclass(frozen=True, slots=True, kw_only=True)
class Begun:
    """What ``begin_turn`` settled: the prompt's ids (tokenized again when the service's
    last turn was another replica's), its max_tokens, the plan, and the seconds spent
    waiting for the service and tokenizing again."""

    ids: list[int]
    max_tokens: int
    decision: KVDecision | None
    service_s: float
    tokenize_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Prompt:
    """A turn's prompt ids, the digest and ids of this replica's copy of the session's
    last turn they were tokenized from, and the seconds the template and tokenizing
    took."""

    ids: list[int]
    digest: int | None
    last_ids: Sequence[int]
    tokenize_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Leased:
    """A turn taken under the session's lease held here: the lease (None: none held),
    its plan, the task reporting its use, and the seconds waited for a hand-over."""

    lease: TurnLease | None = None
    decision: KVDecision | None = None
    used: asyncio.Task[bool] | None = None
    service_s: float = 0.0


@dataclass(slots=True, kw_only=True, eq=False)
class TurnOpener:
    """How the ingress opens a turn (see the module)."""

    config: KVTideConfig
    kv: KVServiceAPI
    router: Router
    admission: AdmissionGate
    metrics: Metrics
    prompts: PromptEncoder
    session_tokens: SessionTokens

    async def _tokenize(
        self, text: str, last_text: str | None = None, last_ids: Sequence[int] = ()
    ) -> list[int]:
        """``text``: a ``RenderedChat`` (its messages' contents stay text) or a
        completion's raw prompt; continuing a session's last turn when given."""
        # Off the event loop: a long prompt takes seconds, and /v1/models must not wait.
        # What is tokenized is the text after the last turn's where it continues one.
        continues = last_text is not None and text.startswith(last_text)
        size = len(text) - (len(last_text) if continues and last_text is not None else 0)
        return await maybe_in_thread(size, self.prompts.encode, text, last_text, list(last_ids))

    async def _begin_turn(
        self,
        session_id: str,
        principal: Principal,
        text: str | None,
        ids: list[int],
        max_tokens: int,
        digest: int | None,
        last_ids: Sequence[int],
        limits: Callable[[list[int]], int],
    ) -> Begun:
        """The turn's one service call before it runs (``begin_turn``: the session
        claimed, the KV plan made), with the prompt tokenized from this replica's copy of
        the session's last turn (``digest`` names it, ``last_ids`` are its ids). The call
        carries only the ids the prompt adds to that last turn. When the service's last
        turn is another one (the previous turn ran on another replica), tokenize again
        from it, check ``limits`` again (the prompt's max_tokens), and ask again."""
        waited = tokenized = 0.0
        leases = self.router.leases
        holder = None if leases is None else leases.holder
        for attempt in range(3):
            # A third try (another replica finished a turn between ours) skips the check:
            # the plan then compares the ids with the kept record itself.
            checked = digest if attempt < 2 else None
            skip = len(last_ids) if checked is not None and _extends(ids, last_ids) else 0
            t0 = self.router.clock()
            claim = await self.kv.begin_turn(
                session_id, principal, ids[skip:], checked, skip, holder
            )
            waited += self.router.clock() - t0
            if claim.outcome != "retokenize":
                break
            assert claim.prefix is not None
            prefix = claim.prefix
            # This replica's copy is now the service's (the turn's hand-over sends only
            # what it adds to it).
            self.session_tokens.remember(
                session_id, prefix.text, prefix.token_ids, self.router.clock()
            )
            digest, last_ids = prefix_digest(prefix.token_ids), prefix.token_ids
            if text is not None:  # a prompt sent as token ids is as it is
                t0 = self.router.clock()
                ids = await self._tokenize(text, prefix.text, prefix.token_ids)
                tokenized += self.router.clock() - t0
                max_tokens = limits(ids)
        raise_unclaimed(claim, session_id)
        return Begun(
            ids=ids,
            max_tokens=max_tokens,
            decision=claim.decision,
            service_s=waited,
            tokenize_s=tokenized,
        )

    def _session_for(self, turn: OpenTurn) -> tuple[str | None, str | None]:
        """The turn's session and, without a header, its conversation's state: the
        unnamed session its text extends (``continued``), or a new one when it carries
        history (``started``; ``orchestrator.kv.conversations``)."""
        session_id, text = turn.session_header, turn.text
        if session_id is not None or text is None:
            return session_id, None
        if not self.config.routing.reuse_without_session:
            return None, None
        now = self.router.clock()
        session_id = self.session_tokens.find_conversation(turn.principal.name, text, now)
        if session_id is not None:
            return session_id, "continued"
        if turn.has_history:
            return self.session_tokens.conversations.new_session_id(turn.principal.name), "started"
        return None, None

    async def _prompt_ids(self, turn: OpenTurn, session_id: str | None) -> Prompt:
        """The prompt, tokenized from this replica's copy of the session's last turn
        (``begin_turn`` checks its digest). Token continuity: a prompt that extends
        the session's last turn continues from its exact ids; one that does not keeps
        the ids it came with, if any."""
        digest: int | None = None
        last_text: str | None = None
        last_ids: Sequence[int] = ()
        if session_id is not None:
            now = self.router.clock()
            last_text, last_ids = self.session_tokens.last_turn(session_id, now)
            digest = self.session_tokens.last_digest(session_id, now)
        text, ids, tokenize_s = turn.text, turn.ids, turn.render_s
        continues = last_text is not None and text is not None and text.startswith(last_text)
        if ids is None or (turn.retokenize and continues):
            assert text is not None
            t_tokenize = self.router.clock()
            ids = await self._tokenize(text, last_text, last_ids)
            tokenize_s += self.router.clock() - t_tokenize
        return Prompt(ids=ids, digest=digest, last_ids=last_ids, tokenize_s=tokenize_s)

    def _not_generating_here(
        self, turn: OpenTurn, session_id: str | None, conversation: str | None
    ) -> tuple[str | None, str | None]:
        """A session whose turn is still generating (or opening) here: a turn named by header is
        refused now (409), not after the service's hand-over wait; one found by its text
        runs without a session. (Another key's turn goes to the service: its 404.)"""
        if session_id is None or not self.router.generating_for(
            session_id, owner_of(turn.principal)
        ):
            return session_id, conversation
        if conversation is None:
            raise TurnInProgress(TurnInProgress.words(session_id), param="x-session-id")
        self.metrics.inc("kvtide_conversation_turns_total", outcome="unmatched")
        return None, "unmatched"

    async def _under_lease(
        self, session_id: str | None, principal: Principal, ids: list[int], digest: int | None
    ) -> Leased:
        """The session's turn lease held here, taken for this turn, with its plan and
        its use reported to the service (a task, awaited before the first token), and
        the seconds waited for a hand-over; or no lease.

        Held since its last turn here: claimed and planned without a service call on the
        path (``orchestrator.kv.turn_leases``), provisionally while the last turn's
        hand-over is still on its way."""
        leases = self.router.leases
        if session_id is None or leases is None:
            return Leased()
        waited_s = 0.0
        lease = leases.take(session_id, principal, digest)
        if lease is None:  # a hand-over on its way may yet bring one
            waited_s = await self.router.handed_over(session_id)
            lease = leases.take(session_id, principal, digest)
        if lease is None:
            return Leased(service_s=waited_s)
        decision = leases.decide(lease, ids)
        reason = None if decision.reason is None else decision.reason.value
        self.metrics.inc("kvtide_turn_leases_total", outcome="used")
        used = asyncio.get_running_loop().create_task(
            self.kv.lease_used(session_id, lease.lease_id, reason, leases.provisional(lease))
        )
        return Leased(lease=lease, decision=decision, used=used, service_s=waited_s)

    async def open(self, turn: OpenTurn) -> OpenedTurn:
        """The turn started: its session found (by header, or the unnamed one its text
        continues), its prompt tokenized from this replica's copy of the session's last
        turn, checked against ``turn.limits``, claimed and planned (under the session's
        turn lease here, or by the KV service's ``begin_turn``), and run to its first
        item, so that a failure before the first token is the response's status."""
        principal = turn.principal
        session_id, conversation = self._session_for(turn)
        # A turn of a session still generating (or opening) here is refused before any
        # work; from here this one is opening, until it runs or fails.
        session_id, conversation = self._not_generating_here(turn, session_id, conversation)
        if session_id is not None:
            self.router.opening(session_id, turn.request_id, owner_of(principal))
        try:
            # Once run, the turn's own mark (the same request id) ends with it.
            return await self._opened(turn, session_id, conversation)
        except BaseException:
            self.router.not_opened(session_id, turn.request_id)
            raise

    async def _opened(
        self, turn: OpenTurn, session_id: str | None, conversation: str | None
    ) -> OpenedTurn:
        """``open`` once the session is known and booked opening here."""
        principal, text = turn.principal, turn.text
        prompt = await self._prompt_ids(turn, session_id)
        ids, digest, last_ids = prompt.ids, prompt.digest, prompt.last_ids
        tokenize_s = prompt.tokenize_s
        max_tokens = turn.limits(ids)
        # Refused now (503 overloaded) rather than queued past its deadline.
        pools = ("prefill", self.router.decode_pool_for(len(ids))[0])
        self.admission.check(pools, turn.num_sequences)
        leased = await self._under_lease(session_id, principal, ids, digest)
        lease, decision, lease_used = leased.lease, leased.decision, leased.used
        service_s = leased.service_s
        if lease is None and session_id is not None:
            try:
                begun = await self._begin_turn(
                    session_id, principal, text, ids, max_tokens, digest, last_ids, turn.limits
                )
                ids, max_tokens, decision = begun.ids, begun.max_tokens, begun.decision
                service_s += begun.service_s
                tokenize_s += begun.tokenize_s
            except (TurnInProgress, LimitExceeded, NotFound):
                if conversation is None:
                    raise
                # The conversation's session is busy (the same history sent twice at
                # once) or over a limit: served as a request without one, which keeps
                # nothing. Never a refusal the client did not ask for.
                self.router.not_opened(session_id, turn.request_id)
                session_id, conversation = None, "unmatched"
                self.metrics.inc("kvtide_conversation_turns_total", outcome="unmatched")
        if conversation in ("continued", "started"):
            self.metrics.inc("kvtide_conversation_turns_total", outcome=conversation)
        tr.set_attrs(turn.root, {tr.GEN_AI_REQUEST_MAX_TOKENS: max_tokens})

        def start(
            ids: list[int], max_tokens: int, decision: KVDecision | None, lease_id: int | None
        ) -> AsyncGenerator[tuple[GenerateChunk, TurnReport], None]:
            asked = turn.run_args
            return self.router.run_turn(
                Turn(
                    prompt_token_ids=ids,
                    max_tokens=max_tokens,
                    session_id=session_id,
                    request_id=turn.request_id,
                    prompt_text=text,
                    trace_parent=turn.root,
                    owner=owner_of(principal),
                    sampling=asked.sampling,
                    engine_sampling=asked.engine_sampling,
                    prompt_logprobs=asked.prompt_logprobs,
                    decision=decision,
                    may_extend=turn.may_extend,
                    lease=(
                        None
                        if lease_id is None or lease_used is None
                        else LeaseUse(lease_id=lease_id, used=lease_used)
                    ),
                )
            )

        # Wait for the first item so that prefill failures become a proper status code.
        t_router = self.router.clock()
        running = start(ids, max_tokens, decision, None if lease is None else lease.lease_id)
        try:
            first = await running.__anext__()
        except StopAsyncIteration:
            raise EngineUnavailable("the decode engine returned no output") from None
        except LeaseRefused:
            # The service gave the lease up (revoked meanwhile, or it restarted): the
            # turn ended unseen; ask the service as any turn does.
            assert session_id is not None
            self.metrics.inc("kvtide_turn_leases_total", outcome="refused")
            self.router.opening(session_id, turn.request_id, owner_of(principal))
            begun = await self._begin_turn(
                session_id, principal, text, ids, max_tokens, digest, last_ids, turn.limits
            )
            ids, max_tokens, decision = begun.ids, begun.max_tokens, begun.decision
            service_s = begun.service_s
            tokenize_s += begun.tokenize_s
            t_router = self.router.clock()
            running = start(ids, max_tokens, decision, None)
            try:
                first = await running.__anext__()
            except StopAsyncIteration:
                raise EngineUnavailable("the decode engine returned no output") from None
        report = first[1]
        report.conversation = conversation
        report.ingress_s = t_router - turn.t_in
        report.service_s = service_s
        report.tokenize_s = tokenize_s
        # Serve sets its own x-request-id (its request id); kvtide's is the completion id.
        headers = {REQUEST_ID_HEADER: turn.request_id}
        if session_id is not None and conversation is None:  # an unnamed one stays unnamed
            headers["x-session-id"] = session_id
        return OpenedTurn(ids=ids, first=first, turn=running, headers=headers)
