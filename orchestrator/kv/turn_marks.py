"""The service's running turns and owners, as it books them and writes them through to
its ``DurableStore`` (formats: ``orchestrator.kv.marks``).

``RunningTurns``: one turn per session at once. A session's running turn is marked when
it is claimed (or held for an ingress replica by a turn lease) and cleared when it ends;
a mark older than the state's ``running_grace_s`` is stale (its ingress is gone): those
rules are ``policies.turn_state``'s, and this part applies them. The marks are written
through, so a restarted service still refuses a second turn of a session whose turn its
ingress is running. A turn hands itself over (``turn_done``) after its client has its last token:
the session's next turn waits ``handover_wait_s`` for it (``wait_ended``).

``OwnerMarks``: the owner book's durable entries, each rewritten whenever the owner's
idle clock restarts.

Single event loop; the clocks' readings come in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.kv.durable import DurableStore, WriteBehind
from orchestrator.kv.marks import OWNER_PREFIX, RUNNING_PREFIX, owner_entry, running_mark
from orchestrator.kv.ownership import Principal, SessionOwners
from policies.turn_state import ClearRunning, MarkRunning, TurnState

__all__ = ["OwnerMarks", "RunningTurns"]


@dataclass(kw_only=True, eq=False)
class RunningTurns:
    """The running marks in the store, and the waits on them: applies the turn state's
    ``MarkRunning`` and ``ClearRunning`` (``policies.turn_state``, which keeps the marks'
    times and decides when they are set and cleared), and a session's next turn waits
    here for its running one to end."""

    state: TurnState
    marks: DurableStore | WriteBehind
    handover_wait_s: float
    wall_clock: Callable[[], float]
    _ended: dict[str, asyncio.Event] = field(default_factory=dict, init=False)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self.state

    def restored(self, session_id: str, started_s: float) -> None:
        """A turn a previous instance marked (its mark is already in the store)."""
        self.state.restore(session_id, started_s)

    def write(self, mark: MarkRunning) -> None:
        """Write the session's running mark (naming its unused lease, if held by one)."""
        if mark.lease_id is None:
            value = running_mark(self.wall_clock())
        else:
            value = running_mark(self.wall_clock(), mark.lease_id, mark.holder or "")
        self.marks.put(RUNNING_PREFIX + mark.session_id, value)

    def cleared(self, clear: ClearRunning) -> None:
        """The session's turn ended: its mark goes and a next turn waiting on it runs."""
        if clear.marked:
            self.marks.delete(RUNNING_PREFIX + clear.session_id)
        ended = self._ended.pop(clear.session_id, None)
        if ended is not None:
            ended.set()

    async def wait_ended(
        self, session_id: str, still_running: Awaitable[bool] | None = None
    ) -> None:
        """Wait (``handover_wait_s`` at most) for the session's running turn to end: its
        client may send the next turn before the finished one's ``turn_done`` lands.
        ``still_running``: its replica's answer whether it is still generating; True ends
        the wait at once (the turn is refused, not waited for)."""
        if session_id not in self.state or self.handover_wait_s <= 0:
            return
        ended = self._ended.setdefault(session_id, asyncio.Event())
        waits: set[asyncio.Future[Any]] = {asyncio.ensure_future(ended.wait())}
        asked = None if still_running is None else asyncio.ensure_future(still_running)
        if asked is not None:
            waits.add(asked)
        deadline = asyncio.get_running_loop().time() + self.handover_wait_s
        try:
            while waits:
                left = deadline - asyncio.get_running_loop().time()
                done, waits = await asyncio.wait(
                    waits, timeout=max(left, 0.0), return_when=asyncio.FIRST_COMPLETED
                )
                if not done or asked not in done or asked.result():
                    return  # ended, out of time (claim_session refuses it), or running
        finally:
            for waiting in waits:
                waiting.cancel()


class OwnerMarks:
    """The owners book (``SessionOwners``) with each owner's durable entry: written when
    a key comes to own a session or its idle clock restarts, deleted where it ends."""

    def __init__(
        self,
        owners: SessionOwners,
        *,
        marks: DurableStore | WriteBehind,
        wall_clock: Callable[[], float],
    ) -> None:
        self.owners = owners
        self.marks = marks
        self.wall_clock = wall_clock

    def write(self, session_id: str, key_name: str) -> None:
        expires_wall_s = self.wall_clock() + self.owners.idle_ttl_s
        self.marks.put(OWNER_PREFIX + session_id, owner_entry(key_name, expires_wall_s))

    def touch(self, session_id: str, key_name: str | None, now: float) -> None:
        """Restart the owner's idle clock, here and in its durable entry."""
        if key_name is not None and self.owners.owner(session_id, now) == key_name:
            self.owners.touch(session_id, Principal(name=key_name), now)
            self.write(session_id, key_name)

    def delete(self, session_id: str) -> None:
        """The durable entry of an owner the book has forgotten (or is forgetting)."""
        self.marks.delete(OWNER_PREFIX + session_id)
