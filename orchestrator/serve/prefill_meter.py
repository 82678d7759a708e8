"""A decode host's prefill time per token, calibrated at start and updated as it serves,
and the prefill chunk its engine runs with it.

A vLLM decode host with ``kv.extend`` on times two prefills after its warm-up
(``orchestrator.serve.warm_up.measure_prefill``); that is the start of its step-time
model. Each request it then computes in place (an extended turn: no remote prefill,
its prompt's new tokens computed here) finishes with the engine's own times: from its
scheduling to its first token, and its mean decode step after (``GenerateChunk``'s
``engine_prefill_s``, ``engine_step_s``). ``PrefillMeter`` folds each into the figure
(``policies.kv_cost.observe_prefill``: what the prefill added to its steps, over its
tokens; smoothed, bounded by the calibration), and the host's heartbeat reports it, so
the cost function prices the ITL budget at what the engine does now.

The chunk follows the same figure. The deploy sizes the decode pool's chunk (vLLM's
``long_prefill_token_threshold``) from ``kv.extend_prefill_ms_per_token``; an engine
slower than that would overrun the ITL budget with every whole chunk, and the cost
function, pricing a step at the engine's own figure, would pull every turn that fills
one. So the meter keeps the engine's chunk at what its figure fits in the budget
(``policies.kv_cost.budget_chunk_tokens``), never above the deployed one (the engine's
step holds ``max_num_seqs`` + that many tokens): at start and whenever a sample moves
it, one request tells the engine's scheduler (``KVTransferParams.set_prefill_chunk``,
read by ``engines.kv_connector``), and the heartbeat reports the chunk the engine runs
with the figure it was fitted to, which the cost function prices a step with. While a
new chunk is on its way the report keeps the previous pair: a new figure beside the old
chunk would price a whole chunk over the budget until the next report.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from engines.base import GenerateChunk, GenerateRequest, final_chunk
from engines.kv_params import KVTransferParams
from policies.kv_cost import (
    PrefillCost,
    PrefillCostSettings,
    budget_chunk_tokens,
    observe_prefill,
    prefill_steps,
)

__all__ = ["ChunkSetter", "PrefillMeter"]

log = logging.getLogger("kvtide.engine_host")

Generate = Callable[[GenerateRequest], AsyncIterator[GenerateChunk]]


class ChunkSetter:
    """How a meter reaches its engine: ``generate`` (the engine's own, not the host's),
    the engine's ``name`` for request ids and logs, and each request's deadline."""

    def __init__(self, generate: Generate, *, name: str, timeout_s: float) -> None:
        self.generate = generate
        self.name = name
        self.timeout_s = timeout_s
        self._num_sent = 0

    async def set(self, chunk_tokens: int) -> bool:
        """Tell the engine's scheduler its chunk: a one-token request whose params carry
        it, nothing kept. False (logged) when the request failed or missed its deadline."""
        self._num_sent += 1
        request = GenerateRequest(
            request_id=f"prefill-chunk-{self.name}-{self._num_sent}",
            prompt_token_ids=[1],
            max_tokens=1,
            kv_transfer_params=KVTransferParams.set_prefill_chunk(chunk_tokens),
        )
        try:
            await asyncio.wait_for(final_chunk(self.generate(request)), self.timeout_s)
        except Exception as exc:  # the engine keeps its chunk, and the meter says so
            log.warning(
                "prefill chunk %d for %s: %s: %s", chunk_tokens, self.name, type(exc).__name__, exc
            )
            return False
        return True


class PrefillMeter:
    """One decode engine's prefill cost and chunk (see the module).
    ``calibrated_s_per_token``: its measurement at start (None: none made, and nothing
    is reported); ``chunk_tokens``: the most prompt tokens one of its steps computes
    beside others, as deployed (vLLM's ``long_prefill_token_threshold``; None: a prompt
    in one step); ``itl_budget_s``: the budget the chunk is fitted to (None: the
    deployed chunk stays); ``setter``: how the chunk reaches the engine (None: it
    stays)."""

    def __init__(
        self,
        calibrated_s_per_token: float | None,
        *,
        chunk_tokens: int | None = None,
        itl_budget_s: float | None = None,
        setter: ChunkSetter | None = None,
        settings: PrefillCostSettings | None = None,
    ) -> None:
        self.cost = (
            None
            if calibrated_s_per_token is None
            else PrefillCost.calibrated(calibrated_s_per_token)
        )
        self.deployed_chunk_tokens = chunk_tokens
        self.chunk_tokens = chunk_tokens  # what the engine runs now
        self.itl_budget_s = itl_budget_s
        self.setter = setter
        self.settings = settings or PrefillCostSettings()
        self._fitting: asyncio.Task[None] | None = None
        # The figure reported with ``chunk_tokens``: the one that chunk was fitted to.
        self._paired_s_per_token = calibrated_s_per_token

    @property
    def s_per_token(self) -> float | None:
        """The figure to report now, with ``chunk_tokens`` (None: never measured)."""
        return self._paired_s_per_token

    def fitted_chunk(self) -> int | None:
        """The chunk for the figure now: the most tokens a step may compute within the
        ITL budget, at most the deployed chunk; the deployed one without a figure, a
        budget or a deployed chunk."""
        deployed, cost, budget = self.deployed_chunk_tokens, self.cost, self.itl_budget_s
        if deployed is None or cost is None or budget is None:
            return deployed
        return min(deployed, budget_chunk_tokens(itl_budget_s=budget, s_per_token=cost.s_per_token))

    async def fit(self) -> None:
        """Give the engine ``fitted_chunk()`` where it runs another (one request through
        ``setter``); ``chunk_tokens`` is what it runs after, the old one if that failed,
        and the figure reported with it is the one now."""
        chunk = self.fitted_chunk()
        figure = self.cost.s_per_token if self.cost is not None else None
        if chunk is None or chunk == self.chunk_tokens or self.setter is None:
            self._paired_s_per_token = figure
            return
        if not await self.setter.set(chunk):
            self._paired_s_per_token = figure  # the engine's chunk stays, at this figure
            return
        log.info(
            "engine %s prefills in chunks of %d tokens (%s s per token)",
            self.setter.name,
            chunk,
            figure,
        )
        self.chunk_tokens, self._paired_s_per_token = chunk, figure

    def record(self, request: GenerateRequest, chunk: GenerateChunk) -> None:
        """Fold in ``request``'s finished ``chunk`` if it computed its prompt here: not a
        remote prefill's decode (its time is the KV pull), and with the engine's times.
        Where the figure moves the fitted chunk, the engine is given it in a task of its
        own (one at a time; the next sample tries again)."""
        if self.cost is None or not chunk.finished:
            return
        params = request.kv_transfer_params
        if params is not None and params.do_remote_prefill:
            return
        prefill_s, step_s = chunk.engine_prefill_s, chunk.engine_step_s
        if prefill_s is None or step_s is None:
            return
        computed = chunk.num_prompt_tokens - chunk.num_cached_tokens
        self.cost = observe_prefill(
            self.cost,
            num_tokens=computed,
            prefill_s=prefill_s,
            step_s=step_s,
            num_steps=prefill_steps(computed, self.chunk_tokens),
            settings=self.settings,
        )
        if self.setter is None or self.fitted_chunk() == self.chunk_tokens:
            self._paired_s_per_token = self.cost.s_per_token
        elif self._fitting is None or self._fitting.done():
            self._fitting = asyncio.get_running_loop().create_task(self.fit())
