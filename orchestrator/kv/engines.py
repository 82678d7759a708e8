"""The engine hosts the KV service hears from: each engine's shards' nodes, its last
heartbeat and the counters it sent with it.

An engine host calls ``heartbeat`` every second. One silent for ``silence_s``, or with a
shard on a lost node, is lost (``lose``): its KV is gone, so the KV booked on it is
dropped and no session's next turn is decided to read it; those turns recompute at once
instead of waiting on a pull. Single event loop; the service's clock readings come in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from engines.decode_path import STOCK
from orchestrator.kv.decider import KVDecider
from orchestrator.kv.drains import Drains

__all__ = ["EngineRegistry", "count_decode_paths", "engine_pool"]


def engine_pool(engine_id: str) -> str:
    """The pool of an engine hosted by ``EngineHost`` (its id is ``<pool>-<replica id>``)."""
    return engine_id.rsplit("-", 1)[0]


def count_decode_paths(books: Iterable[dict[str, Any]]) -> dict[str, int]:
    """How many of the engines' books report each decode path (``EngineStats``)."""
    counts: dict[str, int] = {}
    for book in books:
        path = str(book.get("decode_path") or STOCK)
        counts[path] = counts.get(path, 0) + 1
    return dict(sorted(counts.items()))


class EngineRegistry:
    """Live engines by id: the nodes their shards run on, when each was last heard of,
    and the latest counters each reported."""

    def __init__(self, *, silence_s: float, decider: KVDecider, drains: Drains) -> None:
        self.silence_s = silence_s
        self.decider = decider
        self.drains = drains
        self.counters = dict.fromkeys(("engines_lost", "sessions_lost"), 0)
        # engine id -> (the nodes its shards run on, last heartbeat)
        self._seen: dict[str, tuple[tuple[str, ...], float]] = {}
        self._stats: dict[str, dict[str, Any]] = {}
        # holder engine id -> request ids of its kept blocks that peers read, not yet
        # taken by its host (``peer_reads``)
        self._read_by_peers: dict[str, list[str]] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def heartbeat(
        self, engine_id: str, node_ids: Sequence[str], stats: dict[str, Any] | None, now: float
    ) -> None:
        self._seen[engine_id] = (tuple(node_ids), now)
        if stats is not None:
            self._stats[engine_id] = stats

    def peer_reads(self, engine_id: str, reads: Sequence[tuple[str, str]]) -> list[str]:
        """``engine_id``'s host read the kept blocks ``reads`` (holder engine id, request
        id) of live engines; returns those of ``engine_id``'s own kept blocks that its
        peers read since it last asked."""
        for holder, request_id in reads:
            if holder in self._seen:
                self._read_by_peers.setdefault(holder, []).append(request_id)
        return self._read_by_peers.pop(engine_id, [])

    def lose(self, engine_ids: Sequence[str], now: float) -> int:
        """Engines that died (their node was lost, or they went silent): forgotten, and
        the KV booked on them dropped. Returns the sessions whose KV was dropped."""
        dropped = 0
        for engine_id in engine_ids:
            self._seen.pop(engine_id, None)
            self._stats.pop(engine_id, None)
            self._read_by_peers.pop(engine_id, None)
            effects = self.decider.lifecycle.on_engine_lost(engine_id, now)
            self.counters["engines_lost"] += 1
            dropped += len(effects)
            self.drains.apply(effects)  # never drainable: nothing is left to read
        self.counters["sessions_lost"] += dropped
        return dropped

    def lose_silent(self, now: float) -> None:
        """Lose the engines not heard of for more than ``silence_s``."""
        silent = [e for e, (_, seen) in self._seen.items() if now - seen > self.silence_s]
        if silent:
            self.lose(silent, now)

    def lose_nodes(self, node_ids: Iterable[str], now: float) -> list[str]:
        """Lose every engine with a shard on ``node_ids`` (a TP engine that lost a rank
        is lost); returns their ids, sorted."""
        gone = set(node_ids)
        lost = sorted(e for e, (nodes, _) in self._seen.items() if gone.intersection(nodes))
        if lost:
            self.lose(lost, now)
        return lost

    def loads(self, now: float) -> dict[str, dict[str, float]]:
        """Each live engine's load as its last heartbeat reported it (requests running
        and waiting, KV cache use, requests finished, and a decode engine's prefill time
        per token where its host measured one) and ``age_s``, how long ago."""
        loads: dict[str, dict[str, float]] = {}
        for engine_id, stats in self._stats.items():
            seen = self._seen.get(engine_id)
            if seen is None:
                continue
            loads[engine_id] = {
                "num_running": stats.get("num_running", 0),
                "num_waiting": stats.get("num_waiting", 0),
                "kv_cache_usage": stats.get("kv_cache_usage", 0.0),
                "num_requests": stats.get("num_requests", 0),
                "age_s": max(0.0, now - seen[1]),
            }
            measured = stats.get("prefill_s_per_token")
            if measured is not None:  # a decode engine's, measured by its host at start
                loads[engine_id]["prefill_s_per_token"] = measured
            chunk = stats.get("prefill_chunk_tokens")
            if chunk is not None:  # the chunk its in-place prefills run in
                loads[engine_id]["prefill_chunk_tokens"] = chunk
        return loads

    def by_decode_path(self) -> dict[str, dict[str, int]]:
        """Per pool, how many live engines run each decode path (from their heartbeats)."""
        by_pool: dict[str, list[dict[str, Any]]] = {}
        for engine_id, stats in self._stats.items():
            by_pool.setdefault(engine_pool(engine_id), []).append(stats)
        return {pool: count_decode_paths(books) for pool, books in sorted(by_pool.items())}

    def nodes(self) -> dict[str, tuple[str, ...]]:
        """The nodes of each live engine's shards, as its host reported them."""
        return {e: nodes for e, (nodes, _) in self._seen.items()}

    def stats(self) -> dict[str, dict[str, Any]]:
        """The latest counters of each engine, by id."""
        return dict(sorted(self._stats.items()))
