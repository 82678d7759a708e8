"""The stateful Responses API's store: what vLLM keeps of each response, bounded in
bytes, owned by API keys, and tied to the kvtide session its conversation runs in.

vLLM's ``OpenAIServingResponses`` keeps each response's input messages (the whole
conversation again, written when the request starts) and the response itself
(written when it completes) in two maps it never forgets; ``previous_response_id``
rebuilds the conversation from them. Here those two maps are views of one
``ResponseBook`` (``book.messages``, ``book.responses``), so that everything vLLM
stores is counted and bounded where it is written:

* an entry is *begun* before vLLM sees the request and *settled* when the request
  ends; only a completed one is kept (for the session's KV TTL). A request refused,
  failed after the engine took it, or cancelled leaves nothing (an entry never settled
  goes at its request's deadline);
* what vLLM stores is measured as JSON and bounded per API key and in all: a new entry
  makes room by dropping the key's oldest kept responses (then anyone's, for the
  total); one that cannot fit alone is refused (429) before its turn runs;
* a stored response belongs to the API key that created it;
* each chain of responses is one kvtide session: a response continued for the first
  time runs in its session (the previous turn's KV pulled back); a second continuation
  of it (a fork) starts a session of its own, named by its first response, its history
  recomputed. ``store: false`` keeps no entry and runs without a session;
* a response dropped (``DELETE``, expired, or to make room) that nobody continued
  closes its session, freeing the KV kept for it; ``take_sessions_to_close`` hands
  those to the ingress, which closes them with the KV service.

Per ingress replica, as vLLM's own store is per server: a chain continues on the
replica that stored it. The clock is passed in.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

from orchestrator.bounded import BoundedMap
from orchestrator.config import KVTideConfig
from orchestrator.errors import LimitExceeded

__all__ = ["ResponseBook", "json_size", "response_book"]

log = logging.getLogger("kvtide.ingress")

Part = Literal["messages", "response"]


def _jsonable(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    return dump(mode="json") if callable(dump) else str(value)


def json_size(value: Any) -> int:
    """Bytes of ``value`` as JSON (pydantic models as their dump): what the book counts."""
    return len(json.dumps(value, default=_jsonable))


@dataclass(slots=True)
class _Entry:
    owner: str | None  # the API key's name; None without keys
    session_id: str | None
    previous: str | None
    closes_session: bool  # the session is the book's (not named by x-session-id)
    messages: Any = None
    response: Any = None
    messages_bytes: int = 0
    response_bytes: int = 0

    @property
    def num_bytes(self) -> int:
        return self.messages_bytes + self.response_bytes


class _View(MutableMapping[str, Any]):
    """One of vLLM's two maps, read and written through the book."""

    def __init__(self, book: ResponseBook, part: Part) -> None:
        self._book, self._part = book, part

    def __getitem__(self, response_id: str) -> Any:
        value = self._book.part(response_id, self._part)
        if value is None:
            raise KeyError(response_id)
        return value

    def __setitem__(self, response_id: str, value: Any) -> None:
        self._book.store(response_id, self._part, value)

    def __delitem__(self, response_id: str) -> None:
        self._book.drop(response_id)

    def __iter__(self) -> Iterator[str]:
        return (
            rid for rid in self._book.entry_ids() if self._book.part(rid, self._part) is not None
        )

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ResponseBook:
    """Stored responses (see the module): ``max_bytes`` in all, ``max_bytes_per_key`` for
    one key; kept ``ttl_s``; an entry never settled goes after ``pending_s``."""

    def __init__(
        self,
        *,
        max_bytes: int,
        max_bytes_per_key: int,
        ttl_s: float,
        pending_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.max_bytes = max_bytes
        self.max_bytes_per_key = min(max_bytes_per_key, max_bytes)
        self.ttl_s, self.pending_s, self.clock = ttl_s, pending_s, clock
        self.num_bytes = 0
        self._pending: BoundedMap[str, _Entry] = BoundedMap()
        self._kept: BoundedMap[str, _Entry] = BoundedMap()
        self._kept_by_owner: dict[str | None, OrderedDict[str, None]] = {}
        self._bytes_by_owner: dict[str | None, int] = {}
        # A session's tip: the response whose turn its KV is (or whose turn runs now).
        self._tips: dict[str, str] = {}
        self._to_close: list[str] = []
        self.messages = _View(self, "messages")  # vLLM's msg_store
        self.responses = _View(self, "response")  # vLLM's response_store

    def install(self, serving: Any) -> None:
        """Make ``serving``'s (vLLM's ``OpenAIServingResponses``) maps this book's."""
        serving.msg_store = self.messages
        serving.response_store = self.responses

    def __len__(self) -> int:
        """Kept responses."""
        return len(self._kept)

    def bytes_of(self, owner: str | None) -> int:
        return self._bytes_by_owner.get(owner, 0)

    def entry_ids(self) -> list[str]:
        return [*self._pending, *self._kept]

    def part(self, response_id: str, part: Part) -> Any:
        entry = self._entry(response_id)
        if entry is None:
            return None
        return entry.messages if part == "messages" else entry.response

    def owns(self, response_id: str, owner: str | None) -> bool:
        """Whether ``owner`` has a kept response ``response_id`` (not expired)."""
        self._expire()
        entry = self._kept.get(response_id)
        return entry is not None and entry.owner == owner

    # ---- a request's entry -------------------------------------------------------------

    def begin(
        self,
        response_id: str,
        owner: str | None,
        *,
        previous: str | None,
        store: bool,
        named_session: str | None = None,
    ) -> str | None:
        """A request that will store ``response_id`` (unless not ``store``), continuing
        ``previous`` (owned by ``owner``: checked by the caller). Returns the session its
        turn runs in: ``named_session`` (``x-session-id``); with ``store`` false, none;
        ``previous``'s session when nobody continued it yet; else (a new chain, or a
        fork) a new one named ``response_id``."""
        self._expire()
        if named_session is not None or not store:
            if store:
                self._pending.put(
                    response_id,
                    _Entry(owner, named_session, previous, closes_session=False),
                    expires_s=self.clock() + self.pending_s,
                )
            return named_session
        before = None if previous is None else self._kept.get(previous)
        session = response_id
        if before is not None and before.closes_session and before.session_id is not None:
            if self._tips.get(before.session_id) == previous:
                session = before.session_id
        self._tips[session] = response_id
        self._pending.put(
            response_id,
            _Entry(owner, session, previous, closes_session=True),
            expires_s=self.clock() + self.pending_s,
        )
        return session

    def store(self, response_id: str, part: Part, value: Any) -> None:
        """vLLM stores ``value`` as ``response_id``'s ``part``. Room is made by dropping
        the oldest kept responses; the messages of a request that cannot fit are refused
        (429, before its turn runs); a response that cannot fit is not kept."""
        entry = self._pending.get(response_id)
        if entry is None:  # vLLM writes only what the ingress began: never happens
            log.warning("responses: vLLM stored %s outside a request; not kept", response_id)
            return
        size = json_size(value)
        old = entry.messages_bytes if part == "messages" else entry.response_bytes
        if not self._make_room(entry.owner, size - old):
            if part == "response":
                log.warning("responses: %s does not fit the store; not kept", response_id)
                self._free(response_id, self._pending)
                return
            raise self._refusal(entry, size)
        self._account(entry.owner, size - old)
        if part == "messages":
            entry.messages, entry.messages_bytes = value, size
        else:
            entry.response, entry.response_bytes = value, size

    def settle(self, response_id: str, completed: bool) -> None:
        """The request of ``response_id`` ended: kept if it ``completed`` with its
        response stored, else forgotten."""
        entry = self._pending.get(response_id)
        if entry is None:
            return
        if not completed or entry.response is None:
            self._free(response_id, self._pending)
            return
        self._pending.pop(response_id)
        self._kept.put(response_id, entry, expires_s=self.clock() + self.ttl_s)
        self._kept_by_owner.setdefault(entry.owner, OrderedDict())[response_id] = None

    def drop(self, response_id: str) -> None:
        """Forget ``response_id`` (``DELETE``); its session closes if it is the tip."""
        for book in (self._kept, self._pending):
            if response_id in book:
                self._free(response_id, book)

    def take_sessions_to_close(self) -> list[str]:
        """Sessions whose tip response went (to be closed with the KV service)."""
        sessions, self._to_close = self._to_close, []
        return sessions

    # ---- the books ---------------------------------------------------------------------

    def _entry(self, response_id: str) -> _Entry | None:
        return self._kept.get(response_id) or self._pending.get(response_id)

    def _expire(self) -> None:
        now = self.clock()
        for response_id, entry in self._pending.expire(now):
            self._release(response_id, entry, was_pending=True)
        for response_id, entry in self._kept.expire(now):
            self._release(response_id, entry, was_pending=False)

    def _free(self, response_id: str, book: BoundedMap[str, _Entry]) -> None:
        entry = book.pop(response_id)
        if entry is not None:
            self._release(response_id, entry, was_pending=book is self._pending)

    def _release(self, response_id: str, entry: _Entry, *, was_pending: bool) -> None:
        """``entry``'s bytes given back; its session closed when it is the session's tip
        and no earlier response of the session can take its place."""
        self._account(entry.owner, -entry.num_bytes)
        self._kept_by_owner.get(entry.owner, OrderedDict()).pop(response_id, None)
        session = entry.session_id
        if session is None or not entry.closes_session or self._tips.get(session) != response_id:
            return
        # A continuation that did not complete: the response it continued is the tip
        # again (its turn's KV is still the session's, if any).
        before = None if entry.previous is None else self._kept.get(entry.previous)
        if was_pending and before is not None and before.session_id == session:
            assert entry.previous is not None
            self._tips[session] = entry.previous
            return
        del self._tips[session]
        # vLLM stores the messages before it starts the turn: without them no turn
        # claimed the session, and there is nothing to close.
        if not was_pending or entry.messages is not None:
            self._to_close.append(session)

    def _account(self, owner: str | None, delta: int) -> None:
        self.num_bytes += delta
        self._bytes_by_owner[owner] = self._bytes_by_owner.get(owner, 0) + delta
        if not self._bytes_by_owner[owner]:
            del self._bytes_by_owner[owner]

    def _make_room(self, owner: str | None, delta: int) -> bool:
        """Drop the oldest kept responses (``owner``'s, then anyone's) until ``delta``
        more bytes fit; False, dropping nothing, when they cannot (the responses being
        stored by requests still running fill the bounds)."""
        if delta <= 0:
            return True
        running = [entry for _, entry in self._pending.items()]
        running_mine = sum(e.num_bytes for e in running if e.owner == owner)
        if (
            running_mine + delta > self.max_bytes_per_key
            or sum(e.num_bytes for e in running) + delta > self.max_bytes
        ):
            return False
        mine = self._kept_by_owner.get(owner, OrderedDict())
        while self.bytes_of(owner) + delta > self.max_bytes_per_key:
            self._free(next(iter(mine)), self._kept)
        while self.num_bytes + delta > self.max_bytes:
            self._free(next(iter(self._kept)), self._kept)
        return True

    def _refusal(self, entry: _Entry, size: int) -> LimitExceeded:
        if size > self.max_bytes_per_key:
            return LimitExceeded(
                f"this response would store {size} bytes of conversation, over the "
                f"{self.max_bytes_per_key} bytes a key may keep "
                "(server.responses_max_mib_per_key): send store: false to keep nothing, or "
                "start a new chain without previous_response_id",
                code="response_too_large_to_store",
                param="previous_response_id" if entry.previous else "input",
            )
        return LimitExceeded(
            "the responses other requests are storing now fill this replica's store "
            "(server.responses_max_mib); retry shortly, or send store: false",
            code="response_store_full",
            param="store",
            retry_after_s=1.0,
        )


def response_book(config: KVTideConfig, clock: Callable[[], float]) -> ResponseBook:
    """The ingress replica's book, bounded as ``config`` says."""
    return ResponseBook(
        max_bytes=int(config.server.responses_max_mib * 2**20),
        max_bytes_per_key=int(config.server.responses_max_mib_per_key * 2**20),
        ttl_s=config.kv.decoder_kv_blocks_ttl_s,
        pending_s=config.server.request_timeout_s,
        clock=clock,
    )
