"""Reuse turned off per engine pair, after an integrity check found a pull's KV wrong.

A sampled turn that pulled kept KV back is computed again without reuse, off the
client's path (``orchestrator.router.integrity``); when its first tokens' log
probabilities differ beyond the tolerance, the router reports an ``IntegrityMismatch``
naming the pull's engines: the prefill engine that pulled, and the source engine that
kept the KV. The service books the pair here and turns reuse off for it: fail closed,
until an operator turns it back on (``POST /kvtide/integrity/reuse``, ``kvtide
integrity``).

What "off for the pair" can mean is bounded by when the plan is made: a turn's KV plan
is made before its prefill engine is chosen (Serve's routing picks the replica after),
so a plan cannot tell which prefill engine would pull. The books therefore refuse any
pull *from* a source engine that a disabled pair names (``KVLifecycle.set_reuse_off``):
its sessions recompute, with the reason ``integrity_check_failed``, on every prefill
engine. The pair is what is booked, shown and turned back on; with several pairs on
one source engine, reuse from it returns when the last is turned back on.

The pairs outlive a service restart: each is written to the service's durable store
(Ray's GCS under Ray, ``orchestrator.kv.durable``) as ``reuse_off/<n>:<prefill><source>``
(``n`` the prefill engine id's length, so neither id needs a separator), its value the
mismatch as JSON, and read back when the service starts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from orchestrator.kv.durable import DurableStore
from orchestrator.kv.marks import entries
from orchestrator.kv.messages import IntegrityMismatch
from policies.kv_lifecycle import KVLifecycle

__all__ = ["REUSE_OFF_PREFIX", "ReuseOff", "pair_key"]

log = logging.getLogger("kvtide.kv_service")

REUSE_OFF_PREFIX = "reuse_off/"


def pair_key(prefill_engine_id: str, source_engine_id: str) -> str:
    """The pair's durable key (see the module)."""
    return f"{REUSE_OFF_PREFIX}{len(prefill_engine_id)}:{prefill_engine_id}{source_engine_id}"


class _Entry(msgspec.Struct, frozen=True, kw_only=True):
    mismatch: IntegrityMismatch
    since_wall_s: float


class ReuseOff:
    """The engine pairs whose reuse is off, mirrored into the KV books' set of engines no
    pull may read from. Single event loop."""

    def __init__(
        self, *, store: DurableStore, lifecycle: KVLifecycle, wall_clock: Callable[[], float]
    ) -> None:
        self.store = store
        self.lifecycle = lifecycle
        self.wall_clock = wall_clock
        self._pairs: dict[tuple[str, str], _Entry] = {}
        for key, raw in entries(store, REUSE_OFF_PREFIX):
            try:
                entry = msgspec.json.decode(raw, type=_Entry)
            except msgspec.DecodeError:
                log.warning("dropping an unreadable reuse-off mark %s", key)
                store.delete(REUSE_OFF_PREFIX + key)
                continue
            m = entry.mismatch
            self._pairs[(m.prefill_engine_id, m.source_engine_id)] = entry
        self._apply()

    def __len__(self) -> int:
        return len(self._pairs)

    async def turn_off(self, mismatch: IntegrityMismatch) -> bool:
        """Turn reuse off for the mismatch's pair; False when it was off already (the
        first mismatch stays booked)."""
        pair = (mismatch.prefill_engine_id, mismatch.source_engine_id)
        if pair in self._pairs:
            return False
        entry = _Entry(mismatch=mismatch, since_wall_s=self.wall_clock())
        self._pairs[pair] = entry
        self._apply()  # off before it is written: a write past its deadline keeps it off
        log.error(
            "reuse off for prefill engine %s and source engine %s: turn %s failed its KV "
            "integrity check (log probabilities off by up to %.4g); no turn pulls from %s "
            "until an operator turns it back on (POST /kvtide/integrity/reuse)",
            *pair,
            mismatch.request_id,
            mismatch.max_abs_diff,
            mismatch.source_engine_id,
        )
        # Off the service's event loop, within the store's deadline (``CallTimedOut``
        # past it: reuse stays off here, and a restarted service would not know it).
        await asyncio.to_thread(self.store.put, pair_key(*pair), msgspec.json.encode(entry))
        return True

    async def turn_on(self, prefill_engine_id: str, source_engine_id: str) -> bool:
        """An operator turns reuse back on for the pair; False when it was not off."""
        if self._pairs.pop((prefill_engine_id, source_engine_id), None) is None:
            return False
        self._apply()
        await asyncio.to_thread(self.store.delete, pair_key(prefill_engine_id, source_engine_id))
        log.warning(
            "reuse turned back on for prefill engine %s and source engine %s",
            prefill_engine_id,
            source_engine_id,
        )
        return True

    def _apply(self) -> None:
        self.lifecycle.set_reuse_off(source for _, source in self._pairs)

    def stats(self) -> list[dict[str, Any]]:
        """Each pair whose reuse is off, with the mismatch that turned it off."""
        return [
            {
                **msgspec.structs.asdict(entry.mismatch),
                "since_wall_s": round(entry.since_wall_s, 3),
            }
            for _, entry in sorted(self._pairs.items())
        ]
