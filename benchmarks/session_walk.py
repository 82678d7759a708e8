"""The walk of one session's turn through the KV service: every function of the
service's code (``orchestrator/kv/``, and ``policies/turn_state.py``) that the turn's
calls visit, counted with a profiler hook on an in-process ``KVService`` (no Ray, no
engines).

Two walks, each from the service's entry to the turn's end:

* a turn that asks the service: ``begin_turn`` then ``turn_done`` (with a lease on
  the session's next turn granted to the replica that ran it, whose watch runs);
* the next turn, under that lease: ``lease_used`` then ``turn_done``.

For each: the calls into ``orchestrator/kv/``, their distinct functions and files;
the visits to the session-state parts (``lease_desk``, ``turn_leases``, ``turn_marks``,
``marks``, ``drains``, ``session_turns``, ``ownership`` and, where present,
``turn_effects``), how many returned a value and how many came from another
``kv/`` file; and the calls into the pure turn state (``policies/turn_state.py``),
where its rules are asked.

    python benchmarks/session_walk.py [-v]    (-v: every call, in order)
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import kept_turn_done  # noqa: E402
from orchestrator.kv.messages import TurnDone  # noqa: E402
from orchestrator.kv.ownership import ANONYMOUS  # noqa: E402
from orchestrator.kv.service import KVService, ServiceSettings  # noqa: E402
from policies.kv_records import KVLifecycleConfig  # noqa: E402

SESSION_PARTS = tuple(
    f"orchestrator/kv/{name}.py"
    for name in (
        "lease_desk",
        "turn_leases",
        "turn_marks",
        "marks",
        "drains",
        "session_turns",
        "ownership",
        "turn_effects",
    )
)
CORE = "policies/turn_state.py"


class Visit:
    __slots__ = ("caller", "file", "function", "returned")

    def __init__(self, file: str, function: str, caller: str) -> None:
        self.file, self.function, self.caller = file, function, caller
        self.returned = False


class Walk:
    """The calls into the service's code while it is on."""

    def __init__(self) -> None:
        self.visits: list[Visit] = []
        self._open: dict[int, Visit] = {}

    def _where(self, frame: FrameType | None) -> str:
        if frame is None:
            return ""
        path = Path(frame.f_code.co_filename)
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else ""

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "return":
            visit = self._open.pop(id(frame), None)
            if visit is not None:
                visit.returned = arg is not None
            return
        if event != "call":
            return
        where = self._where(frame)
        if where.startswith("orchestrator/kv/") or where == CORE:
            visit = Visit(where, frame.f_code.co_qualname, self._where(frame.f_back))
            self.visits.append(visit)
            self._open[id(frame)] = visit

    async def run(self, call: Any) -> Any:
        sys.setprofile(self.hook)
        try:
            return await call
        finally:
            sys.setprofile(None)


def done(token_ids: list[int], request_id: str, lease_id: int | None = None) -> TurnDone:
    """The hand-over of replica-a's turn of s1 that ended with ``token_ids``."""
    kept = kept_turn_done(
        "s1", token_ids, engine_id="decode-0", request_id=request_id, kv_expires_in_s=120.0
    )
    return msgspec.structs.replace(kept, holder="replica-a", lease_id=lease_id)


def report(name: str, walk: Walk) -> None:
    kv = [v for v in walk.visits if v.file.startswith("orchestrator/kv/")]
    parts = [v for v in kv if v.file in SESSION_PARTS]
    crossed = [v for v in parts if v.caller.startswith("orchestrator/kv/") and v.caller != v.file]
    core = [v for v in walk.visits if v.file == CORE and not v.caller.startswith("policies/")]
    print(
        f"{name}: kv/ {len(kv)} calls, {len({(v.file, v.function) for v in kv})} functions, "
        f"{len({v.file for v in kv})} files; session parts {len(parts)} visits in "
        f"{len({v.file for v in parts})} files, {sum(v.returned for v in parts)} returning "
        f"a value, {len(crossed)} from another kv/ file; policies/turn_state.py asked "
        f"{len(core)} times"
    )
    if "-v" in sys.argv:
        for v in walk.visits:
            print(f"    {v.file}:{v.function}  <- {v.caller}{'  (value)' if v.returned else ''}")


async def walk_turns() -> tuple[Walk, Walk]:
    """The two walks (see the module): a turn that asks the service, then the next one
    under the lease its hand-over granted."""
    service = KVService(
        KVLifecycleConfig(ttl_s=120, safety_margin_s=15, recompute_threshold_tokens=4),
        prefill=None,
        settings=ServiceSettings(drain_timeout_s=5.0, turn_lease_s=30.0),
        clock=lambda: 100.0,
    )
    await service.lease_watch("replica-a", [], 0.0)  # the replica's watch runs
    first = list(range(100))
    first_out = [*first, 7, 8, 9]
    asked = Walk()
    await asked.run(service.begin_turn("s1", ANONYMOUS, first, holder="replica-a"))
    handover = await asked.run(service.turn_done(done(first_out, "r1")))
    assert handover.lease is not None, "the replica's next turn is leased"
    second_out = [*first_out, 5, 6, 4]
    leased = Walk()
    assert await leased.run(service.lease_used("s1", handover.lease.lease_id, None))
    await leased.run(service.turn_done(done(second_out, "r2", handover.lease.lease_id)))
    return asked, leased


def main() -> None:
    asked, leased = asyncio.run(walk_turns())
    report("begin_turn -> turn_done", asked)
    report("lease_used -> turn_done", leased)


if __name__ == "__main__":
    main()
