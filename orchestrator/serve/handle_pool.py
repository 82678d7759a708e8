"""A pool reached through its Ray Serve deployment handle."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray.serve.handle import DeploymentHandle

from engines.base import GenerateChunk, GenerateRequest

__all__ = ["HandlePool"]


class HandlePool:
    """A pool reached through its Serve deployment handle (streaming ``generate``)."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle
        self._stream = handle.options(stream=True)

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        stream: AsyncIterator[GenerateChunk] = self._stream.generate.remote(request)
        return stream
