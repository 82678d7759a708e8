"""The Responses API's book on its own (``orchestrator.serve.responses_api``): what it
keeps of each response, its bounds in bytes, and which sessions it closes. vLLM's
serving class writes through ``book.messages`` and ``book.responses`` as here; the
clock is the test's."""

from __future__ import annotations

import pytest

from orchestrator.errors import LimitExceeded
from orchestrator.serve.responses_api import ResponseBook, json_size


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make_book(clock: Clock, max_bytes: int = 1000, per_key: int = 1000) -> ResponseBook:
    return ResponseBook(
        max_bytes=max_bytes, max_bytes_per_key=per_key, ttl_s=480.0, pending_s=600.0, clock=clock
    )


def stored(book: ResponseBook, rid: str, owner: str, size: int, previous: str | None = None) -> str:
    """A request that completes: vLLM stores its messages, then its response."""
    session = book.begin(rid, owner, previous=previous, store=True)
    assert session is not None
    book.messages[rid] = ["m" * (size - 4)]  # ["mmm…"]: size bytes as JSON
    book.responses[rid] = {}
    book.settle(rid, completed=True)
    return session


def test_what_vllm_stores_is_counted_as_json_and_given_back_when_dropped() -> None:
    book = make_book(Clock())
    stored(book, "r1", "a", 300)
    assert book.num_bytes == book.bytes_of("a") == 300 + json_size({})
    assert "r1" in book.responses and list(book.messages) == ["r1"]
    book.drop("r1")
    assert book.num_bytes == 0 and "r1" not in book.messages
    assert book.take_sessions_to_close() == ["r1"]


def test_responses_still_being_stored_that_fill_the_store_refuse_a_new_one() -> None:
    book = make_book(Clock())
    stored(book, "old", "a", 300)
    book.begin("running", "a", previous=None, store=True)
    book.messages["running"] = ["m" * 596]  # 600 bytes, its request still running
    book.begin("new", "b", previous=None, store=True)
    with pytest.raises(LimitExceeded) as refused:
        book.messages["new"] = ["m" * 446]  # 450 more: only the running one could go
    assert refused.value.code == "response_store_full"
    assert refused.value.headers() == {"Retry-After": "1"}
    assert "old" in book.responses and book.bytes_of("b") == 0  # nothing dropped for it
    # Alone over a key's bound: refused as too large, whatever is stored.
    with pytest.raises(LimitExceeded) as refused:
        book.messages["new"] = ["m" * 1200]
    assert refused.value.code == "response_too_large_to_store"
    book.settle("new", completed=False)  # refused before its turn: no session to close
    assert book.take_sessions_to_close() == []


def test_a_request_refused_before_vllm_stored_anything_closes_nothing() -> None:
    book = make_book(Clock())
    assert book.begin("r1", "a", previous=None, store=True) == "r1"
    book.settle("r1", completed=False)  # refused by vLLM's validation: no turn ran
    assert book.take_sessions_to_close() == [] and book.num_bytes == 0


def test_a_continuation_that_fails_leaves_the_chain_to_the_response_it_continued() -> None:
    book = make_book(Clock())
    assert stored(book, "r1", "a", 100) == "r1"
    assert book.begin("r2", "a", previous="r1", store=True) == "r1"
    book.settle("r2", completed=False)
    assert book.take_sessions_to_close() == []  # r1's KV is still the session's
    assert book.begin("r3", "a", previous="r1", store=True) == "r1"  # not a fork
    assert book.begin("r4", "a", previous="r1", store=True) == "r4"  # a fork


def test_an_expired_or_dropped_response_closes_its_session_only_if_nobody_continued_it() -> None:
    clock = Clock()
    book = make_book(clock)
    stored(book, "r1", "a", 100)
    clock.now_s += 10
    stored(book, "r2", "a", 100, previous="r1")
    book.drop("r1")
    assert book.take_sessions_to_close() == []  # the session's KV is r2's
    clock.now_s += 480
    assert not book.owns("r2", "a")  # expired
    assert book.take_sessions_to_close() == ["r1"] and book.num_bytes == 0


def test_a_request_that_never_ends_gives_its_bytes_back_at_its_deadline() -> None:
    clock = Clock()
    book = make_book(clock)
    book.begin("lost", "a", previous=None, store=True)
    book.messages["lost"] = ["m" * 200]
    assert book.num_bytes > 0
    clock.now_s += 600
    book.owns("x", "a")  # any use of the book expires what is due
    assert book.num_bytes == 0 and book.take_sessions_to_close() == ["lost"]
