"""Placing tensor-parallel engines inside one NVLink domain each.

A TP engine is only fast when every shard talks to every other over NVLink, so an
engine's shards never span NVLink domains. Among the domains that can host it the
planner takes the one whose free GPUs afterwards still cut best into TP16 and TP8
engines (`leftover_for_large_engines`), then the tightest fit (fewest free GPUs
left), which fills partly used domains and keeps empty racks whole for the large
engines that need them. Inside the domain it uses as few nodes as possible: whole
free trays first for engines larger than a tray, and for the tray that finishes
the engine (or an engine that fits on one tray) the tray whose free GPUs fit it
most tightly, so that partial trays fill up before whole ones are broken.

`choose_placement` is the decision, a pure function of the ledger and the
request. `PlacementPlanner` wraps it in check/act pairs (`plan`/`can_place`,
`place`) and `release`. "Cannot place" is an `Unplaceable` value that lists every
domain's free GPUs against what was asked, never an exception.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from placement.errors import DuplicateEngine, InvalidEngineRequest, UnknownEngine
from placement.plan import (
    MAX_TP_SIZE,
    EngineRequest,
    PlacementDecision,
    PlacementPlan,
    ShardAssignment,
    Unplaceable,
)
from placement.topology import (
    ClusterLedger,
    ClusterSnapshot,
    ClusterTopology,
    DomainState,
    NodeClaim,
)

# The value types of `placement.plan` are re-exported: callers need one import.
__all__ = [
    "LARGE_TP_SIZES",
    "MAX_TP_SIZE",
    "EngineRequest",
    "PickMemo",
    "PlacementDecision",
    "PlacementPlan",
    "PlacementPlanner",
    "ShardAssignment",
    "Unplaceable",
    "choose_in_domain",
    "choose_placement",
    "describe_domains",
    "leftover_for_large_engines",
]

LARGE_TP_SIZES = (16, 8)
"""TP sizes whose room the planner protects: they need many GPUs of one domain."""

# A candidate placement inside one domain: (node ordinal, number of shards) pairs,
# rank 0's node first.
_Picks = list[tuple[int, int]]

PickMemo = dict[tuple[int, int, float], tuple[int, "_Picks | None", int]]
"""(domain, tp_size, cpus per shard) -> (domain version, picks, partial nodes added).

Optional memory for `choose_placement`, valid for one ledger only: a domain's node
choice is reused while the domain's version is unchanged.
"""


def choose_placement(
    ledger: ClusterLedger, request: EngineRequest, *, memo: PickMemo | None = None
) -> PlacementDecision:
    """Decide where `request` goes given what `ledger` holds; changes nothing.

    Domains that can host the engine are ranked by, in order: GPUs the domain
    would leave over for TP16/TP8 engines afterwards, free GPUs it would have left
    (best fit), nodes the engine would span, partly used nodes the placement adds,
    and domain order. Raises `DuplicateEngine` when the engine is already placed.
    """
    if ledger.holds(request.engine_id):
        raise DuplicateEngine(f"engine {request.engine_id!r} is already placed; release it first")
    tp_size = request.tp_size
    best_key: tuple[int, int, int, int, int] | None = None
    best_picks: _Picks = []
    best_domain = -1
    cpu_short: list[int] = []
    leftover = _leftover_table(max(ledger.free_gpus_by_domain(), default=0))
    for domain, free in enumerate(ledger.free_gpus_by_domain()):
        if free < tp_size:
            continue
        left = free - tp_size
        coarse = (leftover[left], left)
        if best_key is not None and coarse > best_key[:2]:
            continue  # cannot win: skip the node scan
        picks, partial = _pick_nodes_memo(ledger, domain, request, memo)
        if picks is None:
            cpu_short.append(domain)
            continue
        key = (*coarse, len(picks), partial, domain)
        if best_key is None or key < best_key:
            best_key, best_picks, best_domain = key, picks, domain
    if best_key is None:
        return _unplaceable(ledger, request, cpu_short)
    return _plan_from_picks(ledger, request, best_domain, best_picks)


def choose_in_domain(
    ledger: ClusterLedger, request: EngineRequest, domain_id: str
) -> PlacementPlan | None:
    """Where `request` goes inside `domain_id`, or None if that domain cannot hold it
    now (or is unknown); changes nothing. Used to keep a running engine where it is."""
    if ledger.holds(request.engine_id):
        raise DuplicateEngine(f"engine {request.engine_id!r} is already placed; release it first")
    if domain_id not in ledger.domain_ids:
        return None
    domain = ledger.domain_ids.index(domain_id)
    if ledger.domain_free_gpus(domain) < request.tp_size:
        return None
    picks = _pick_nodes(ledger, domain, request)
    return None if picks is None else _plan_from_picks(ledger, request, domain, picks)


def leftover_for_large_engines(num_free_gpus: int) -> int:
    """GPUs of a domain left over once its free GPUs are cut into TP16, then TP8 engines.

    `num_free % 16 + num_free % 8`: 0 for 64 free GPUs, 8 for a whole NVL72 rack
    (72 = 4 x 16 + 8, the 8 can still take a TP8) or a whole HGX node, 4 + 4 for 68.
    The planner keeps this smallest, so that free GPUs stay in shapes the large
    engines can use.
    """
    return sum(num_free_gpus % size for size in LARGE_TP_SIZES)


@functools.cache
def _leftover_table(max_free_gpus: int) -> tuple[int, ...]:
    # Powers of two up to the next one above the largest domain: few distinct keys.
    size = 1 << max(max_free_gpus, 1).bit_length()
    return tuple(leftover_for_large_engines(free) for free in range(size + 1))


def _pick_nodes_memo(
    ledger: ClusterLedger, domain: int, request: EngineRequest, memo: PickMemo | None
) -> tuple[_Picks | None, int]:
    key = (domain, request.tp_size, request.num_cpus_per_shard)
    version = ledger.domain_version(domain)
    if memo is not None and key in memo and memo[key][0] == version:
        return memo[key][1], memo[key][2]
    picks = _pick_nodes(ledger, domain, request)
    partial = 0 if picks is None else _new_partial_nodes(ledger, picks)
    if memo is not None:
        memo[key] = (version, picks, partial)
    return picks, partial


def _pick_nodes(ledger: ClusterLedger, domain: int, request: EngineRequest) -> _Picks | None:
    """The fewest nodes of `domain` that host the engine, or None if CPUs run short.

    Repeat until every shard has a node: if one node can take all remaining shards,
    take the node whose free GPUs fit them most tightly (lowest ordinal on ties) and
    stop; otherwise take a node with the most free GPUs (a whole tray when there is
    one). Largest-first keeps the node count minimal; the tight fit at the end keeps
    whole trays whole.
    """
    remaining = request.tp_size
    cpus = request.num_cpus_per_shard
    max_gpus = ledger.domain_max_gpus_per_node(domain)
    used: set[int] = set()
    picks: _Picks = []
    while remaining > 0:
        fit = _tightest_node(ledger, domain, remaining, max_gpus, used, cpus)
        if fit is not None:
            picks.append((fit, remaining))
            return picks
        largest = _largest_node(ledger, domain, max_gpus, used, cpus)
        if largest is None:
            return None
        ordinal, shards = largest
        picks.append((ordinal, shards))
        used.add(ordinal)
        remaining -= shards
    return picks


def _tightest_node(
    ledger: ClusterLedger, domain: int, shards: int, max_gpus: int, used: set[int], cpus: float
) -> int | None:
    for num_free in range(shards, max_gpus + 1):
        for ordinal in sorted(ledger.nodes_with_free_gpus(domain, num_free)):
            if ordinal not in used and ledger.max_shards(ordinal, cpus) >= shards:
                return ordinal
    return None


def _largest_node(
    ledger: ClusterLedger, domain: int, top: int, used: set[int], cpus: float
) -> tuple[int, int] | None:
    for num_free in range(top, 0, -1):
        for ordinal in sorted(ledger.nodes_with_free_gpus(domain, num_free)):
            if ordinal in used:
                continue
            shards = ledger.max_shards(ordinal, cpus)
            if shards > 0:
                return ordinal, shards
    return None


def _new_partial_nodes(ledger: ClusterLedger, picks: _Picks) -> int:
    """How many more nodes are partly used after the placement than before."""
    delta = 0
    for ordinal, shards in picks:
        total = ledger.node_spec(ordinal).num_gpus
        before = ledger.free_gpus(ordinal)
        after = before - shards
        delta += (0 < after < total) - (0 < before < total)
    return delta


def _plan_from_picks(
    ledger: ClusterLedger, request: EngineRequest, domain: int, picks: _Picks
) -> PlacementPlan:
    shards: list[ShardAssignment] = []
    for ordinal, count in picks:
        node_id = ledger.node_spec(ordinal).node_id
        gpu_indices = ledger.free_gpu_indices(ordinal)[:count]
        for local_rank, gpu_index in enumerate(gpu_indices):
            shards.append(
                ShardAssignment(
                    rank=len(shards),
                    node_id=node_id,
                    local_rank=local_rank,
                    gpu_index=gpu_index,
                    num_cpus=request.num_cpus_per_shard,
                )
            )
    return PlacementPlan(
        engine_id=request.engine_id,
        role=request.role,
        tp_size=request.tp_size,
        domain_id=ledger.domain_ids[domain],
        shards=tuple(shards),
    )


def describe_domains(domains: Sequence[DomainState]) -> str:
    """One line per domain: free GPUs of total and the largest free node."""
    return "\n".join(
        f"  {d.domain_id}: {d.num_free_gpus} of {d.num_gpus} GPUs free, "
        f"largest free node {d.largest_free_node_gpus} GPUs"
        for d in domains
    )


def _unplaceable(
    ledger: ClusterLedger, request: EngineRequest, cpu_short: list[int]
) -> Unplaceable:
    domains = ledger.domain_states()
    tp_size = request.tp_size
    head = f"engine {request.engine_id!r} (TP{tp_size}, {request.role}) cannot be placed: "
    largest_domain = max(d.num_gpus for d in domains)
    if tp_size > largest_domain:
        why = (
            f"no NVLink domain has {tp_size} GPUs at all (the largest has "
            f"{largest_domain}) and an engine's shards never span domains; "
            f"use a TP size of at most {largest_domain} or add a larger domain."
        )
    elif cpu_short:
        names = ", ".join(ledger.domain_ids[d] for d in cpu_short)
        why = (
            f"{names} {'has' if len(cpu_short) == 1 else 'have'} {tp_size} or more "
            f"free GPUs, but their nodes lack the {request.num_cpus_per_shard:g} free "
            f"CPUs each shard needs; lower num_cpus_per_shard or release engines there."
        )
    else:
        total_free = sum(d.num_free_gpus for d in domains)
        why = (
            f"no NVLink domain has {tp_size} free GPUs ({total_free} are free across "
            f"{len(domains)} domains, but an engine's shards never span domains); "
            f"release engines in one domain or lower the TP size."
        )
    reason = f"{head}{why}\nFree GPUs per domain:\n{describe_domains(domains)}"
    return Unplaceable(engine_id=request.engine_id, tp_size=tp_size, reason=reason, domains=domains)


class PlacementPlanner:
    """kvtide's planner: one NVLink domain per engine, best fit across domains.

    Queries (`plan`, `can_place`, `plan_many`, `plan_of`, `snapshot`) never change
    state; `place`, `place_many` and `release` do. Several engines placed at once
    go largest TP first, which packs better than arrival order.
    """

    def __init__(self, topology: ClusterTopology) -> None:
        self._ledger = ClusterLedger(topology)
        self._plans: dict[str, PlacementPlan] = {}
        self._memo: PickMemo = {}

    @property
    def ledger(self) -> ClusterLedger:
        return self._ledger

    def snapshot(self) -> ClusterSnapshot:
        return self._ledger.snapshot()

    def plan(self, request: EngineRequest) -> PlacementDecision:
        return choose_placement(self._ledger, request, memo=self._memo)

    def can_place(self, request: EngineRequest) -> bool:
        return isinstance(self.plan(request), PlacementPlan)

    def place(self, request: EngineRequest) -> PlacementDecision:
        decision = choose_placement(self._ledger, request, memo=self._memo)
        if isinstance(decision, PlacementPlan):
            self._commit(decision)
        return decision

    def release(self, engine_id: str) -> PlacementPlan:
        """Free the engine's GPUs and CPUs; returns the plan it held."""
        if engine_id not in self._plans:
            raise UnknownEngine(f"engine {engine_id!r} is not placed; nothing to release")
        self._ledger.release(engine_id)
        return self._plans.pop(engine_id)

    def plan_of(self, engine_id: str) -> PlacementPlan:
        if engine_id not in self._plans:
            raise UnknownEngine(f"engine {engine_id!r} is not placed")
        return self._plans[engine_id]

    def plan_many(self, requests: Sequence[EngineRequest]) -> tuple[PlacementDecision, ...]:
        """What `place_many` would decide, tried out on a copy of the ledger."""
        trial = PlacementPlanner.__new__(PlacementPlanner)
        trial._ledger = self._ledger.copy()
        trial._plans = dict(self._plans)
        trial._memo = dict(self._memo)  # the trial's versions diverge from ours
        return trial.place_many(requests)

    def place_many(self, requests: Sequence[EngineRequest]) -> tuple[PlacementDecision, ...]:
        """Place each engine it can, largest TP first; results in request order."""
        ids = [request.engine_id for request in requests]
        repeated = sorted({engine_id for engine_id in ids if ids.count(engine_id) > 1})
        if repeated:
            raise InvalidEngineRequest(f"engine ids repeated within one batch: {repeated}")
        for request in requests:
            if self._ledger.holds(request.engine_id):
                raise DuplicateEngine(
                    f"engine {request.engine_id!r} is already placed; release it first"
                )
        order = sorted(range(len(requests)), key=lambda i: -requests[i].tp_size)
        results: dict[int, PlacementDecision] = {}
        for i in order:
            results[i] = self.place(requests[i])
        return tuple(results[i] for i in range(len(requests)))

    def place_in_domain(self, request: EngineRequest, domain_id: str) -> PlacementPlan | None:
        """Place `request` inside `domain_id` if it fits there now; None (nothing
        placed) otherwise."""
        plan = choose_in_domain(self._ledger, request, domain_id)
        if plan is not None:
            self._commit(plan)
        return plan

    def _commit(self, plan: PlacementPlan) -> None:
        claims = [
            NodeClaim(
                node_id=node_id,
                num_gpus=len(on_node := plan.shards_on(node_id)),
                num_cpus=sum(shard.num_cpus for shard in on_node),
            )
            for node_id in plan.node_ids
        ]
        grants = self._ledger.claim(plan.engine_id, claims)
        # The plan named the lowest free GPU indices, which is what claim hands out.
        assert [g.gpu_indices for g in grants] == [
            tuple(s.gpu_index for s in plan.shards_on(g.node_id)) for g in grants
        ]
        self._plans[plan.engine_id] = plan
