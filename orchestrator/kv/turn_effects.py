"""The turn state's effects, applied (``policies.turn_state``): running marks written
through and cleared (``RunningTurns``), an owner's idle clock restarted here and in its
durable entry (``OwnerMarks``), and the KV books' own effects drained (``Drains``), each
in the order the state returned them. Decides nothing. Single event loop; the clock is
the service's."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from orchestrator.kv.drains import Drains
from orchestrator.kv.turn_marks import OwnerMarks, RunningTurns
from policies.turn_state import ClearRunning, MarkRunning, TouchOwner, TurnEffect

__all__ = ["TurnEffects"]


@dataclass(kw_only=True, eq=False)
class TurnEffects:
    """Applies a list of ``TurnEffect``s."""

    running: RunningTurns
    owners: OwnerMarks
    drains: Drains
    clock: Callable[[], float]

    def apply(
        self, effects: Iterable[TurnEffect], candidates: Sequence[Sequence[int] | None] = ()
    ) -> None:
        """Apply ``effects`` in order; a KV effect's record is drained with the first of
        ``candidates`` that holds its tokens (``Drains.apply``)."""
        for effect in effects:
            if isinstance(effect, MarkRunning):
                self.running.write(effect)
            elif isinstance(effect, ClearRunning):
                self.running.cleared(effect)
            elif isinstance(effect, TouchOwner):
                now = self.clock()
                sid = effect.session_id
                self.owners.touch(sid, self.owners.owners.owner(sid, now), now)
            else:
                self.drains.apply([effect], candidates)
