"""Idempotent turns: a retried request runs its turn at most once.

A client that lost a response (a reset connection, a 503 from a proxy) cannot know
whether its turn ran. If it sends the same ``Idempotency-Key`` again, kvtide answers from
this book instead of running the turn a second time (which would also append a second
answer to the session's KV):

- first sight of a key: the turn runs (``begin`` returns ``RUN``);
- the key's turn is still running: ``IN_PROGRESS`` (HTTP 409 ``turn_in_progress``, with
  ``Retry-After``);
- the key's turn completed: its stored response is replayed;
- the key's turn failed: the key is free again, so the retry runs the turn.

Keys are scoped by the caller (API key name and session id) so one caller cannot read
another's replay. Completed entries are kept ``ttl_s`` and at most ``max_entries``
(oldest dropped first). The clock is passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal

import msgspec

__all__ = ["Replay", "TurnReplayBook"]


class Replay(msgspec.Struct, frozen=True, kw_only=True):
    """What ``begin`` says: run the turn, wait, or replay ``body``."""

    action: Literal["run", "in_progress", "replay"]
    body: dict[str, Any] | None = None


_IN_PROGRESS = object()


class TurnReplayBook:
    def __init__(
        self,
        *,
        ttl_s: float = 600.0,
        max_entries: int = 10_000,
        clock: Callable[[], float],
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, object]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def begin(self, key: str) -> Replay:
        now = self.clock()
        self._prune(now)
        entry = self._entries.get(key)
        if entry is None:
            self._put(key, now, _IN_PROGRESS)
            return Replay(action="run")
        if entry[1] is _IN_PROGRESS:
            return Replay(action="in_progress")
        body = entry[1]
        assert isinstance(body, dict)
        return Replay(action="replay", body=body)

    def complete(self, key: str, body: dict[str, Any]) -> None:
        """The turn succeeded: keep its response for retries."""
        self._put(key, self.clock(), body)

    def fail(self, key: str) -> None:
        """The turn failed or was cancelled: a retry may run it."""
        entry = self._entries.get(key)
        if entry is not None and entry[1] is _IN_PROGRESS:
            del self._entries[key]

    def _put(self, key: str, now: float, value: object) -> None:
        self._entries[key] = (now, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def _prune(self, now: float) -> None:
        while self._entries:
            # A turn running longer than ttl_s is forgotten too (its ingress may be gone).
            key, (stored, _) = next(iter(self._entries.items()))
            if now - stored < self.ttl_s:
                break
            del self._entries[key]
