"""A decode engine stopped by a scale-in: the KV service moves its idle sessions' KV to
the host tier first (``KVService.retire_engine``, which the engine host calls before
it stops its engine), so their next turns pull it back instead of recomputing; a
session whose KV the tier did not take recomputes with reason ``scaled_in``. An engine
stopped by a redeploy or a removal (``replaced``) moves its sessions' KV the same way,
and a session the tier did not take recomputes with reason ``replaced``.

The engines are test_kv_service.py's fake pools, the tier test_host_tier.py's fake."""

from __future__ import annotations

import asyncio

import pytest
from test_host_tier import FakeHostTier, prompt
from test_kv_service import Cluster
from test_turn_leases import first_turn_leased, leasing_router

from orchestrator.kv.ownership import Principal
from policies.kv_lifecycle import HOST_POOL


def test_a_scaled_in_engines_sessions_come_back_from_the_host_tier() -> None:
    c = Cluster()
    host = FakeHostTier()
    svc = c.new_service(host=host)

    async def run() -> None:
        await c.turn(prompt(0), "a")
        await c.turn(prompt(1_000), "b")
        kept = svc.decider.lifecycle.record("a")
        assert kept is not None and kept.pool_id == "decode"
        moved = await svc.retire_engine(kept.engine_id)
        # Both sessions' KV went to the tier before the call answered.
        assert moved == {"num_sessions": 2, "num_to_host": 2}
        for sid in ("a", "b"):
            record = svc.decider.lifecycle.record(sid)
            assert record is not None and record.pool_id == HOST_POOL
        report = await c.turn([*prompt(0), 11, 12, 13, 60, 61], "a")
        assert (report.kv_plan, report.kv_source) == ("pull", "host_tier")

    asyncio.run(run())


def test_a_session_the_tier_did_not_take_recomputes_with_reason_scaled_in() -> None:
    c = Cluster()
    svc = c.new_service(host=FakeHostTier(fail=True))

    async def run() -> None:
        await c.turn(prompt(0), "a")
        kept = svc.decider.lifecycle.record("a")
        assert kept is not None
        assert await svc.retire_engine(kept.engine_id) == {"num_sessions": 1, "num_to_host": 0}
        assert svc.decider.lifecycle.record("a") is None
        report = await c.turn([*prompt(0), 11, 12, 13, 60, 61], "a")
        assert (report.kv_plan, report.kv_plan_reason) == ("recompute", "scaled_in")

    asyncio.run(run())


@pytest.mark.parametrize("with_tier", [True, False])
def test_a_replaced_engines_sessions_move_to_the_tier_or_recompute_with_reason_replaced(
    with_tier: bool,
) -> None:
    c = Cluster()
    svc = c.new_service(host=FakeHostTier() if with_tier else None)

    async def run() -> None:
        await c.turn(prompt(0), "a")
        kept = svc.decider.lifecycle.record("a")
        assert kept is not None and kept.pool_id == "decode"
        moved = await svc.retire_engine(kept.engine_id, "replaced")
        assert moved == {"num_sessions": 1, "num_to_host": int(with_tier)}
        # The record no longer names the stopped engine: the tier's copy, or none (its
        # blocks drained back to prefill).
        record = svc.decider.lifecycle.record("a")
        assert (record and record.pool_id) == (HOST_POOL if with_tier else None)
        report = await c.turn([*prompt(0), 11, 12, 13, 60, 61], "a")
        if with_tier:
            assert (report.kv_plan, report.kv_source) == ("pull", "host_tier")
        else:
            assert (report.kv_plan, report.kv_plan_reason) == ("recompute", "replaced")

    asyncio.run(run())


def test_retiring_an_engine_with_no_sessions_moves_nothing() -> None:
    c = Cluster()
    svc = c.new_service(host=FakeHostTier())

    async def run() -> None:
        assert await svc.retire_engine("decode-nobody") == {"num_sessions": 0, "num_to_host": 0}

    asyncio.run(run())


def test_a_session_held_for_an_ingress_moves_too_and_its_lease_is_taken_back() -> None:
    c = Cluster()
    c.new_service(host=FakeHostTier())
    c.service.leases.lasts_s = 30.0
    router, _ = leasing_router(c)
    svc = c.service

    async def run() -> None:
        # The first turn leaves the session's next turn held for replica-a.
        await first_turn_leased(svc, router, "s9", Principal(name="alice"))
        [grant] = svc.leases.grants.values()
        assert grant.record is not None
        moved = await svc.retire_engine(grant.record.engine_id)
        assert moved == {"num_sessions": 1, "num_to_host": 1}
        record = svc.decider.lifecycle.record("s9")
        assert record is not None and record.pool_id == HOST_POOL
        # replica-a is told its lease is gone: its next turn asks the service again.
        revoked, _ = await svc.leases.watch("replica-a", 0.0)
        assert revoked == [grant.lease_id]

    asyncio.run(run())
