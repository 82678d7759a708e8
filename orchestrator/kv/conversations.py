"""Conversations without a session header, found again by their text.

Most multi-turn clients send the whole history each turn and no ``x-session-id``. The
ingress gives such a conversation an *unnamed* session of its own (an id the client
never sees and cannot send: ``~<key tag>.<random>``), so that its turns go through the
session machinery (decode keeps the turn's KV, the service books it with its TTL, the
next turn pulls it back) exactly as a named session's do.

The next request is matched by its rendered text: it extends the last turn's text
(prompt + answer) of one of the key's unnamed sessions. ``ConversationIndex`` files each
unnamed session under a hash of its last turn's text cut at a multiple of
``chunk_chars``; a request's text is hashed at every such cut (one pass, chained), the
longest cut filed wins, and a candidate counts only when the request's text starts with
its whole last-turn text (checked exactly). The key's tag is part of every hash: one
key's requests never find another key's conversations (and the service checks the
owner again when the turn claims the session).

Per ingress replica: a conversation whose next request lands on another replica starts
a new unnamed session there (its prompt still hits the prefill engine's prefix cache).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable

from orchestrator.bounded import BoundedMap

__all__ = ["UNNAMED_PREFIX", "ConversationIndex", "is_unnamed", "key_tag"]

UNNAMED_PREFIX = "~"


def is_unnamed(session_id: str | None) -> bool:
    """An unnamed session's id (a client's ``x-session-id`` cannot start with ``~``)."""
    return session_id is not None and session_id.startswith(UNNAMED_PREFIX)


def key_tag(principal_name: str) -> str:
    """8 hex characters naming an API key (its name, hashed) inside unnamed ids."""
    return hashlib.blake2b(principal_name.encode(), digest_size=4).hexdigest()


def _tag_of(session_id: str) -> str:
    return session_id[len(UNNAMED_PREFIX) :].split(".", 1)[0]


class ConversationIndex:
    """Unnamed sessions by the text of their last turn (see the module). At most
    ``max_sessions`` filed, and at most ``max_per_cut`` sessions under one cut (the
    most recent kept)."""

    def __init__(
        self,
        *,
        chunk_chars: int = 128,
        max_sessions: int = 50_000,
        max_per_cut: int = 16,
    ) -> None:
        if chunk_chars < 1:
            raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
        self.chunk_chars = chunk_chars
        self.max_per_cut = max_per_cut
        self._cuts: BoundedMap[bytes, list[str]] = BoundedMap(max_entries=max_sessions)
        self._cut_of: BoundedMap[str, bytes] = BoundedMap(max_entries=max_sessions)

    def __len__(self) -> int:
        return len(self._cut_of)

    def new_session_id(self, principal_name: str) -> str:
        return f"{UNNAMED_PREFIX}{key_tag(principal_name)}.{uuid.uuid4().hex}"

    def _cut_hashes(self, tag: str, text: str, limit: int) -> list[bytes]:
        """Chained hashes of ``text[:k * chunk_chars]`` for k = 0 .. ``limit // chunk_chars``
        (``limit`` at most ``len(text)``), with the key's tag in front."""
        h = hashlib.blake2b(tag.encode(), digest_size=16)
        out = [h.digest()]
        c = self.chunk_chars
        for start in range(0, limit - c + 1, c):
            h.update(text[start : start + c].encode())
            out.append(h.digest())
        return out

    def file(self, session_id: str, text: str) -> None:
        """File (again) an unnamed session under its last turn's text."""
        cut = self._cut_hashes(_tag_of(session_id), text, len(text))[-1]
        old = self._cut_of.get(session_id)
        if old is not None and old != cut:
            self._unfile(session_id, old)
        self._cut_of.put(session_id, cut)
        sessions = [s for s in self._cuts.get(cut) or [] if s != session_id]
        sessions.append(session_id)
        self._cuts.put(cut, sessions[-self.max_per_cut :])

    def _unfile(self, session_id: str, cut: bytes) -> None:
        sessions = [s for s in self._cuts.get(cut) or [] if s != session_id]
        if sessions:
            self._cuts.put(cut, sessions)
        else:
            self._cuts.pop(cut)

    def forget(self, session_id: str) -> None:
        cut = self._cut_of.get(session_id)
        if cut is not None:
            self._unfile(session_id, cut)
            self._cut_of.pop(session_id)

    def find(
        self, principal_name: str, text: str, last_text: Callable[[str], str | None]
    ) -> str | None:
        """The key's unnamed session whose last turn ``text`` extends (the longest such
        last turn), or None. ``last_text(session_id)``: the session's last-turn text as
        held now (None once forgotten or expired: the session is dropped from the index)."""
        hashes = self._cut_hashes(key_tag(principal_name), text, len(text) - 1)
        for cut in reversed(hashes):
            best: tuple[int, str] | None = None
            for session_id in list(self._cuts.get(cut) or ()):
                last = last_text(session_id)
                if last is None:
                    self.forget(session_id)
                elif len(text) > len(last) and text.startswith(last):
                    if best is None or len(last) > best[0]:
                        best = (len(last), session_id)
            if best is not None:
                return best[1]
        return None
