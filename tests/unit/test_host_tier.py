"""The KV service with a host-memory tier: a session evicted under the idle budget is
copied to the tier, not drained, and its next turn pulls it from there.

The engines are test_kv_service.py's fake pools; the tier is a fake too (the real
store needs NIXL and vLLM engines: ``tests/engine/test_host_store_nixl.py``): it answers a
take-in with params naming its own blocks, or fails, and records what it was asked.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from test_kv_service import Cluster

from engines.base import GenerateRequest
from engines.kv_params import KVTransferParams
from orchestrator.kv.decider import params_of
from orchestrator.kv.drains import HostCopy
from orchestrator.kv.durable import MemoryStore
from orchestrator.kv.host_reads import HOST_READ_PREFIX, HostReads, restore_host_reads
from orchestrator.kv.turn_leases import LeaseBook
from policies.kv_lifecycle import HOST_POOL

RECORD_BYTES = 7 * 16 * 100  # a 100-token prompt and 3 tokens: 7 blocks of 16, 100 B a token


class FakeHostTier:
    """Stands in for ``orchestrator.kv.host_tier.HostTierClient``."""

    def __init__(self, *, fail: bool = False) -> None:
        self.fail = fail
        self.taken: list[KVTransferParams] = []
        self.released: list[str | None] = []
        self.held: dict[str | None, tuple[HostCopy, dict[str, Any]]] = {}

    async def take_in(
        self, params: KVTransferParams, tag: dict[str, Any] | None = None
    ) -> HostCopy | None:
        self.taken.append(params)
        if self.fail:
            return None
        copy = msgspec.structs.replace(
            params,
            remote_engine_id="host-0",
            remote_request_id=f"host-{len(self.taken)}",
            remote_block_ids=((90 + len(self.taken),),),
        )
        self.held[copy.remote_request_id] = (HostCopy(params=copy, expires_in_s=900.0), tag or {})
        return self.held[copy.remote_request_id][0]

    async def release(self, params: KVTransferParams) -> None:
        self.released.append(params.remote_request_id)
        self.held.pop(params.remote_request_id, None)

    async def entries(self) -> list[tuple[HostCopy, dict[str, Any]]]:
        return list(self.held.values())

    async def stats(self) -> dict[str, Any]:
        return {"num_entries": len(self.held)}


def prompt(first: int) -> list[int]:
    return list(range(first, first + 100))


def test_an_evicted_session_comes_back_from_the_host_tier_without_recompute() -> None:
    c = Cluster()
    host = FakeHostTier()
    svc = c.new_service(idle_budget_bytes=RECORD_BYTES, host=host)
    prefill_requests: list[GenerateRequest] = []
    generate = c.prefill.generate

    def recorded(req: GenerateRequest):  # type: ignore[no-untyped-def]
        prefill_requests.append(req)
        return generate(req)

    c.prefill.generate = recorded  # type: ignore[method-assign]

    async def run() -> None:
        await c.turn(prompt(0), "a")
        a_kept = svc.decider.lifecycle.record("a")
        assert a_kept is not None and a_kept.pool_id == "decode"
        await c.turn(prompt(1_000), "b")  # one record fits the decode's budget: a goes
        await svc.wait_drains()
        # a's blocks went to the host tier (whose read frees them on the decode), not
        # back into a prefill engine.
        assert [p.remote_request_id for p in host.taken] == [
            a_kept.transfer_params.remote_request_id  # type: ignore[attr-defined]
        ]
        assert not [r for r in prefill_requests if r.request_id.startswith("drain-")]
        on_host = svc.decider.lifecycle.record("a")
        assert on_host is not None and on_host.pool_id == HOST_POOL
        assert (on_host.engine_id, on_host.block_ids) == ("host-0", (91,))
        assert (on_host.num_tokens, on_host.prefix_hash) == (a_kept.num_tokens, a_kept.prefix_hash)
        stats = svc.drains.stats()
        assert stats["num_host_take_ins"] == 1 and stats["num_drains"] == 0
        # a's next turn pulls its KV from the tier, with the tier's params.
        report = await c.turn([*prompt(0), 11, 12, 13, 60, 61], "a")
        assert (report.kv_plan, report.kv_source) == ("pull", "host_tier")
        pulled = prefill_requests[-1].kv_transfer_params
        assert pulled is not None and pulled.read_target() == ("host-0", "host-1")
        # Read by that pull, the copy is the store's to free: nothing released by hand.
        assert host.released == []

    asyncio.run(run())


def test_a_read_mark_that_never_lands_fails_the_take_in_by_its_deadline() -> None:
    # The mark goes to Ray's GCS before the store reads; a write that hangs must not
    # hang the eviction: past the deadline the blocks are drained as without a tier.
    c = Cluster()
    host = FakeHostTier()
    svc = c.new_service(idle_budget_bytes=RECORD_BYTES, host=host)
    svc.drains.timeout_s = 0.2

    async def never(engine_id: str, request_id: str) -> None:
        await asyncio.Event().wait()

    svc.drains.mark_read = never

    async def run() -> None:
        await c.turn(prompt(0), "a")
        await c.turn(prompt(1_000), "b")
        await asyncio.wait_for(svc.wait_drains(), 10)
        stats = svc.drains.stats()
        assert stats["num_host_take_in_failures"] == 1 and stats["num_drains"] == 1
        assert host.taken == []  # nothing read without its mark

    asyncio.run(run())


def test_a_failed_take_in_drains_the_blocks_as_before() -> None:
    c = Cluster()
    host = FakeHostTier(fail=True)
    svc = c.new_service(idle_budget_bytes=RECORD_BYTES, host=host)

    async def run() -> None:
        await c.turn(prompt(0), "a")
        await c.turn(prompt(1_000), "b")
        await svc.wait_drains()
        stats = svc.drains.stats()
        assert len(host.taken) == 1
        assert stats["num_host_take_in_failures"] == 1 and stats["num_drains"] == 1
        assert svc.decider.lifecycle.record("a") is None
        report = await c.turn([*prompt(0), 11, 12, 13, 60, 61], "a")
        assert (report.kv_plan, report.kv_plan_reason) == ("recompute", "evicted")

    asyncio.run(run())


@pytest.mark.parametrize("fail", [False, True])
def test_a_session_outliving_its_decode_ttl_keeps_its_kv_in_the_host_tier(fail: bool) -> None:
    # An agent's SDK session heartbeats through a tool call longer than the decode's TTL:
    # at the record's offer deadline the tier copies the blocks, and the turn after the
    # call pulls them from there. A failed copy leaves the blocks to their TTL (no drain:
    # they are not drainable this close to it) and the turn recomputes.
    c = Cluster()
    host = FakeHostTier(fail=fail)
    svc = c.new_service(host=host)

    async def run() -> None:
        await c.turn(prompt(0), "a")
        kept = svc.decider.lifecycle.record("a")
        assert kept is not None and kept.pool_id == "decode"
        c.clock.now_s += 300.0
        await svc.renew("a")
        c.clock.now_s = kept.expiry_s - 15.0  # the offer deadline: 15 s of blocks left
        await svc.tick()
        await svc.wait_drains()
        assert [p.remote_request_id for p in host.taken] == [
            kept.transfer_params.remote_request_id  # type: ignore[attr-defined]
        ]
        stats = svc.drains.stats()
        assert (stats["num_host_take_ins"], stats["num_drains"]) == (int(not fail), 0)
        c.clock.now_s += 120.0  # the tool call returns, past the decode's TTL
        await svc.renew("a")
        report = await c.turn([*prompt(0), 11, 12, 13, 60, 61], "a")
        if fail:
            assert (report.kv_plan, report.kv_plan_reason) == ("recompute", "expired")
        else:
            assert (report.kv_plan, report.kv_source) == ("pull", "host_tier")

    asyncio.run(run())


@pytest.mark.parametrize("then", ["closed", "superseded"])
def test_a_host_copy_nobody_will_pull_is_released_in_the_store(then: str) -> None:
    c = Cluster()
    host = FakeHostTier()
    svc = c.new_service(idle_budget_bytes=RECORD_BYTES, host=host)

    async def run() -> None:
        await c.turn(prompt(0), "a")
        await c.turn(prompt(1_000), "b")
        await svc.wait_drains()
        assert svc.decider.lifecycle.record("a") is not None
        if then == "closed":
            await svc.close("a")
        else:  # a new history under the same session: the copy covers none of it
            await c.turn(prompt(5_000), "a")
        await svc.wait_drains()
        assert host.released == ["host-1"]

    asyncio.run(run())


def test_a_restarted_service_books_the_host_copies_again_not_the_blocks_they_came_from() -> None:
    # The store's read freed a's blocks on the decode, but the decode host's ledger
    # still lists them as kept: adopted, a's next turn would pull freed blocks. The
    # store outlives the service and still holds a's copy: that is a's record again.
    c = Cluster()
    store = MemoryStore()
    tier = FakeHostTier()
    svc = c.new_service(idle_budget_bytes=RECORD_BYTES, host=tier, store=store)

    async def run() -> None:
        await c.turn(prompt(0), "a")
        a_kept = svc.decider.lifecycle.record("a")
        assert a_kept is not None
        await c.turn(prompt(1_000), "b")
        await svc.wait_drains()
        assert [k for k in store.keys(HOST_READ_PREFIX)] == [
            f"{HOST_READ_PREFIX}{a_kept.engine_id}/{params_of(a_kept).remote_request_id}"
        ]
        restarted = c.new_service(idle_budget_bytes=RECORD_BYTES, store=store, host=tier)
        for report in c.reports():
            await restarted.restore(report)
        await restarted.wait_drains()
        b = restarted.decider.lifecycle.record("b")
        assert b is not None and b.pool_id == "decode"  # the decode still holds b's
        assert restarted.adoption.counters["adopt_skipped_consumed"] >= 1
        assert restarted.decider.lifecycle.record("a") is None  # not from the decode
        c.clock.now_s += 10.0  # the engines' ledgers had their wait
        await restarted.tick()
        a = restarted.decider.lifecycle.record("a")
        assert a is not None and (a.pool_id, a.engine_id) == (HOST_POOL, "host-0")
        assert (a.num_tokens, a.prefix_hash) == (a_kept.num_tokens, a_kept.prefix_hash)
        report = await c.turn([*prompt(0), 11, 12, 13, 60, 61], "a")
        assert (report.kv_plan, report.kv_source) == ("pull", "host_tier")

    asyncio.run(run())


def test_a_host_copy_of_a_session_with_a_record_again_is_released_at_restart() -> None:
    c = Cluster()
    tier = FakeHostTier()
    svc = c.new_service(idle_budget_bytes=RECORD_BYTES, host=tier)

    async def run() -> None:
        await c.turn(prompt(0), "a")
        await c.turn(prompt(1_000), "b")  # a to the tier
        await svc.wait_drains()
        [copy_id] = tier.held
        # The service dies before a's next turn's record supersedes the copy, and the
        # decode's ledger reports that newer record to the restarted one.
        restarted = c.new_service(idle_budget_bytes=10 * RECORD_BYTES, host=tier)
        await c.turn(prompt(5_000), "a")
        c.clock.now_s += 10.0
        await restarted.tick()
        await restarted.wait_drains()
        kept = restarted.decider.lifecycle.record("a")
        assert kept is not None and kept.pool_id == "decode"
        assert tier.released == [copy_id]

    asyncio.run(run())


def test_host_read_marks_past_their_time_are_deleted() -> None:
    store = MemoryStore()
    now = [1_000.0]
    reads = HostReads(store, ttl_s=60.0, wall_clock=lambda: now[0])
    asyncio.run(reads.mark("decode-0", "r-1-d"))
    assert restore_host_reads(store, wall=now[0]) == {("decode-0", "r-1-d")}
    now[0] += 60.0
    reads.expire()
    assert store.keys(HOST_READ_PREFIX) == []
    asyncio.run(reads.mark("decode-0", "r-2-d"))
    # A restarted service a minute later: the blocks would have expired anyway.
    assert restore_host_reads(store, wall=now[0] + 61.0) == set()
    assert store.keys(HOST_READ_PREFIX) == []


def test_a_lease_planned_without_the_copy_is_revoked_when_the_copy_is_booked() -> None:
    # The replica holding the session's next turn planned it without a record; once the
    # tier's copy is booked it is asked to give the lease back, so the turn asks the
    # service and finds the copy.
    async def run() -> None:
        book = LeaseBook(lasts_s=30.0, grace_s=5.0, clock=lambda: 0.0)
        await book.watch("replica-1", 0.0)  # the replica's watch is running
        grant = book.grant("a", "replica-1", None, 0.0)
        book.revoke_session("b")  # another session: nothing asked
        assert await book.watch("replica-1", 0.0) == ([], [])
        book.revoke_session("a")
        assert await book.watch("replica-1", 0.0) == ([grant.lease_id], [])

    asyncio.run(run())


def test_each_take_in_goes_to_the_store_on_its_decode_engines_node() -> None:
    from orchestrator.kv.host_nodes import NodeStores, store_name
    from orchestrator.kv.host_tier import HostTierClient, HostTierSpec

    spec = HostTierSpec(capacity_bytes=2**20, ttl_s=60.0)
    tiers: dict[str, FakeHostTier] = {}
    started: list[tuple[str, str]] = []

    def start(spec: HostTierSpec, name: str, namespace: str, node: str) -> HostTierClient:
        started.append((name, node))
        tier = tiers[name] = FakeHostTier()
        return tier  # type: ignore[return-value]

    nodes = {"decode-a": "nodeA" + "0" * 51, "decode-b": "nodeB" + "0" * 51}
    home = "head" + "0" * 52
    stores = NodeStores(
        spec, "kvtide-host-app", "kvtide", node_of=nodes.get, home_node=home, start=start, find=dict
    )

    def kept(engine_id: str, request_id: str) -> KVTransferParams:
        return KVTransferParams(
            do_remote_decode=True,
            remote_engine_id=engine_id,
            remote_request_id=request_id,
            remote_block_ids=((1, 2),),
        )

    async def run() -> None:
        # A decode engine keeping session KV gets its node's store before it evicts
        # (the service's tick), and an engine of no known node none.
        stores.prepare("decode-b")
        stores.prepare("decode-unheard-of")
        while stores._preparing:
            await asyncio.sleep(0)
        assert started == [(store_name("kvtide-host-app", nodes["decode-b"]), nodes["decode-b"])]
        started.clear()
        await stores.take_in(kept("decode-a", "r1"))
        await stores.take_in(kept("decode-b", "r2"))
        await stores.take_in(kept("decode-a", "r3"))
        await stores.take_in(kept("decode-unheard-of", "r4"))  # no heartbeat yet: home
        a, b, h = (store_name("kvtide-host-app", n) for n in (*nodes.values(), home))
        assert started == [(a, nodes["decode-a"]), (h, home)]  # b's runs already
        assert [p.remote_request_id for p in tiers[a].taken] == ["r1", "r3"]
        assert [p.remote_request_id for p in tiers[b].taken] == ["r2"]
        # A copy's params name its store (the fake names every copy "host-0": rename).
        copy = kept(b, "host-1")
        await stores.release(copy)
        assert tiers[b].released == ["host-1"] and tiers[a].released == []
        assert len(await stores.entries()) == 3
        stats = await stores.stats()
        assert stats["num_stores"] == 3 and stats["num_entries"] == 3

    asyncio.run(run())


def test_a_restarted_service_finds_every_nodes_store() -> None:
    from orchestrator.kv.host_nodes import NodeStores
    from orchestrator.kv.host_tier import HostTierClient, HostTierSpec

    left = {"kvtide-host-app.aaaa": FakeHostTier(), "kvtide-host-app.bbbb": FakeHostTier()}

    async def run() -> None:
        for i, tier in enumerate(left.values()):
            await tier.take_in(
                KVTransferParams(remote_engine_id="d", remote_request_id=f"r{i}"), {"i": i}
            )

        def start(*_: Any) -> HostTierClient:
            raise AssertionError("nothing to start: no take-in")

        stores = NodeStores(
            HostTierSpec(capacity_bytes=2**20, ttl_s=60.0),
            "kvtide-host-app",
            "kvtide",
            node_of=lambda _: None,
            home_node="head",
            start=start,
            find=lambda: dict(left),  # type: ignore[arg-type]
        )
        assert sorted(tag["i"] for _, tag in await stores.entries()) == [0, 1]

    asyncio.run(run())


@pytest.mark.parametrize("store", ["read in flight", "no answer"])
def test_a_take_in_whose_read_may_still_land_is_not_drained_by_the_service(store: str) -> None:
    # The store's READ of a's blocks outlives its deadline. Drained as well, the blocks
    # would be read back (and freed on the decode) while the READ may still read them,
    # and freed again by its notification: one owner ends the decode's hold, the store.
    from test_host_store import FakeNixlAgent, store_reading_from

    from orchestrator.kv.host_tier import HostStoreActor, HostTierClient

    agent = FakeNixlAgent(plan=["PROC"])
    actor = HostStoreActor.__new__(HostStoreActor)  # its store, without Ray and NIXL
    actor.store = store_reading_from(agent, ["D"], num_blocks=16)
    tier = HostTierClient.in_process(actor, timeout_s=0.05)
    if store == "no answer":  # the store's answer is lost: its READ may run on

        async def never(name: str, *args: Any) -> Any:
            await asyncio.Event().wait()

        tier = HostTierClient(never, timeout_s=0.05, answer_margin_s=0.05)
    c = Cluster()
    svc = c.new_service(idle_budget_bytes=RECORD_BYTES, host=tier)

    async def run() -> None:
        await c.turn(prompt(0), "a")
        a_kept = svc.decider.lifecycle.record("a")
        assert a_kept is not None
        await c.turn(prompt(1_000), "b")  # a goes to the tier, whose READ hangs
        await asyncio.wait_for(svc.wait_drains(), 10)
        stats = svc.drains.stats()
        assert (stats["num_drains"], stats["num_host_reads_pending"]) == (0, 1)
        assert svc.decider.lifecycle.record("a") is None
        if store == "read in flight":  # the READ lands late: its notification, once
            agent.end(0, "DONE")
            actor.store._end_late_reads()
            request_id = params_of(a_kept).remote_request_id
            assert agent.delivered == [("D", f"{request_id}:1".encode())]
            assert actor.store.stats().num_entries == 0  # nobody books a late copy

    asyncio.run(run())
