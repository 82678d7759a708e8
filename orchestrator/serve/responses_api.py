"""The stateful Responses API's book: which API key owns each stored response, and the
kvtide session its conversation runs in.

vLLM's ``OpenAIServingResponses`` keeps stored responses and their input messages in
two in-process maps (it never forgets them); ``previous_response_id`` rebuilds the
conversation from them, so a later turn sends only its new input items. kvtide puts
that on its own terms:

* a stored response belongs to the API key that created it: another key's
  ``previous_response_id``, ``GET`` or ``DELETE`` gets the same 404 as an unknown id;
* a chain of responses is one kvtide session (named by the chain's first response id),
  so each later turn pulls the previous turn's KV back, without a header and without
  the client resending the history;
* the book is bounded (count) and expires with the session's KV TTL; what it drops
  (or ``DELETE`` removes) leaves vLLM's maps too.

Per ingress replica, as vLLM's own store is per server: a chain continues on the
replica that stored it.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from orchestrator.bounded import BoundedMap

__all__ = ["ResponseBook", "StoredResponse"]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    owner: str | None  # the API key's name; None without keys
    session_id: str


class ResponseBook:
    """Stored responses' owners and sessions (see the module). The clock is passed in."""

    def __init__(
        self,
        stores: tuple[MutableMapping[str, Any], ...],
        *,
        ttl_s: float,
        max_entries: int,
        clock: Callable[[], float],
    ) -> None:
        self._stores = stores  # vLLM's response and message maps, kept in step
        self._book: BoundedMap[str, StoredResponse] = BoundedMap(max_entries=max_entries)
        self.ttl_s = ttl_s
        self.clock = clock

    def __len__(self) -> int:
        return len(self._book)

    def session_of(self, response_id: str, owner: str | None) -> str | None:
        """The session of ``owner``'s stored response ``response_id``; None when there
        is none (unknown, expired, deleted, or another key's)."""
        self._expire()
        entry = self._book.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        return entry.session_id

    def keep(self, response_id: str, owner: str | None, session_id: str) -> None:
        """A response stored by ``owner`` in ``session_id``'s chain."""
        self._expire()
        dropped = self._book.put(
            response_id, StoredResponse(owner, session_id), expires_s=self.clock() + self.ttl_s
        )
        self._forget_stored(key for key, _ in dropped)

    def delete(self, response_id: str) -> None:
        self._book.pop(response_id)
        self._forget_stored([response_id])

    def _expire(self) -> None:
        self._forget_stored(key for key, _ in self._book.expire(self.clock()))

    def _forget_stored(self, response_ids: Any) -> None:
        for response_id in response_ids:
            for store in self._stores:
                store.pop(response_id, None)
