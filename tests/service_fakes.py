"""The KV service as its callers reach it: through its protocol (``KVServiceAPI``, the
calls in ``API_METHODS``), never as a subclass of ``KVService``.

A test's fake holds the real service and defines only the calls it scripts (each one
ending, if it lets the call through, in ``self.service``'s); every other call of the
protocol reaches the real service unchanged. The service's internals are not reachable
through the fake: a test that reads them asks the real one (``fake.service``)."""

from __future__ import annotations

from typing import Any

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
