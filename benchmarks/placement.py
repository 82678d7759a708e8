"""Place 1,000 engines of mixed TP onto 100 NVL72 domains: kvtide's planner vs first fit.

Run from the repository root (no install needed; an installed kvtide works too):

    python benchmarks/placement.py [--seed 0] [--requests 1000] [--domains 100]

Three planners replay the same script: engine requests of TP 1/2/4/8/16 drawn with
a fixed seed, with releases of earlier engines interleaved (a planner that
rejected an engine has nothing to release). kvtide's `PlacementPlanner`; first
fit, which takes the first free GPUs in node order and may span domains; and first
fit restricted to the first domain with room, the naive fix. The table shows:

- decisions per second: `place` calls divided by the process CPU time spent in
  them (CPU time, so that other load on the machine does not skew it);
- engines placed / rejected, and rejections while the cluster as a whole still
  had enough free GPUs (the price of never spanning domains);
- cross-domain placements: engines whose shards sit in more than one NVLink domain
  (their all-reduce would leave NVLink);
- extra nodes spanned: over placed engines, nodes used beyond the minimum
  ceil(tp / 4) trays;
- GPUs stranded for TP8 / TP16: free GPUs in domains that have fewer than 8 / 16
  free, so that no TP8 / TP16 engine can use them in-domain; the mean over the run
  (sampled after every event) and at the end;
- free GPUs at the end.

Each ratio column is kvtide divided by the column to its left.

A second table times kvtide's Serve pool layout (`orchestrator/cluster/pool_layout.py`) for a
large config on the same domains, and what a lost tray costs: re-planning with the
running layout (engines stay where their domain still holds them) against re-planning
from scratch, counted as engines that change domain (each one a replica restarted by
the re-deploy).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.cli.table import format_table
from placement.first_fit import FirstFitPlacement, FirstFitPlanner
from placement.planner import EngineRequest, PlacementPlan, PlacementPlanner
from placement.topology import ClusterLedger, ClusterTopology, NodeSpec

GPUS_PER_TRAY = 4
TRAYS_PER_DOMAIN = 18
CPUS_PER_TRAY = 144
TP_MIX = {1: 0.05, 2: 0.10, 4: 0.20, 8: 0.35, 16: 0.30}
RELEASE_PROBABILITY = 0.15


@dataclass(frozen=True, slots=True)
class Place:
    request: EngineRequest


@dataclass(frozen=True, slots=True)
class Release:
    engine_id: str


Event = Place | Release


def nvl72_cluster(num_domains: int) -> ClusterTopology:
    return ClusterTopology(
        nodes=tuple(
            NodeSpec(
                node_id=f"rack{d:03d}-tray{t:02d}",
                domain_id=f"rack{d:03d}",
                num_gpus=GPUS_PER_TRAY,
                num_cpus=CPUS_PER_TRAY,
            )
            for d in range(num_domains)
            for t in range(TRAYS_PER_DOMAIN)
        )
    )


def make_script(num_requests: int, seed: int) -> list[Event]:
    rng = random.Random(seed)
    sizes, weights = list(TP_MIX), list(TP_MIX.values())
    events: list[Event] = []
    releasable: list[str] = []
    for i in range(num_requests):
        tp_size = rng.choices(sizes, weights)[0]
        role = "prefill" if rng.random() < 0.5 else "decode"
        engine_id = f"engine-{i:04d}"
        events.append(Place(EngineRequest(engine_id=engine_id, tp_size=tp_size, role=role)))
        releasable.append(engine_id)
        if rng.random() < RELEASE_PROBABILITY:
            victim = releasable.pop(rng.randrange(len(releasable)))
            events.append(Release(victim))
    return events


@dataclass
class Result:
    place_s: float = 0.0
    num_decisions: int = 0
    num_placed: int = 0
    num_rejected: int = 0
    num_rejected_with_room: int = 0
    num_cross_domain: int = 0
    num_extra_nodes: int = 0
    stranded_tp8_sum: int = 0
    stranded_tp16_sum: int = 0
    num_samples: int = 0
    stranded_tp8_end: int = 0
    stranded_tp16_end: int = 0
    free_end: int = 0


def stranded(ledger: ClusterLedger, tp_size: int) -> int:
    """Free GPUs in domains with fewer than `tp_size` free (see DomainState)."""
    free = [ledger.domain_free_gpus(d) for d in range(len(ledger.domain_ids))]
    return sum(f for f in free if f < tp_size)


def run(planner: PlacementPlanner | FirstFitPlanner, script: Sequence[Event]) -> Result:
    ledger = planner.ledger
    domain_of = {node.node_id: node.domain_id for node in ledger.topology.nodes}
    result = Result()
    for event in script:
        if isinstance(event, Place):
            num_free = sum(ledger.free_gpus_by_domain())
            start = time.process_time()
            decision = planner.place(event.request)
            result.place_s += time.process_time() - start
            result.num_decisions += 1
            if isinstance(decision, (PlacementPlan, FirstFitPlacement)):
                result.num_placed += 1
                domains = {domain_of[shard.node_id] for shard in decision.shards}
                result.num_cross_domain += len(domains) > 1
                minimum = math.ceil(decision.tp_size / GPUS_PER_TRAY)
                result.num_extra_nodes += decision.num_nodes - minimum
            else:
                result.num_rejected += 1
                result.num_rejected_with_room += num_free >= event.request.tp_size
        elif ledger.holds(event.engine_id):
            planner.release(event.engine_id)
        result.stranded_tp8_sum += stranded(ledger, 8)
        result.stranded_tp16_sum += stranded(ledger, 16)
        result.num_samples += 1
    result.stranded_tp8_end = stranded(ledger, 8)
    result.stranded_tp16_end = stranded(ledger, 16)
    result.free_end = sum(ledger.domain_free_gpus(d) for d in range(len(ledger.domain_ids)))
    return result


def ratio(a: float, b: float) -> str:
    if b == 0:
        return "n/a" if a else "1.00"
    return f"{a / b:.2f}"


ROWS: tuple[tuple[str, Callable[[Result], float]], ...] = (
    ("decisions per second", lambda r: r.num_decisions / r.place_s),
    ("engines placed", lambda r: r.num_placed),
    ("engines rejected", lambda r: r.num_rejected),
    ("  of which with enough free GPUs", lambda r: r.num_rejected_with_room),
    ("cross-domain placements", lambda r: r.num_cross_domain),
    ("extra nodes spanned", lambda r: r.num_extra_nodes),
    ("GPUs stranded for TP8, mean", lambda r: r.stranded_tp8_sum / r.num_samples),
    ("GPUs stranded for TP8, end", lambda r: r.stranded_tp8_end),
    ("GPUs stranded for TP16, mean", lambda r: r.stranded_tp16_sum / r.num_samples),
    ("GPUs stranded for TP16, end", lambda r: r.stranded_tp16_end),
    ("free GPUs, end", lambda r: r.free_end),
)


def table(kvtide: Result, first_fit: Result, one_domain: Result) -> str:
    """kvtide, first fit and first fit in one domain, with kvtide's ratio to each."""
    header = ("metric", "kvtide", "first fit", "ratio", "first fit, 1 domain", "ratio")
    rows = []
    for name, metric in ROWS:
        a, b, c = (float(metric(r)) for r in (kvtide, first_fit, one_domain))
        whole = name.startswith("decisions") or all(v == int(v) for v in (a, b, c))
        fmt = "{:,.0f}" if whole else "{:.1f}"
        rows.append((name, fmt.format(a), fmt.format(b), ratio(a, b), fmt.format(c), ratio(a, c)))
    return format_table(header, rows, align=["<"] + [">"] * 5, markdown=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--domains", type=int, default=100)
    args = parser.parse_args(argv)

    topology = nvl72_cluster(args.domains)
    script = make_script(args.requests, args.seed)
    num_releases = sum(isinstance(event, Release) for event in script)
    kvtide = run(PlacementPlanner(topology), script)
    first_fit = run(FirstFitPlanner(topology), script)
    one_domain = run(FirstFitPlanner(topology, within_domain=True), script)
    print(
        f"{args.requests} engine requests (TP mix {TP_MIX}, seed {args.seed}), "
        f"{num_releases} releases, onto {args.domains} NVL72 domains "
        f"({TRAYS_PER_DOMAIN} trays x {GPUS_PER_TRAY} GPUs = "
        f"{topology.num_gpus} GPUs)\n"
    )
    print(table(kvtide, first_fit, one_domain))
    print()
    print(layout_table(topology))


def _moved(old: dict[str, int], new: dict[str, int]) -> int:
    """Engines that left their deployment (pool and domain) between two layouts."""
    return sum(max(0, n - new.get(name, 0)) for name, n in old.items())


def layout_table(topology: ClusterTopology) -> str:
    from orchestrator.cluster.pool_layout import plan_layout
    from orchestrator.config import parse_config

    config = parse_config(
        {
            "device": "cuda",
            "prefill": {"num_engines": 200, "tensor_parallel_size": 8, "cpu_threads_bind": None},
            "decode": {"num_engines": 100, "tensor_parallel_size": 16, "cpu_threads_bind": None},
            "decode_long": {"num_engines": 40, "tensor_parallel_size": 16},
            "routing": {"long_context_threshold_tokens": 32768},
        }
    )
    t0 = time.process_time()
    layout = plan_layout(config, topology)
    plan_s = time.process_time() - t0
    # Lose one tray that an engine uses.
    used = layout.deployments[-1].plans[0].node_ids[0]
    smaller = ClusterTopology(nodes=tuple(n for n in topology.nodes if n.node_id != used))
    t0 = time.process_time()
    sticky = plan_layout(config, smaller, running=layout)
    sticky_s = time.process_time() - t0
    scratch = plan_layout(config, smaller)
    before = layout.counts()
    moved_sticky = _moved(before, sticky.counts())
    moved_scratch = _moved(before, scratch.counts())
    engines = sum(before.values())
    rows = [
        ("engines placed (prefill 200 x TP8, decode 140 x TP16)", f"{engines:,}", "", ""),
        ("Serve deployments (pool, domain)", f"{len(layout.deployments):,}", "", ""),
        ("plan the whole layout, ms (CPU)", f"{plan_s * 1000:,.0f}", "", ""),
        ("re-plan after a lost tray, ms (CPU)", f"{sticky_s * 1000:,.0f}", "", ""),
        (
            "engines moved by a lost tray",
            f"{moved_sticky:,}",
            f"{moved_scratch:,}",
            ratio(moved_sticky, moved_scratch),
        ),
    ]
    header = ("Serve pool layout", "kvtide", "from scratch", "ratio")
    return format_table(header, rows, align=("<", ">", ">", ">"), markdown=True)


if __name__ == "__main__":
    main()
