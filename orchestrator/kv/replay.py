"""Idempotent turns: a retried request runs its turn at most once.

A client that lost a response (a reset connection, a 503 from a proxy) cannot know
whether its turn ran. If it sends the same ``Idempotency-Key`` again, kvtide answers from
this book instead of running the turn a second time (which would also append a second
answer to the session's KV):

- first sight of a key: the turn runs (``begin`` returns ``RUN``);
- the key's turn is still running: ``IN_PROGRESS`` (HTTP 409 ``turn_in_progress``, with
  ``Retry-After``) -- unless the asker is the attempt that began it: each HTTP attempt
  names itself (``attempt``), and a ``begin`` that Ray delivers again on a restarted
  service, after the dead instance had stored the key running, is told to run (no
  ingress runs that turn: the attempt that began it is the one asking);
- the key's turn completed: its stored response is replayed;
- the key's turn failed: the key is free again, so the retry runs the turn;
- the key was first sent with another request: ``MISMATCH`` (HTTP 422
  ``idempotency_key_reused``), neither replayed nor run.

A key is bound to the request it first came with by a *fingerprint* (the endpoint and a
digest of what the request asks, ``orchestrator.serve.responses.request_fingerprints``):
``begin`` takes the request's fingerprints, stores the first with the key, and a later
request with the key matches when its fingerprints include the stored one (a request
may have more than one: the SDK's continuation of a cut stream is the same request as
the one it continues).

Keys are scoped by the caller (API key name and session id) so one caller cannot read
another's replay. Completed entries are kept ``ttl_s``, at most ``max_entries`` and at
most ``max_bytes`` of stored responses (oldest dropped first). The clock is passed in.

The book writes through to a ``DurableStore`` (``orchestrator.kv.durable``): a restarted
service reloads it, so a retry after a restart is still replayed, and a turn that was
running when the service died still answers ``in_progress`` (for ``running_grace_s``,
the longest a turn may run) instead of running a second time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

from orchestrator.bounded import BoundedMap
from orchestrator.kv.durable import DurableStore, MemoryStore

__all__ = ["Replay", "TurnReplayBook"]

_PREFIX = "replay/"


class Replay(msgspec.Struct, frozen=True, kw_only=True):
    """What ``begin`` says: run the turn, wait, or replay ``body``."""

    action: Literal["run", "in_progress", "replay", "mismatch"]
    body: dict[str, Any] | None = None


class _Stored(msgspec.Struct, frozen=True, kw_only=True):
    """A book entry as the durable store holds it (``body`` None: running, begun by
    ``attempt``; ``fingerprint`` empty: stored without one, matches any request)."""

    key: str
    body: dict[str, Any] | None = None
    fingerprint: str = ""
    attempt: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Stored).decode


def _store_key(key: str) -> str:
    return _PREFIX + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


class TurnReplayBook:
    def __init__(
        self,
        *,
        ttl_s: float = 600.0,
        max_entries: int = 10_000,
        max_bytes: int = 64 * 2**20,
        running_grace_s: float = 600.0,
        store: DurableStore | None = None,
        clock: Callable[[], float],
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.running_grace_s = running_grace_s
        self.store: DurableStore = store if store is not None else MemoryStore()
        self.clock = clock
        # key -> response body (None while running), expiring ttl_s after it was stored;
        # sized as stored.
        self._entries: BoundedMap[str, dict[str, Any] | None] = BoundedMap(
            max_entries=max_entries, max_bytes=max_bytes
        )
        # key -> the fingerprint of the request it was first sent with.
        self._fingerprints: dict[str, str] = {}
        # running key -> the attempt that began it.
        self._attempts: dict[str, str] = {}
        self.num_duplicates = 0
        self._load()

    @property
    def num_bytes(self) -> int:
        return self._entries.num_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def begin(self, key: str, fingerprints: Sequence[str] = (), attempt: str = "") -> Replay:
        """What to do with a request under ``key`` whose fingerprints are
        ``fingerprints`` (the first is stored when the turn runs; none: any request),
        asked by ``attempt`` (one id per HTTP attempt; empty: anonymous)."""
        now = self.clock()
        self._prune(now)
        if key not in self._entries:
            self._put(key, now, None, fingerprints[0] if fingerprints else "", attempt)
            return Replay(action="run")
        stored = self._fingerprints.get(key, "")
        if stored and fingerprints and stored not in fingerprints:
            return Replay(action="mismatch")
        body = self._entries.get(key)
        if body is None:
            if attempt and self._attempts.get(key) == attempt:
                return Replay(action="run")  # its own begin, delivered again
            return Replay(action="in_progress")
        return Replay(action="replay", body=body)

    def complete(self, key: str, body: dict[str, Any]) -> None:
        """The turn succeeded: keep its response for retries. A key that had completed
        already ran twice: counted in ``num_duplicates`` (it should stay 0)."""
        if self._entries.get(key) is not None:
            self.num_duplicates += 1
        self._put(key, self.clock(), body, self._fingerprints.get(key, ""))

    def fail(self, key: str, attempt: str = "") -> None:
        """The turn failed or was cancelled: a retry may run it. With ``attempt``: only
        if that attempt began it (an attempt taking back a ``begin`` it does not know
        reached the book)."""
        if key in self._entries and self._entries.get(key) is None:
            if not attempt or self._attempts.get(key) == attempt:
                self._drop(key)

    def _put(
        self,
        key: str,
        now: float,
        body: dict[str, Any] | None,
        fingerprint: str,
        attempt: str = "",
    ) -> None:
        stored = _Stored(key=key, body=body, fingerprint=fingerprint, attempt=attempt)
        data = _encode(stored)
        if key in self._entries:
            self._drop(key)
        if len(data) > self.max_bytes:
            return  # a response larger than the whole book is not kept: a retry runs
        self.store.put(_store_key(key), data)
        self._keep(stored, now + self.ttl_s, len(data))

    def _keep(self, stored: _Stored, expires_s: float, size: int) -> None:
        key = stored.key
        self._fingerprints[key] = stored.fingerprint
        if stored.body is None and stored.attempt:
            self._attempts[key] = stored.attempt
        for old, _ in self._entries.put(key, stored.body, expires_s=expires_s, size=size):
            self._forget(old)
            self.store.delete(_store_key(old))

    def _forget(self, key: str) -> None:
        self._fingerprints.pop(key, None)
        self._attempts.pop(key, None)

    def _drop(self, key: str) -> None:
        self._entries.pop(key)
        self._forget(key)
        self.store.delete(_store_key(key))

    def _prune(self, now: float) -> None:
        # A turn running longer than ttl_s is forgotten too (its ingress may be gone).
        for key, _ in self._entries.expire(now):
            self._forget(key)
            self.store.delete(_store_key(key))

    def _load(self) -> None:
        """Read back what a previous instance stored. A turn that was running is
        ``in_progress`` for ``running_grace_s`` more (its ingress may still finish it),
        then forgotten; completed turns keep a fresh ``ttl_s``."""
        now = self.clock()
        loaded: list[tuple[float, _Stored, int]] = []
        for store_key in self.store.keys(_PREFIX):
            raw = self.store.get(store_key)
            try:
                stored = _decode(raw) if raw is not None else None
            except msgspec.DecodeError:
                stored = None
            if raw is None or stored is None:
                self.store.delete(store_key)
                continue
            since = now
            if stored.body is None:  # running: pruned after running_grace_s from now
                since = now - max(0.0, self.ttl_s - self.running_grace_s)
            loaded.append((since, stored, len(raw)))
        for since, stored, size in sorted(loaded, key=lambda e: e[0]):  # oldest first
            self._keep(stored, since + self.ttl_s, size)
