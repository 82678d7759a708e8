"""The decode pool's paused-session demand (``kv_blocks_held``), as an engine host reports
it to Serve's autoscaler: the blocks the KV service books on its engine, which it hears
with each heartbeat, not every block its engine kept until the TTL.

The engines, ledgers and service are those of test_kv_service.py; the decode host's
heartbeat reaches the service as a Ray handle's ``.remote`` would."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from test_kv_service import S1_T1, S1_T2, Cluster

from engines.base import EngineStats
from orchestrator.autoscale.load_meter import LoadMeter
from orchestrator.kv.actor import EpochWatcher
from orchestrator.kv.service import KVService
from orchestrator.serve.ledger import BOOKED_FOR_S

DECODE_ENGINE = "D"  # the engine the fake decode pool's params name


class Remote:
    """``handle.method.remote(*args)`` on the service itself."""

    def __init__(self, method: Callable[..., Awaitable[Any]]) -> None:
        self.remote = method


class Handle:
    def __init__(self, service: KVService) -> None:
        self.service = service

    def __getattr__(self, name: str) -> Remote:
        return Remote(getattr(self.service, name))


def held_kv(c: Cluster) -> float:
    """What the decode host reports to Serve as KV held for paused sessions
    (``EngineHost.record_autoscaling_stats``), on an engine whose blocks are all in use."""
    meter = LoadMeter(clock=c.clock, engine_start_s=1.0)
    stats = EngineStats(engine_id=DECODE_ENGINE, kv_cache_usage=1.0)
    report = meter.report(
        stats, num_kv_blocks=1000, kv_blocks_kept=c.decode.ledger.num_kept_blocks()
    )
    return report["kv_blocks_held"]


def test_a_session_pulled_by_its_next_turn_is_no_longer_paused_decode_demand() -> None:
    c = Cluster()
    ledger = c.decode.ledger
    watcher = EpochWatcher(
        lambda: Handle(c.service),  # type: ignore[arg-type,return-value]
        ledger.report,
        engine_id=DECODE_ENGINE,
        booked=ledger.booked,
    )

    async def run() -> None:
        assert await watcher.check_once()  # the first beat reports the ledger
        assert (await c.turn(S1_T1, "s1")).kv_plan == "recompute"
        await watcher.check_once()
        assert held_kv(c) == 1  # turn 1's block, kept for the paused session
        # Turn 2 pulls turn 1's block (the decode engine frees it; its host does not see
        # the read) and keeps its own: one block is paused demand, not two.
        assert (await c.turn(S1_T2, "s1")).kv_source == "sent_back"
        await watcher.check_once()
        assert len(ledger.report().kept) == 2  # the ledger still lists both until the TTL
        assert held_kv(c) == 1
        assert c.service.decider.lifecycle.blocks_held(DECODE_ENGINE) == 1
        # The session closes: its KV is released, no longer demand.
        assert await c.service.close("s1")
        await c.service.wait_drains()
        await watcher.check_once()
        assert held_kv(c) == 0
        # A service silent past the bound: the ledger's own count (never less).
        c.clock.now_s += BOOKED_FOR_S + 1
        assert held_kv(c) == 2

    asyncio.run(run())
