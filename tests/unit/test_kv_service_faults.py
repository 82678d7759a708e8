"""The KV service's guarantees under restarts, overlapping turns and rewritten histories.

A "restart" is a new ``KVService`` on the same durable store (``MemoryStore`` here; the
GCS table under Ray, see tests/ray/test_kv_service_durable.py), as Ray restarts the
actor: nothing else of the old instance survives.
"""

from __future__ import annotations

import asyncio

import pytest
from test_kv_service import S1_T1, S1_T2, Cluster

from orchestrator.kv.durable import MemoryStore
from orchestrator.kv.messages import TurnDone
from orchestrator.kv.ownership import Principal
from orchestrator.kv.service import KVService, ServiceSettings, merge_counters
from orchestrator.serve.responses import pool_stats

ALICE = Principal(name="alice")
MALLORY = Principal(name="mallory")


def restarted(c: Cluster, store: MemoryStore) -> KVService:
    c.service = KVService(
        c.service.decider.lifecycle.config,
        prefill=c.prefill,
        settings=ServiceSettings(drain_timeout_s=5.0, running_grace_s=60.0),
        store=store,
        clock=c.clock,
        wall_clock=c.clock,
    )
    return c.service


def test_session_ownership_survives_a_service_restart() -> None:
    c, store = Cluster(), MemoryStore()
    restarted(c, store)

    async def run() -> None:
        assert (await c.service.claim_session("s1", ALICE)).outcome == "claimed"
        await c.service.turn_abandoned("s1")
        service = restarted(c, store)  # the actor died; Ray started a new one
        # Another key cannot take the session over, and cannot see it.
        assert (await service.claim_session("s1", MALLORY)).outcome == "not_found"
        assert not await service.session_owned("s1", MALLORY)
        assert (await service.session_prefix("s1", MALLORY)).owned is False
        assert (await service.claim_session("s1", ALICE)).outcome == "claimed"
        await service.turn_abandoned("s1")
        # Closing ends the ownership for good, also for the next instance.
        await service.close("s1")
        service = restarted(c, store)
        assert (await service.claim_session("s1", MALLORY)).outcome == "claimed"

    asyncio.run(run())


def test_a_retried_turn_is_replayed_or_refused_after_a_restart_never_run_twice() -> None:
    c, store = Cluster(), MemoryStore()
    restarted(c, store)

    async def run() -> None:
        service = c.service
        assert (await service.replay_begin("done-key")).action == "run"
        await service.replay_complete("done-key", {"id": "chatcmpl-1"})
        assert (await service.replay_begin("running-key")).action == "run"
        service = restarted(c, store)
        replay = await service.replay_begin("done-key")
        assert (replay.action, replay.body) == ("replay", {"id": "chatcmpl-1"})
        # Its turn may still be running on an ingress: the retry waits (409), and the
        # original's completion reaches the new instance.
        assert (await service.replay_begin("running-key")).action == "in_progress"
        await service.replay_complete("running-key", {"id": "chatcmpl-2"})
        assert (await service.replay_begin("running-key")).action == "replay"
        # A turn whose ingress died too is given up after running_grace_s: then it runs.
        assert (await service.replay_begin("orphan")).action == "run"
        service = restarted(c, store)
        assert (await service.replay_begin("orphan")).action == "in_progress"
        c.clock.now_s += 61.0
        assert (await service.replay_begin("orphan")).action == "run"

    asyncio.run(run())


def test_a_begin_delivered_again_on_the_restarted_service_runs_its_turn() -> None:
    """The service stores the key running and dies before answering; Ray delivers the
    same call to the restarted instance. Nobody runs that turn: the asker is told to run
    it, not to wait (a 409 its retries would get until running_grace_s)."""
    c, store = Cluster(), MemoryStore()
    restarted(c, store)

    async def run() -> None:
        assert (await c.service.replay_begin("k", ("fp",), "attempt-1")).action == "run"
        service = restarted(c, store)
        assert (await service.replay_begin("k", ("fp",), "attempt-1")).action == "run"
        # Any other attempt of the key still waits for it, and it completes once.
        assert (await service.replay_begin("k", ("fp",), "attempt-2")).action == "in_progress"
        await service.replay_complete("k", {"id": "chatcmpl-1"})
        replay = await service.replay_begin("k", ("fp",), "attempt-1")
        assert (replay.action, replay.body) == ("replay", {"id": "chatcmpl-1"})
        assert service.replays.num_duplicates == 0

    asyncio.run(run())


def test_a_second_concurrent_turn_of_a_session_is_refused_until_the_first_ends() -> None:
    c = Cluster()

    async def run() -> None:
        service = c.service
        assert (await service.claim_session("s1", ALICE)).outcome == "claimed"
        second = await service.claim_session("s1", ALICE)
        assert second.outcome == "turn_in_progress" and "s1" in second.message
        await service.turn_done(TurnDone(session_id="s1", token_ids=[1, 2], owner="alice"))
        assert (await service.claim_session("s1", ALICE)).outcome == "claimed"
        await service.turn_abandoned("s1")  # a failed turn frees the session too
        assert (await service.claim_session("s1", ALICE)).outcome == "claimed"

    asyncio.run(run())


def test_a_running_turn_still_refuses_a_second_one_after_a_service_restart() -> None:
    c, store = Cluster(), MemoryStore()
    restarted(c, store)

    async def run() -> None:
        assert (await c.service.claim_session("s1", ALICE)).outcome == "claimed"
        assert (await c.service.claim_session("s2", ALICE)).outcome == "claimed"
        await c.service.turn_abandoned("s2")
        service = restarted(c, store)  # s1's turn is still running on its ingress
        assert (await service.claim_session("s1", ALICE)).outcome == "turn_in_progress"
        assert (await service.claim_session("s2", ALICE)).outcome == "claimed"
        # The original's end reaches the new instance and clears the mark for good.
        await service.turn_abandoned("s1")
        assert (await service.claim_session("s1", ALICE)).outcome == "claimed"
        await service.turn_abandoned("s1")
        assert (await restarted(c, store).claim_session("s1", ALICE)).outcome == "claimed"
        # A mark whose ingress died too expires running_grace_s after its claim, also
        # across a restart.
        c.clock.now_s += 61.0
        assert (await restarted(c, store).claim_session("s1", ALICE)).outcome == "claimed"
        assert store.keys("running/") == ["running/s1"]

    asyncio.run(run())


def test_finished_turns_and_renewals_keep_a_session_owned_past_one_ttl() -> None:
    c = Cluster()
    ttl = c.service.owners.idle_ttl_s

    async def run() -> None:
        service = c.service
        assert (await service.claim_session("s1", ALICE)).outcome == "claimed"
        c.clock.now_s += ttl - 10  # a long turn
        await service.tick()
        await service.turn_done(TurnDone(session_id="s1", token_ids=[1, 2], owner="alice"))
        c.clock.now_s += ttl - 10  # idle, but the SDK renews
        await service.renew("s1", ALICE)
        c.clock.now_s += ttl - 10
        await service.tick()
        assert service.owners.owner("s1", c.clock()) == "alice"
        assert not await service.session_owned("s1", MALLORY)
        c.clock.now_s += 11  # a whole TTL since the renewal: ownership ends
        await service.tick()
        assert service.owners.owner("s1", c.clock()) is None

    asyncio.run(run())


def test_a_turn_longer_than_the_ttl_keeps_its_owner() -> None:
    c = Cluster()
    ttl = c.service.owners.idle_ttl_s

    async def run() -> None:
        service = c.service
        service.running_grace_s = 10 * ttl
        assert (await service.claim_session("s1", ALICE)).outcome == "claimed"
        c.clock.now_s += ttl + 5  # still decoding
        await service.tick()
        assert service.owners.owner("s1", c.clock()) == "alice"
        assert (await service.claim_session("s1", MALLORY)).outcome == "not_found"

    asyncio.run(run())


def test_a_superseded_record_is_drained_with_the_tokens_it_covers() -> None:
    c = Cluster()

    async def run() -> None:
        await c.turn(S1_T1, "s1")
        # The client rewrote the history: the new prompt does not start with turn 1's.
        report = await c.turn([7, *S1_T2[1:]], "s1")
        assert report.kv_plan == "recompute"
        assert c.service.counters["undrainable"] == 0
        assert c.service.counters["drains"] == 1  # turn 1's blocks were read back
        held = c.service.decider.lifecycle.records()
        assert [r.session_id for r in held] == ["s1"] and len(held) == 1

    asyncio.run(run())


def test_stats_sum_every_replicas_counters_instead_of_overwriting() -> None:
    books = [
        {"kvtide_kv_send_backs_total": 5.0, "kvtide_requests_total{status=ok}": 7.0},
        {"kvtide_kv_send_backs_total": 0.0, "kvtide_kv_expiries_total": 2.0},
        {"kvtide_kv_send_backs_total": 3.0, "kvtide_requests_total{status=ok}": 1.0},
    ]
    assert merge_counters(books) == {
        "kvtide_kv_send_backs_total": 8.0,
        "kvtide_requests_total{status=ok}": 8.0,
        "kvtide_kv_expiries_total": 2.0,
    }
    c = Cluster()

    async def run() -> None:
        await c.service.report_metrics("ingress-a", books[0])
        await c.service.report_metrics("ingress-b", books[2])
        await c.service.heartbeat("decode-x1", ["n1"], {"num_requests": 4})
        await c.service.heartbeat("decode-x2", ["n2"], {"num_requests": 6})
        stats = await c.service.stats()
        assert stats["ingress_metrics"]["kvtide_kv_send_backs_total"] == 8.0
        assert stats["engines"] == {
            "decode-x1": {"num_requests": 4},
            "decode-x2": {"num_requests": 6},
        }
        c.clock.now_s += c.service.engine_silence_s + 1  # ingress-a and -b went away
        assert (await c.service.stats())["ingress_metrics"] == {}

    asyncio.run(run())


def test_a_pools_stats_sum_its_engines_counters_and_average_their_kv_cache_use() -> None:
    books = [
        {"engine_id": "decode-a", "num_requests": 5, "num_running": 1, "kv_cache_usage": 0.5},
        {"engine_id": "decode-b", "num_requests": 2, "num_running": 0, "kv_cache_usage": 0.1},
    ]
    merged = pool_stats("decode", books)
    assert (merged["num_requests"], merged["num_running"]) == (7, 1)
    assert merged["kv_cache_usage"] == pytest.approx(0.3)
    assert (merged["engine_id"], merged["num_replicas"]) == ("decode", 2)
