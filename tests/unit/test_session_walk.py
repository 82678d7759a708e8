"""A session's turn through the KV service asks ``policies/turn_state.py`` for every
running-mark and lease rule: the service's ``kv/`` parts call each other only to apply
what it returned or to reach outside (docs/architecture.md, "A session's turn through
the KV service"; the walk is ``benchmarks/session_walk.py``'s)."""

from __future__ import annotations

import asyncio

from benchmarks.session_walk import SESSION_PARTS, walk_turns

APPLIES = {
    # the turn state's effects, applied
    "TurnEffects.apply",
    "RunningTurns.write",
    "RunningTurns.cleared",
    "running_mark",
    "OwnerMarks.touch",
    "Drains.apply",
    # the lessees' channel: its watch, the grant announced, the lease's answer
    "LeaseBook.watching",
    "LeaseBook.announce",
    "offer_of",
    "LeaseDesk.grant",
    # the owners' book
    "SessionOwners.owner",
    "SessionOwners.claim",
}


def test_the_kv_parts_ask_each_other_no_running_or_lease_rule() -> None:
    asked, leased = asyncio.run(walk_turns())
    for walk in (asked, leased):
        between = {
            v.function
            for v in walk.visits
            if v.file in SESSION_PARTS and v.caller in SESSION_PARTS and v.caller != v.file
        }
        assert between <= APPLIES, between - APPLIES
        rules = [v.function for v in walk.visits if v.file == "policies/turn_state.py"]
        assert rules  # the turn's running mark and lease were decided there
