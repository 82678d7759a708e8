"""A session's turn run where its KV already is: the router's side of the ``extend`` plan.

The KV service plans a turn whose history a decode engine kept as a ``pull`` (the
prefill reads the history back, computes the new tokens, and sends the whole prompt's
KV to a decode engine). ``ExtendPlan`` asks ``policies.kv_cost.choose_plan`` whether
the turn should instead run on the decode engine that kept the history, which finds it
in its own prefix cache and prefills only the new tokens: nothing moves. It weighs the
new tokens' count, where the history is, that engine's last load report (with the
prefill time per token it measured at start) and the prefill pool's queue (the engines'
reports as the ingress reads them each second, ``orchestrator.serve.admission``),
against the ``kv.extend_*`` settings.

To the KV service an extended turn is the pull it planned (its record handed to the
turn, booked again from the decode engine's final params at the hand-over); the
previous turn's blocks are not read (they share every whole block with the new turn's),
and once the turn is booked its engine frees them unread
(``orchestrator.router.kept_release``). An extended turn that fails leaves the record
whole: the service offers it again (``turn_abandoned(unread=True)``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from orchestrator.kv.engines import engine_pool
from orchestrator.kv.messages import KVDecision
from policies.admission import EngineLoad
from policies.kv_cost import ExtendSettings, PlanChoice, PlanInputs, choose_plan

__all__ = ["ExtendPlan"]


class ExtendPlan:
    """Turns a pull into an extend where the cost function says so (see the module).

    ``loads``: the engines' latest reports (None: none known here, so no turn extends);
    ``decode_max_running``: a decode engine's ``max_num_seqs``; ``decode_chunk_tokens``:
    the most prompt tokens of one request it computes in a step (vLLM's
    ``long_prefill_token_threshold``, as deployed; None: all at once), where the engine
    reported none (its host fits it to its own cost: ``orchestrator.serve.prefill_meter``);
    ``block_size_tokens``: its KV block, the grain of its prefix cache (what it computes
    in place is the new tokens and the history after its last whole block);
    ``prefill_pool``: the pool name of the prefill engines in the reports."""

    def __init__(
        self,
        *,
        settings: ExtendSettings,
        loads: Callable[[], Iterable[EngineLoad]] | None = None,
        decode_max_running: int | None = None,
        decode_chunk_tokens: int | None = None,
        block_size_tokens: int | None = None,
        prefill_pool: str = "prefill",
    ) -> None:
        self.settings = settings
        self.loads = loads
        self.decode_max_running = decode_max_running
        self.decode_chunk_tokens = decode_chunk_tokens
        self.block_size_tokens = block_size_tokens
        self.prefill_pool = prefill_pool

    def plan(
        self, decision: KVDecision, num_prompt_tokens: int, decode_pool: str, now_s: float
    ) -> tuple[KVDecision, PlanChoice | None]:
        """``decision``, made an ``extend`` where chosen, and the choice (None: not a
        pull of kept blocks, so there was nothing to choose). ``decode_pool``: the pool
        the prompt decodes on (``DecodePools.for_prompt``)."""
        params = decision.kv_transfer_params
        if decision.kind != "pull" or params is None or not params.remote_engine_id:
            return decision, None
        loads = list(self.loads()) if self.loads is not None else []
        engine = next((x for x in loads if x.engine_id == params.remote_engine_id), None)
        choice = choose_plan(
            PlanInputs(
                num_new_tokens=num_prompt_tokens - decision.num_reusable_tokens,
                num_history_tokens=decision.num_reusable_tokens,
                block_size_tokens=self.block_size_tokens,
                history_pool=decision.source_pool,
                in_turn_pool=engine_pool(params.remote_engine_id) == decode_pool,
                decode_reported_s=None if engine is None else engine.reported_s,
                decode_running=0 if engine is None else engine.num_running,
                decode_waiting=0 if engine is None else engine.num_waiting,
                decode_kv_cache_usage=0.0 if engine is None else engine.kv_cache_usage,
                decode_max_running=self.decode_max_running,
                decode_chunk_tokens=self.decode_chunk_tokens
                if engine is None or engine.prefill_chunk_tokens is None
                else engine.prefill_chunk_tokens,
                prefill_waiting=sum(x.num_waiting for x in loads if x.pool == self.prefill_pool),
                decode_prefill_s_per_token=None if engine is None else engine.prefill_s_per_token,
            ),
            self.settings,
            now_s,
        )
        if choice.extend:
            decision = msgspec.structs.replace(decision, kind="extend")
        return decision, choice
