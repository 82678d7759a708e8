"""A second turn of a session while its first still generates is refused at once
(``409 turn_in_progress``), not after the service's hand-over wait: on the replica that
runs the first, from its own books; on another, by asking that replica through its lease
watch. A turn whose predecessor has sent its last token still waits for the hand-over
and runs. The hand-over wait is an hour here: a refusal that waited for it would not
come back (each story is bounded so that the test fails instead of hanging)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from typing import Any

from test_kv_service import S1_T1, S1_T2, Cluster
from test_turn_calls import two_ingresses
from test_turn_leases import Chat, leasing, second_turn_hanging

from orchestrator.kv.messages import TurnDone
from orchestrator.kv.ownership import Principal
from orchestrator.kv.service import KVService

HOUR_S = 3600.0
BOUND_S = 30.0  # a story that waits the hand-over wait fails here
ALICE, BOB = Principal(name="alice"), Principal(name="bob")


def test_a_second_turn_on_the_replica_running_the_first_is_refused_without_asking(
    tiny_tokenizer: Any,
) -> None:
    first, _second, log = two_ingresses(tiny_tokenizer)
    first.kv.service.handover_wait_s = HOUR_S
    gate = asyncio.Event()

    async def story() -> None:
        chat, other, slow = await second_turn_hanging(first, "s1", gate)
        log.take()
        reply = await other.turn(first, "Meanwhile?", expect=409)
        assert reply["error"]["code"] == "turn_in_progress"
        assert reply["error"]["param"] == "x-session-id"
        assert "begin_turn" not in log.take()  # refused here, the service not asked
        gate.set()
        await slow
        # The first turn's end frees the session for its next turn.
        await first.router.settled()
        await chat.turn(first, "And now?")

    asyncio.run(asyncio.wait_for(story(), BOUND_S))


def test_a_second_turn_of_a_new_session_is_refused_while_its_first_is_still_opening(
    tiny_tokenizer: Any,
) -> None:
    """The first turn of a new session has no lease: it is claimed by the service's
    ``begin_turn``, whose answer is held here. A second turn of the session sent then is
    refused by this replica, which knows the first is opening; it never reaches the
    service (whose hand-over wait, an hour here, would hold it)."""
    first, _second, log = two_ingresses(tiny_tokenizer)
    first.kv.service.handover_wait_s = HOUR_S
    service_begin = log.service.begin_turn
    answer = asyncio.Event()
    claimed = asyncio.Event()

    async def begin_held(*args: Any) -> Any:
        claim = await service_begin(*args)
        claimed.set()
        await answer.wait()  # the first turn's answer is on its way
        return claim

    log.service.begin_turn = begin_held

    async def story() -> None:
        chat = Chat("new-1")
        opening = asyncio.ensure_future(chat.turn(first, "What is kept?"))
        await claimed.wait()
        log.take()
        reply = await Chat("new-1").turn(first, "Meanwhile?", expect=409)
        assert reply["error"]["code"] == "turn_in_progress"
        assert reply["error"]["param"] == "x-session-id"
        assert log.take() == []  # refused here: no begin_turn waits out the first
        # The service is not told the first generates until it runs (asked by another
        # replica, this one answers for turns the service has handed it).
        assert not first.router.generating("new-1")
        answer.set()
        await opening
        # A refused or failed opening leaves the session free: its next turn runs.
        await first.router.settled()
        await chat.turn(first, "And now?")

    asyncio.run(asyncio.wait_for(story(), BOUND_S))


def test_a_new_sessions_turn_that_fails_to_open_leaves_the_session_free(
    tiny_tokenizer: Any,
) -> None:
    """A turn refused while opening (over its key's prompt limit here, before any
    service call) books nothing: the session's next turn is not refused as busy."""
    first, _second, _log = two_ingresses(tiny_tokenizer)
    first.kv.service.handover_wait_s = HOUR_S

    async def story() -> None:
        chat = Chat("new-2")
        long = "word " * 300  # past the 256-token context: 400
        await chat.turn(first, long, expect=400)
        await chat.turn(first, "Short now?")

    asyncio.run(asyncio.wait_for(story(), BOUND_S))


def test_a_second_turn_on_another_replica_is_refused_once_the_first_says_it_generates(
    tiny_tokenizer: Any,
) -> None:
    first, second, _log = two_ingresses(tiny_tokenizer)
    first.kv.service.handover_wait_s = HOUR_S
    gate = asyncio.Event()

    async def story() -> None:
        async with leasing(first, second):
            _chat, other, slow = await second_turn_hanging(first, "s2", gate)
            reply = await other.turn(second, "Meanwhile?", expect=409)
            assert reply["error"]["code"] == "turn_in_progress"
            gate.set()
            await slow

    asyncio.run(asyncio.wait_for(story(), BOUND_S))


@asynccontextmanager
async def watching(svc: KVService, holder: str, generating: Collection[str]) -> AsyncIterator[None]:
    """``holder``'s lease watch, answering that its turns of ``generating`` generate."""

    async def watch() -> None:
        answers: dict[str, bool] = {}
        while True:
            seen = await svc.lease_watch(holder, [], 2.0, [], answers)
            answers = {sid: sid in generating for sid in seen.asked}

    task = asyncio.ensure_future(watch())
    await asyncio.sleep(0)
    try:
        yield
    finally:
        task.cancel()


def test_the_service_asks_the_running_replica_and_refuses_at_once_while_it_generates() -> None:
    async def story() -> tuple[str, str]:
        svc = Cluster().service
        svc.leases.lasts_s = 30.0
        svc.handover_wait_s = HOUR_S
        async with watching(svc, "replica-a", {"s1"}):
            claim = await svc.begin_turn("s1", ALICE, S1_T1, None, 0, "replica-a")
            assert claim.outcome == "claimed"
            second = await svc.begin_turn("s1", ALICE, S1_T2, None, 0, "replica-b")
            # Another key is told nothing, and not after a wait either.
            other = await svc.begin_turn("s1", BOB, S1_T2, None, 0, "replica-b")
        return second.outcome, other.outcome

    assert asyncio.run(asyncio.wait_for(story(), BOUND_S)) == ("turn_in_progress", "not_found")


def test_a_turn_after_the_last_token_waits_for_the_hand_over_and_runs() -> None:
    async def story() -> tuple[bool, str]:
        svc = Cluster().service
        svc.leases.lasts_s = 30.0
        svc.handover_wait_s = HOUR_S
        # replica-a's turn has sent its last token: it says it is not generating.
        async with watching(svc, "replica-a", set()):
            claim = await svc.begin_turn("s1", ALICE, S1_T1, None, 0, "replica-a")
            assert claim.outcome == "claimed"
            second = asyncio.ensure_future(svc.begin_turn("s1", ALICE, S1_T2, None, 0, "replica-b"))
            for _ in range(50):
                await asyncio.sleep(0)
            waited = not second.done()
            await svc.turn_abandoned("s1")  # its end reaches the service
            return waited, (await second).outcome

    assert asyncio.run(asyncio.wait_for(story(), BOUND_S)) == (True, "claimed")


def test_a_lease_its_lessee_runs_under_is_not_taken_back_by_a_turn_elsewhere() -> None:
    async def story() -> tuple[str, bool]:
        svc = Cluster().service
        svc.leases.lasts_s = 30.0
        svc.handover_wait_s = HOUR_S
        # replica-a holds s1's next turn and has started it (its use not yet sent).
        async with watching(svc, "replica-a", {"s1"}):
            claim = await svc.begin_turn("s1", ALICE, S1_T1, None, 0, "replica-a")
            assert claim.outcome == "claimed"
            done = TurnDone(
                session_id="s1",
                token_ids=S1_T1,
                next_token_ids=S1_T1,
                owner="alice",
                holder="replica-a",
            )
            lease = (await svc.turn_done(done)).lease
            assert lease is not None
            second = await svc.begin_turn("s1", ALICE, S1_T2, None, 0, "replica-b")
            used = await svc.lease_used("s1", lease.lease_id, "no_record")
        return second.outcome, used

    # The turn elsewhere is refused at once; the lessee's use still finds its lease.
    assert asyncio.run(asyncio.wait_for(story(), BOUND_S)) == ("turn_in_progress", True)
