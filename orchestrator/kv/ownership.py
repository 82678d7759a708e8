"""Who sent a request, and which key owns each session.

``Principal`` is an API key's name and limits (or the anonymous principal); ``SessionOwners``
records the first key to run a turn on a session, so that no other key may read, run or
close it. Both the KV lifecycle service (which keeps the books) and the ingress (which
authenticates) use them, so they live here, below ``serve/``. Pure: ``now_s`` comes in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from orchestrator.bounded import BoundedMap
from orchestrator.config import ApiKeyConfig
from orchestrator.errors import LimitExceeded, SessionNotFound

__all__ = ["ANONYMOUS", "Principal", "SessionOwners", "session_not_found"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Principal:
    """Who sent a request: an API key's name and limits (``None``: no limit from the key),
    or the anonymous principal when no keys are configured."""

    name: str
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_concurrent_requests: int | None = None
    max_sessions: int | None = None
    is_anonymous: bool = False
    is_operator: bool = False

    @classmethod
    def of(cls, key: ApiKeyConfig) -> Principal:
        return cls(
            name=key.name,
            max_prompt_tokens=key.max_prompt_tokens,
            max_tokens=key.max_tokens,
            max_concurrent_requests=key.max_concurrent_requests,
            max_sessions=key.max_sessions,
            is_operator=key.operator,
        )

    @property
    def may_operate(self) -> bool:
        """Whether the operator routes serve this principal: an operator's key, or any
        request when no keys are configured (the local default: open, as every route)."""
        return self.is_operator or self.is_anonymous

    def cap_max_tokens(self, max_tokens: int) -> int:
        """``max_tokens`` lowered to the key's limit (for a request that sent none)."""
        return max_tokens if self.max_tokens is None else min(max_tokens, self.max_tokens)


# Key names cannot contain parentheses (config validates them), so no key is this one.
ANONYMOUS = Principal(name="(anonymous)", is_anonymous=True)


def session_not_found(session_id: str) -> SessionNotFound:
    """The one 404 for a session a caller may not see: unknown, expired, closed, or
    another key's. Use it for all of them so that the bodies are identical."""
    return SessionNotFound(
        f"session {session_id!r} not found: it does not exist, has expired or was closed; "
        "start a new session (a new x-session-id)",
        param="x-session-id",
    )


class SessionOwners:
    """Which key owns each session: the first key to run a turn on it.

    Bounded per key and in all: a key owns at most its ``max_sessions`` sessions, and the
    book at most ``max_sessions`` of all keys; a turn that would open one more is refused
    (429), never served by closing another session (least of all another key's). An
    entry idle for ``idle_ttl_s`` expires: ``expire`` *returns* the session ids whose
    ownership ended, and the caller must close those sessions (KV record, session
    tokens), so that no other key can later claim one and inherit its state. Choose
    ``idle_ttl_s`` ≥ the session state's TTL (``kv.decoder_kv_blocks_ttl_s``) and
    ``touch`` when a turn ends and when the session is renewed, so that ownership
    outlives the state it protects (the KV a turn leaves is kept for the TTL from the
    turn's end); sessions with a turn running are passed to ``expire`` as ``keep``.

    ``now_s`` must not go backwards (a monotonic clock). With the anonymous principal
    (no keys configured) nothing is recorded and nothing is refused.

    The book is a ``BoundedMap`` without a bound of its own: when full it refuses the
    new session instead of dropping the oldest, as the map would.
    """

    def __init__(self, *, idle_ttl_s: float, max_sessions: int) -> None:
        if idle_ttl_s <= 0 or max_sessions < 1:
            raise ValueError(
                f"idle_ttl_s ({idle_ttl_s}) must be > 0 and max_sessions ({max_sessions}) >= 1"
            )
        self.idle_ttl_s = idle_ttl_s
        self.max_sessions = max_sessions
        # session id → owner key name, expiring idle_ttl_s after its last use; ordered by
        # last use, oldest first.
        self._owners: BoundedMap[str, str] = BoundedMap()
        self._per_key: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._owners)

    def num_owned(self, key_name: str) -> int:
        return self._per_key[key_name]

    def owner(self, session_id: str, now_s: float) -> str | None:
        """The owning key's name, or ``None`` (never claimed, forgotten or expired)."""
        return self._owners.get(session_id, now_s)

    def check(self, session_id: str, principal: Principal, now_s: float) -> None:
        """Query: raises ``session_not_found(session_id)`` when another key owns the
        session. Records nothing (for reading or closing a session)."""
        if principal.is_anonymous:
            return
        owner = self.owner(session_id, now_s)
        if owner is not None and owner != principal.name:
            raise session_not_found(session_id)

    def claim(self, session_id: str, principal: Principal, now_s: float) -> tuple[str, ...]:
        """``check``, then make ``principal`` the owner (or refresh its idle clock), just
        before a turn runs. Returns the sessions whose ownership ended (expired); close
        them before the turn runs. That may include ``session_id`` itself when another
        key's ownership of it had expired: its state must not carry over to the new
        owner. Raises ``LimitExceeded`` (429) when the session is new and the key already
        owns ``principal.max_sessions`` sessions, or the book is full."""
        self.check(session_id, principal, now_s)
        if principal.is_anonymous:
            return ()
        dropped = list(self.expire(now_s, keep=(session_id,)))
        owner = self._owners.get(session_id)
        if owner is not None and owner != principal.name:  # expired, as check passed
            self._remove(session_id)
            dropped.append(session_id)
            owner = None
        if owner is None:
            self._check_room(principal)
            self._per_key[principal.name] += 1
        self._use(session_id, principal.name, now_s)
        return tuple(dropped)

    def _check_room(self, principal: Principal) -> None:
        limit = principal.max_sessions
        if limit is not None and self._per_key[principal.name] >= limit:
            raise LimitExceeded(
                f"API key {principal.name!r} already owns {limit} sessions (its "
                "max_sessions); close one with DELETE /kvtide/sessions/{id} or let one "
                "expire, then start this one",
                code="session_limit_exceeded",
                param="x-session-id",
            )
        if len(self._owners) >= self.max_sessions:
            raise LimitExceeded(
                f"the server holds its maximum of {self.max_sessions} sessions; retry "
                "later or continue an existing session",
                code="session_capacity_exceeded",
                param="x-session-id",
                retry_after_s=self.idle_ttl_s / 10,
            )

    def adopt(
        self, session_id: str, key_name: str, now_s: float, expires_s: float | None = None
    ) -> None:
        """Record an owner read back after a restart, expiring at ``expires_s`` (the
        expiry its entry carries; None, an entry without one: ``idle_ttl_s`` from
        ``now_s``, so ownership may last longer than it would have, never shorter).
        The caller drops entries already expired instead of adopting them."""
        if session_id not in self._owners:
            self._per_key[key_name] += 1
            if expires_s is None:
                self._use(session_id, key_name, now_s)
            else:
                self._owners.put(session_id, key_name, expires_s=expires_s)

    def touch(self, session_id: str, principal: Principal, now_s: float) -> None:
        """Restart the idle clock of ``principal``'s session when a turn ends or the
        session is renewed (its KV is kept from then on). Does nothing if ``principal``
        no longer owns it; never raises."""
        if self._owners.get(session_id) == principal.name and not principal.is_anonymous:
            self._use(session_id, principal.name, now_s)

    def expire(self, now_s: float, keep: Iterable[str] = ()) -> tuple[str, ...]:
        """Drop entries idle for ``idle_ttl_s`` or longer, except those in ``keep``
        (sessions with a turn running: their idle clock restarts); returns the dropped
        session ids."""
        kept = set(keep)
        dropped: list[str] = []
        for session_id, name in self._owners.expire(now_s):
            if session_id in kept:
                self._use(session_id, name, now_s)
                continue
            self._drop_count(name)
            dropped.append(session_id)
        return tuple(dropped)

    def forget(self, session_id: str) -> None:
        """The session was closed: anyone may start a new one with this id."""
        self._remove(session_id)

    def _use(self, session_id: str, key_name: str, now_s: float) -> None:
        self._owners.put(session_id, key_name, expires_s=now_s + self.idle_ttl_s)

    def _remove(self, session_id: str) -> None:
        name = self._owners.pop(session_id)
        if name is not None:
            self._drop_count(name)

    def _drop_count(self, key_name: str) -> None:
        self._per_key[key_name] -= 1
        if not self._per_key[key_name]:
            del self._per_key[key_name]
