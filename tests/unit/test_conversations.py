"""Conversations without a session header (``orchestrator.kv.conversations``): found
again by their text, per API key, and served as turns of an unnamed session so that
their KV is kept and pulled back like a named session's."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ingress_harness import MODEL, bare_ingress, handle

from orchestrator.kv.conversations import ConversationIndex, is_unnamed, key_tag
from orchestrator.kv.ownership import ANONYMOUS
from orchestrator.kv.session_tokens import SessionTokens

CHAT = "/v1/chat/completions"


def test_the_longest_last_turn_a_text_extends_is_found_for_its_key_only() -> None:
    alice, bob = key_tag("alice"), key_tag("bob")
    held = {
        f"~{alice}.short": "system: be brief. user: hi",
        f"~{alice}.long": "system: be brief. user: hi assistant: hello user: more",
        f"~{bob}.other": "system: be brief. user: hi assistant: hello user: more",
    }
    index = ConversationIndex(chunk_chars=8)
    for sid, text in held.items():
        index.file(sid, text)

    def find(text: str, key: str = "alice") -> str | None:
        return index.find(key, text, held.get)

    nxt = held[f"~{alice}.long"] + " assistant: ok user: again"
    assert find(nxt) == f"~{alice}.long"  # the longest last turn it extends
    assert find(held[f"~{alice}.short"] + " assistant: x") == f"~{alice}.short"
    # A history rewritten before its end matches nothing (but the shorter turn it
    # still extends)...
    assert find("system: be brief. user: hi assistant: HELLO user: more!") == f"~{alice}.short"
    assert find("system: be BRIEF. user: hi assistant: hello user: more!") is None
    # ...nor does a last turn itself (nothing new to run); another key finds its own.
    assert find(held[f"~{alice}.long"]) == f"~{alice}.short"
    assert find(nxt, key="bob") == f"~{bob}.other"
    assert find(nxt, key="carol") is None


def test_a_forgotten_or_expired_last_turn_is_not_found() -> None:
    tokens = SessionTokens(ttl_s=100.0)
    sid = tokens.conversations.new_session_id("alice")
    assert is_unnamed(sid) and not is_unnamed("s1")
    tokens.remember(sid, "user: hi assistant: hello", [1, 2, 3], now_s=0.0)
    assert tokens.find_conversation("alice", "user: hi assistant: hello user: more", 50.0) == sid
    assert tokens.find_conversation("bob", "user: hi assistant: hello user: more", 50.0) is None
    assert tokens.find_conversation("alice", "user: hi assistant: hello user: more", 150.0) is None
    tokens.remember(sid, "user: hi assistant: hello", [1, 2, 3], now_s=200.0)
    tokens.forget(sid)
    assert tokens.find_conversation("alice", "user: hi assistant: hello user: more", 201.0) is None
    assert len(tokens.conversations) == 0


def test_the_index_stays_within_its_bounds() -> None:
    tokens = SessionTokens(max_sessions=4)
    for i in range(10):
        sid = tokens.conversations.new_session_id("alice")
        tokens.remember(sid, f"user: question {i}", [i], now_s=0.0)
    assert len(tokens) == 4 and len(tokens.conversations) == 4


class Client:
    """An OpenAI chat client that sends its whole history and no x-session-id."""

    def __init__(self, ingress: Any) -> None:
        self.ingress = ingress
        self.messages: list[dict[str, str]] = []
        self.headers: list[dict[str, str]] = []

    def turn(self, question: str) -> dict[str, Any]:
        self.messages.append({"role": "user", "content": question})
        body = json.dumps({"model": MODEL, "messages": self.messages, "max_tokens": 3})
        status, reply = asyncio.run(handle(self.ingress, CHAT, body.encode()))
        assert status == 200, reply
        self.messages.append(reply["choices"][0]["message"])
        return dict(reply["kvtide"])


def decode_requests(ingress: Any) -> list[Any]:
    return list(ingress.router.decode.requests)


def test_a_history_only_client_gets_a_session_of_its_own_from_its_second_turn(
    tiny_tokenizer: Any,
) -> None:
    ingress = bare_ingress(tiny_tokenizer)
    client = Client(ingress)
    first = client.turn("What is kept?")
    # One question, no history: nothing says another turn comes; decode keeps nothing.
    assert first["conversation"] is None and first["session_id"] is None
    second = client.turn("And after?")
    # History (an assistant message): an unnamed session, its KV kept by decode.
    assert second["conversation"] == "started" and second["session_id"] is None
    third = client.turn("And then?")
    assert third["conversation"] == "continued" and third["session_id"] is None
    keep = [r.kv_transfer_params.kvtide_keep is True for r in decode_requests(ingress)]
    assert keep == [False, True, True]
    # Turn 3 continues from the tokens the model generated in turn 2 (exact ids), so the
    # KV plan compares it with the kept record (no prefix mismatch).
    turn2, turn3 = (list(r.prompt_token_ids) for r in decode_requests(ingress)[1:])
    assert turn3[: len(turn2) + 3] == [*turn2, 11, 12, 13]
    assert third["kv_plan_reason"] != "prefix_mismatch"
    counters = ingress.metrics.snapshot()
    assert counters['kvtide_conversation_turns_total{outcome="started"}'] == 1
    assert counters['kvtide_conversation_turns_total{outcome="continued"}'] == 1


def test_the_same_history_sent_while_its_turn_runs_is_served_without_the_session(
    tiny_tokenizer: Any,
) -> None:
    ingress = bare_ingress(tiny_tokenizer)
    ingress.kv.handover_wait_s = 0.0
    client = Client(ingress)
    client.turn("What is kept?")
    client.turn("And after?")
    [sid] = list(ingress.session_tokens.conversations._cut_of)
    assert asyncio.run(ingress.kv.claim_session(sid, ANONYMOUS)).outcome == "claimed"
    busy = client.turn("And then?")  # the conversation's session is running: no 409
    assert busy["conversation"] == "unmatched"
    assert decode_requests(ingress)[-1].kv_transfer_params.kvtide_keep is not True


def test_switched_off_a_request_without_the_header_keeps_nothing(tiny_tokenizer: Any) -> None:
    ingress = bare_ingress(tiny_tokenizer, routing={"reuse_without_session": False})
    client = Client(ingress)
    for question in ("What is kept?", "And after?", "And then?"):
        assert client.turn(question)["conversation"] is None
    keep = [r.kv_transfer_params.kvtide_keep is True for r in decode_requests(ingress)]
    assert keep == [False] * 3
