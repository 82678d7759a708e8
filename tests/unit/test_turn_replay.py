"""Idempotent turns: the replay book that lets a retried request run its turn once."""

from __future__ import annotations

import pytest

from orchestrator.kv.replay import TurnReplayBook


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_a_key_runs_once_then_replays_its_response() -> None:
    book = TurnReplayBook(clock=Clock())
    assert book.begin("k").action == "run"
    assert book.begin("k").action == "in_progress"  # the retry came while it ran
    book.complete("k", {"id": "chatcmpl-1"})
    replay = book.begin("k")
    assert (replay.action, replay.body) == ("replay", {"id": "chatcmpl-1"})
    assert book.begin("other").action == "run"


def test_a_failed_turn_frees_its_key_for_the_retry() -> None:
    book = TurnReplayBook(clock=Clock())
    assert book.begin("k").action == "run"
    book.fail("k")
    assert book.begin("k").action == "run"
    book.complete("k", {"id": "x"})
    book.fail("k")  # a late failure report never drops a completed response
    assert book.begin("k").action == "replay"


def test_entries_expire_and_the_book_is_bounded() -> None:
    clock = Clock()
    book = TurnReplayBook(ttl_s=60.0, max_entries=3, clock=clock)
    for key in "abcd":
        book.begin(key)
        book.complete(key, {"id": key})
    assert len(book) == 3 and book.begin("a").action == "run"  # "a" was dropped first
    clock.now_s = 61.0
    assert book.begin("zz").action == "run"
    assert len(book) == 1  # everything older than the TTL is gone


def test_the_book_needs_room_for_one_entry() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        TurnReplayBook(max_entries=0, clock=Clock())


def test_a_key_completed_twice_is_counted_as_a_duplicate_run() -> None:
    book = TurnReplayBook(clock=Clock())
    book.begin("k")
    book.complete("k", {"id": "a"})
    assert book.num_duplicates == 0
    book.complete("k", {"id": "b"})  # the turn ran a second time somewhere
    assert book.num_duplicates == 1


def test_the_book_is_bounded_in_bytes() -> None:
    book = TurnReplayBook(max_bytes=2_000, clock=Clock())
    for key in "abcdef":
        book.begin(key)
        book.complete(key, {"id": key, "text": "x" * 500})
    assert book.num_bytes <= 2_000 and len(book) < 6
    assert book.begin("a").action == "run"  # the oldest went first
    assert book.begin("f").action == "replay"
