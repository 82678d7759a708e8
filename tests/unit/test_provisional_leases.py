"""Provisional turn leases: a session's next turn on the replica that ran its last one
starts without waiting for the last turn's hand-over to the service. The hand-over
proposes the next lease's id and the replica holds that lease at once from its own copy
of the kept record; the turn pulls under it and its first token waits for the
service's confirmation. The service holds the record from the hand-over's booking, so
no drain or eviction frees the blocks the provisional pull reads. The real service and
router with scripted engines (``test_kv_service.Cluster``), no Ray."""

from __future__ import annotations

import asyncio
from typing import Any

from service_fakes import HeldHandOver
from test_kv_service import S1_T1, S1_T2, Cluster

from engines.base import GenerateChunk
from orchestrator.kv.messages import TurnDone
from orchestrator.kv.ownership import Principal
from orchestrator.kv.service import KVServiceAPI
from orchestrator.kv.session_tokens import prefix_digest
from orchestrator.router import LeaseUse, Router, Turn, TurnReport
from orchestrator.router.held_leases import HeldLeases

ALICE = Principal(name="alice")
BOUND_S = 30.0  # a story that waits for what never comes fails here


def cluster(idle_budget_bytes: int | None = None) -> tuple[Cluster, HeldHandOver, Router]:
    """A service granting 30 s leases and a router whose replica proposes them."""
    c = Cluster()
    c.new_service(idle_budget_bytes=idle_budget_bytes)
    svc = c.fake(HeldHandOver)
    svc.service.leases.lasts_s = 30.0
    leases = HeldLeases(
        "replica-a", clock=c.clock, lifecycle=svc.service.decider.lifecycle.config, lasts_s=30.0
    )
    router = c.router(clock=c.clock, leases=leases)
    router.session_tokens = None
    return c, svc, router


async def first_turn(svc: HeldHandOver, router: Router) -> TurnDone:
    """Alice's first turn of s1, run to its last token; its hand-over arrived at the
    service, which has not booked it."""
    assert router.leases is not None
    router.leases.new_epoch((await svc.lease_watch("replica-a", [], 0.0)).epoch)
    claim = await svc.begin_turn("s1", ALICE, S1_T1, None, 0, "replica-a")
    assert claim.outcome == "claimed"
    async for _ in router.run_turn(
        Turn(
            prompt_token_ids=S1_T1,
            max_tokens=3,
            session_id="s1",
            owner="alice",
            request_id="r-1",
            decision=claim.decision,
        )
    ):
        pass
    while not svc.arrived:
        await asyncio.sleep(0)
    return svc.arrived[-1]


def second_turn(
    svc: KVServiceAPI, router: Router, done: TurnDone
) -> tuple[asyncio.Task[list[tuple[GenerateChunk, TurnReport]]], asyncio.Future[bool]]:
    """Alice's next turn under the replica's provisional lease: its stream (a task) and
    its use reported to the service."""
    leases = router.leases
    assert leases is not None
    nxt = done.next_token_ids or done.token_ids[: done.next_len]
    lease = leases.take("s1", ALICE, prefix_digest(nxt))
    assert lease is not None and leases.provisional(lease)
    assert lease.lease_id == done.next_lease_id
    decision = leases.decide(lease, S1_T2)
    assert decision.kind == "pull"
    used = asyncio.ensure_future(svc.lease_used("s1", lease.lease_id, None, True))

    async def run() -> list[tuple[GenerateChunk, TurnReport]]:
        return [
            item
            async for item in router.run_turn(
                Turn(
                    prompt_token_ids=S1_T2,
                    max_tokens=3,
                    session_id="s1",
                    owner="alice",
                    request_id="r-2",
                    decision=decision,
                    lease=LeaseUse(lease_id=lease.lease_id, used=used),
                )
            )
        ]

    return asyncio.ensure_future(run()), used


async def settle(n: int = 50) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_the_next_turn_pulls_before_the_hand_over_is_booked_and_is_confirmed_after() -> None:
    c, svc, router = cluster()

    async def story() -> None:
        done = await first_turn(svc, router)
        kept = done.kv_transfer_params
        assert kept is not None and kept.kept_blocks() is not None
        pulls = svc.service.decider.lifecycle.stats().num_pulls
        turn, used = second_turn(svc, router, done)
        await settle()
        # The prefill already pulls the kept blocks back, the hand-over not booked...
        pulled = c.prefill.pool.requests[-1].kv_transfer_params
        assert pulled is not None and pulled.remote_block_ids == kept.remote_block_ids
        # ...and the turn's first item waits for the service's confirmation.
        assert not turn.done() and not used.done()
        svc.release.set()
        items = await turn
        assert await used is True
        assert items[-1][1].kv_source == "sent_back"
        assert svc.service.decider.lifecycle.stats().num_pulls == pulls + 1
        await router.settled()

    asyncio.run(asyncio.wait_for(story(), BOUND_S))


def test_the_booked_record_is_held_from_its_booking_while_a_provisional_pull_reads_it() -> None:
    c, svc, router = cluster()

    async def story() -> None:
        done = await first_turn(svc, router)
        kept = done.kv_transfer_params
        assert kept is not None
        c.prefill.pool.hang_pulls = True  # the provisional pull is still reading...
        turn, used = second_turn(svc, router, done)
        await settle()
        svc.release.set()  # ...when the hand-over is booked (held, not idle)...
        assert await used is True
        # ...and the session is closed during the pull: nothing else reads the blocks
        # (no drain frees them under the pull; the pull's read resolves the record).
        await svc.close("s1")
        await svc.service.wait_drains()
        readers = [
            r
            for r in c.prefill.pool.requests
            if r.kv_transfer_params is not None
            and r.kv_transfer_params.remote_block_ids == kept.remote_block_ids
        ]
        assert [r.request_id for r in readers] == [c.prefill.pool.requests[-1].request_id]
        turn.cancel()

    asyncio.run(asyncio.wait_for(story(), BOUND_S))


def test_no_lease_is_proposed_under_an_idle_budget() -> None:
    # A record booked over the budget is evicted at once: nothing may pull it before
    # the service answers, so the replica proposes nothing and waits for the hand-over.
    _, svc, router = cluster(idle_budget_bytes=1)

    async def story() -> int | None:
        done = await first_turn(svc, router)
        svc.release.set()
        await router.settled()
        return done.next_lease_id

    assert asyncio.run(asyncio.wait_for(story(), BOUND_S)) is None


def test_a_provisional_use_with_no_hand_over_is_refused_and_its_id_never_granted() -> None:
    _, svc, router = cluster()
    svc.service.leases.grace_s = 0.05  # how long a use waits for the hand-over proposing it

    async def story() -> tuple[bool, int | None]:
        assert router.leases is not None
        router.leases.new_epoch((await svc.lease_watch("replica-a", [], 0.0)).epoch)
        claim = await svc.begin_turn("s1", ALICE, S1_T1, None, 0, "replica-a")
        assert claim.outcome == "claimed"
        refused = await svc.lease_used("s1", 12345, None, True)
        # The hand-over proposing that id comes after the refusal: not granted with it.
        svc.release.set()
        answer = await svc.turn_done(
            TurnDone(
                session_id="s1",
                token_ids=S1_T1,
                next_token_ids=S1_T1,
                holder="replica-a",
                next_lease_id=12345,
            )
        )
        return refused, None if answer.lease is None else answer.lease.lease_id

    refused, granted = asyncio.run(asyncio.wait_for(story(), BOUND_S))
    assert refused is False and granted != 12345


def test_a_provisional_lease_plans_recompute_from_an_engine_whose_reuse_is_off() -> None:
    _, svc, router = cluster()
    leases = router.leases
    assert leases is not None

    async def story() -> str | None:
        # The service's watch said an integrity check turned reuse from decode "D" off.
        leases.reuse_off = frozenset({"D"})
        done = await first_turn(svc, router)
        assert done.kv_transfer_params is not None
        assert done.kv_transfer_params.remote_engine_id == "D"
        nxt = done.next_token_ids or done.token_ids[: done.next_len]
        lease = leases.take("s1", ALICE, prefix_digest(nxt))
        assert lease is not None and leases.provisional(lease)
        decision = leases.decide(lease, S1_T2)
        assert decision.kind == "recompute"
        svc.release.set()
        return decision.reason

    assert asyncio.run(asyncio.wait_for(story(), BOUND_S)) == "integrity_check_failed"


def _readers_of(c: Cluster, kept: Any) -> list[str]:
    """The prefill requests that read the blocks ``kept`` names (pulls and drains)."""
    return [
        r.request_id
        for r in c.prefill.pool.requests
        if r.kv_transfer_params is not None
        and r.kv_transfer_params.remote_block_ids == kept.remote_block_ids
    ]


def test_a_session_closed_before_its_last_turns_hand_over_keeps_nothing() -> None:
    # The client closes as the last token lands, and the close reaches the service
    # before the turn's hand-over: the hand-over frees the turn's KV (one drain) instead
    # of starting the closed session anew with it kept until its TTL. (Under an idle
    # budget nothing is proposed: the hand-over carries no next lease.)
    c, svc, router = cluster(idle_budget_bytes=2**30)

    async def story() -> None:
        done = await first_turn(svc, router)
        assert done.next_lease_id is None
        await svc.close("s1")
        svc.release.set()
        await router.settled()
        await svc.service.wait_drains()
        assert svc.service.decider.lifecycle.record("s1") is None
        assert (await svc.session("s1")).known is False
        assert len(_readers_of(c, done.kv_transfer_params)) == 1  # drained, once
        assert svc.service.decider.lifecycle.stats().num_records == 0

    asyncio.run(asyncio.wait_for(story(), BOUND_S))


def test_a_session_closed_before_a_hand_over_proposing_a_lease_is_closed_once_it_is_back() -> None:
    # With a next lease proposed, its lessee may already pull the record under it: the
    # hand-over books it held and grants the lease, and the close runs again, which
    # revokes the lease and, once the lessee gives it back unused, drains the record.
    c, svc, router = cluster()

    async def story() -> None:
        done = await first_turn(svc, router)
        assert done.next_lease_id is not None
        await svc.close("s1")
        svc.release.set()
        await router.settled()
        await settle()
        # Held for the proposed lease: no drain reads the blocks while it may be used.
        assert svc.service.decider.lifecycle.held("s1")
        assert _readers_of(c, done.kv_transfer_params) == []
        # The lessee gives the revoked lease back unused (its next watch call).
        assert router.leases is not None
        await svc.lease_watch("replica-a", [done.next_lease_id], 0.0)
        for _ in range(20):
            await settle()
            await svc.service.wait_drains()
        assert svc.service.decider.lifecycle.record("s1") is None
        assert (await svc.session("s1")).known is False
        assert len(_readers_of(c, done.kv_transfer_params)) == 1

    asyncio.run(asyncio.wait_for(story(), BOUND_S))
