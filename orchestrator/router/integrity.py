"""A sampled, fail-closed KV integrity check: a reused turn's first tokens computed again
without reuse, off the client's path.

A turn whose KV plan pulls the previous turn's KV back, or extends it on the decode
engine that kept it (``orchestrator.router.extend_plan``: that engine's prefix cache
gives the history), is sampled with probability ``kv.integrity_sample_fraction``. Its
decode is asked for the log probability of each token it samples (a client that did not
ask for them never sees them). After the turn's
last token, in a task of its own, the check sends the prefill pool one sessionless
request with no KV transfer parameters: the prompt and the turn's first ``num_tokens``
output tokens, ``max_tokens=1``, with ``prompt_logprobs``, which also makes vLLM skip its
prefix cache (``SamplingParams.skip_reading_prefix_cache``): every position is computed
from the token ids alone. The log probability that request gives each of those output
tokens is what the reused turn's decode should have given it; vLLM reports both before
temperature, penalties or any other processing (``logprobs_mode: raw_logprobs``), so the
check holds for any sampling.

Outcomes (``kvtide_kv_integrity_checks_total{outcome}``): ``match``, all within
``kv.integrity_logprob_tolerance``; ``mismatch``, one beyond it (or not a number on
either side): logged with both plans and the engines, reuse from the source engine
(the one that kept the KV) turned off in this replica's router at once (``vetted``: its
turns recompute whatever plan they were given), and reported to the KV service
(``IntegrityMismatch``), which turns reuse off for the engine pair (the engine that
computed from the reused KV: the prefill engine that pulled it, or for an extended turn
the decode engine itself; and the source) until an operator turns it back on
(``orchestrator.kv.integrity``). The report is sent again, each try bounded by
``report_timeout_s`` and backing off (``report_backoff_s`` doubling up to
``report_backoff_max_s``), until the service has it; only then does this replica leave
the decision to the service's books. ``skipped``, a sampled turn that could not be
checked: it did not end up reusing the KV (its pull failed, its extended decode found
nothing in its cache, or it migrated), its decode sampled under a structured output's
grammar (vLLM masks the logits before its sampler, so its log probabilities are the
grammar's: a tool call with ``tool_choice: required``, a JSON schema), its decode gave
no log probabilities (the simulated engine), too many checks were running, or the
check's request failed or ran past its deadline.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from engines.base import GenerateChunk, GenerateRequest, TokenLogprob, final_chunk
from orchestrator.errors import RequestError
from orchestrator.kv.decider import kv_decision
from orchestrator.kv.messages import IntegrityMismatch, KVDecision
from orchestrator.kv.service import KVServiceAPI
from orchestrator.observability.metrics import Metrics
from orchestrator.router.streams import bounded
from orchestrator.router.turn import IntegritySample, TurnState
from orchestrator.router.turn_report import PoolClient, TurnReport
from policies.kv_records import RecomputeReason

__all__ = [
    "IntegrityCheck",
    "IntegritySample",
    "IntegritySettings",
    "take_logprobs",
    "token_logprob",
]

log = logging.getLogger("kvtide.router")

METRIC = "kvtide_kv_integrity_checks_total"


@dataclass(frozen=True, slots=True, kw_only=True)
class IntegritySettings:
    """The check's knobs (``kv.integrity_*`` in the config)."""

    sample_fraction: float = 0.01
    logprob_tolerance: float = 0.05
    num_tokens: int = 4
    # The check's own request is bounded by this (it is not on any client's path).
    timeout_s: float = 60.0
    # Checks running at once; a sampled turn past it is skipped.
    max_running: int = 4
    # A mismatch's report to the service: each try's deadline, and the wait before the
    # next try (doubling up to the max) until the service has it.
    report_timeout_s: float = 10.0
    report_backoff_s: float = 0.5
    report_backoff_max_s: float = 30.0


def token_logprob(candidates: Sequence[TokenLogprob] | None, token_id: int) -> float | None:
    """The log probability ``candidates`` (one position's) give ``token_id``; None when
    they do not name it."""
    for candidate in candidates or ():
        if candidate.token_id == token_id:
            return candidate.logprob
    return None


def take_logprobs(state: TurnState, chunk: GenerateChunk) -> GenerateChunk:
    """A sampled turn's decode chunk: each token's log probability kept in the turn's
    state (``integrity_logprobs``, None where the engine gave none), and the chunk as
    its client gets it: without log probabilities when the client did not ask for them
    (its vLLM sampling parameters ask none; kvtide's own layer serves none)."""
    if state.integrity is None:
        return chunk
    kept = state.integrity_logprobs
    positions = chunk.logprobs or []
    for i, token in enumerate(chunk.token_ids):
        kept.append(token_logprob(positions[i], token) if i < len(positions) else None)
    asked = getattr(state.turn.engine_sampling, "logprobs", None) is not None
    if asked or (chunk.logprobs is None and chunk.cumulative_logprob is None):
        return chunk
    return msgspec.structs.replace(chunk, logprobs=None, cumulative_logprob=None)


def _constrained(state: TurnState) -> bool:
    """The turn's decode sampled under a grammar: vLLM applies a structured output's
    bitmask to the logits before its sampler, so even its raw log probabilities are
    renormalised over the tokens the grammar allows (off by several nats from the
    prefill's unconstrained ones, for a tool call's JSON)."""
    return getattr(state.turn.engine_sampling, "structured_outputs", None) is not None


class IntegrityCheck:
    """One ingress replica's integrity checks (see the module). Single event loop."""

    def __init__(
        self,
        *,
        prefill: PoolClient,
        service: Callable[[], KVServiceAPI],
        metrics: Metrics,
        clock: Callable[[], float],
        settings: IntegritySettings,
        rng: random.Random | None = None,
    ) -> None:
        self.prefill = prefill
        self.service = service
        self.metrics = metrics
        self.clock = clock
        self.settings = settings
        self.rng = rng if rng is not None else random.Random()
        self._running: set[asyncio.Task[None]] = set()
        self._reports: set[asyncio.Task[None]] = set()
        # Source engines whose reuse a mismatch here turned off, with the number of its
        # reports the service does not have yet: their pulls are refused here meanwhile.
        self._off_here: dict[str, int] = {}

    def vetted(self, decision: KVDecision) -> KVDecision:
        """``decision``, or recompute when it pulls from an engine whose reuse a
        mismatch here turned off and whose report the service does not have yet."""
        params = decision.kv_transfer_params
        if decision.kind != "pull" or params is None:
            return decision
        if params.remote_engine_id not in self._off_here:
            return decision
        return kv_decision(RecomputeReason.INTEGRITY_CHECK_FAILED)

    @property
    def off_here(self) -> frozenset[str]:
        """The source engines whose reuse is off here until the service has the report."""
        return frozenset(self._off_here)

    def sample(self, decision: KVDecision) -> IntegritySample | None:
        """Whether this turn is checked: a pull or an extend, chosen with the configured
        probability."""
        params = decision.kv_transfer_params
        fraction = self.settings.sample_fraction
        reuses = decision.kind in ("pull", "extend")
        if not reuses or params is None or not params.remote_engine_id:
            return None
        if fraction <= 0 or self.rng.random() >= fraction:
            return None
        return IntegritySample(
            source_engine_id=params.remote_engine_id, plan_reason=decision.reason_text
        )

    def after_turn(self, state: TurnState, output_ids: list[int]) -> None:
        """The sampled turn ended with these output tokens (their decode's log
        probabilities in its state): start its check off the turn's path, or count it
        skipped."""
        sample, report, logprobs = state.integrity, state.report, state.integrity_logprobs
        if sample is None:
            return
        num = min(self.settings.num_tokens, len(output_ids), len(logprobs))
        why = None
        if report.migrations or _computed_on(state) is None:
            why = "the turn did not decode from the reused KV"
        elif _constrained(state):
            why = (
                "its decode sampled under a grammar (structured output): vLLM's log "
                "probabilities are then the grammar's, which a recompute does not give"
            )
        elif num == 0 or any(lp is None for lp in logprobs[:num]):
            why = "its decode gave no log probabilities"
        elif len(self._running) >= self.settings.max_running:
            why = f"{len(self._running)} checks are running"
        if why is not None:
            self._skipped(report, why)
            return
        task = asyncio.get_running_loop().create_task(
            self._check(
                sample, state, state.turn.prompt_token_ids, output_ids[:num], logprobs[:num]
            )
        )
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def settled(self) -> None:
        """Wait for the checks running now (tests, shutdown); not for their reports."""
        if self._running:
            await asyncio.gather(*list(self._running), return_exceptions=True)

    async def reported(self, timeout_s: float | None = None) -> bool:
        """Wait until the service has every mismatch found here (at most ``timeout_s``:
        a replica's shutdown); whether it has."""
        if self._reports:
            waiting = asyncio.gather(*list(self._reports), return_exceptions=True)
            try:
                await asyncio.wait_for(asyncio.shield(waiting), timeout_s)
            except TimeoutError:
                return False
        return True

    def _skipped(self, report: TurnReport, why: str) -> None:
        self.metrics.inc(METRIC, outcome="skipped")
        log.info("integrity check of turn %s skipped: %s", report.request_id, why)

    async def _recomputed(self, rid: str, prompt: list[int], output: list[int]) -> GenerateChunk:
        request = GenerateRequest(
            request_id=f"{rid}-i",
            prompt_token_ids=[*prompt, *output],
            max_tokens=1,
            prompt_logprobs=0,
        )
        deadline_s = self.clock() + self.settings.timeout_s
        return await final_chunk(
            bounded(self.prefill.generate(request), deadline_s, self.clock, "integrity check")
        )

    async def _check(
        self,
        sample: IntegritySample,
        state: TurnState,
        prompt: list[int],
        output: list[int],
        reused: list[float | None],
    ) -> None:
        report = state.report
        try:
            chunk = await self._recomputed(report.request_id, prompt, output)
        except Exception as exc:  # the check's own failure: the turn is long done
            self._skipped(report, f"its request failed: {type(exc).__name__}: {exc}")
            return
        positions = chunk.prompt_logprobs or []
        recomputed = [
            token_logprob(positions[len(prompt) + i], token)
            if len(prompt) + i < len(positions)
            else None
            for i, token in enumerate(output)
        ]
        if any(lp is None for lp in recomputed):
            self._skipped(report, "its request gave no prompt log probabilities")
            return
        diff = max(_abs_diff(a, b) for a, b in zip(reused, recomputed, strict=True))
        tolerance = self.settings.logprob_tolerance
        if diff <= tolerance:
            self.metrics.inc(METRIC, outcome="match")
            log.debug(
                "integrity check of turn %s: match (differences up to %.3g)",
                report.request_id,
                diff,
            )
            return
        self.metrics.inc(METRIC, outcome="mismatch")
        mismatch = IntegrityMismatch(
            prefill_engine_id=_computed_on(state) or "",
            source_engine_id=sample.source_engine_id,
            decode_engine_id=state.decode_engine_id,
            session_id=report.session_id,
            request_id=report.request_id,
            owner=state.turn.owner,
            num_tokens=len(output),
            max_abs_diff=diff,
            tolerance=tolerance,
        )
        log.error(
            "KV integrity mismatch on turn %s of session %s: its plan reused the KV kept "
            "on engine %s, computing on engine %s (%s), decoded on %s; the check's plan "
            "recomputed it without reuse on prefill engine %s: the first %d tokens' log "
            "probabilities differ by up to %.4g (tolerance %.4g): reused %s, recomputed %s. "
            "Reuse from %s into %s is turned off until an operator turns it back on.",
            report.request_id,
            report.session_id,
            mismatch.source_engine_id,
            mismatch.prefill_engine_id,
            sample.plan_reason,
            mismatch.decode_engine_id,
            chunk.engine_id,
            len(output),
            diff,
            tolerance,
            reused,
            recomputed,
            mismatch.source_engine_id,
            mismatch.prefill_engine_id,
        )
        self.turn_off(mismatch)

    def turn_off(self, mismatch: IntegrityMismatch) -> None:
        """Reuse from the mismatch's source engine off here now, and the mismatch sent
        to the service until it has it (a task)."""
        source = mismatch.source_engine_id
        self._off_here[source] = self._off_here.get(source, 0) + 1
        task = asyncio.get_running_loop().create_task(self._report(mismatch))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report(self, mismatch: IntegrityMismatch) -> None:
        """Tell the service of ``mismatch`` until it has it (see the module); then reuse
        from its source is the service's to refuse."""
        settings = self.settings
        wait_s = settings.report_backoff_s
        num_tries = 0
        try:
            while True:
                num_tries += 1
                try:
                    await asyncio.wait_for(
                        self.service().integrity_mismatch(mismatch), settings.report_timeout_s
                    )
                    break
                except (RequestError, TimeoutError) as exc:
                    why = str(exc) or f"no answer within {settings.report_timeout_s:g} s"
                    log.error(
                        "could not tell the KV service of turn %s's integrity mismatch "
                        "(try %d): %s; reuse from %s stays off here, next try in %.3g s",
                        mismatch.request_id,
                        num_tries,
                        why,
                        mismatch.source_engine_id,
                        wait_s,
                    )
                await asyncio.sleep(wait_s)
                wait_s = min(wait_s * 2, settings.report_backoff_max_s)
        finally:
            source = mismatch.source_engine_id
            left = self._off_here.get(source, 1) - 1
            if left > 0:
                self._off_here[source] = left
            else:
                self._off_here.pop(source, None)


def _computed_on(state: TurnState) -> str | None:
    """The engine that computed the turn from the reused KV: the prefill engine that
    pulled it, or the decode engine an extended turn ran on (its prefix cache hit); None
    when the turn reused none."""
    report = state.report
    if report.kv_source in ("sent_back", "host_tier"):
        return report.prefill_replica
    if report.kv_source == "extended":
        return state.decode_engine_id
    return None


def _abs_diff(a: float | None, b: float | None) -> float:
    """``|a - b|``; infinite where either is missing or not a number (fail closed)."""
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b)
