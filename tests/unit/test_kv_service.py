"""The KV lifecycle service: expiry conversion and rebuilding after its own restart.

The engines are the fake pools of test_router.py, wrapped so that each one keeps its
half of the ledger exactly as an engine host does (``EngineLedger.on_finished``).
A "restart" is a new ``KVService`` with empty books on the same engines.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import msgspec
import pytest
from test_router import FakeClock, FakePool, decode_script, prefill_script

from engines.base import GenerateChunk, GenerateRequest
from engines.kv_params import KVTransferParams
from orchestrator.kv.actor import EpochWatcher
from orchestrator.kv.decider import kv_lifecycle_config
from orchestrator.kv.messages import Beat, LedgerReport, TurnDone
from orchestrator.kv.service import KVService, KVServiceAPI, ServiceSettings
from orchestrator.router import Router, RouterSettings, Turn, TurnReport
from orchestrator.serve.ledger import EngineLedger

TTL_S = 480.0
SETTINGS_FIELDS = {f.name for f in dataclasses.fields(ServiceSettings)}
F = TypeVar("F")


class HostedPool:
    """A fake engine behind a host that keeps the ledger (as ``EngineHost`` does)."""

    def __init__(self, pool: FakePool, role: str, clock: FakeClock) -> None:
        self.pool = pool
        self.ledger = EngineLedger(engine_id=role, role=role, ttl_s=TTL_S, clock=clock)

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        return self.ledger.watch(request, self.pool.generate(request))


def decode_with_fresh_blocks(req: GenerateRequest) -> list[GenerateChunk]:
    """Like ``decode_script`` but each request keeps its own blocks (as vLLM does)."""
    chunks = decode_script(req)
    last = chunks[-1]
    assert last.kv_transfer_params is not None
    block = 10 + int(req.request_id.split("-")[1])
    params = msgspec.structs.replace(last.kv_transfer_params, remote_block_ids=((block,),))
    return [*chunks[:-1], GenerateChunk(**{**_fields(last), "kv_transfer_params": params})]


def _fields(chunk: GenerateChunk) -> dict[str, Any]:
    return {f: getattr(chunk, f) for f in chunk.__struct_fields__}


class Cluster:
    """One prefill and one decode engine with ledgers, a service and a router."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.prefill = HostedPool(FakePool(prefill_script(cached=101)), "prefill", self.clock)
        self.decode = HostedPool(FakePool(decode_with_fresh_blocks), "decode", self.clock)
        self.num_requests = 0
        self.service = self.new_service()

    def new_service(
        self,
        idle_budget_bytes: int | None = None,
        room_kv_cache_usage: float | None = None,
        **kwargs: Any,
    ) -> KVService:
        """A service (``kwargs`` for its constructor or its settings) on these engines;
        the router reaches it directly."""
        settings = {k: kwargs.pop(k) for k in list(kwargs) if k in SETTINGS_FIELDS}
        self.service = KVService(
            kv_lifecycle_config(
                ttl_s=TTL_S,
                safety_margin_s=15,
                recompute_threshold_tokens=4,
                kv_bytes_per_token=100,
                block_size_tokens=16,
                idle_budget_bytes_per_engine=idle_budget_bytes,
                room_kv_cache_usage=room_kv_cache_usage,
            ),
            prefill=self.prefill,
            settings=ServiceSettings(
                drain_timeout_s=5.0, num_prefill_engines=1, restore_wait_s=10.0, **settings
            ),
            clock=self.clock,
            **kwargs,
        )
        self.kv: KVServiceAPI = self.service
        return self.service

    def fake(self, make: Callable[[KVService], F]) -> F:
        """The router reaches the service through ``make``'s fake from now on (the
        service's own books stay ``self.service``)."""
        fake = make(self.service)
        self.kv = fake
        return fake

    def router(self, **kwargs: Any) -> Router:
        """A router on these engines that reaches the service as ``self.kv``
        (``kwargs``: the router's other collaborators)."""
        return Router(
            prefill=self.prefill,
            decode=self.decode,
            kv=self.kv,
            settings=RouterSettings(pull_timeout_s=5.0),
            **kwargs,
        )

    async def turn(self, prompt: list[int], session: str | None) -> TurnReport:
        router = self.router()
        self.num_requests += 1
        reports = [
            r
            async for _, r in router.run_turn(
                Turn(
                    prompt_token_ids=prompt,
                    max_tokens=3,
                    session_id=session,
                    request_id=f"r-{self.num_requests}",
                )
            )
        ]
        await router.settled()
        await self.service.wait_drains()
        return reports[-1]

    def bytes_held(self) -> dict[str, int]:
        return dict(self.service.decider.lifecycle._books.held_bytes)

    def reports(self) -> tuple[LedgerReport, LedgerReport]:
        return self.decode.ledger.report(), self.prefill.ledger.report()


S1_T1 = list(range(100))
S1_T2 = [*S1_T1, 11, 12, 13, 50, 51]


async def two_sessions(c: Cluster) -> None:
    """s1: two turns (turn 2 pulled turn 1's blocks); s2: one turn; one sessionless."""
    assert (await c.turn(S1_T1, "s1")).kv_plan == "recompute"
    assert (await c.turn(S1_T2, "s1")).kv_source == "sent_back"
    await c.turn(list(range(200, 300)), "s2")
    await c.turn(list(range(300, 400)), None)


def test_a_restarted_service_rebuilds_exactly_what_the_engines_still_hold() -> None:
    c = Cluster()

    async def run() -> None:
        await two_sessions(c)
        before = c.bytes_held()
        s1_record = c.service.decider.lifecycle.record("s1")
        assert s1_record is not None
        svc = c.new_service()  # the actor died; Ray started a new one, books empty
        decode_report, prefill_report = c.reports()
        await svc.restore(decode_report)
        # Not adopted yet: a read the prefill engine has not reported would make the
        # service book blocks that are already free.
        assert svc.decider.lifecycle.records() == []
        await svc.restore(prefill_report)
        await svc.wait_drains()
        assert c.bytes_held() == before
        rebuilt = svc.decider.lifecycle.record("s1")
        assert rebuilt is not None
        # Turn 2's blocks, not turn 1's (those were read by turn 2's pull: freed).
        assert (rebuilt.block_ids, rebuilt.prefix_hash) == (
            s1_record.block_ids,
            s1_record.prefix_hash,
        )
        assert svc.counters["adopt_skipped_consumed"] >= 1
        # Nothing freed twice: no drain of blocks a read already freed.
        assert svc.counters["drain_failures"] == 0
        # The conversation goes on with the KV it had before the restart.
        r3 = await c.turn([*S1_T2, 11, 12, 13, 60, 61], "s1")
        assert (r3.kv_plan, r3.kv_source) == ("pull", "sent_back")

    asyncio.run(run())


def test_a_restart_rebuilds_the_same_books_from_ledgers_sent_in_small_pages() -> None:
    c = Cluster()

    async def run() -> None:
        await two_sessions(c)
        before = c.bytes_held()

        def books(service: KVService) -> dict[str, Any]:
            return {
                s: (r.engine_id, r.block_ids, r.num_tokens, r.prefix_hash)
                for s in ("s1", "s2")
                if (r := service.decider.lifecycle.record(s)) is not None
            }

        records = books(c.service)
        assert set(records) == {"s1", "s2"}
        svc = c.new_service()
        decode_report, prefill_report = c.reports()
        pages = [*decode_report.pages(600), *prefill_report.pages(600)]
        # Each kept request's tokens go in a page of their own: no call carries it all.
        assert len(pages) >= 4 and all(len(msgspec.msgpack.encode(p)) < 1500 for p in pages)
        for page in pages:
            await svc.restore(page)
        await svc.wait_drains()
        assert c.bytes_held() == before
        assert books(svc) == records
        assert svc.counters["restores"] == 2

    asyncio.run(run())


def test_a_session_that_moved_on_during_the_restart_keeps_its_new_record() -> None:
    c = Cluster()

    async def run() -> None:
        await two_sessions(c)
        old = c.service.decider.lifecycle.record("s2")
        assert old is not None
        svc = c.new_service()
        # s2 comes back before any engine reported: the service recomputes...
        r = await c.turn([*range(200, 300), 11, 12, 13, 70], "s2")
        assert (r.kv_plan, r.kv_plan_reason) == ("recompute", "no_record")
        new = svc.decider.lifecycle.record("s2")
        assert new is not None and new.block_ids != old.block_ids
        for report in c.reports():
            await svc.restore(report)
        await svc.wait_drains()
        # ...and the old blocks, reported later, are drained instead of booked.
        assert svc.decider.lifecycle.record("s2") == new
        assert svc.counters["adopt_superseded"] == 1
        drained = [
            q.kv_transfer_params.remote_block_ids
            for q in c.prefill.pool.requests
            if q.request_id.startswith("drain-") and q.kv_transfer_params
        ]
        assert (old.block_ids,) in drained

    asyncio.run(run())


def test_without_every_prefill_report_the_service_adopts_after_the_wait() -> None:
    c = Cluster()

    async def run() -> None:
        await c.turn(S1_T1, "s1")
        svc = c.new_service()
        await svc.restore(c.decode.ledger.report())
        await svc.tick()
        assert svc.decider.lifecycle.records() == []
        c.clock.now_s += 10.0  # restore_wait_s
        await svc.tick()
        assert svc.decider.lifecycle.record("s1") is not None

    asyncio.run(run())


def test_a_ledger_reported_twice_is_booked_once() -> None:
    c = Cluster()

    async def run() -> None:
        await two_sessions(c)
        before = c.bytes_held()
        svc = c.new_service()
        for _ in range(2):
            for report in c.reports():
                await svc.restore(report)
        assert c.bytes_held() == before

    asyncio.run(run())


def test_records_expire_on_the_engines_clock_not_a_guess() -> None:
    c = Cluster()

    async def run() -> None:
        svc = c.service
        await svc.decide_turn("s", [1, 2, 3])
        params = KVTransferParams(
            do_remote_decode=True,
            remote_engine_id="D",
            remote_request_id="x",
            remote_block_ids=((1,),),
            remote_num_tokens=4,
        )
        # The engine said its blocks live 100 s more (not the configured 480 s).
        await svc.turn_done(
            TurnDone(
                session_id="s",
                token_ids=[1, 2, 3, 4, 5],
                kv_transfer_params=params,
                kv_expires_in_s=100.0,
                next_token_ids=[1, 2, 3, 4, 5],
            )
        )
        info = await svc.session("s")
        assert info.expires_in_s == pytest.approx(100.0, abs=0.01)
        c.clock.now_s += 100.0 - 15.0  # the safety margin before the engine's expiry
        await svc.tick()
        assert (await svc.session("s")).engine_id is None

    asyncio.run(run())


def test_ledgers_forget_blocks_past_their_ttl() -> None:
    c = Cluster()

    async def run() -> None:
        await two_sessions(c)
        assert c.decode.ledger.report().kept and c.prefill.ledger.report().consumed
        c.clock.now_s += TTL_S
        assert c.decode.ledger.report().kept == [] and c.prefill.ledger.report().consumed == []
        assert len(c.decode.ledger) == 0 and len(c.prefill.ledger) == 0

    asyncio.run(run())


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        async def call() -> Any:
            return self.fn(*args)

        return call()


class FakeServiceHandle:
    def __init__(self) -> None:
        self.current_epoch = "a"
        self.reports: list[LedgerReport] = []
        self.epoch = _Method(lambda: self.current_epoch)
        self.restore = _Method(self.reports.append)


def test_engine_hosts_report_once_per_service_epoch() -> None:
    handle = FakeServiceHandle()
    report = LedgerReport(engine_id="decode-0", role="decode")
    watcher = EpochWatcher(lambda: handle, lambda: report)  # type: ignore[arg-type,return-value]

    async def run() -> list[bool]:
        sent = [await watcher.check_once(), await watcher.check_once()]
        handle.current_epoch = "b"  # the service restarted
        sent.append(await watcher.check_once())
        return sent

    assert asyncio.run(run()) == [True, False, True]
    assert handle.reports == [report, report]


def test_sessions_on_a_lost_engine_recompute_at_once_instead_of_pulling() -> None:
    c = Cluster()

    async def run() -> None:
        assert (await c.turn(S1_T1, "s1")).kv_plan == "recompute"
        beat = await c.service.heartbeat("D", node_ids=["node-6", "node-7"])
        assert beat.epoch == c.service.epoch
        assert c.service.decider.lifecycle.record("s1") is not None
        # Ray reports node-7 dead: a rank of the decode engine was there, so the engine
        # and the KV it kept are gone.
        assert c.service.nodes_lost(["node-3"]) == []
        assert c.service.nodes_lost(["node-7"]) == ["D"]
        assert c.service.decider.lifecycle.record("s1") is None
        assert c.bytes_held().get("D", 0) == 0
        report = await c.turn(S1_T2, "s1")
        assert report.kv_plan == "recompute" and report.kv_source != "sent_back"
        stats = (await c.service.stats())["service"]
        assert stats["engines_lost"] == 1 and stats["sessions_lost"] == 1
        assert stats["engines_live"] == 0
        assert c.service.counters["drains"] == 0  # nothing is left on D to read

    asyncio.run(run())


def test_an_engine_silent_past_the_bound_is_lost_one_that_beats_is_not() -> None:
    c = Cluster()
    c.service.engine_silence_s = 60.0

    async def run() -> None:
        await c.turn(S1_T1, "s1")
        await c.service.heartbeat("D")
        c.clock.now_s += 59.0
        await c.service.tick()
        assert c.service.decider.lifecycle.record("s1") is not None
        await c.service.heartbeat("D")  # still beating
        c.clock.now_s += 59.0
        await c.service.tick()
        assert c.service.decider.lifecycle.record("s1") is not None
        c.clock.now_s += 2.0  # 61 s since its last beat: its host is gone
        await c.service.tick()
        assert c.service.decider.lifecycle.record("s1") is None
        assert c.service.counters["engines_lost"] == 1

    asyncio.run(run())


def test_an_engine_host_heartbeat_carries_its_engine_and_node() -> None:
    handle = FakeServiceHandle()
    beats: list[tuple[str, list[str]]] = []

    def beat(engine_id: str, node_ids: list[str], stats: Any = None) -> Beat:
        beats.append((engine_id, node_ids))
        return Beat(epoch=handle.current_epoch)

    handle.heartbeat = _Method(beat)  # type: ignore[attr-defined]
    report = LedgerReport(engine_id="decode-0", role="decode")
    watcher = EpochWatcher(
        lambda: handle,  # type: ignore[arg-type,return-value]
        lambda: report,
        engine_id="decode-0",
        node_ids=["n1", "n2"],
    )

    async def run() -> list[bool]:
        return [await watcher.check_once(), await watcher.check_once()]

    assert asyncio.run(run()) == [True, False]
    assert beats == [("decode-0", ["n1", "n2"])] * 2
    assert handle.reports == [report]


def test_a_decode_engine_full_of_kept_blocks_gets_room_from_its_idle_sessions() -> None:
    c = Cluster()
    c.new_service(room_kv_cache_usage=0.95)

    async def run() -> None:
        await c.turn(S1_T1, "s1")
        record = c.service.decider.lifecycle.record("s1")
        assert record is not None
        full = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.99}
        # The decode engine reports its KV cache full with nothing running: the idle
        # session's record is evicted and drained back to the prefill engine.
        await c.service.heartbeat(record.engine_id, stats={**full, "kv_cache_usage": 0.5})
        await c.service.tick()
        assert c.service.decider.lifecycle.record("s1") is not None  # room to spare
        await c.service.heartbeat(record.engine_id, stats=full)
        await c.service.tick()
        await c.service.wait_drains()
        assert c.service.decider.lifecycle.record("s1") is None
        assert c.service.counters["drains"] == 1
        # The prefill engine's host tells the service what it read; the decode's host
        # hears it with its next beat (for engines that cannot see their peers' reads).
        assert await c.service.peer_reads(record.engine_id, []) == []
        reads = c.prefill.ledger.take_reads()
        assert reads == [(record.engine_id, str(record.transfer_params.remote_request_id))]
        assert c.prefill.ledger.take_reads() == []  # each read is passed on once
        assert await c.service.peer_reads("prefill", reads) == []
        assert await c.service.peer_reads(record.engine_id, []) == [reads[0][1]]
        assert await c.service.peer_reads(record.engine_id, []) == []

    asyncio.run(run())
