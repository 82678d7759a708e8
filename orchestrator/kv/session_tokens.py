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
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from orchestrator.kv.bounded import BoundedMap

__all__ = ["SessionTokens", "continue_tokens"]


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


class SessionTokens:
    """Each session's last turn, at most ``max_sessions`` (the least recently
    remembered dropped first). An entry past ``ttl_s`` is ignored when read, not
    dropped: it still counts until a newer one pushes it out."""

    def __init__(self, *, max_sessions: int = 50_000, ttl_s: float = 480.0) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._turns: BoundedMap[str, _Turn] = BoundedMap(max_entries=max_sessions)

    def __len__(self) -> int:
        return len(self._turns)

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
        self._turns.put(session_id, _Turn(text, array("I", token_ids), now_s))

    def last_turn(self, session_id: str, now_s: float) -> tuple[str | None, Sequence[int]]:
        """The text and ids the session's last turn covered (``(None, ())``: nothing
        usable), for a tokenizer elsewhere to continue with ``continue_from``."""
        turn = self._turns.get(session_id)
        if turn is None or now_s - turn.stored_s > self.ttl_s:
            return None, ()
        return turn.text, turn.token_ids

    def token_ids(self, session_id: str) -> Sequence[int] | None:
        """The exact token ids the session's last turn covered, if remembered."""
        turn = self._turns.get(session_id)
        return turn.token_ids if turn is not None else None

    def forget(self, session_id: str) -> None:
        self._turns.pop(session_id)
