"""Blocking calls to Ray's GCS, each bounded by a deadline.

Ray's Python calls to the GCS (``ray.get_actor``, ``ray.util.list_named_actors``, the
key-value table of ``ray.experimental.internal_kv``, an actor's creation with
``get_if_exists``) take no timeout: while the GCS does not answer they wait, Ray
retrying for ``gcs_rpc_server_reconnect_timeout_s`` (60 s by default) and longer with
GCS fault tolerance. On a turn's or an eviction's path that wait would hold the turn,
or everything queued behind it, for as long. ``call_within`` runs such a call on a
worker thread and waits at most its deadline; past it the caller gets ``CallTimedOut``
naming the call, a call not started yet is cancelled, and one running is left to end on
its own (its answer dropped). ``call_within_async`` does the same from an event loop
without blocking it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

from orchestrator.errors import KVTideError

__all__ = ["GCS_TIMEOUT_S", "CallTimedOut", "call_within", "call_within_async"]

T = TypeVar("T")

GCS_TIMEOUT_S = 5.0
"""The deadline of one GCS call on a turn's or an eviction's path: a round trip is about
0.5 ms; well inside the 30 s a caller of the KV service waits (``kv.service_timeout_s``)."""

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvtide-gcs")
"""The threads the calls run on: a hung call holds one; callers return at their
deadline even when all are held (their calls wait for a thread, and are cancelled)."""


class CallTimedOut(KVTideError, TimeoutError):
    """``what`` did not answer within ``timeout_s``."""

    def __init__(self, what: str, timeout_s: float) -> None:
        super().__init__(f"{what} did not answer within {timeout_s:g} s")
        self.what = what
        self.timeout_s = timeout_s


def call_within(call: Callable[[], T], timeout_s: float, what: str) -> T:
    """``call()``'s answer (or its exception) if it comes within ``timeout_s``; else
    ``CallTimedOut`` naming ``what``."""
    future = _POOL.submit(call)
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError:
        if future.done():
            raise  # the call's own
        future.cancel()  # not started yet: it never runs
        raise CallTimedOut(what, timeout_s) from None


async def call_within_async(call: Callable[[], T], timeout_s: float, what: str) -> T:
    """``call_within`` from an event loop: the loop runs on while the call waits."""
    future = asyncio.wrap_future(_POOL.submit(call))
    try:
        return await asyncio.wait_for(future, timeout_s)  # cancels a call not started
    except TimeoutError:
        if not future.cancelled():
            raise  # the call's own
        raise CallTimedOut(what, timeout_s) from None
