"""The guard every request that runs a turn runs under, in both OpenAI layers: the API
key's concurrency ticket (held until the response, or its stream, ends) and the request's
Idempotency-Key (the turn runs once per key; a retry gets the stored response).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from orchestrator.errors import ServiceUnavailable
from orchestrator.kv.ownership import Principal
from orchestrator.kv.service import KVServiceAPI
from orchestrator.serve import openai_api as api
from orchestrator.serve.auth import ConcurrencyGate, Ticket
from orchestrator.serve.responses import replay_key_of

__all__ = ["BeginReplay", "Replayed", "RequestGuard", "RunGuarded"]

RunGuarded = Callable[[Ticket, str | None], Awaitable[Any]]
"""``(ticket, replay_key)``: the request's run under its concurrency ticket."""
BeginReplay = Callable[[str, str], Awaitable[dict[str, Any] | None]]
"""``(replay_key, attempt)``: an Idempotency-Key looked up (``responses.begin_replay``)."""
Replayed = Callable[[dict[str, Any]], Any]
"""An earlier run's stored response, as this request's response."""


@dataclass(slots=True, kw_only=True, eq=False)
class RequestGuard:
    """A request's concurrency ticket and Idempotency-Key (see the module)."""

    kv: KVServiceAPI
    gate: ConcurrencyGate

    async def guarded(
        self,
        http: Request,
        principal: Principal,
        run: RunGuarded,
        begin: BeginReplay,
        replayed: Replayed,
        num_sequences: int = 1,
    ) -> Any:
        """``run(ticket, replay_key)`` under the key's concurrency ticket (counting the
        request's ``num_sequences``: its ``n`` choices), once per
        Idempotency-Key: ``begin(replay_key, attempt)`` looks the key up (the stored
        response of an earlier run, which is ``replayed``; 409 while it runs, 422 when
        the key came with another request; None: run now, as after a failed run). The
        ticket is released when the response ends (a stream's own end releases it).

        ``attempt`` names this HTTP attempt in the book. A ``begin`` that fails here
        (the service did not answer in time) may still reach the service later (Ray
        delivers it to a restarted instance) and book the key running for nobody: the
        attempt takes back what it may have booked, and only that, so the client's
        retry runs instead of waiting out a turn that never runs."""
        replay_key = replay_key_of(
            http.headers.get("idempotency-key"),
            principal.name,
            api.session_header(http.headers.get("x-session-id")),
        )
        ticket = self.gate.acquire(principal, num_sequences)
        streaming = False
        try:
            if replay_key is not None:
                attempt = uuid.uuid4().hex
                try:
                    stored = await begin(replay_key, attempt)
                except ServiceUnavailable:
                    await asyncio.shield(self._take_back(replay_key, attempt))
                    raise
                if stored is not None:
                    return replayed(stored)
            try:
                response = await run(ticket, replay_key)
            except BaseException:
                if replay_key is not None:
                    await asyncio.shield(self.kv.replay_fail(replay_key))
                raise
            streaming = isinstance(response, StreamingResponse)
            return response
        finally:
            if not streaming:  # a stream releases its ticket when it ends
                self.gate.release(ticket)

    async def _take_back(self, replay_key: str, attempt: str) -> None:
        """Free ``replay_key`` if ``attempt`` booked it running (sent even when the
        service does not answer: Ray delivers it after the ``begin`` it follows)."""
        with contextlib.suppress(ServiceUnavailable):
            await self.kv.replay_fail(replay_key, attempt)
