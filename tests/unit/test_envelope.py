"""KV service calls through their messages (``orchestrator.kv.envelope``): what the
ingress and the service exchange through the Ray actor, encoded and decoded exactly as
``ServiceClient`` and the actor do, without Ray."""

from __future__ import annotations

import asyncio
from array import array
from typing import Any

import msgspec
import pytest
from test_turn_calls import Chat, two_ingresses

from engines.kv_params import KVTransferParams
from orchestrator.kv.envelope import decode_result, dispatch, encode_call
from orchestrator.kv.messages import Claim, KVDecision, TurnDone
from orchestrator.kv.ownership import Principal
from orchestrator.kv.service import API_METHODS, KVService
from orchestrator.kv.session_tokens import NO_PREFIX
from policies.kv_records import RecomputeReason


class Enveloped:
    """A ``KVServiceAPI`` whose every call travels as messages, as through the actor."""

    def __init__(self, service: KVService) -> None:
        self.service = service
        self.messages = 0

    def __getattr__(self, name: str) -> Any:
        if name not in API_METHODS:
            return getattr(self.service, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.messages += 1
            answer = await dispatch(self.service, encode_call(name, args, kwargs))
            return decode_result(name, answer)

        return call


def test_a_conversation_runs_the_same_with_every_service_call_as_messages(
    tiny_tokenizer: Any,
) -> None:
    first, second, wire = two_ingresses(tiny_tokenizer, Enveloped)
    chat = Chat("e1")
    assert chat.turn(first, "What is kept?")["kv_plan"] == "recompute"
    # The next turn on the other replica: told the last turn (a typed SessionPrefix),
    # tokenized again, claimed and planned (a typed Claim holding a KVDecision).
    reply = chat.turn(second, "And on another replica?")
    assert reply["kv_plan_reason"] == "cheaper_to_recompute"
    assert wire.messages >= 5
    stats = asyncio.run(wire.stats())
    assert stats["num_turns_running"] == 0


def test_arguments_and_answers_keep_their_types() -> None:
    alice = Principal(name="alice", max_sessions=3)
    message = encode_call("begin_turn", ("s", alice, [1, 2, 3]), {"prefix_digest": NO_PREFIX})
    assert message.startswith(b"begin_turn\0")
    done = TurnDone(
        session_id="s",
        token_ids=array("I", [1, 2, 3]),  # type: ignore[arg-type]  # as the books keep them
        kv_transfer_params=KVTransferParams(
            do_remote_decode=True, remote_engine_id="d", remote_block_ids=((4, 5),)
        ),
        kv_expires_in_s=30.0,
    )

    class Echo:
        async def begin_turn(self, *args: Any) -> Claim:
            assert args == ("s", alice, [1, 2, 3], NO_PREFIX, 0, None)  # defaults filled in
            assert type(args[1]) is Principal
            return Claim(
                outcome="claimed",
                decision=KVDecision(kind="recompute", reason=RecomputeReason.NO_RECORD),
            )

        async def turn_done(self, got: TurnDone) -> bool:
            assert got.token_ids == [1, 2, 3]
            assert got.kv_transfer_params == done.kv_transfer_params
            return True

    claim = decode_result("begin_turn", asyncio.run(dispatch(Echo(), message)))
    assert isinstance(claim, Claim) and isinstance(claim.decision, KVDecision)
    asyncio.run(dispatch(Echo(), encode_call("turn_done", (done,))))


def test_a_call_of_the_wrong_shape_is_refused_at_either_end() -> None:
    with pytest.raises(TypeError):
        encode_call("begin_turn", ("s",))  # a missing argument
    with pytest.raises(ValueError, match="not a KV service method"):
        encode_call("drop_everything", ())
    wrong = b"session\0" + msgspec.msgpack.encode([5])  # an int for a session id
    with pytest.raises(msgspec.ValidationError):
        asyncio.run(dispatch(object(), wrong))


def test_a_keyword_only_argument_reaches_the_service() -> None:
    # turn_abandoned(session_id, *, unread): an extended turn that failed offers its
    # record again only if ``unread`` arrives; a message that dropped it was refused.
    seen: list[tuple[Any, ...]] = []

    class Target:
        async def turn_abandoned(self, session_id: str | None, *, unread: bool = False) -> None:
            seen.append((session_id, unread))

    for kwargs, unread in (({"unread": True}, True), ({}, False)):
        answer = asyncio.run(dispatch(Target(), encode_call("turn_abandoned", ("s1",), kwargs)))
        assert decode_result("turn_abandoned", answer) is None
        assert seen[-1] == ("s1", unread)
