"""Where each prefill request was routed and why, from the request router to the turn.

Serve's request router (``orchestrator.cluster.prefix_router``) runs in the process of
the handle that sends the request (the ingress replica), possibly on a loop thread of
its own; it ``put``\\ s each routed request's ``RouteChoice`` here under the kvtide
request id, and the turn (``orchestrator.router``) ``take``\\ s it once the prefill has
answered (Serve calls the router's ``on_request_routed`` before the request's first
result comes back). Bounded: notes nobody takes (a request that failed before it was
routed) fall out, oldest first. Thread-safe; no Ray.

The routers also count the engine blocks their KV cache events reported
(``count_events``; the ingress reads ``event_counts`` into its metrics).

Callers use the module functions ``put`` and ``take``, never the book itself: Serve
ships both callers *by value* (cloudpickle copies the router class, and the ingress
class that ``@serve.ingress`` wraps), and a by-value function carries a copy of every
object it names, so a caller naming the book would hold a copy nobody else writes to.
A module-level function is pickled by name and reaches this process's one book.
"""

from __future__ import annotations

import threading

from orchestrator.bounded import BoundedMap
from policies.prefix_routing import RouteChoice

__all__ = ["RouteNotes", "count_events", "event_counts", "put", "take"]


class RouteNotes:
    """At most ``max_entries`` notes, keyed by request id."""

    def __init__(self, max_entries: int = 4096) -> None:
        self._notes: BoundedMap[str, RouteChoice] = BoundedMap(max_entries=max_entries)
        self._lock = threading.Lock()

    def put(self, request_id: str, choice: RouteChoice) -> None:
        with self._lock:
            self._notes.put(request_id, choice)

    def take(self, request_id: str) -> RouteChoice | None:
        """The note of ``request_id``, removed; None when there is none."""
        with self._lock:
            return self._notes.pop(request_id)


_NOTES = RouteNotes()  # this process's book (one per ingress replica process)


def put(request_id: str, choice: RouteChoice) -> None:
    """Note where ``request_id`` was routed and why, in this process's book."""
    _NOTES.put(request_id, choice)


def take(request_id: str) -> RouteChoice | None:
    """The note of ``request_id`` from this process's book, removed; None when none."""
    return _NOTES.take(request_id)


_EVENTS_LOCK = threading.Lock()
_EVENTS: dict[str, int] = {"stored": 0, "removed": 0, "unchained": 0}


def count_events(*, stored: int = 0, removed: int = 0, unchained: int = 0) -> None:
    """Engine blocks the prefix routers of this process heard reported as cached
    (``stored``), evicted (``removed``), or cached after a block they never heard of
    (``unchained``: not matched)."""
    with _EVENTS_LOCK:
        _EVENTS["stored"] += stored
        _EVENTS["removed"] += removed
        _EVENTS["unchained"] += unchained


def event_counts() -> dict[str, int]:
    """This process's totals of ``count_events``."""
    with _EVENTS_LOCK:
        return dict(_EVENTS)
