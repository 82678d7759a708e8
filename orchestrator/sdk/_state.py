"""A session's state, shared by ``Session`` and ``AsyncSession``: history, turns, and when
the KV lease is due for renewal. Pure bookkeeping; time comes in as ``now_s``.

Invariants: the history only ever holds completed turns (a user message is appended
together with its assistant reply, after the server answered); one turn runs at a time;
a closed session runs no more turns and renews nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.sdk._wire import (
    TurnMeta,
    chat_body,
    check_session_id,
    new_session_id,
    turn_headers,
)
from orchestrator.sdk.results import TurnResult

_ROLES = ("system", "user", "assistant", "tool", "developer")


class SessionState:
    def __init__(
        self,
        *,
        session_id: str | None,
        model: str | None,
        system: str | None,
        messages: Sequence[Mapping[str, str]] | None,
        renew_every_s: float | None,
    ) -> None:
        if renew_every_s is not None and renew_every_s <= 0:
            raise ValueError(f"renew_every_s must be > 0 or None, got {renew_every_s}")
        self.id = check_session_id(session_id) if session_id is not None else new_session_id()
        self.model = model
        self.messages: list[dict[str, str]] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})
        for i, m in enumerate(messages or ()):
            if m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
                raise ValueError(
                    f"messages[{i}] must have role in {list(_ROLES)} and string content"
                )
            self.messages.append({"role": m["role"], "content": m["content"]})
        self.turns: list[TurnResult] = []
        self.renew_every_s = renew_every_s
        self.closed = False
        self.busy = False
        self.last_activity_s: float | None = None  # end of the last turn or renewal
        # Set when the server no longer knows the session: nothing to renew until a turn.
        self.renew_suspended = False
        self.renew_error: Exception | None = None
        self._lock = threading.Lock()  # guards busy/closed against the renew thread

    # ---- turns --------------------------------------------------------------------

    def begin_turn(self) -> None:
        with self._lock:
            if self.closed:
                raise RuntimeError(f"session {self.id} is closed; open a new one")
            if self.busy:
                raise RuntimeError(
                    f"session {self.id} is already running a turn; finish it (iterate its "
                    "stream to the end or close it) before sending the next one"
                )
            self.busy = True

    def request_messages(self, user_text: str) -> list[dict[str, str]]:
        return [*self.messages, {"role": "user", "content": user_text}]

    def turn_request(
        self,
        model: str,
        user_text: str,
        idempotency_key: str,
        *,
        stream: bool,
        max_tokens: int | None,
        temperature: float | None,
        traceparent: str | None,
        sampling: Mapping[str, Any],
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The body and headers of one turn's chat request (sync and async alike)."""
        body = chat_body(
            model,
            self.request_messages(user_text),
            max_tokens=max_tokens,
            temperature=temperature,
            stream=stream,
            sampling=sampling,
        )
        return body, turn_headers(self.id, idempotency_key, traceparent)

    def end_turn(self, user_text: str, result: TurnResult, now_s: float) -> None:
        with self._lock:
            self.messages.append({"role": "user", "content": user_text})
            self.messages.append({"role": "assistant", "content": result.text})
            self.turns.append(result)
            self.busy = False
            self.last_activity_s = now_s
            self.renew_suspended = False

    def abort_turn(self) -> None:
        with self._lock:
            self.busy = False

    def turn_meta(self, idempotency_key: str, num_attempts: int) -> TurnMeta:
        return TurnMeta(
            turn=len(self.turns) + 1,
            session_id=self.id,
            idempotency_key=idempotency_key,
            num_attempts=num_attempts,
        )

    def close(self) -> bool:
        """Mark closed; ``True`` only for the call that closed it (DELETE is sent once)."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            return True

    # ---- renewal ------------------------------------------------------------------

    def renew_due(self, now_s: float) -> bool:
        """Renew when open, idle, holding KV worth keeping, and a full interval has passed
        since the last turn or renewal (a turn refreshes the lease itself)."""
        with self._lock:
            return (
                self.renew_every_s is not None
                and not self.closed
                and not self.busy
                and not self.renew_suspended
                and self.last_activity_s is not None
                and now_s - self.last_activity_s >= self.renew_every_s
            )

    def renew_wait_s(self, now_s: float) -> float:
        """How long the renew loop sleeps before it looks again: until the lease is due, or
        a whole interval while nothing can be renewed (a turn running, no KV held)."""
        every = self.renew_every_s or 0.0
        with self._lock:
            if self.last_activity_s is None or self.busy or self.renew_suspended:
                return every
            return max(0.0, self.last_activity_s + every - now_s)

    def renewed(self, now_s: float) -> None:
        with self._lock:
            self.last_activity_s = now_s
            self.renew_error = None
            self.renew_suspended = False

    def renew_failed(self, exc: Exception, now_s: float, *, gone: bool) -> None:
        """Wait a full interval before trying again; stop until the next turn if the server
        no longer knows the session (its KV is gone: the next turn recomputes)."""
        with self._lock:
            self.renew_error = exc
            self.last_activity_s = now_s
            self.renew_suspended = gone
