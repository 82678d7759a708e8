"""BoundedMap: put order, bounds by count and bytes, expiry with the clock passed in."""

from __future__ import annotations

import pytest

from orchestrator.bounded import BoundedMap


def test_a_put_past_the_count_bound_drops_and_returns_the_oldest() -> None:
    book: BoundedMap[str, int] = BoundedMap(max_entries=2)
    assert book.put("a", 1) == [] and book.put("b", 2) == []
    # Putting "a" again makes it the newest, so "b" is now the oldest.
    assert book.put("a", 10) == []
    assert book.put("c", 3) == [("b", 2)]
    assert list(book.items()) == [("a", 10), ("c", 3)]


def test_the_byte_bound_counts_every_entry_and_a_too_large_entry_drops_itself() -> None:
    book: BoundedMap[str, str] = BoundedMap(max_bytes=100)
    book.put("a", "x", size=40)
    book.put("b", "y", size=40)
    assert book.num_bytes == 80
    # 40 + 40 + 30 > 100: the oldest goes.
    assert book.put("c", "z", size=30) == [("a", "x")] and book.num_bytes == 70
    assert book.pop("b") == "y" and book.num_bytes == 30
    # Larger than the whole book: everything goes, the new entry too.
    assert book.put("d", "w", size=101) == [("c", "z"), ("d", "w")]
    assert len(book) == 0 and book.num_bytes == 0


def test_expiry_drops_from_the_oldest_end_and_reads_hide_expired_entries() -> None:
    book: BoundedMap[str, int] = BoundedMap()
    book.put("a", 1, expires_s=10.0)
    book.put("b", 2, expires_s=20.0)
    assert book.get("a", now_s=9.9) == 1
    assert book.get("a", now_s=10.0) is None and "a" in book  # hidden, not dropped
    assert book.expire(10.0) == [("a", 1)]
    assert book.expire(19.0) == [] and list(book) == ["b"]
    assert book.get("missing") is None and book.pop("missing") is None


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        BoundedMap(max_entries=0)
