"""Token continuity across a session's turns.

A client sends each turn as text (chat messages); re-tokenizing the previous answer
does not always give back the tokens the model generated (a BPE tokenizer has many
tokenizations of one string, and models do emit non-canonical ones). The KV kept by the
decode engine belongs to the *generated* tokens, so a re-tokenized history would fail
the KV policy's prefix check and recompute every turn.

``SessionTokens`` remembers, per session, the exact text the last turn covered (rendered
prompt + generated text) and its token ids. When the next turn's rendered text starts
with that text, the new token ids are the remembered ids followed by the tokens of the
new suffix: the same text, the model's own tokens, and a prefix the KV policy can verify.
If the client rewrote the history, the text does not match and the prompt is tokenized
from scratch (and the KV policy then recomputes). Bounded: oldest sessions are dropped
first; entries older than ``ttl_s`` are ignored. The clock is passed in.

The service holds every session's last turn; each ingress replica keeps its own copy of
the turns it finished, so that it tokenizes a session's next turn without asking for
them. ``prefix_digest`` names a last turn in 8 bytes: the turn's claim carries the digest
of the prefix it was tokenized from, and the service answers with its own last turn when
that is another (the turn ran on another replica, or the copy is stale).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from orchestrator.bounded import BoundedMap
from orchestrator.kv.conversations import ConversationIndex, is_unnamed

__all__ = ["SessionTokens", "continue_tokens", "prefix_digest"]


def prefix_digest(token_ids: Sequence[int]) -> int:
    """An 8-byte digest of a last turn's token ids (``()``: no usable last turn)."""
    data = token_ids.tobytes() if isinstance(token_ids, array) else array("I", token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


NO_PREFIX = prefix_digest(())


def continue_tokens(
    last_text: str | None,
    last_token_ids: Sequence[int],
    text: str,
    *,
    full: Callable[[str], Sequence[int]],
    suffix: Callable[[str], Sequence[int]],
) -> list[int]:
    """Token ids of ``text``: the last turn's exact ids plus the new suffix's tokens when
    ``text`` extends the last turn's text, else ``text`` tokenized from scratch.

    ``full`` tokenizes a whole prompt (with any BOS); ``suffix`` a continuation.
    """
    if last_text is not None and len(text) > len(last_text) and text.startswith(last_text):
        return [*last_token_ids, *suffix(text[len(last_text) :])]
    return list(full(text))


@dataclass(frozen=True, slots=True)
class _Turn:
    text: str | None  # None: the turn was sent as token ids (nothing to continue as text)
    token_ids: array[int]  # 4 bytes a token: sessions hold long histories
    stored_s: float
    digest: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", prefix_digest(self.token_ids))


class SessionTokens:
    """Each session's last turn, at most ``max_sessions`` (the least recently
    remembered dropped first). An entry past ``ttl_s`` is ignored when read, not
    dropped: it still counts until a newer one pushes it out."""

    def __init__(
        self, *, max_sessions: int = 50_000, ttl_s: float = 480.0, max_bytes: int | None = None
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._turns: BoundedMap[str, _Turn] = BoundedMap(
            max_entries=max_sessions, max_bytes=max_bytes
        )
        # Unnamed sessions (conversations without x-session-id) by their last turn's text.
        self.conversations = ConversationIndex(max_sessions=max_sessions)

    def __len__(self) -> int:
        return len(self._turns)

    @property
    def max_bytes(self) -> int | None:
        """The bound on the turns' size (token ids and text) in all; None: none."""
        return self._turns.max_bytes

    def encode(
        self,
        session_id: str | None,
        text: str,
        *,
        full: Callable[[str], Sequence[int]],
        suffix: Callable[[str], Sequence[int]],
        now_s: float,
    ) -> list[int]:
        """Token ids of ``text``, continuing the session's last turn where it matches
        (see ``continue_tokens``)."""
        if session_id is None:
            return list(full(text))
        last_text, last_ids = self.last_turn(session_id, now_s)
        return continue_tokens(last_text, last_ids, text, full=full, suffix=suffix)

    def remember(
        self, session_id: str | None, text: str | None, token_ids: Sequence[int], now_s: float
    ) -> None:
        """Record what this turn covered: its prompt text + generated text (None for a
        prompt sent as token ids), and ids."""
        if session_id is None:
            return
        ids = array("I", token_ids)
        size = 4 * len(ids) + len(text or "")
        dropped = self._turns.put(session_id, _Turn(text, ids, now_s), size=size)
        for old, _ in dropped:
            self.conversations.forget(old)
        if is_unnamed(session_id):
            if text is None or session_id in dict(dropped):
                self.conversations.forget(session_id)
            else:
                self.conversations.file(session_id, text)

    def find_conversation(self, principal_name: str, text: str, now_s: float) -> str | None:
        """The key's unnamed session whose last turn ``text`` extends (see
        ``orchestrator.kv.conversations``), or None."""
        return self.conversations.find(
            principal_name, text, lambda session_id: self.last_turn(session_id, now_s)[0]
        )

    def last_turn(self, session_id: str, now_s: float) -> tuple[str | None, Sequence[int]]:
        """The text and ids the session's last turn covered (``(None, ())``: nothing
        usable), for a tokenizer elsewhere to continue with ``continue_from``."""
        turn = self._live(session_id, now_s)
        return (None, ()) if turn is None else (turn.text, turn.token_ids)

    def last_digest(self, session_id: str, now_s: float) -> int:
        """``prefix_digest`` of what ``last_turn`` answers now (kept with the turn)."""
        turn = self._live(session_id, now_s)
        return NO_PREFIX if turn is None else turn.digest

    def _live(self, session_id: str, now_s: float) -> _Turn | None:
        turn = self._turns.get(session_id)
        return None if turn is None or now_s - turn.stored_s > self.ttl_s else turn

    def digest(self, session_id: str) -> int | None:
        """``prefix_digest`` of the session's last turn as remembered (however old)."""
        turn = self._turns.get(session_id)
        return None if turn is None else turn.digest

    def token_ids(self, session_id: str) -> Sequence[int] | None:
        """The exact token ids the session's last turn covered, if remembered."""
        turn = self._turns.get(session_id)
        return turn.token_ids if turn is not None else None

    def forget(self, session_id: str) -> None:
        self._turns.pop(session_id)
        self.conversations.forget(session_id)
