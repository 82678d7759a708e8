"""Turn leases: a session's next turn is held for the ingress replica that ran its last
one, so that it runs there without a service call on its path, while every guarantee of
``begin_turn`` holds: one turn of a session at a time, only its owner's key, a turn on
another replica or a close gets the session back, and a restarted service still knows
the claim. Two ingresses (no Ray) share one in-process service and scripted engines,
each with its lease watch running as in a replica."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from ingress_harness import MODEL, handle
from test_kv_service import S1_T1, S1_T2, Cluster
from test_turn_calls import CallLog, two_ingresses

from orchestrator.kv.durable import MemoryStore
from orchestrator.kv.ownership import Principal
from orchestrator.kv.session_tokens import prefix_digest
from orchestrator.router import LeaseUse, Router, Turn
from orchestrator.router.held_leases import HeldLeases

CHAT = "/v1/chat/completions"
ANYONE = Principal(name="anonymous", is_anonymous=True)


class Chat:
    def __init__(self, session: str) -> None:
        self.session = session
        self.messages: list[dict[str, str]] = []

    async def turn(self, ingress: Any, question: str, expect: int = 200) -> dict[str, Any]:
        self.messages.append({"role": "user", "content": question})
        body = json.dumps({"model": MODEL, "messages": self.messages, "max_tokens": 3})
        status, reply = await handle(ingress, CHAT, body.encode(), x_session_id=self.session)
        assert status == expect, reply
        if status != 200:
            self.messages.pop()
            return dict(reply)
        self.messages.append(reply["choices"][0]["message"])
        return dict(reply["kvtide"])


def turn_calls(log: CallLog) -> list[str]:
    """The calls a turn made, without the lease watches' standing calls."""
    return [c for c in log.take() if c != "lease_watch"]


@asynccontextmanager
async def leasing(*ingresses: Any) -> AsyncIterator[None]:
    """Turn leases on for these ingresses (as ``kv.turn_lease_s`` does), their watches
    running; the watch is in place before the first turn."""
    service = ingresses[0].kv.service
    service.leases.lasts_s = 30.0
    tasks = []
    for n, ingress in enumerate(ingresses):
        leases = HeldLeases(
            f"replica-{n}",
            clock=ingress.router.clock,
            lifecycle=service.decider.lifecycle.config,
            lasts_s=30.0,
        )
        ingress.router.leases = leases
        tasks.append(asyncio.ensure_future(ingress._watch_leases_forever(leases)))
    for _ in range(20):
        await asyncio.sleep(0)
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()


def test_a_turn_on_the_replica_that_ran_the_last_one_asks_the_service_nothing_first(
    tiny_tokenizer: Any,
) -> None:
    first, second, log = two_ingresses(tiny_tokenizer)

    async def story() -> None:
        async with leasing(first, second):
            chat = Chat("s1")
            await chat.turn(first, "What is kept?")
            assert turn_calls(log) == ["begin_turn", "turn_done"]
            # Turn 2 on the same replica: claimed and planned there; the service hears
            # of it off the path (lease_used) and with its hand-over.
            reply = await chat.turn(first, "And after?")
            assert turn_calls(log) == ["lease_used", "turn_done"]
            assert reply["service_s"] == 0.0
            # The plan is the one the service would make (not a prefix mismatch).
            assert reply["kv_plan_reason"] == "cheaper_to_recompute"
            turn1, turn2 = [list(r.prompt_token_ids) for r in first.router.decode.requests]
            assert turn2[: len(turn1) + 3] == [*turn1, 11, 12, 13]
            await chat.turn(first, "And again?")
            assert turn_calls(log) == ["lease_used", "turn_done"]
            assert first.metrics.snapshot()['kvtide_turn_leases_total{outcome="used"}'] == 2

    asyncio.run(story())


def test_a_prompt_sent_as_token_ids_runs_under_the_lease_too(tiny_tokenizer: Any) -> None:
    first, second, log = two_ingresses(tiny_tokenizer)
    service = first.kv.service

    async def complete(prompt: list[int]) -> dict[str, Any]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "return_token_ids": True}
        status, reply = await handle(
            first, "/v1/completions", json.dumps(body).encode(), x_session_id="s11"
        )
        assert status == 200, reply
        return dict(reply)

    async def story() -> None:
        async with leasing(first, second):
            prompt = list(range(100, 140))
            reply = await complete(prompt)
            assert turn_calls(log) == ["begin_turn", "turn_done"]
            # The next turn extends the last one (prompt + answer + new ids), as an agent
            # loop that keeps token ids sends it: no service call before it runs.
            prompt = [*prompt, *reply["choices"][0]["token_ids"], 7, 8, 9]
            reply = await complete(prompt)
            assert turn_calls(log) == ["lease_used", "turn_done"]
            assert first.metrics.snapshot()['kvtide_turn_leases_total{outcome="used"}'] == 1
            # On the other replica: begin_turn, carrying only the ids the turn adds to
            # the session's last turn (its copy came from the service's answer).
            prompt = [*prompt, *reply["choices"][0]["token_ids"], 5, 6]
            status, _ = await handle(
                second,
                "/v1/completions",
                json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 3}).encode(),
                x_session_id="s11",
            )
            assert status == 200
            # Its copy is empty: the service answers with its last turn, and the turn
            # asks again with what it adds to it.
            assert turn_calls(log) == ["begin_turn", "begin_turn", "turn_done"]
            _, _, added, _, prefix_len = log.begun[-1]
            assert added == [5, 6] and prefix_len == len(prompt) - 2
            assert service.leases.grants["s11"].holder == "replica-1"

    asyncio.run(story())


def test_a_turn_on_another_replica_gets_the_session_back_from_the_lease(
    tiny_tokenizer: Any,
) -> None:
    first, second, log = two_ingresses(tiny_tokenizer)
    service = first.kv.service
    service.handover_wait_s = 5.0

    async def story() -> None:
        async with leasing(first, second):
            chat = Chat("s2")
            await chat.turn(first, "What is kept?")
            await chat.turn(first, "And after?")
            log.take()
            # The other replica asks the service, which revokes the first's unused
            # lease; the first gives it back and the turn runs, long before the wait
            # for a running turn would end.
            t0 = asyncio.get_running_loop().time()
            reply = await chat.turn(second, "And on another replica?")
            assert asyncio.get_running_loop().time() - t0 < 1.0
            assert turn_calls(log)[-1] == "turn_done"
            assert reply["kv_plan_reason"] == "cheaper_to_recompute"
            # The lease now is the second's: the first asks (and gets it back) again.
            assert len(first.router.leases) == 0 and len(second.router.leases) == 1
            await chat.turn(first, "Back here?")
            assert "begin_turn" in turn_calls(log)
            assert len(first.router.leases) == 1 and len(second.router.leases) == 0

    asyncio.run(story())


def test_a_leased_session_still_runs_one_turn_at_a_time(tiny_tokenizer: Any) -> None:
    first, second, _log = two_ingresses(tiny_tokenizer)
    service = first.kv.service
    service.handover_wait_s = 0.2
    gate = asyncio.Event()

    async def story() -> None:
        async with leasing(first, second):
            # Turn 2 runs under the lease and hangs in decode...
            _chat, other, slow = await second_turn_hanging(first, "s3", gate)
            # ...so a turn of the session elsewhere is refused, and so is one on the
            # same replica (its lease is in use): 409, as without leases.
            reply = await other.turn(second, "Meanwhile?", expect=409)
            assert reply["error"]["code"] == "turn_in_progress"
            reply = await other.turn(first, "Meanwhile here?", expect=409)
            assert reply["error"]["code"] == "turn_in_progress"
            gate.set()
            await slow

    asyncio.run(story())


async def second_turn_hanging(
    ingress: Any, session: str, gate: asyncio.Event
) -> tuple[Chat, Chat, asyncio.Future[None]]:
    """The session's first turn on ``ingress``, then its second, hanging in decode until
    ``gate`` (a task); and another client of the session holding the first turn only."""
    chat = Chat(session)
    await chat.turn(ingress, "What is kept?")
    slow = asyncio.ensure_future(hanging_turn(ingress, chat, gate, ingress.router.decode.script))
    for _ in range(50):
        await asyncio.sleep(0)
    other = Chat(session)
    other.messages = list(chat.messages[:-1])
    return chat, other, slow


async def hanging_turn(ingress: Any, chat: Chat, gate: asyncio.Event, script: Any) -> None:
    """Chat turn whose decode waits for ``gate`` before answering."""
    pool = ingress.router.decode

    async def stream(request: Any) -> Any:
        await gate.wait()
        for chunk in script(request):
            yield chunk

    pool.generate = stream
    try:
        await chat.turn(ingress, "And after?")
    finally:
        del pool.generate


async def first_turn_leased(svc: Any, router: Router, session: str, owner: Principal) -> None:
    """The session's first turn through ``router`` (lessee ``replica-a``, its watch
    seen), which leaves the next turn leased to it."""
    await svc.lease_watch("replica-a", [], 0.0)
    claim = await svc.begin_turn(session, owner, S1_T1)
    assert claim.outcome == "claimed"
    async for _ in router.run_turn(
        Turn(
            prompt_token_ids=S1_T1,
            max_tokens=3,
            session_id=session,
            owner=owner.name,
            request_id="r-1",
            decision=claim.decision,
        )
    ):
        pass
    await router.settled()


def leasing_router(c: Cluster) -> tuple[Router, HeldLeases]:
    leases = HeldLeases("replica-a", clock=c.clock)
    router = c.router(clock=c.clock, leases=leases)
    router.session_tokens = None
    return router, leases


def leased_cluster() -> tuple[Cluster, Router, HeldLeases]:
    """A cluster whose service grants 30 s turn leases, and a router leasing from it."""
    c = Cluster()
    c.service.leases.lasts_s = 30.0
    router, leases = leasing_router(c)
    return c, router, leases


def test_a_lease_serves_its_owner_key_only() -> None:
    c, router, leases = leased_cluster()
    svc = c.service
    alice, mallory = Principal(name="alice"), Principal(name="mallory")

    async def story() -> None:
        await first_turn_leased(svc, router, "s4", alice)
        digest = svc.tokens.last_digest("s4", c.clock())
        # Another key neither uses the lease here nor learns or revokes anything there.
        assert leases.take("s4", mallory, digest) is None
        assert (await svc.begin_turn("s4", mallory, [1])).outcome == "not_found"
        assert await svc.leases.watch("replica-a", 0.0) == ([], [])
        # The owner's key, from the last turn the lease names, runs under it: the
        # kept KV pulled back, the pull booked once.
        lease = leases.take("s4", alice, digest)
        assert lease is not None and lease.owner == "alice"
        decision = leases.decide(lease, S1_T2)
        assert decision.kind == "pull" and decision.num_reusable_tokens > 0
        pulls = svc.decider.lifecycle.stats().num_pulls
        used = asyncio.ensure_future(svc.lease_used("s4", lease.lease_id, None))
        reports = [
            r
            async for _, r in router.run_turn(
                Turn(
                    prompt_token_ids=S1_T2,
                    max_tokens=3,
                    session_id="s4",
                    owner="alice",
                    request_id="r-2",
                    decision=decision,
                    lease=LeaseUse(lease_id=lease.lease_id, used=used),
                )
            )
        ]
        await router.settled()
        assert reports[-1].kv_source == "sent_back"
        assert svc.decider.lifecycle.stats().num_pulls == pulls + 1
        # Used once: a second use of the same lease is refused.
        assert await svc.lease_used("s4", lease.lease_id, None) is False

    asyncio.run(story())


def test_a_refused_lease_runs_the_turn_again_through_the_service(tiny_tokenizer: Any) -> None:
    first, second, log = two_ingresses(tiny_tokenizer)
    service = first.kv.service

    async def story() -> None:
        async with leasing(first, second):
            chat = Chat("s5")
            await chat.turn(first, "What is kept?")
            log.take()
            # The service gave the lease up without the lessee hearing of it (as a
            # restarted instance would): the turn's use is refused, it ends unseen and
            # runs again through begin_turn; the client gets one answer.
            [grant] = service.leases.grants.values()
            service.lease_desk.end(grant)
            n = len(first.router.decode.requests)
            reply = await chat.turn(first, "And after?")
            assert turn_calls(log) == ["lease_used", "begin_turn", "turn_done"]
            assert reply["kv_plan_reason"] == "cheaper_to_recompute"
            assert len(first.router.decode.requests) - n <= 2
            snapshot = first.metrics.snapshot()
            assert snapshot['kvtide_turn_leases_total{outcome="refused"}'] == 1
            # The turn's hand-over leases the next turn to the replica again.
            assert service.leases.grants["s5"].holder == "replica-0"

    asyncio.run(story())


def test_a_lessee_that_never_answers_holds_the_session_no_longer_than_the_wait() -> None:
    c, router, _ = leased_cluster()
    svc, alice = c.service, Principal(name="alice")

    async def story() -> None:
        await first_turn_leased(svc, router, "s10", alice)
        # The lessee's replica is gone (its watch never calls again): a turn of the
        # session elsewhere revokes the lease, waits out the hand-over wait and runs.
        svc.handover_wait_s = 0.05
        claim = await svc.begin_turn("s10", alice, S1_T2)
        assert claim.outcome == "claimed"
        assert svc.leases.grants == {}

    asyncio.run(story())


def test_a_lease_whose_kv_is_lost_is_revoked_and_the_turn_asks_the_service() -> None:
    c, router, leases = leased_cluster()
    svc, alice = c.service, Principal(name="alice")

    async def story() -> None:
        await first_turn_leased(svc, router, "s9", alice)
        [grant] = svc.leases.grants.values()
        assert grant.record is not None
        # The decode engine holding the leased KV dies: the lessee is told at once (its
        # watch answers) and gives the lease back, so the session's next turn is decided
        # by the service (a recompute), not by the lessee from KV that is gone.
        assert await svc.engines_lost([grant.record.engine_id]) == 1
        revoked, _ = await svc.leases.watch("replica-a", 0.0)
        assert revoked == [grant.lease_id]
        leases.revoke(revoked)
        await svc.lease_watch("replica-a", leases.take_released(), 0.0)
        assert svc.leases.grants == {} and "s9" not in svc.running
        digest = svc.tokens.last_digest("s9", c.clock())
        assert leases.take("s9", alice, digest) is None
        claim = await svc.begin_turn("s9", alice, S1_T2)
        assert claim.outcome == "claimed" and claim.decision is not None
        assert claim.decision.kind == "recompute"

    asyncio.run(story())


def test_a_restarted_service_keeps_a_leases_claim_until_its_lessee_gives_it_back() -> None:
    c = Cluster()
    store = MemoryStore()
    svc = c.new_service(store=store, turn_lease_s=30.0)
    alice = Principal(name="alice")
    router, leases = leasing_router(c)

    async def story() -> None:
        await first_turn_leased(svc, router, "s6", alice)
        assert len(leases) == 1
        # The service restarts: its lease is gone, its claim is not (a turn the lessee
        # starts meanwhile must not run beside one elsewhere).
        restarted = c.new_service(store=store, turn_lease_s=30.0, handover_wait_s=0.05)
        assert "s6" in restarted.running
        blocked = await restarted.begin_turn("s6", alice, S1_T2)
        assert blocked.outcome == "turn_in_progress"
        # The lessee learns of the new epoch and gives its unused lease back: the
        # session is free at once.
        leases.new_epoch(restarted.epoch)
        answer = await restarted.lease_watch("replica-a", leases.take_released(), 0.0)
        assert answer.epoch == restarted.epoch and "s6" not in restarted.running
        claim = await restarted.begin_turn("s6", alice, S1_T2)
        assert claim.outcome == "claimed"

    asyncio.run(story())


def test_closing_a_leased_session_gets_the_lease_back_and_frees_its_kv(
    tiny_tokenizer: Any,
) -> None:
    first, second, _log = two_ingresses(tiny_tokenizer)
    service = first.kv.service

    async def story() -> None:
        async with leasing(first, second):
            chat = Chat("s7")
            await chat.turn(first, "What is kept?")
            assert len(first.router.leases) == 1
            assert await service.close("s7") is True
            assert len(first.router.leases) == 0 and service.leases.grants == {}
            assert "s7" not in service.running
            assert service.decider.lifecycle.record("s7") is None

    asyncio.run(story())


def test_digest_of_the_leased_last_turn_matches_the_replicas_copy(tiny_tokenizer: Any) -> None:
    first, second, _ = two_ingresses(tiny_tokenizer)

    async def story() -> None:
        async with leasing(first, second):
            chat = Chat("s8")
            await chat.turn(first, "What is kept?")
            [lease] = first.router.leases.unused()
            ids = first.session_tokens.token_ids("s8")
            assert ids is not None and lease.digest == prefix_digest(ids)

    asyncio.run(story())


def test_a_decode_full_of_leased_kv_asks_the_lease_back_and_makes_room() -> None:
    c = Cluster()
    c.new_service(room_kv_cache_usage=0.95)
    c.service.leases.lasts_s = 30.0
    router, leases = leasing_router(c)
    svc, alice = c.service, Principal(name="alice")
    full = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 1.0}

    async def story() -> None:
        await first_turn_leased(svc, router, "s9", alice)
        [grant] = svc.leases.grants.values()
        assert grant.record is not None
        engine_id = grant.record.engine_id
        # The decode engine's KV cache is full of kept blocks, nothing running; its one
        # record is held for replica-a's next turn: the lease is asked back, not evicted.
        await svc.heartbeat(engine_id, stats=full)
        await svc.tick()
        assert svc.decider.lifecycle.record("s9") is not None
        revoked, _ = await svc.leases.watch("replica-a", 0.0)
        assert revoked == [grant.lease_id]
        leases.revoke(revoked)
        await svc.lease_watch("replica-a", leases.take_released(), 0.0)
        # Given back, the session is idle: the next tick evicts its record and drains it.
        await svc.heartbeat(engine_id, stats=full)
        await svc.tick()
        await svc.wait_drains()
        assert svc.decider.lifecycle.record("s9") is None
        assert svc.counters["drains"] == 1

    asyncio.run(story())
