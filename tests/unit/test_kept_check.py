"""Kept blocks no hand-over booked are drained, not pinned until the decode TTL.

A decode engine keeps a session turn's KV as the request finishes; the service books it
when the turn's ingress hands the turn over. When the hand-over never lands (the turn's
deadline passed as its decode finished, the service call failed, the ingress died), the
blocks used to stay pinned for the TTL (480 s) with no record: no budget, eviction or
drain could reach them. Now the decode host asks the service about each entry past its
grace (``EngineLedger.due_checks``, ``check_kept``), and the service drains what it
never booked (``orchestrator.kv.kept_check``). The cluster is test_kv_service.py's:
fake engines behind hosts that keep the ledger, the real service and router.
"""

from __future__ import annotations

import asyncio
from typing import Any

from service_fakes import ServiceFake
from test_kv_service import S1_T1, S1_T2, Cluster, _Method, decode_with_fresh_blocks

from engines.kv_params import KVTransferParams
from orchestrator.errors import ServiceUnavailable
from orchestrator.kv.kept_check import KeptCheck, KeptRef, check_kept
from orchestrator.kv.messages import Handover, TurnDone
from orchestrator.kv.ownership import ANONYMOUS
from orchestrator.kv.service import KVService

GRACE_S = 60.0


class LostHandover(ServiceFake):
    """The service as the router reaches it, with ``turn_done`` calls that never land
    (the ingress's deadline passes)."""

    lose = True

    async def turn_done(self, done: TurnDone) -> Handover:
        if self.lose:
            raise ServiceUnavailable("the hand-over's deadline passed")
        return await self.service.turn_done(done)


class Handle:
    """The service as its actor handle reaches it (``handle.method.remote(...)``)."""

    def __init__(self, service: KVService) -> None:
        self.kept_check = _Method(service.unbooked.check)
        self.kept_orphans = _Method(service.unbooked.drain_orphans)


def checking_cluster(lose_handovers: bool = True) -> Cluster:
    cluster = Cluster()
    cluster.decode.ledger.check_grace_s = GRACE_S
    if lose_handovers:
        cluster.fake(LostHandover)
    return cluster


async def check(cluster: Cluster) -> int:
    sent = await check_kept(Handle(cluster.service), cluster.decode.ledger, timeout_s=5.0)
    await cluster.service.wait_drains()
    return sent


def last_kept(cluster: Cluster) -> tuple[KVTransferParams, list[int]]:
    """What the decode engine kept after its last request: the params that name the
    blocks, and the tokens they hold (prompt and output)."""
    req = cluster.decode.pool.requests[-1]
    chunks = decode_with_fresh_blocks(req)
    params = chunks[-1].kv_transfer_params
    assert params is not None
    return params, [*req.prompt_token_ids, *(t for c in chunks for t in c.token_ids)]


def drains(cluster: Cluster) -> list[Any]:
    """The prefill requests that read kept blocks back with nothing to keep (drains)."""
    return [r for r in cluster.prefill.pool.requests if r.request_id.startswith("drain-")]


def test_a_turn_whose_hand_over_never_lands_has_its_kept_blocks_drained_after_the_grace() -> None:
    cluster = checking_cluster()

    async def run() -> None:
        await cluster.turn(S1_T1, "s1")  # decode kept the KV; the service never heard
        kept_params, kept_ids = last_kept(cluster)
        assert cluster.service.decider.lifecycle.record("s1") is None
        assert await check(cluster) == 0  # within the grace: not asked about yet
        assert drains(cluster) == []
        cluster.clock.now_s += GRACE_S
        assert await check(cluster) == 1
        (drain,) = drains(cluster)
        assert drain.kv_transfer_params == kept_params.pull_back(keep=False)
        assert drain.prompt_token_ids == kept_ids  # exactly the tokens it holds
        assert await check(cluster) == 0  # drained once: not asked about again
        assert len(drains(cluster)) == 1
        assert cluster.service.counters["kept_orphans_drained"] == 1

    asyncio.run(run())


def test_a_booked_turn_is_never_drained_by_the_check_even_after_its_record_was_pulled() -> None:
    cluster = checking_cluster(lose_handovers=False)

    async def run() -> None:
        await cluster.turn(S1_T1, "s1")
        assert cluster.service.decider.lifecycle.record("s1") is not None
        await cluster.turn(S1_T2, "s1")  # pulls turn 1's blocks: the record is gone
        cluster.clock.now_s += GRACE_S
        assert await check(cluster) == 0
        assert drains(cluster) == []
        assert cluster.service.decider.lifecycle.record("s1") is not None  # turn 2's

    asyncio.run(run())


def test_a_session_with_a_turn_running_is_asked_about_again_not_drained() -> None:
    cluster = checking_cluster()
    service = cluster.service

    async def run() -> None:
        await cluster.turn(S1_T1, "s1")
        _, kept_ids = last_kept(cluster)
        await service.begin_turn("s1", ANONYMOUS, S1_T2)  # s1's next turn is running
        cluster.clock.now_s += GRACE_S
        assert await check(cluster) == 0
        assert await check(cluster) == 0  # asked about at every beat while it runs
        await service.turn_abandoned("s1")
        assert await check(cluster) == 1
        assert [d.prompt_token_ids for d in drains(cluster)] == [kept_ids]

    asyncio.run(run())


def test_a_hand_over_after_the_check_books_no_kv_and_the_next_turn_recomputes() -> None:
    cluster = checking_cluster()
    lost = cluster.kv
    assert isinstance(lost, LostHandover)

    async def run() -> None:
        await cluster.turn(S1_T1, "s1")
        kept_params, kept_ids = last_kept(cluster)
        cluster.clock.now_s += GRACE_S
        assert await check(cluster) == 1
        # The lost hand-over arrives after all: its blocks are being drained.
        lost.lose = False
        answer = await lost.turn_done(
            TurnDone(
                session_id="s1",
                token_ids=kept_ids,
                kv_transfer_params=kept_params,
                next_token_ids=kept_ids,
            )
        )
        assert answer.accepted
        assert cluster.service.decider.lifecycle.record("s1") is None
        report = await cluster.turn(S1_T2, "s1")
        assert report.kv_source == "recomputed"

    asyncio.run(run())


def ref(request_id: str, *, age_s: float, session_id: str | None = "s1") -> KeptRef:
    return KeptRef(engine_id="decode", request_id=request_id, session_id=session_id, age_s=age_s)


def params(request_id: str) -> KVTransferParams:
    return KVTransferParams(
        do_remote_decode=True,
        remote_engine_id="decode",
        remote_request_id=request_id,
        remote_block_ids=((1, 2),),
        remote_num_tokens=20,
    )


def test_entries_older_than_the_service_or_its_memory_are_left_to_the_ttl() -> None:
    now = [1000.0]
    drained: list[Any] = []
    check_ = KeptCheck(
        retention_s=480.0,
        margin_s=30.0,
        clock=lambda: now[0],
        busy=lambda sid: False,
        drain=lambda p, ids: drained.append(p),
        max_entries=2,
    )
    now[0] += 100.0
    # Finished before this service started (a restart's adoption owns it), or so old
    # its booking may be forgotten: unknown, never an orphan.
    verdict = check_.check([ref("before-start", age_s=101.0), ref("old", age_s=460.0)])
    assert (verdict.orphans, verdict.later) == ([], [])
    assert check_.counters["kept_unknown"] == 2
    # Three bookings in a map of two: the first is dropped, and with it what the
    # service can say of anything that finished before that moment.
    for rid in ("b1", "b2", "b3"):
        check_.booked(params(rid))
    now[0] += 100.0
    verdict = check_.check([ref("b1", age_s=110.0), ref("new", age_s=61.0)])
    assert verdict.orphans == [("decode", "new")]
    assert check_.counters["kept_unknown"] == 3  # b1: forgotten, not an orphan
