"""Turn leases as the KV service books them, pure: the grants by session
(``LeaseGrants``: granted, found, used, lapsed, revoked when their record goes, and the
proposals refused for good), and a previous service instance's unused leases known only
by their running marks (``RestoredLeases``). The rules that grant and end them with a
session's running turn are ``policies.turn_state``'s; the protocol is described in
``orchestrator.kv.turn_leases``. Single-threaded; times come in."""

from __future__ import annotations

import secrets
from collections.abc import Collection
from dataclasses import dataclass, field

from policies.kv_records import KVLifecycleConfig, KVRecord

__all__ = [
    "REFUSED_KEPT",
    "Grant",
    "LeaseGrants",
    "RestoredLeases",
    "RevokeLease",
    "proposals_allowed",
]

REFUSED_KEPT = 4096
"""How many refused proposals the state remembers (their hand-overs come within
``grace_s`` of the refusal, or never)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RevokeLease:
    """Ask ``holder`` (through its watch) to give the lease ``lease_id`` back."""

    holder: str
    lease_id: int


def proposals_allowed(config: KVLifecycleConfig, lasts_s: float) -> bool:
    """Whether a hand-over may propose its next turn's lease (a provisional lease): leases
    on and no idle budget (under one, a record booked over it is evicted at once, and
    holding every proposed record would keep the engines over it). Both sides ask it: the
    lessee before it proposes, the service before it grants a proposal."""
    return lasts_s > 0 and config.idle_budget_bytes_per_engine is None


@dataclass(slots=True)
class Grant:
    """A lease as the service books it."""

    session_id: str
    holder: str
    lease_id: int
    record: KVRecord | None
    lapses_s: float  # service clock: lasts_s + grace_s after the grant
    used: bool = False


@dataclass(slots=True)
class _Restored:
    session_id: str
    holder: str | None
    lapses_s: float
    vouched: bool = False


class RestoredLeases:
    """Unused leases a previous service instance granted, known to a restarted one only
    by their running marks (``orchestrator.kv.marks``). Each mark ends on its lessee's
    evidence: the lessee gives the lease back or uses it (``pop``), or its watch reports
    the leases it still holds and this one is not among them (``vouched``: a lease whose
    grant never reached it, or that it gave back before the restart and whose mark the
    old instance had no time to clear). One its lessee vouches for is a running turn
    like any (it ends with its turn). One nobody vouches for lapses when the lease would
    have (``lapsed``). The caller clears the returned sessions' running marks."""

    def __init__(self) -> None:
        self._by_id: dict[int, _Restored] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, lease_id: int, session_id: str, holder: str | None, lapses_s: float) -> None:
        self._by_id[lease_id] = _Restored(session_id, holder, lapses_s)

    def pop(self, lease_id: int) -> str | None:
        restored = self._by_id.pop(lease_id, None)
        return None if restored is None else restored.session_id

    def vouched(self, holder: str, held: Collection[int]) -> list[str]:
        """``holder`` holds exactly the leases ``held``: its restored leases not among
        them are over (returned), unless it vouched for them before (they ended since,
        with their turn or given back: their marks went then); those among them are now
        its running turns, kept here until they end, so that the lessee's giving one
        back, or its use refused, still ends the mark (``pop``)."""
        over = []
        for lease_id, restored in list(self._by_id.items()):
            if restored.holder != holder:
                continue
            if lease_id in held:
                restored.vouched = True
                continue
            del self._by_id[lease_id]
            if not restored.vouched:
                over.append(restored.session_id)
        return over

    def lapsed(self, now: float) -> list[str]:
        """Sessions of the leases nobody vouched for that are past their lapse time."""
        over = [lid for lid, r in self._by_id.items() if not r.vouched and now >= r.lapses_s]
        return [self._by_id.pop(lid).session_id for lid in over]


@dataclass(slots=True)
class LeaseGrants:
    """The granted leases, by session, and the proposals refused for good."""

    lasts_s: float
    grace_s: float
    grants: dict[str, Grant] = field(default_factory=dict)
    refused: dict[int, None] = field(default_factory=dict)  # oldest first

    def grant(
        self,
        session_id: str,
        holder: str,
        record: KVRecord | None,
        now_s: float,
        lease_id: int | None,
    ) -> Grant:
        """Book a lease: ``lease_id`` the lessee proposed, or a new one."""
        grant = Grant(
            session_id=session_id,
            holder=holder,
            # Unique across service instances.
            lease_id=secrets.randbits(62) if lease_id is None else lease_id,
            record=record,
            lapses_s=now_s + self.lasts_s + self.grace_s,
        )
        self.grants[session_id] = grant
        return grant

    def find(self, session_id: str, lease_id: int) -> Grant | None:
        grant = self.grants.get(session_id)
        return grant if grant is not None and grant.lease_id == lease_id else None

    def unused(self, session_id: str) -> Grant | None:
        grant = self.grants.get(session_id)
        return grant if grant is not None and not grant.used else None

    def num_unused(self) -> int:
        return sum(not g.used for g in self.grants.values())

    def lapsed(self, now_s: float) -> list[Grant]:
        """Unused grants past their lapse time (their lessee went silent)."""
        return [g for g in self.grants.values() if not g.used and now_s >= g.lapses_s]

    def revocations(self, record: KVRecord) -> list[RevokeLease]:
        """``record`` is gone: revoke an unused lease that would read it."""
        grant = self.unused(record.session_id)
        if grant is None or grant.record != record:
            return []
        return [RevokeLease(holder=grant.holder, lease_id=grant.lease_id)]

    def revoke_session(self, session_id: str) -> list[RevokeLease]:
        """The session's KV changed under an unused lease (a host tier's copy was booked,
        or an engine short of KV asks it back): revoke the lease, so that the next turn
        asks and finds it."""
        grant = self.unused(session_id)
        return [] if grant is None else [RevokeLease(holder=grant.holder, lease_id=grant.lease_id)]

    def refuse(self, lease_id: int) -> None:
        self.refused[lease_id] = None
        while len(self.refused) > REFUSED_KEPT:
            del self.refused[next(iter(self.refused))]
