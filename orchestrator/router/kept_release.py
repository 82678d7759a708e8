"""The previous turn's kept blocks freed, unread, once a turn extended on them is booked.

A turn extended on the decode engine that kept its session's history
(``orchestrator.router.extend_plan``) reads nothing: the engine finds the history in its
prefix cache, so the blocks it kept for the previous turn become the new turn's prefix
(vLLM's prefix cache shares them). vLLM still holds them for a reader that never comes,
until their TTL. Once the KV service has booked the extended turn's record (``HandOver``),
``KeptRelease`` asks that engine to free them: a one-token request, asking for that
engine, whose params name them (``KVTransferParams.release``, honoured by
``engines.kv_connector``); nothing is read, and the decode host's ledger drops the entry
with it (``orchestrator.serve.ledger``). Not before the booking: a turn that fails leaves
the previous record whole for the next turn to pull or extend. A release that fails or
misses its deadline leaves the blocks to their TTL, as they were.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engines.base import GenerateRequest
from engines.kv_params import KVTransferParams
from orchestrator.errors import RequestError
from orchestrator.router.streams import bounded
from orchestrator.router.turn_report import PoolClient

__all__ = ["KeptRelease", "release_request"]

log = logging.getLogger("kvtide.router")


def release_request(
    request_id: str, prompt_token_ids: list[int], kept: KVTransferParams
) -> GenerateRequest | None:
    """The request that frees the blocks ``kept`` names on their engine (None: they name
    no engine's request): one token of ``prompt_token_ids`` computed there, its own
    blocks freed at once."""
    engine_id, kept_id = kept.remote_engine_id, kept.remote_request_id
    if not engine_id or not kept_id or not prompt_token_ids:
        return None
    return GenerateRequest(
        request_id=f"{request_id}-release",
        prompt_token_ids=prompt_token_ids[:1],
        max_tokens=1,
        kv_transfer_params=KVTransferParams.release(kept_id),
        engine_id=engine_id,
    )


class KeptRelease:
    """Sends releases to the decode pool (see the module), each bounded by ``timeout_s``;
    ``pool``: the decode pool of a prompt of so many tokens (the pool its turn extended
    on)."""

    def __init__(
        self, *, pool: Callable[[int], PoolClient], timeout_s: float, clock: Callable[[], float]
    ) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.clock = clock

    async def release(self, request: GenerateRequest, num_prompt_tokens: int) -> bool:
        """Run ``request`` (``release_request``) to its end on the decode pool of the
        extended turn's prompt (``num_prompt_tokens``); False when it failed."""
        deadline_s = self.clock() + self.timeout_s
        pool = self.pool(num_prompt_tokens)
        try:
            async for _ in bounded(
                pool.generate(request), deadline_s, self.clock, "release of kept blocks"
            ):
                pass
        except RequestError as exc:
            log.warning("%s: kept blocks left to their TTL: %s", request.request_id, exc)
            return False
        return True
