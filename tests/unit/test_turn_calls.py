"""What a session's turn asks of the KV service: one call before it runs (``begin_turn``:
the session claimed and the KV plan made at once) and one after (``turn_done``).

The ingress tokenizes a session's next turn from its own copy of the last turn it
served; ``begin_turn`` checks that copy against the service's (by digest). A turn that
lands on another ingress replica is told the service's last turn and tokenized again,
to the same ids. Two ingresses (no Ray) share one in-process service and one pair of
scripted engines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from ingress_harness import MODEL, bare_ingress, handle, http_request
from service_fakes import HeldHandOver, ServiceFake
from test_kv_service import S1_T1, S1_T2, Cluster

from engines.kv_params import KVTransferParams
from orchestrator.errors import DeadlineExceeded
from orchestrator.kv.messages import Handover, TurnDone
from orchestrator.kv.ownership import Principal
from orchestrator.kv.service import API_METHODS, KVService
from orchestrator.kv.session_tokens import NO_PREFIX, prefix_digest
from orchestrator.router import Turn

CHAT = "/v1/chat/completions"


class CallLog:
    """The service, recording the name of every call made to it (and the arguments of
    each ``begin_turn``)."""

    def __init__(self, service: KVService) -> None:
        self.service = service
        self.calls: list[str] = []
        self.begun: list[tuple[Any, ...]] = []
        self.handed: list[TurnDone] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.service, name)
        if name not in API_METHODS:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if name == "begin_turn":
                self.begun.append((*args, *kwargs.values())[:5])  # without the holder
            if name == "turn_done":
                self.handed.append(args[0])
            return attr(*args, **kwargs)

        return call

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


def two_ingresses(tokenizer: Any, wire: Callable[[Any], Any] = CallLog) -> tuple[Any, Any, Any]:
    """Two ingress replicas on the same pools, clock and KV service, which both call
    through ``wire(service)`` (returned third)."""
    first = bare_ingress(tokenizer, kv=wire)
    second = bare_ingress(tokenizer, kv=lambda _: first.kv)
    second.router.prefill = first.router.prefill
    second.router.decode = first.router.decode
    return first, second, first.kv


class Chat:
    def __init__(self, session: str) -> None:
        self.session = session
        self.messages: list[dict[str, str]] = []

    def turn(self, ingress: Any, question: str) -> dict[str, Any]:
        self.messages.append({"role": "user", "content": question})
        body = json.dumps({"model": MODEL, "messages": self.messages, "max_tokens": 3})
        status, reply = asyncio.run(handle(ingress, CHAT, body.encode(), x_session_id=self.session))
        assert status == 200, reply
        self.messages.append(reply["choices"][0]["message"])
        return dict(reply["kvtide"])


def decode_prompts(ingress: Any) -> list[list[int]]:
    return [list(r.prompt_token_ids) for r in ingress.router.decode.requests]


def test_a_session_turn_makes_one_service_call_before_it_runs_and_one_after(
    tiny_tokenizer: Any,
) -> None:
    first, _, log = two_ingresses(tiny_tokenizer)
    chat = Chat("s1")
    assert chat.turn(first, "What is kept?")["kv_plan"] == "recompute"
    assert log.take() == ["begin_turn", "turn_done"]
    # The next turn: tokenized from this replica's copy of turn 1 (no call for it),
    # claimed and planned in one call; its ids extend turn 1's record (the cost model,
    # not a prefix mismatch, makes the plan on these short prompts).
    second_turn = chat.turn(first, "And after?")
    assert log.take() == ["begin_turn", "turn_done"]
    assert second_turn["kv_plan_reason"] == "cheaper_to_recompute"
    turn1, turn2 = decode_prompts(first)
    assert turn2[: len(turn1) + 3] == [*turn1, 11, 12, 13]  # the model's own tokens
    # The call carried turn 2's new ids only, not the history the service holds.
    _, _, sent, digest, prefix_len = log.begun[-1]
    assert prefix_len == len(turn1) + 3  # turn 1 and its answer
    assert sent == turn2[prefix_len:] and 0 < len(sent) < len(turn2) // 2
    assert digest == prefix_digest(turn2[:prefix_len])


def test_a_turn_on_another_replica_is_tokenized_again_from_the_services_last_turn(
    tiny_tokenizer: Any,
) -> None:
    first, second, log = two_ingresses(tiny_tokenizer)
    chat = Chat("s2")
    chat.turn(first, "What is kept?")
    chat.turn(first, "And after?")
    log.take()
    # Turn 3 lands on the other replica, which never saw the session: its first
    # tokenization is from scratch, the service answers with its last turn, and the
    # ids then extend turn 2's exactly.
    third = chat.turn(second, "And on another replica?")
    assert log.take() == ["begin_turn", "begin_turn", "turn_done"]
    # From nothing, the whole prompt; told the last turn, only what the turn adds.
    (*_, sent_first, _, skipped_first), (*_, sent_again, _, skipped_again) = log.begun[-2:]
    assert skipped_first == 0 and skipped_again > 0
    assert sent_first[skipped_again:] == sent_again
    assert third["kv_plan_reason"] == "cheaper_to_recompute"  # not prefix_mismatch
    turn2, turn3 = decode_prompts(first)[1:]
    assert turn3[: len(turn2) + 3] == [*turn2, 11, 12, 13]
    # That replica now holds the last turn: its next turn is one call again.
    chat.turn(second, "Once more?")
    assert log.take() == ["begin_turn", "turn_done"]
    # And the first replica's copy is stale: it is told the new last turn.
    chat.turn(first, "Back here?")
    assert log.take() == ["begin_turn", "begin_turn", "turn_done"]


def test_begin_turn_tells_the_last_turn_only_to_its_owner_and_claims_nothing_then(
    tiny_tokenizer: Any,
) -> None:
    first, _, _ = two_ingresses(tiny_tokenizer)
    alice, mallory = Principal(name="alice"), Principal(name="mallory")
    service: KVService = first.kv.service

    async def story() -> None:
        claim = await service.begin_turn("s3", alice, [1, 2, 3], NO_PREFIX)
        assert claim.outcome == "claimed" and claim.decision is not None
        service.tokens.remember("s3", "hello", [1, 2, 3, 4], service.clock())
        await service.turn_abandoned("s3")
        # Another key, tokenized from nothing: the same 404 as for no session.
        refused = await service.begin_turn("s3", mallory, [9], NO_PREFIX)
        assert (refused.outcome, refused.prefix) == ("not_found", None)
        # The owner, from a stale copy: told the last turn, nothing claimed...
        stale = await service.begin_turn("s3", alice, [1, 2], prefix_digest([1, 2]))
        assert stale.outcome == "retokenize" and stale.prefix is not None
        assert (stale.prefix.text, stale.prefix.token_ids) == ("hello", [1, 2, 3, 4])
        # ...so the same key's turn from the right copy claims it at once.
        fresh = await service.begin_turn("s3", alice, [1, 2, 3, 4, 5], prefix_digest([1, 2, 3, 4]))
        assert fresh.outcome == "claimed"
        # Token ids sent as ids (no digest) are not checked against the last turn.
        await service.turn_abandoned("s3")
        assert (await service.begin_turn("s3", alice, [7], None)).outcome == "claimed"

    asyncio.run(story())


def test_begin_turn_rebuilds_the_prompt_from_the_last_turn_and_the_ids_it_adds() -> None:
    c = Cluster()
    alice = Principal(name="alice")
    svc = c.service
    history = list(range(1, 41))

    async def story() -> None:
        assert (await svc.begin_turn("s", alice, history, NO_PREFIX)).outcome == "claimed"
        kept = KVTransferParams(
            do_remote_decode=True,
            remote_engine_id="decode",
            remote_request_id="t1",
            remote_block_ids=((1, 2, 3),),
            remote_num_tokens=len(history),
        )
        await svc.turn_done(
            TurnDone(
                session_id="s",
                token_ids=history,
                kv_transfer_params=kept,
                kv_expires_in_s=100.0,
                next_token_ids=history,
            )
        )
        added = [41, 42]
        # The new ids alone would not extend the kept record...
        alone = svc.decider.decide_turn("s", added, c.clock())
        assert alone.reason == "prefix_mismatch"
        whole = svc.decider.decide_turn("s", [*history, *added], c.clock())
        assert whole.reason != "prefix_mismatch"
        # ...with the last turn they stand for, the decision is the whole prompt's.
        claim = await svc.begin_turn("s", alice, added, prefix_digest(history), len(history))
        assert claim.outcome == "claimed" and claim.decision == whole
        await svc.turn_abandoned("s")
        # A length that is not the last turn's is refused, not guessed at.
        with pytest.raises(ValueError, match="prefix_len"):
            await svc.begin_turn("s", alice, added, prefix_digest(history), len(history) - 1)

    asyncio.run(story())


def held_cluster(handover_wait_s: float = 5.0) -> Cluster:
    c = Cluster()
    c.new_service(handover_wait_s=handover_wait_s)
    c.fake(HeldHandOver)
    return c


def test_a_turns_last_token_does_not_wait_for_its_hand_over_to_the_service() -> None:
    c = held_cluster()
    service = c.kv
    assert isinstance(service, HeldHandOver)
    router = c.router()

    async def story() -> None:
        chunks = [
            chunk
            async for chunk, _ in router.run_turn(
                Turn(prompt_token_ids=S1_T1, max_tokens=3, session_id="s1", request_id="r-1")
            )
        ]
        # The client has every token, the finished one included, while the service
        # has not yet been handed the turn...
        assert chunks[-1].finished and service.booked == []
        settled = asyncio.ensure_future(router.settled())
        await asyncio.sleep(0)
        assert not settled.done()
        # ...which it books once it gets it: the next turn pulls what decode kept.
        service.release.set()
        await settled
        assert [d.session_id for d in service.booked] == ["s1"]
        second = [
            r
            async for _, r in router.run_turn(
                Turn(prompt_token_ids=S1_T2, max_tokens=3, session_id="s1", request_id="r-2")
            )
        ]
        assert second[-1].kv_source == "sent_back"
        await router.settled()

    asyncio.run(story())


def test_the_next_turn_waits_for_the_last_turns_hand_over_then_claims() -> None:
    alice = Principal(name="alice")

    async def story(handover_wait_s: float) -> tuple[str, str]:
        c = held_cluster(handover_wait_s)
        service = c.kv
        assert isinstance(service, HeldHandOver)
        router = c.router()
        assert (await service.begin_turn("s1", alice, S1_T1, None)).outcome == "claimed"
        async for _ in router.run_turn(
            Turn(prompt_token_ids=S1_T1, max_tokens=3, session_id="s1", request_id="r-1")
        ):
            pass
        # The client's next turn arrives before the finished one is handed over.
        nxt = asyncio.ensure_future(service.begin_turn("s1", alice, S1_T2, None))
        await asyncio.sleep(0)
        early = nxt.done()
        service.release.set()
        await router.settled()
        claim = await nxt
        return ("done early" if early else "waited"), claim.outcome

    # It waits for the hand-over and is then claimed (with the booked record)...
    assert asyncio.run(story(5.0)) == ("waited", "claimed")
    # ...but not forever: with no wait, a turn still running is refused (409).
    assert asyncio.run(story(0.0)) == ("done early", "turn_in_progress")


def test_a_failed_hand_over_is_counted_and_ends_the_sessions_claim() -> None:
    c = Cluster()
    alice = Principal(name="alice")

    class Unreachable(ServiceFake):
        async def turn_done(self, done: TurnDone) -> Handover:
            raise DeadlineExceeded("the KV service did not answer turn_done in time")

    c.new_service(handover_wait_s=0.0)
    service = c.fake(Unreachable)
    router = c.router()

    async def story() -> str:
        assert (await service.begin_turn("s1", alice, S1_T1, None)).outcome == "claimed"
        reports = [
            r
            async for _, r in router.run_turn(
                Turn(prompt_token_ids=S1_T1, max_tokens=3, session_id="s1", request_id="r-1")
            )
        ]
        assert reports[-1].finish_reason == "length"  # the client's turn completed
        await router.settled()
        # The claim was ended: the session's next turn is not refused as running.
        return (await service.begin_turn("s1", alice, S1_T2, None)).outcome

    assert asyncio.run(story()) == "claimed"
    assert router.metrics.snapshot()["kvtide_turn_handover_failures_total"] == 1


class HoldTurnDone:
    """A service wrapper that holds each ``turn_done`` until ``release`` and logs the
    order in which calls end."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self.release = asyncio.Event()
        self.ended: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.service, name)
        if name not in API_METHODS:
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            if name == "turn_done":
                await self.release.wait()
            result = await attr(*args, **kwargs)
            self.ended.append(name)
            return result

        return call


def test_reading_a_session_after_its_turn_sees_the_turn(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer, kv=HoldTurnDone)
    held = ingress.kv

    async def story() -> dict[str, Any]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        request, _ = http_request(CHAT, json.dumps(body).encode(), {"x-session-id": "s9"})
        response = await ingress.routes.edge.traced(request, "chat", ingress.routes.own.chat)
        assert response.status_code == 200  # answered; its hand-over is still held
        get, _ = http_request("/kvtide/sessions/s9", method="GET")
        read = asyncio.ensure_future(ingress.routes.operator.get_session("s9", get))
        for _ in range(100):  # let the read run as far as it can without the hand-over
            await asyncio.sleep(0)
        held.release.set()
        info: dict[str, Any] = await read
        return info

    info = asyncio.run(story())
    # The read waited for this replica's hand-over: it shows the turn's record.
    assert held.ended[-2:] == ["turn_done", "session"]
    assert info["record"] is not None


def test_a_turns_hand_over_carries_only_what_it_added(tiny_tokenizer: Any) -> None:
    first, _, log = two_ingresses(tiny_tokenizer)
    chat = Chat("s5")
    chat.turn(first, "What is kept?")
    chat.turn(first, "And after?")
    sent = log.handed[-1]
    turn2 = decode_prompts(first)[1]
    # Turn 1's prompt and answer (the service's last turn) are not sent again, nor the
    # next turn's ids (this turn's, whole)...
    assert sent.prefix_len == len(decode_prompts(first)[0]) + 3
    assert sent.token_ids == [*turn2[sent.prefix_len :], 11, 12, 13]
    assert sent.next_token_ids is None and sent.next_len == len(turn2) + 3
    # ...and the service booked the whole turn.
    service: KVService = first.kv.service
    assert list(service.tokens.token_ids("s5") or ()) == [*turn2, 11, 12, 13]


def test_a_hand_over_naming_another_last_turn_is_refused_then_sent_whole() -> None:
    c = Cluster()
    svc = c.service
    svc.tokens.remember("s", "t", [1, 2, 3], c.clock())
    added = TurnDone(
        session_id="s",
        token_ids=[4, 5],
        next_text="t45",
        prefix_len=3,
        prefix_digest=prefix_digest([1, 2, 3]),
        next_len=5,
    )
    whole = svc.whole(added)
    assert whole is not None and whole.token_ids == [1, 2, 3, 4, 5]
    assert whole.next_token_ids == [1, 2, 3, 4, 5] and whole.prefix_len == 0
    stale = msgspec.structs.replace(added, prefix_digest=prefix_digest([1, 2, 9]))
    assert svc.whole(stale) is None
    assert not asyncio.run(svc.turn_done(stale)).accepted  # nothing booked from a guess
    assert list(svc.tokens.token_ids("s") or ()) == [1, 2, 3]
