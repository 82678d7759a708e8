"""The ingress replicas' metric books, gathered at the KV service: each replica sends
its book every second (``report_metrics``) and ``/kvtide/stats`` sums the recent ones
(``merge_counters``). Single event loop; the service's clock readings come in."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["MetricsBook", "merge_counters"]


def merge_counters(books: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Sum metric books key by key (nested dicts recursively): counters and histogram
    counts from several replicas add up; a value that is not a number is kept from the
    first book that has it."""
    merged: dict[str, Any] = {}
    for book in books:
        for key, value in book.items():
            if isinstance(value, dict):
                merged[key] = merge_counters([merged.get(key) or {}, value])
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = merged.get(key, 0) + value
            else:
                merged.setdefault(key, value)
    return merged


class MetricsBook:
    """The latest metric book of each source (an ingress replica), with when it came.
    A source silent for more than ``silence_s`` is dropped when the books are read."""

    def __init__(self, *, silence_s: float) -> None:
        self.silence_s = silence_s
        self._by_source: dict[str, tuple[float, dict[str, Any]]] = {}

    def report(self, source: str, snapshot: dict[str, Any], now: float) -> None:
        self._by_source[source] = (now, snapshot)

    def recent(self, now: float) -> list[dict[str, Any]]:
        """The books reported within ``silence_s`` (older sources are dropped)."""
        for source, (seen, _) in list(self._by_source.items()):
            if now - seen > self.silence_s:
                del self._by_source[source]
        return [snapshot for _, snapshot in self._by_source.values()]
