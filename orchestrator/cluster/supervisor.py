"""Deploying domain-pinned engine pools with a bounded wait, and keeping them placed.

Ray Serve builds each pinned replica's placement group itself, and Ray leaves a group
it cannot place pending forever without an error. ``PlacementWatch`` bounds that: it
reads the app's replica groups from Ray's placement group table (Serve names a
replica's group after the replica actor, ``SERVE_REPLICA::<app>#<deployment>#<id>``)
and reports the groups pending longer than ``placement.timeout_s``;
``EnginesNotPlaced`` then lists what was asked against each domain's free GPUs.

``PoolSupervisor`` keeps the pools placed when nodes come and go. Serve restarts a
replica whose node died inside the same deployment, so in the same domain, which is
right while that domain still holds it. When it no longer does, ``reconcile`` plans a
new layout (engines stay in their domain where they still fit, the rest move;
``orchestrator.cluster.pool_layout.plan_layout``) and re-deploys the app: deployments whose
placement did not change keep their replicas (their Serve version is stable), a
shrunk domain's deployment loses its pending replica and the receiving domain's
gains one. Serve stops routing to a dead replica by itself; the KV of sessions on a
lost engine is dropped by the KV service (``KVService.on_engines_lost``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.cluster.pool_layout import EnginesUnplaceable, PoolLayout, plan_layout
from orchestrator.config import KVTideConfig
from orchestrator.errors import KVTideError
from placement.planner import describe_domains
from placement.topology import ClusterTopology, DomainState

__all__ = [
    "EnginesNotPlaced",
    "PendingGroup",
    "PlacementWatch",
    "PoolSupervisor",
    "ReconcileResult",
    "not_placed_error",
    "pending_groups_of",
    "read_pending_groups",
    "replica_group_name",
]

log = logging.getLogger("kvtide.placement")

REPLICA_PREFIX = "SERVE_REPLICA::"


class EnginesNotPlaced(KVTideError):
    """Ray did not place an engine's placement group within ``placement.timeout_s``."""

    def __init__(self, message: str, *, domains: Sequence[DomainState] = ()) -> None:
        super().__init__(message)
        self.domains = tuple(domains)


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingGroup:
    """A replica's placement group that Ray has not placed."""

    group_id: str
    replica: str  # the replica actor's name, which Serve names its group after
    deployment: str
    bundles: tuple[Mapping[str, float], ...]
    state: str

    def describe_ask(self, domain_id: str | None) -> str:
        gpus = sum(b.get("GPU", 0) for b in self.bundles)
        where = f" in NVLink domain {domain_id}" if domain_id else ""
        return f"{len(self.bundles)} bundles with {gpus:g} GPUs in all{where}"


def replica_group_name(name: str) -> tuple[str, str, str] | None:
    """``(app, deployment, replica)`` of a Serve replica's placement group name
    (``SERVE_REPLICA::<app>#<deployment>#<replica>``); None for any other group."""
    if not name.startswith(REPLICA_PREFIX):
        return None
    app, deployment, replica = [*name[len(REPLICA_PREFIX) :].split("#"), "", ""][:3]
    return app, deployment, replica


def pending_groups_of(app_name: str, table: Mapping[str, Mapping[str, Any]]) -> list[PendingGroup]:
    """The app's replica groups in ``table`` (``placement_group_table()``) that are not
    placed yet (pure)."""
    out = []
    for group_id, row in table.items():
        parsed = replica_group_name(str(row.get("name") or ""))
        if parsed is None or parsed[0] != app_name:
            continue
        if row.get("state") not in ("PENDING", "RESCHEDULING"):
            continue
        bundles = row.get("bundles") or {}
        out.append(
            PendingGroup(
                group_id=group_id,
                replica=str(row["name"]),
                deployment=parsed[1],
                bundles=tuple(bundles[i] for i in sorted(bundles)),
                state=str(row.get("state")),
            )
        )
    return out


def read_pending_groups(app_name: str) -> list[PendingGroup]:
    """The app's unplaced replica groups now (needs ``ray.init``)."""
    from ray.util.placement_group import placement_group_table

    return pending_groups_of(app_name, placement_group_table())


class PlacementWatch:
    """Remembers since when each group is pending; ``overdue`` names those pending
    longer than ``timeout_s`` (the clock is passed in)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._since: dict[str, float] = {}

    def overdue(self, pending: Iterable[PendingGroup]) -> list[PendingGroup]:
        now = self._clock()
        current = {g.group_id: g for g in pending}
        self._since = {gid: self._since.get(gid, now) for gid in current}
        return [g for gid, g in current.items() if now - self._since[gid] >= self.timeout_s]


def not_placed_error(
    app_name: str,
    overdue: Sequence[PendingGroup],
    layout: PoolLayout,
    domains: Sequence[DomainState],
    timeout_s: float,
) -> EnginesNotPlaced:
    """The error for groups still pending after ``timeout_s`` (pure)."""
    domain_of = {d.name: d.domain_id for d in layout.deployments}
    lines = [
        f"app {app_name!r}: Ray did not place {len(overdue)} engine placement group(s) "
        f"within {timeout_s:g} s; kvtide stopped waiting."
    ]
    for group in overdue:
        ask = group.describe_ask(domain_of.get(group.deployment))
        lines.append(f"  {group.deployment}: asked {ask} ({group.state})")
    lines += [
        "Free GPUs per domain, as Ray reports them now:",
        describe_domains(domains),
        "Free GPUs in that domain (stop other work there), lower num_engines or "
        "tensor_parallel_size, or raise placement.timeout_s if GPUs are being released.",
    ]
    return EnginesNotPlaced("\n".join(lines), domains=domains)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReconcileResult:
    """What one ``reconcile`` saw and did."""

    lost_node_ids: tuple[str, ...] = ()
    new_node_ids: tuple[str, ...] = ()
    layout: PoolLayout | None = None  # the layout deployed now; None: nothing re-deployed
    unplaceable: str | None = None  # why the lost engines fit nowhere, if they do not

    @property
    def changed(self) -> bool:
        return self.layout is not None


class PoolSupervisor:
    """Re-places engines when nodes are lost (see the module doc). Call ``reconcile``
    periodically (``kvtide up`` does, every ``placement.supervise_interval_s``)."""

    def __init__(
        self,
        config: KVTideConfig,
        layout: PoolLayout,
        *,
        deploy: Callable[[PoolLayout], None],
        read_topology: Callable[[], ClusterTopology],
    ) -> None:
        self.config = config
        self.layout = layout
        self._deploy = deploy
        self._read_topology = read_topology
        self._node_ids = {n.node_id for n in read_topology().nodes}

    def reconcile(self) -> ReconcileResult:
        topology = self._read_topology()
        now = {n.node_id for n in topology.nodes}
        lost = tuple(sorted(self._node_ids - now))
        new = tuple(sorted(now - self._node_ids))
        if not lost and not new:
            return ReconcileResult()
        self._node_ids = now
        try:
            layout = plan_layout(self.config, topology, running=self.layout)
        except EnginesUnplaceable as err:
            log.error("engines lost with nodes %s cannot be re-placed: %s", lost, err)
            return ReconcileResult(lost_node_ids=lost, new_node_ids=new, unplaceable=str(err))
        if layout.counts() == self.layout.counts():
            return ReconcileResult(lost_node_ids=lost, new_node_ids=new)
        log.warning(
            "nodes lost %s: re-placing engines; deployments now:\n%s", lost, layout.describe()
        )
        self._deploy(layout)
        self.layout = layout
        return ReconcileResult(lost_node_ids=lost, new_node_ids=new, layout=layout)
