"""The KV service as its callers reach it: through its protocol (``KVServiceAPI``, the
calls in ``API_METHODS``), never as a subclass of ``KVService``.

A test's fake holds the real service and defines only the calls it scripts (each one
ending, if it lets the call through, in ``self.service``'s); every other call of the
protocol reaches the real service unchanged. The service's internals are not reachable
through the fake: a test that reads them asks the real one (``fake.service``)."""

from __future__ import annotations

import asyncio
from typing import Any

from orchestrator.kv.messages import Handover, TurnDone
from orchestrator.kv.service import API_METHODS, KVService


class ServiceFake:
    """The real service behind its protocol; subclasses script the calls they change."""

    def __init__(self, service: KVService) -> None:
        self.service = service

    def __getattr__(self, name: str) -> Any:
        if name not in API_METHODS:
            raise AttributeError(
                f"{name!r} is not a call of the KV service's protocol (KVServiceAPI); "
                "read the real service's internals as .service"
            )
        return getattr(self.service, name)


class HeldHandOver(ServiceFake):
    """The real service, each ``turn_done`` held until the test sets ``release``: seen on
    arrival (``arrived``), booked by the real service once let through (``booked``)."""

    def __init__(self, service: KVService) -> None:
        super().__init__(service)
        self.release = asyncio.Event()
        self.arrived: list[TurnDone] = []
        self.booked: list[TurnDone] = []

    async def turn_done(self, done: TurnDone) -> Handover:
        self.arrived.append(done)
        await self.release.wait()
        answer = await self.service.turn_done(done)
        self.booked.append(done)
        return answer
