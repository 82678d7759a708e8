"""A session's state, shared by ``Session`` and ``AsyncSession``: history, tool results
waiting for the next turn, turns, and when the KV lease is due for renewal. Pure
bookkeeping; time comes in as ``now_s``.

Invariants: the history only ever holds completed turns (a turn's tool results and user
message are appended together with its assistant reply, after the server answered); the
reply is kept as the server sent it, ``tool_calls`` and all; a reply that calls tools is
followed by a result for each call before anything else; one turn runs at a time; a
closed session runs no more turns and renews nothing.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.sdk._turn import Turn, WireRequest
from orchestrator.sdk._wire import (
    CHAT_PATH,
    TurnOptions,
    chat_body,
    check_session_id,
    new_idempotency_key,
    new_session_id,
    turn_headers,
)
from orchestrator.sdk.errors import (
    InvalidArgumentError,
    KVTideAPIError,
    NotFoundError,
    SessionStateError,
)
from orchestrator.sdk.results import TurnResult

log = logging.getLogger("kvtide.sdk")

_ROLES = ("system", "user", "assistant", "tool", "developer")


def _checked_message(i: int, m: Mapping[str, Any]) -> dict[str, Any]:
    """A message of a resumed history, kept as given (``tool_calls``, ``tool_call_id``,
    content parts and all): a known role, and content a string, a list of parts, or
    ``None`` for an assistant message that only calls tools."""
    role, content = m.get("role"), m.get("content")
    calls_only = content is None and role == "assistant" and bool(m.get("tool_calls"))
    if role not in _ROLES or not (isinstance(content, str | list) or calls_only):
        raise InvalidArgumentError(
            f"messages[{i}] must have role in {list(_ROLES)} and string content"
        )
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise InvalidArgumentError(f"messages[{i}] is a tool result without its tool_call_id")
    return copy.deepcopy(dict(m))


class ConversationState:
    def __init__(
        self,
        *,
        session_id: str | None,
        model: str | None,
        system: str | None,
        messages: Sequence[Mapping[str, Any]] | None,
        renew_every_s: float | None,
    ) -> None:
        if renew_every_s is not None and renew_every_s <= 0:
            raise InvalidArgumentError(f"renew_every_s must be > 0 or None, got {renew_every_s}")
        self.id = check_session_id(session_id) if session_id is not None else new_session_id()
        self.model = model
        self.messages: list[dict[str, Any]] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})
        self.messages.extend(_checked_message(i, m) for i, m in enumerate(messages or ()))
        # Tool results for the next turn; they enter the history with it.
        self.pending: list[dict[str, Any]] = []
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

    def _check_idle(self) -> None:
        if self.closed:
            raise SessionStateError(f"session {self.id} is closed; open a new one")
        if self.busy:
            raise SessionStateError(
                f"session {self.id} is already running a turn; finish it (iterate its "
                "stream to the end or close it) before sending the next one"
            )

    def unanswered_tool_calls(self) -> list[str]:
        """Ids of the last reply's tool calls that have no result yet."""
        last = self.messages[-1] if self.messages else {}
        calls = last.get("tool_calls") if last.get("role") == "assistant" else None
        answered = {m.get("tool_call_id") for m in self.pending}
        ids = [str(c.get("id")) for c in calls or () if isinstance(c, Mapping)]
        return [i for i in ids if i not in answered]

    def add_tool_result(self, tool_call_id: str, content: Any) -> None:
        """Queue a ``tool`` message answering one of the last reply's tool calls; a
        non-string ``content`` is sent as its JSON text."""
        with self._lock:
            self._check_idle()
            unanswered = self.unanswered_tool_calls()
            if tool_call_id not in unanswered:
                raise InvalidArgumentError(
                    f"no tool call {tool_call_id!r} is waiting for a result in session "
                    f"{self.id}; the last reply's open calls are {unanswered}"
                )
            text = content if isinstance(content, str) else json.dumps(content)
            self.pending.append({"role": "tool", "tool_call_id": tool_call_id, "content": text})

    def start_turn(
        self,
        model: str,
        user_text: str | None,
        options: TurnOptions,
        *,
        stream: bool,
        now_s: float,
    ) -> Turn:
        """Mark the session busy and build the turn's request (sync and async alike):
        the history, the tool results added since, then the user message."""
        with self._lock:
            self._check_idle()
            unanswered = self.unanswered_tool_calls()
            if unanswered:
                raise SessionStateError(
                    f"the last reply of session {self.id} called tools {unanswered} that "
                    "have no result; add_tool_result(id, content) for each first"
                )
            new = [*self.pending]
            if user_text is not None:
                new.append({"role": "user", "content": user_text})
            if not new:
                raise InvalidArgumentError(
                    "nothing to send: pass user_text, or add tool results first"
                )
            body = chat_body(model, [*self.messages, *new], options, stream=stream)
            key = options.idempotency_key or new_idempotency_key()
            headers = turn_headers(self.id, key, options.traceparent)
            self.busy = True
            return Turn(
                number=len(self.turns) + 1,
                session_id=self.id,
                key=key,
                start_s=now_s,
                new_messages=tuple(new),
                request=WireRequest(
                    method="POST", path=CHAT_PATH, json=body, headers=headers, stream=stream
                ),
                parse_as=options.parse_as,
            )

    def end_turn(self, turn: Turn, result: TurnResult, now_s: float) -> TurnResult:
        """Put the completed turn in the history: its new messages, then the reply as the
        server sent it. Raises ``StructuredOutputError`` (after that: the server ran the
        turn) when the reply does not validate as the model it asked for."""
        result, error = turn.parsed(result)
        reply = copy.deepcopy(dict(result.message)) or {"role": "assistant", "content": result.text}
        with self._lock:
            self.messages.extend(turn.new_messages)
            self.messages.append(reply)
            self.pending.clear()  # none can be added while a turn runs: these were its own
            self.turns.append(result)
            self.busy = False
            self.last_activity_s = now_s
            self.renew_suspended = False
        if error is not None:
            error.result = result
            raise error
        return result

    def abort_turn(self, turn: Turn, exc: BaseException) -> None:
        """The turn failed: the history (and the tool results waiting) stay as they were."""
        with self._lock:
            self.busy = False
        turn.failed(exc)

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

    def renew_failed(self, exc: KVTideAPIError, now_s: float) -> None:
        """Wait a full interval before trying again; stop until the next turn if the server
        no longer knows the session (its KV is gone: the next turn recomputes)."""
        gone = isinstance(exc, NotFoundError)
        log.warning("renewing session %s failed: %s", self.id, exc)
        with self._lock:
            self.renew_error = exc
            self.last_activity_s = now_s
            self.renew_suspended = gone

    def close_failed(self, exc: Exception) -> None:
        """A ``DELETE`` that failed while a block's own exception was on its way: logged,
        not raised over it."""
        log.warning("closing session %s failed: %s", self.id, exc)
