"""A prefill engine stopped by a scale-in: the prompts' KV it keeps for decode engines.

A prefill request's blocks stay on its engine after the request ends, until the decode
engine given its ``kv_transfer_params`` has read them (NIXL's read notification frees
them on vLLM; a peer's completed pull on the simulated engine) or their lease
(``kv.prefill_lease_s``, vLLM's ``kv_lease_duration``) runs out. Serve drains a stopping
replica by its ongoing calls, and a prefill call ends before decode reads its KV: an
engine stopped then takes that KV with it, and the decode's pull fails (its turn fails
under ``kv_load_failure_policy: fail``, else decode computes the prompt again).

So a stopping prefill host waits, before its engine stops, until the engine keeps no
KV: nothing running or waiting and no block in use (on a prefill engine, the blocks
left once its requests end are those kept for a peer), within the lease (past it they
are freed, read or not). The engine's own stats are the only view of its reads the host
has: on vLLM, they are as its last engine step logged them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from engines.base import EngineStats

__all__ = ["POLL_S", "hand_offs_read"]

POLL_S = 0.1
"""How often the stats are read while the engine keeps KV for a peer."""


async def hand_offs_read(
    stats: Callable[[], EngineStats],
    *,
    within_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], Awaitable[None]],
) -> bool:
    """Wait until the engine keeps no KV for a peer (True) or ``within_s`` passes (False)."""
    deadline_s = clock() + within_s
    while True:
        now = stats()
        if now.num_running == 0 and now.num_waiting == 0 and now.kv_cache_usage <= 0:
            return True
        left_s = deadline_s - clock()
        if left_s <= 0:
            return False
        await sleep(min(POLL_S, left_s))
