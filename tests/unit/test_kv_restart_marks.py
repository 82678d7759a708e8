"""What a restarted KV service reads back about owners and running turns never outlives
what it stood for: an expired owner stays expired, a finished turn blocks nothing.

A "restart" is a new ``KVService`` on the same durable store, as Ray restarts the actor
(see test_kv_service_faults.py). Clocks are moved, never slept on.
"""

from __future__ import annotations

import asyncio

import pytest
from test_kv_service import Cluster

from orchestrator.kv.durable import MemoryStore
from orchestrator.kv.marks import read_owner
from orchestrator.kv.messages import TurnDone
from orchestrator.kv.ownership import Principal
from orchestrator.kv.service import KVService

ALICE = Principal(name="alice", max_sessions=1)
BOB = Principal(name="bob")
MALLORY = Principal(name="mallory")


def restarted(c: Cluster, store: MemoryStore) -> KVService:
    return c.new_service(store=store, turn_lease_s=30.0, wall_clock=c.clock)


async def one_turn(service: KVService, session_id: str, principal: Principal) -> None:
    assert (await service.claim_session(session_id, principal)).outcome == "claimed"
    await service.turn_done(TurnDone(session_id=session_id, token_ids=[1, 2], owner=principal.name))


def test_an_owner_that_expires_while_another_key_claims_leaves_no_entry_behind() -> None:
    c, store = Cluster(), MemoryStore()
    service = restarted(c, store)
    ttl = service.owners.idle_ttl_s

    async def run() -> None:
        await one_turn(service, "s1", ALICE)  # alice's one session
        c.clock.now_s += ttl + 1
        # No tick ran: bob's claim is what ends alice's ownership of s1.
        await one_turn(service, "s2", BOB)
        assert service.owners.owner("s1", c.clock()) is None
        assert "owner/s1" not in store.keys("owner/")
        # After a restart alice owns nothing (her quota is free) and s1 is anyone's.
        after = restarted(c, store)
        assert (await after.claim_session("s3", ALICE)).outcome == "claimed"
        assert (await after.claim_session("s1", MALLORY)).outcome == "claimed"

    asyncio.run(run())


def test_a_restart_does_not_resurrect_an_owner_whose_time_ran_out() -> None:
    c, store = Cluster(), MemoryStore()
    service = restarted(c, store)
    ttl = service.owners.idle_ttl_s

    async def run() -> None:
        await one_turn(service, "s1", ALICE)
        # The service dies before its tick expired s1; it comes back after the TTL.
        c.clock.now_s += ttl + 1
        after = restarted(c, store)
        assert after.owners.num_owned("alice") == 0
        assert store.keys("owner/") == []  # dropped, not adopted with a fresh TTL
        assert (await after.claim_session("s1", MALLORY)).outcome == "claimed"

    asyncio.run(run())


def test_an_owner_entry_carries_the_expiry_its_last_use_gave_it() -> None:
    c, store = Cluster(), MemoryStore()
    service = restarted(c, store)
    ttl = service.owners.idle_ttl_s

    async def run() -> None:
        await one_turn(service, "s1", ALICE)
        c.clock.now_s += 0.8 * ttl
        await service.renew("s1", ALICE)  # the SDK's heartbeat: a new expiry, written
        name, expires_s = read_owner(store.get("owner/s1") or b"")
        assert name == "alice" and expires_s == pytest.approx(c.clock() + ttl, abs=0.1)
        c.clock.now_s += 0.5 * ttl  # past the first turn's expiry, not the renewal's
        after = restarted(c, store)
        assert (await after.claim_session("s1", MALLORY)).outcome == "not_found"
        # Adopted with the time it had left, not a fresh TTL.
        c.clock.now_s += 0.5 * ttl + 1
        await after.tick()
        assert (await after.claim_session("s1", MALLORY)).outcome == "claimed"

    asyncio.run(run())


async def leased_then_lost(c: Cluster, store: MemoryStore) -> KVService:
    """s1's turn finishes and the service grants replica-a its next turn; the service
    dies before the grant reaches replica-a. Returns the restarted service."""
    service = restarted(c, store)
    await service.lease_watch("replica-a", [], 0.0)
    c.clock.now_s += 0.1
    assert (await service.claim_session("s1", BOB)).outcome == "claimed"
    done = TurnDone(session_id="s1", token_ids=[1, 2], owner="bob", holder="replica-a")
    answer = await service.turn_done(done)
    assert answer.lease is not None  # granted (and its running mark written) ...
    return restarted(c, store)  # ... but replica-a never saw it


def test_a_lease_its_holder_never_got_does_not_block_the_next_turn_after_a_restart() -> None:
    c, store = Cluster(), MemoryStore()

    async def run() -> None:
        service = await leased_then_lost(c, store)
        # The restarted service keeps the lease's running mark (the holder may hold it)...
        assert (await service.claim_session("s1", BOB)).outcome == "turn_in_progress"
        # ... until the holder's watch says which leases it holds: not that one.
        await service.lease_watch("replica-a", [], 0.0, [])
        assert (await service.claim_session("s1", BOB)).outcome == "claimed"
        assert store.keys("running/") == ["running/s1"]  # the new turn's own mark

    asyncio.run(run())


def test_a_restored_lease_nobody_vouches_for_lapses_as_the_lease_would() -> None:
    c, store = Cluster(), MemoryStore()

    async def run() -> None:
        service = await leased_then_lost(c, store)
        await service.tick()
        assert (await service.claim_session("s1", BOB)).outcome == "turn_in_progress"
        # replica-a died too: no watch comes. The lease lapses lasts_s + grace_s after
        # its grant, not running_grace_s (request_timeout_s) later.
        c.clock.now_s += 30.0 + 5.0
        await service.tick()
        assert (await service.claim_session("s1", BOB)).outcome == "claimed"

    asyncio.run(run())


def test_a_restored_lease_its_holder_vouches_for_runs_until_its_turn_ends() -> None:
    c, store = Cluster(), MemoryStore()

    async def run() -> None:
        service = await leased_then_lost(c, store)
        (lease_id,) = [int(store.get("running/s1").split()[1])]  # type: ignore[union-attr]
        # replica-a holds it (its turn runs under it): the mark outlives the lapse...
        await service.lease_watch("replica-a", [], 0.0, [lease_id])
        c.clock.now_s += 40.0
        await service.tick()
        assert (await service.claim_session("s1", BOB)).outcome == "turn_in_progress"
        # ... and ends with the turn, like any running turn's.
        await service.turn_done(TurnDone(session_id="s1", token_ids=[1, 2, 3], owner="bob"))
        assert (await service.claim_session("s1", BOB)).outcome == "claimed"

    asyncio.run(run())


def test_a_used_lease_mark_is_a_plain_running_mark_after_a_restart() -> None:
    c, store = Cluster(), MemoryStore()

    async def run() -> None:
        service = restarted(c, store)
        await service.lease_watch("replica-a", [], 0.0)
        assert (await service.claim_session("s1", BOB)).outcome == "claimed"
        done = TurnDone(session_id="s1", token_ids=[1, 2], owner="bob", holder="replica-a")
        lease = (await service.turn_done(done)).lease
        assert lease is not None
        assert await service.lease_used("s1", lease.lease_id, "no_record")
        after = restarted(c, store)
        # The holder no longer lists it (the turn is running, its lease consumed): the
        # turn still counts as running until it ends.
        await after.lease_watch("replica-a", [], 0.0, [])
        assert (await after.claim_session("s1", BOB)).outcome == "turn_in_progress"

    asyncio.run(run())


def test_a_restored_lease_its_holder_vouches_for_then_gives_back_frees_the_session() -> None:
    """The holder's first watch after the restart vouches for its unused lease, learns
    of the new instance and gives the lease back with its next call: the session is free
    at once (the mark used to stay, every turn of the session a 409 until the running
    grace ran out)."""
    c, store = Cluster(), MemoryStore()

    async def run() -> None:
        service = await leased_then_lost(c, store)
        (lease_id,) = [int(store.get("running/s1").split()[1])]  # type: ignore[union-attr]
        await service.lease_watch("replica-a", [], 0.0, [lease_id])
        await service.lease_watch("replica-a", [lease_id], 0.0, [])
        assert (await service.claim_session("s1", BOB)).outcome == "claimed"

    asyncio.run(run())


def test_a_refused_use_of_a_vouched_restored_lease_frees_the_session() -> None:
    """The holder vouched for its lease, then its client's turn comes and uses it: the
    restarted service refuses the use (it never granted it) and the turn asks again with
    begin_turn, which finds the session free."""
    c, store = Cluster(), MemoryStore()

    async def run() -> None:
        service = await leased_then_lost(c, store)
        (lease_id,) = [int(store.get("running/s1").split()[1])]  # type: ignore[union-attr]
        await service.lease_watch("replica-a", [], 0.0, [lease_id])
        assert not await service.lease_used("s1", lease_id, None)
        assert (await service.claim_session("s1", BOB)).outcome == "claimed"

    asyncio.run(run())
