"""Restart recovery: a restarted KV service starts with empty books and rebuilds them.

- From its ``DurableStore`` (GCS marks, ``orchestrator.kv.marks``), at start: the running
  turns a previous instance marked (``restore_running``; their ingresses may still
  finish them) and the owners it recorded (``adopt_owners``), each until its expiry.
- From the engine hosts' ledgers (``LedgerAdoption``): the hosts notice the new
  ``epoch`` and send their ledgers (``orchestrator.serve.ledger``); once every prefill
  host has reported what it read (or ``restore_wait_s`` passed), the service adopts the
  decode engines' kept blocks minus those reads. A session that moved on meanwhile
  keeps its newer record and the old blocks are drained: nothing booked twice, nothing
  left pinned unbudgeted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from orchestrator.kv.decider import KVDecider
from orchestrator.kv.drains import Drains
from orchestrator.kv.durable import DurableStore
from orchestrator.kv.marks import OWNER_PREFIX, RUNNING_PREFIX, entries, read_owner, read_running
from orchestrator.kv.messages import KeptBlocks, LedgerReport
from orchestrator.kv.ownership import SessionOwners
from orchestrator.kv.session_tokens import SessionTokens
from orchestrator.kv.turn_leases import RestoredLeases
from orchestrator.kv.turn_marks import RunningTurns
from policies.kv_lifecycle import kept_record

__all__ = ["LedgerAdoption", "adopt_owners", "rebuild_from_marks", "restore_running"]

log = logging.getLogger("kvtide.kv_service")


def restore_running(
    store: DurableStore,
    running: RunningTurns,
    restored_leases: RestoredLeases,
    *,
    lease_lapse_s: float,
    now: float,
) -> None:
    """The running marks a previous instance left (its turns' ingresses may still
    finish them), each at its age; marks past the running grace are dropped. An unused
    lease's mark ends on its lessee's evidence (``RestoredLeases``), ``lease_lapse_s``
    after its claim at the latest."""
    wall = running.wall_clock()
    grace_s = running.state.running_grace_s
    for sid, raw in entries(store, RUNNING_PREFIX):
        mark = read_running(raw)
        age = grace_s if mark is None else wall - mark.claimed_wall_s
        if mark is None or not 0 <= age < grace_s:
            store.delete(RUNNING_PREFIX + sid)
            continue
        running.restored(sid, now - age)
        if mark.lease_id is not None:
            restored_leases.add(mark.lease_id, sid, mark.holder, now - age + lease_lapse_s)


def adopt_owners(
    store: DurableStore,
    owners: SessionOwners,
    running: RunningTurns,
    *,
    now: float,
    wall: float,
) -> None:
    """The owners a previous instance left, each until the expiry its entry carries
    (one already past is deleted: no restart resurrects an expired owner; a session
    with a turn running keeps its owner until the turn ends)."""
    ttl = owners.idle_ttl_s
    for sid, raw in entries(store, OWNER_PREFIX):
        name, expires_wall_s = read_owner(raw)
        left_s = ttl if expires_wall_s is None else min(expires_wall_s - wall, ttl)
        if left_s <= 0 and sid not in running:
            store.delete(OWNER_PREFIX + sid)
            continue
        owners.adopt(sid, name, now, expires_s=now + max(left_s, 0.0))


def rebuild_from_marks(
    store: DurableStore,
    running: RunningTurns,
    restored_leases: RestoredLeases,
    owners: SessionOwners,
    *,
    lease_lapse_s: float,
    now: float,
) -> None:
    """A new instance's start: the running turns, then the owners (a session with a
    turn running keeps its owner), a previous instance left in ``store``."""
    restore_running(store, running, restored_leases, lease_lapse_s=lease_lapse_s, now=now)
    adopt_owners(store, owners, running, now=now, wall=running.wall_clock())


class LedgerAdoption:
    """The engine hosts' ledgers, gathered page by page, and the decode engines' kept
    blocks adopted into the books once the prefill hosts' reads are known."""

    def __init__(
        self,
        *,
        decider: KVDecider,
        tokens: SessionTokens,
        drains: Drains,
        num_prefill_engines: int,
        restore_wait_s: float,
        started_s: float,
        clock: Callable[[], float],
        consumed: Collection[tuple[str, str]] = (),
    ) -> None:
        self.decider = decider
        self.tokens = tokens
        self.drains = drains
        self.num_prefill_engines = num_prefill_engines
        self.restore_wait_s = restore_wait_s
        self.started_s = started_s
        self.clock = clock
        self._kept_reports: dict[str, list[KeptBlocks]] = {}
        self._ledger_pages: dict[str, list[LedgerReport]] = {}
        # Kept blocks a reader freed: prefill hosts' reads, and the host tier's take-ins
        # a previous instance marked (``orchestrator.kv.host_reads``).
        self._consumed: set[tuple[str, str]] = set(consumed)
        self._prefill_reporters: set[str] = set()
        self.counters = dict.fromkeys(
            (
                "restores",
                "adopted",
                "adopt_skipped_consumed",
                "adopt_superseded",
                "adopt_host_copies",
            ),
            0,
        )

    @property
    def restoring(self) -> bool:
        """Kept blocks reported and not adopted yet."""
        return bool(self._kept_reports)

    def restore(self, report: LedgerReport) -> None:
        """An engine host's ledger, sent after it saw a new ``epoch``, in pages
        (``LedgerReport.pages``): applied when its last page has come."""
        pending = self._ledger_pages.setdefault(report.engine_id, [])
        if report.page == 0:
            pending.clear()  # a host that started over
        elif len(pending) != report.page:
            log.warning("ledger page %d of %s out of order", report.page, report.engine_id)
            return  # the host sees no new epoch acknowledged and sends it all again
        pending.append(report)
        if not report.last:
            return
        del self._ledger_pages[report.engine_id]
        self.counters["restores"] += 1
        kept = [k for page in pending for k in page.kept]
        if report.role == "prefill":
            self._prefill_reporters.add(report.engine_id)
            self._consumed.update((e, r) for page in pending for e, r in page.consumed)
        if kept:
            self._kept_reports[report.engine_id] = kept
        self.maybe_adopt()

    def maybe_adopt(self) -> None:
        """Adopt the reported kept blocks once every prefill host has reported (or
        ``restore_wait_s`` passed since the start)."""
        if not self._kept_reports:
            return
        waited = self.clock() - self.started_s >= self.restore_wait_s
        if len(self._prefill_reporters) < self.num_prefill_engines and not waited:
            return  # a read we have not heard of yet would make us book freed blocks
        reports, self._kept_reports = self._kept_reports, {}
        # Oldest first: a session reported twice keeps its newest blocks.
        kept = sorted((k for ks in reports.values() for k in ks), key=lambda k: -k.age_s)
        now = self.clock()
        for k in kept:
            if (k.engine_id, k.request_id) in self._consumed:
                self.counters["adopt_skipped_consumed"] += 1
            elif k.session_id is None:
                self.drains.drain(k.kv_transfer_params, k.token_ids)
            else:
                self._adopt(k, k.session_id, now)

    def _adopt(self, k: KeptBlocks, session_id: str, now: float) -> None:
        lifecycle = self.decider.lifecycle
        record = kept_record(
            session_id,
            engine_id=k.engine_id,
            token_ids_covered=k.token_ids[: k.num_tokens],
            block_ids=k.block_ids,
            transfer_params=k.kv_transfer_params,
            expiry_s=now + k.expires_in_s,
            last_used_s=now - k.age_s,
            config=lifecycle.config,
        )
        effects = lifecycle.adopt(record, now)
        if effects and effects[0].record is record:
            self.counters["adopt_superseded"] += 1
        else:
            self.counters["adopted"] += 1
            if self.tokens.token_ids(session_id) is None:
                # The next turn tokenizes from scratch (text was not kept); the
                # prefix check then decides whether these blocks still match.
                self.tokens.remember(session_id, None, k.token_ids, now)
        self.drains.apply(effects, candidates=(k.token_ids,))
