"""Prefix-aware choice of a prefill replica: send a prompt where its prefix was computed.

A vLLM engine keeps the KV of the prompts it prefilled in its prefix cache, in blocks of
``block_size`` tokens, each block keyed by a hash of every token up to its end. A
conversation sent without a session id carries its whole history every turn; the turn
reuses that history's KV only on the replica that computed the earlier turns. This
module remembers which replica recently computed which blocks and picks a replica by the
longest prefix it holds, balanced against load:

* ``block_hashes``: a prompt's full blocks as chained hashes (hash ``i`` covers tokens
  ``[0, (i + 1) * block_size)``, so equal hashes mean equal prefixes);
* ``PrefixIndex``: which replica computed which block hash and when, bounded by count
  (least recently used first out) and by age (entries older than ``ttl_s`` do not match);
* ``choose_replica``: the replica with the longest match, unless its queue is longer
  than the least loaded replica's by more than ``imbalance_threshold`` requests (then
  the least loaded); with no match, the least loaded, ties to the replica holding the
  fewest blocks (new conversations spread over the pool);
* ``PrefixRouter``: the index and the choice together, as a request router uses them;
* ``EngineBlocks``: one engine's own reports of the blocks it cached and evicted (vLLM's
  KV cache events), in this module's hashes: blocks that reached the engine another way
  (a read-back, another ingress's prompts) count, and evicted ones stop counting.

Without the engines' reports it is a guess, not a ledger: an engine may have evicted
blocks the index still lists, and a match only saves time when the engine still holds
them. Pure: time comes in as
``now_s``; nothing here knows Ray or the engines.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "EngineBlocks",
    "PrefixIndex",
    "PrefixRouter",
    "PrefixRoutingSettings",
    "RouteChoice",
    "RouteReason",
    "block_hashes",
    "choose_replica",
]

RouteReason = Literal["prefix_match", "least_loaded", "load_imbalance"]

# The chain's seed: the hash "before" the first block.
_ROOT = 0x6B767469646521


def block_hashes(token_ids: Sequence[int], block_size_tokens: int) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a partial last block has
    none: an engine caches full blocks only). Deterministic across processes: ints and
    tuples of ints hash the same in every Python process of one version."""
    if block_size_tokens < 1:
        raise ValueError(f"block_size_tokens must be at least 1, got {block_size_tokens}")
    return _chain(_ROOT, token_ids, block_size_tokens)


def _chain(parent: int, token_ids: Sequence[int], block_size_tokens: int) -> list[int]:
    """``block_hashes`` continued from ``parent`` (the hash of the tokens before)."""
    out: list[int] = []
    for end in range(block_size_tokens, len(token_ids) + 1, block_size_tokens):
        parent = hash((parent, tuple(token_ids[end - block_size_tokens : end])))
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixRoutingSettings:
    """How the prefix router hashes, remembers and balances."""

    block_size_tokens: int = 16
    # Queue-length lead (requests) the best-matching replica may have over the least
    # loaded one before load wins over the match.
    imbalance_threshold: int = 4
    # Block hashes remembered, all replicas together (the oldest go first).
    max_index_entries: int = 200_000
    # A block computed longer ago than this no longer counts as held.
    ttl_s: float = 600.0

    def __post_init__(self) -> None:
        if self.block_size_tokens < 1 or self.max_index_entries < 1 or self.ttl_s <= 0:
            raise ValueError(
                f"invalid prefix routing settings: {self}; block_size_tokens and "
                "max_index_entries must be at least 1 and ttl_s above 0"
            )
        if self.imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be >= 0, got {self.imbalance_threshold}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteChoice:
    """Where a prompt goes and why. ``num_matched_tokens``: the prefix the chosen
    replica is expected to hold (0 unless ``reason`` is ``prefix_match``)."""

    replica: str
    reason: RouteReason
    num_matched_tokens: int = 0


class PrefixIndex:
    """Which replica computed which block hash, and when (``now_s`` of the last time).

    Invariant: ``_holders[h]`` is exactly the set of replicas ``r`` with ``(h, r)`` in
    ``_seen``; ``_seen`` is ordered from least to most recently recorded and holds at
    most ``max_entries`` pairs.
    """

    __slots__ = ("_holders", "_per_replica", "_seen", "max_entries", "ttl_s")

    def __init__(self, *, max_entries: int, ttl_s: float) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._seen: OrderedDict[tuple[int, str], float] = OrderedDict()
        self._holders: dict[int, set[str]] = {}
        self._per_replica: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def num_blocks(self, replica: str) -> int:
        """Block hashes remembered for ``replica``."""
        return self._per_replica.get(replica, 0)

    def record(self, hashes: Iterable[int], replica: str, now_s: float) -> None:
        """``replica`` computed (or holds) these blocks at ``now_s``."""
        for h in hashes:
            key = (h, replica)
            if key in self._seen:
                self._seen.move_to_end(key)
            else:
                self._holders.setdefault(h, set()).add(replica)
                self._per_replica[replica] = self._per_replica.get(replica, 0) + 1
            self._seen[key] = now_s
        while len(self._seen) > self.max_entries:
            self._drop_oldest()
        self.prune(now_s)

    def prune(self, now_s: float) -> None:
        """Forget every entry older than ``ttl_s``."""
        while self._seen:
            oldest_s = next(iter(self._seen.values()))
            if now_s - oldest_s <= self.ttl_s:
                return
            self._drop_oldest()

    def match(self, hashes: Sequence[int], replicas: Iterable[str], now_s: float) -> dict[str, int]:
        """For each of ``replicas``, how many leading blocks of ``hashes`` it holds
        (entries past their TTL do not count)."""
        matched = dict.fromkeys(replicas, 0)
        alive = set(matched)
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            alive = {r for r in alive & holders if now_s - self._seen[(h, r)] <= self.ttl_s}
            if not alive:
                break
            for r in alive:
                matched[r] = i + 1
        return matched

    def forget(self, hashes: Iterable[int], replica: str) -> None:
        """``replica`` no longer holds these blocks (it evicted them)."""
        for h in hashes:
            if (h, replica) in self._seen:
                self._forget((h, replica))

    def remove_replica(self, replica: str) -> None:
        """Forget everything ``replica`` held (it left the pool). O(entries)."""
        for key in [k for k in self._seen if k[1] == replica]:
            self._forget(key)

    def _drop_oldest(self) -> None:
        key = next(iter(self._seen))
        self._forget(key)

    def _forget(self, key: tuple[int, str]) -> None:
        del self._seen[key]
        h, replica = key
        holders = self._holders[h]
        holders.discard(replica)
        if not holders:
            del self._holders[h]
        left = self._per_replica[replica] - 1
        if left:
            self._per_replica[replica] = left
        else:
            del self._per_replica[replica]


def choose_replica(
    matched_tokens: Mapping[str, int],
    loads: Mapping[str, int],
    *,
    imbalance_threshold: int,
    num_blocks: Mapping[str, int] | None = None,
) -> RouteChoice:
    """Pick one of ``loads``' replicas (their queue lengths) for a prompt.

    The replica with the longest match (``matched_tokens``; ties to the less loaded)
    wins unless its queue exceeds the least loaded replica's by more than
    ``imbalance_threshold``; then the least loaded (``load_imbalance``). With no match:
    the least loaded (``least_loaded``), ties to the replica holding the fewest blocks
    (``num_blocks``), then to the first given.
    """
    if not loads:
        raise ValueError("choose_replica needs at least one replica")
    order = {r: i for i, r in enumerate(loads)}
    held = num_blocks or {}
    least = min(loads, key=lambda r: (loads[r], held.get(r, 0), order[r]))
    best = max(loads, key=lambda r: (matched_tokens.get(r, 0), -loads[r], -order[r]))
    num_matched = matched_tokens.get(best, 0)
    if num_matched <= 0:
        return RouteChoice(replica=least, reason="least_loaded")
    if loads[best] - loads[least] > imbalance_threshold:
        return RouteChoice(replica=least, reason="load_imbalance")
    return RouteChoice(replica=best, reason="prefix_match", num_matched_tokens=num_matched)


class PrefixRouter:
    """The index and the choice: ``hashes`` once per prompt, ``choose`` among the live
    replicas, ``record`` where the prompt actually went."""

    __slots__ = ("index", "settings")

    def __init__(self, settings: PrefixRoutingSettings) -> None:
        self.settings = settings
        self.index = PrefixIndex(max_entries=settings.max_index_entries, ttl_s=settings.ttl_s)

    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        return block_hashes(token_ids, self.settings.block_size_tokens)

    def choose(self, hashes: Sequence[int], loads: Mapping[str, int], now_s: float) -> RouteChoice:
        """The replica for a prompt of ``hashes`` among ``loads``' replicas."""
        matched = self.index.match(hashes, loads, now_s)
        size = self.settings.block_size_tokens
        return choose_replica(
            {r: n * size for r, n in matched.items()},
            loads,
            imbalance_threshold=self.settings.imbalance_threshold,
            num_blocks={r: self.index.num_blocks(r) for r in loads},
        )

    def record(self, hashes: Sequence[int], replica: str, now_s: float) -> None:
        self.index.record(hashes, replica, now_s)

    def remove_replica(self, replica: str) -> None:
        self.index.remove_replica(replica)


class EngineBlocks:
    """One engine's cached blocks as its KV cache events report them, translated into
    ``block_hashes``' hashes.

    An engine names its blocks by hashes of its own (a block of ``engine_block_size``
    tokens, chained to its parent block's); a stored-blocks report carries the tokens, so
    each engine block maps to the hashes of its ``block_size_tokens``-token sub-blocks
    (the engine's block size must be a multiple of it). A report whose parent block is
    unknown here (reports were missed, or came before this subscription) cannot be
    chained and is skipped (``None``). Bounded: past ``max_blocks`` engine blocks the
    oldest mapping goes (its blocks then stay in the index until its TTL)."""

    __slots__ = ("_blocks", "block_size_tokens", "max_blocks")

    def __init__(self, block_size_tokens: int, *, max_blocks: int = 200_000) -> None:
        self.block_size_tokens = block_size_tokens
        self.max_blocks = max_blocks
        # engine block hash -> this module's hashes of its sub-blocks (the last one is
        # the chain's state after the block)
        self._blocks: OrderedDict[object, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def stored(
        self,
        engine_hashes: Sequence[object],
        parent: object | None,
        token_ids: Sequence[int],
        engine_block_size: int,
    ) -> list[int] | None:
        """The hashes of blocks the engine cached (``token_ids``: theirs, in order, after
        the block ``parent``; None: the first blocks of a prompt). None when they cannot
        be translated (unknown parent, a block size that is not a multiple)."""
        size = self.block_size_tokens
        if engine_block_size < size or engine_block_size % size:
            return None
        if parent is None:
            state = _ROOT
        else:
            known = self._blocks.get(parent)
            if not known:
                return None
            state = known[-1]
        out: list[int] = []
        for i, engine_hash in enumerate(engine_hashes):
            tokens = token_ids[i * engine_block_size : (i + 1) * engine_block_size]
            if len(tokens) < engine_block_size:
                break
            ours = _chain(state, tokens, size)
            state = ours[-1]
            self._blocks[engine_hash] = tuple(ours)
            self._blocks.move_to_end(engine_hash)
            out += ours
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
        return out

    def removed(self, engine_hashes: Iterable[object]) -> list[int]:
        """The hashes of blocks the engine evicted (those it reported storing)."""
        out: list[int] = []
        for engine_hash in engine_hashes:
            ours = self._blocks.pop(engine_hash, None)
            if ours is not None:
                out += ours
        return out

    def cleared(self) -> None:
        """The engine dropped its whole cache."""
        self._blocks.clear()
