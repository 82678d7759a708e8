"""Kept blocks nobody booked: found on the decode hosts and freed.

A decode engine keeps a session turn's KV when the request finishes; the service books
it when the turn's ingress hands the turn over (``turn_done``). A hand-over that never
comes leaves the blocks pinned until the decode TTL (480 s by default) with no record,
so no budget, eviction or drain can reach them: a turn whose deadline passes as its
decode finishes, an ingress replica that dies between the two, a hand-over call that
fails. Under a burst that is how a decode engine fills with KV nobody owns.

So each decode host asks about what its engine kept (``EngineLedger.due_checks``): with
its heartbeat, once an entry is ``grace_s`` old, it sends the entry's ids; the service
answers which it never booked (``KeptCheck.check``); the host sends those entries
whole (their tokens), and the service drains them (``orchestrator.kv.drains``). What
the service answers:

- **booked**: a hand-over booked it (the record may be gone since: pulled, drained,
  evicted; its blocks are then freed or being freed, never read again);
- **later**: its session has a turn running or held, whose hand-over may still come;
  asked again at the next beat;
- **orphan**: none of these. From that answer on the service refuses to book it (a
  hand-over that comes after all keeps no KV: the session's next turn recomputes), so
  the drain never races a record of the same blocks;
- **unknown**: older than what the service remembers (``retention_s``, or a booking
  dropped past ``max_entries``), or from before the service's epoch (a restart's
  ledger adoption, ``orchestrator.kv.adoption``, owns those; the host sends none of
  them, as its report to a new epoch ends their checks): left to the TTL, since
  a drain of blocks that a forgotten booking's pull already freed would read whatever
  the engine put in them since.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from engines.kv_params import KVTransferParams
from orchestrator.bounded import BoundedMap
from orchestrator.kv.messages import KeptBlocks

__all__ = ["KeptCheck", "KeptLedger", "KeptRef", "KeptVerdict", "check_kept"]

log = logging.getLogger("kvtide.kv_service")

MAX_BOOKED = 1_000_000
"""Hand-overs remembered (about 200 bytes each); one dropped early makes its blocks
``unknown`` to a later check (left to the TTL), never an orphan."""


BOOKED, ORPHAN, DRAINED = "booked", "orphan", "drained"


class KeptRef(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of a decode host's ledger, as a check names it."""

    engine_id: str
    request_id: str
    session_id: str | None
    age_s: float  # since the request finished, on the host's clock


class KeptVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """The service's answer to a check, as (engine id, request id) pairs (``unknown``
    and ``booked`` are not listed: the host drops them)."""

    orphans: list[tuple[str, str]] = []
    later: list[tuple[str, str]] = []


class KeptLedger(Protocol):
    """A decode host's side (``orchestrator.serve.ledger.EngineLedger``)."""

    def due_checks(self) -> list[KeptRef]: ...

    def check_again(self, keys: Sequence[tuple[str, str]]) -> None: ...

    def kept(self, keys: Sequence[tuple[str, str]]) -> list[KeptBlocks]: ...


def _key(params: KVTransferParams | None) -> tuple[str, str] | None:
    kept = None if params is None else params.kept_blocks()
    return None if kept is None else (kept[0], kept[1])


class KeptCheck:
    """The service's side: the hand-overs it booked and the entries it called orphans.
    Single event loop; the clock is the service's."""

    def __init__(
        self,
        *,
        retention_s: float,
        margin_s: float,
        clock: Callable[[], float],
        busy: Callable[[str | None], bool],
        drain: Callable[[KVTransferParams, Sequence[int]], None],
        max_entries: int = MAX_BOOKED,
    ) -> None:
        self.retention_s = retention_s
        self.margin_s = margin_s  # a check's transit: an age reads up to this much short
        self.clock = clock
        self.busy = busy
        self.drain = drain
        self.started_s = clock()
        # Bookings, orphans and drained orphans, one retention (expiry in put order).
        self._seen: BoundedMap[tuple[str, str], str] = BoundedMap(max_entries=max_entries)
        self._forgot_before_s = -math.inf  # bookings made before this may be forgotten
        self.counters = dict.fromkeys(
            ("kept_checked", "kept_orphans", "kept_orphans_drained", "kept_unknown"), 0
        )

    def refused(self, params: KVTransferParams | None) -> bool:
        """A check called ``params``' kept blocks an orphan: a hand-over must not book
        them (they are drained or about to be)."""
        key = _key(params)
        return key is not None and self._seen.get(key, self.clock()) in (ORPHAN, DRAINED)

    def booked(self, params: KVTransferParams | None) -> None:
        """A hand-over booked ``params``' kept blocks (or drained them: sessionless)."""
        key = _key(params)
        if key is not None:
            now = self.clock()
            self._seen.expire(now)
            self._remember(key, BOOKED, now)

    def check(self, refs: Sequence[KeptRef]) -> KeptVerdict:
        """Which of a decode host's entries nobody booked (see the module)."""
        now = self.clock()
        self._seen.expire(now)
        orphans: list[tuple[str, str]] = []
        later: list[tuple[str, str]] = []
        for ref in refs:
            self.counters["kept_checked"] += 1
            key = (ref.engine_id, ref.request_id)
            seen = self._seen.get(key)
            if seen is not None:
                if seen == ORPHAN:
                    orphans.append(key)  # its whole entry did not come yet
                continue
            # The host checks nothing it finished before its report to this epoch (those
            # are the adoption's): the first test is a second guard. The others allow
            # for the check's transit, which makes an entry look younger than it is.
            if (
                now - ref.age_s <= self.started_s
                or now - ref.age_s - self.margin_s <= self._forgot_before_s
                or ref.age_s + self.margin_s >= self.retention_s
            ):
                self.counters["kept_unknown"] += 1
            elif self.busy(ref.session_id):
                later.append(key)
            else:
                self.counters["kept_orphans"] += 1
                self._remember(key, ORPHAN, now)
                orphans.append(key)
        return KeptVerdict(orphans=orphans, later=later)

    def drain_orphans(self, kept: Sequence[KeptBlocks]) -> int:
        """Drain the entries a check called orphans (any other is ignored); returns how
        many drains started."""
        started = 0
        for k in kept:
            key = (k.engine_id, k.request_id)
            if self._seen.get(key) != ORPHAN or _key(k.kv_transfer_params) != key:
                continue
            self._remember(key, DRAINED, self.clock())  # once, whatever comes again
            self.drain(k.kv_transfer_params, k.token_ids)
            started += 1
        self.counters["kept_orphans_drained"] += started
        return started

    def _remember(self, key: tuple[str, str], state: str, now: float) -> None:
        if self._seen.put(key, state, expires_s=now + self.retention_s):
            self._forgot_before_s = now  # dropped by count: anything older is unknown


async def check_kept(handle: Any, ledger: KeptLedger, timeout_s: float) -> int:
    """A decode host's check of its ledger's due entries with the service behind
    ``handle`` (each call within ``timeout_s``); returns the orphans it sent. A failed
    call puts its entries back for the next beat."""
    refs = ledger.due_checks()
    if not refs:
        return 0
    try:
        verdict: KeptVerdict = await asyncio.wait_for(handle.kept_check.remote(refs), timeout_s)
    except BaseException:
        ledger.check_again([(r.engine_id, r.request_id) for r in refs])
        raise
    ledger.check_again(verdict.later)
    if not verdict.orphans:
        return 0
    kept = ledger.kept(verdict.orphans)
    try:
        await asyncio.wait_for(handle.kept_orphans.remote(kept), timeout_s)
    except BaseException:
        ledger.check_again(verdict.orphans)  # asked again: still orphans, sent again
        raise
    log.info("%d kept entries nobody booked, sent to be drained", len(kept))
    return len(kept)
