"""What the KV service writes to its ``DurableStore`` about owners and running turns, and
how a restarted service reads it back.

Two kinds of entry, both under a prefix of their own:

- ``owner/<session id>``: ``"<key name> <expiry>"``, the owning API key's name and the
  wall-clock time (seconds) its ownership ends unless it is used again. The service
  rewrites the entry whenever the owner's idle clock restarts (a finished turn, a
  renewal) and deletes it wherever the session ends (closed, expired in the tick, or
  expired while another key claims the session). A restarted service adopts an owner
  only until that expiry: an entry whose time has passed is deleted, not adopted, so no
  restart brings an expired owner back. Key names hold no spaces (config checks them).
  An entry without an expiry (written by an older kvtide) gets a fresh TTL.
- ``running/<session id>``: ``"<claimed at> [<lease id> <holder>]"``, a session's running
  turn (wall clock), and for a turn held for an ingress replica (a turn lease) the
  lease's id and the replica that holds it. A lease's mark is rewritten without them
  once the lease is used: a restored mark that still names a lease was unused when last
  written, so it lapses as the lease would have, unless its holder vouches for it.

Pure: the clocks' readings come in.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.kv.durable import DurableStore

__all__ = [
    "OWNER_PREFIX",
    "RUNNING_PREFIX",
    "RunningMark",
    "owner_entry",
    "read_owner",
    "read_running",
    "running_mark",
]

OWNER_PREFIX = "owner/"
RUNNING_PREFIX = "running/"


def owner_entry(key_name: str, expires_wall_s: float) -> bytes:
    return f"{key_name} {expires_wall_s!r}".encode()


def read_owner(raw: bytes) -> tuple[str, float | None]:
    """The key name and the wall-clock expiry (None: an entry written without one)."""
    name, _, expiry = raw.decode(errors="replace").partition(" ")
    try:
        return name, float(expiry) if expiry else None
    except ValueError:
        return name, None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunningMark:
    """A running turn's mark as read back: when it was claimed (wall clock) and, for a
    turn lease not yet used, the lease and its holder."""

    claimed_wall_s: float
    lease_id: int | None = None
    holder: str | None = None


def running_mark(claimed_wall_s: float, lease_id: int | None = None, holder: str = "") -> bytes:
    text = repr(claimed_wall_s)
    if lease_id is not None:
        text += f" {lease_id} {holder}".rstrip()
    return text.encode()


def read_running(raw: bytes) -> RunningMark | None:
    """The mark, or None when it cannot be read (the caller drops it)."""
    parts = raw.decode(errors="replace").split(" ", 2)
    try:
        return RunningMark(
            claimed_wall_s=float(parts[0]),
            lease_id=int(parts[1]) if len(parts) > 1 else None,
            holder=parts[2] if len(parts) > 2 and parts[2] else None,
        )
    except ValueError:
        return None


def entries(store: DurableStore, prefix: str) -> list[tuple[str, bytes]]:
    """``(session id, value)`` of every entry under ``prefix`` still there."""
    out = []
    for key in store.keys(prefix):
        value = store.get(key)
        if value is not None:
            out.append((key.removeprefix(prefix), value))
    return out
