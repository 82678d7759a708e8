"""A decode host's prefill time per token, calibrated at start and updated as it serves.

A vLLM decode host with ``kv.extend`` on times two prefills after its warm-up
(``orchestrator.serve.warm_up.measure_prefill``); that is the start of its step-time
model. Each request it then computes in place (an extended turn: no remote prefill,
its prompt's new tokens computed here) finishes with the engine's own times: from its
scheduling to its first token, and its mean decode step after (``GenerateChunk``'s
``engine_prefill_s``, ``engine_step_s``). ``PrefillMeter`` folds each into the figure
(``policies.kv_cost.observe_prefill``: what the prefill added to its steps, over its
tokens; smoothed, bounded by the calibration), and the host's heartbeat reports it, so
the cost function prices the ITL budget at what the engine does now.
"""

from __future__ import annotations

from engines.base import GenerateChunk, GenerateRequest
from policies.kv_cost import PrefillCost, PrefillCostSettings, observe_prefill, prefill_steps

__all__ = ["PrefillMeter"]


class PrefillMeter:
    """One decode engine's prefill cost (see the module). ``calibrated_s_per_token``:
    its measurement at start (None: none made, and nothing is reported);
    ``chunk_tokens``: the most prompt tokens one of its steps computes beside others
    (vLLM's ``long_prefill_token_threshold``; None: a prompt in one step)."""

    def __init__(
        self,
        calibrated_s_per_token: float | None,
        *,
        chunk_tokens: int | None = None,
        settings: PrefillCostSettings | None = None,
    ) -> None:
        self.cost = (
            None
            if calibrated_s_per_token is None
            else PrefillCost.calibrated(calibrated_s_per_token)
        )
        self.chunk_tokens = chunk_tokens
        self.settings = settings or PrefillCostSettings()

    @property
    def s_per_token(self) -> float | None:
        """The figure to report now (None: never measured)."""
        return None if self.cost is None else self.cost.s_per_token

    def record(self, request: GenerateRequest, chunk: GenerateChunk) -> None:
        """Fold in ``request``'s finished ``chunk`` if it computed its prompt here: not a
        remote prefill's decode (its time is the KV pull), and with the engine's times."""
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
