"""The KV lifecycle's effects, applied: every set of kept blocks nobody will reuse
(sessionless turns, closed, superseded or budget-evicted sessions) is *drained*, read
back into a prefill engine with a ``max_tokens=1`` pull, because vLLM 0.32's decode
engine pins them until its TTL otherwise.

A drain needs the exact tokens the blocks hold: the caller's candidates, then the
session's last turn (``SessionTokens``). A record no known tokens match stays until its
TTL (counted as undrainable). A record gone from under an unused turn lease revokes the
lease (``LeaseBook.revoke_record``): its next turn asks ``begin_turn`` instead of reading
KV that is no longer there. A record on an engine whose reuse an integrity check turned
off (``orchestrator.kv.integrity``) is not drained either: the read-back is the same read
that check found wrong, and its KV would land in the prefill engine's prefix cache; its
blocks stay until the TTL (counted as withheld).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from engines.base import GenerateRequest, final_chunk
from engines.kv_params import KVTransferParams
from orchestrator.kv.decider import params_of
from orchestrator.kv.session_tokens import SessionTokens
from orchestrator.kv.turn_leases import LeaseBook
from policies.kv_lifecycle import Effect, prefix_hash

__all__ = ["Drains", "PrefillPool"]

log = logging.getLogger("kvtide.kv_service")


class PrefillPool(Protocol):
    """How the service reaches the prefill pool to drain kept blocks."""

    def generate(self, request: GenerateRequest) -> Any: ...


class Drains:
    """Applies lifecycle effects and runs the drains they call for (one task each)."""

    def __init__(
        self,
        *,
        prefill: PrefillPool | None,
        timeout_s: float,
        tokens: SessionTokens,
        leases: LeaseBook,
        reuse_off: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self.prefill = prefill
        # The engines no read-back may read from (an integrity check failed there).
        self.reuse_off = reuse_off
        self.timeout_s = timeout_s
        self.tokens = tokens
        self.leases = leases
        self._tasks: set[asyncio.Task[None]] = set()
        self.counters = dict.fromkeys(
            ("drains", "drain_failures", "undrainable", "drains_withheld"), 0
        )

    def __len__(self) -> int:
        """The drains in flight."""
        return len(self._tasks)

    def stats(self) -> dict[str, int]:
        """The drains' part of the service's stats."""
        c = self.counters
        return {
            "num_drains": c["drains"],
            "num_drain_failures": c["drain_failures"],
            "num_drains_running": len(self._tasks),
            "num_undrainable": c["undrainable"],
            "num_drains_withheld": c["drains_withheld"],
        }

    def apply(
        self, effects: Sequence[Effect], candidates: Sequence[Sequence[int] | None] = ()
    ) -> None:
        """Drain records nobody will reuse, with the tokens they hold: the first of
        ``candidates`` (then the session's current tokens) that starts with the record's
        covered tokens (see the module)."""
        for effect in effects:
            self.leases.revoke_record(effect.record)
            if not effect.drainable:
                continue  # expiring anyway: the engine frees the blocks at its TTL
            record = effect.record
            if record.engine_id in self.reuse_off():
                self.counters["drains_withheld"] += 1
                continue
            options = (*candidates, self.tokens.token_ids(record.session_id))
            ids = next(
                (
                    c
                    for c in options
                    if c is not None
                    and len(c) > record.num_tokens
                    and prefix_hash(c, record.num_tokens) == record.prefix_hash
                ),
                None,
            )
            if ids is None:
                self.counters["undrainable"] += 1
                continue
            self.drain(params_of(record), ids[: record.num_tokens + 1])

    def drain(self, params: KVTransferParams | None, token_ids: Sequence[int]) -> None:
        """Free a decode engine's kept blocks by reading them into a prefill engine."""
        if self.prefill is None or params is None or params.kept_blocks() is None:
            return
        task = asyncio.get_running_loop().create_task(self._read_back(params, list(token_ids)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read_back(self, params: KVTransferParams, token_ids: list[int]) -> None:
        assert self.prefill is not None
        req = GenerateRequest(
            request_id=f"drain-{uuid.uuid4().hex}",
            prompt_token_ids=token_ids,
            max_tokens=1,
            # Nobody decodes after a drain: the prefill frees its copy at once.
            kv_transfer_params=params.pull_back(keep=False),
        )
        try:
            await asyncio.wait_for(final_chunk(self.prefill.generate(req)), self.timeout_s)
            self.counters["drains"] += 1
        except Exception as exc:
            self.counters["drain_failures"] += 1
            log.warning("drain of %s failed: %s", params.remote_request_id, exc)

    async def wait(self) -> None:
        """Wait for the drains in flight (tests and shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
