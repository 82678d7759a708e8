"""Prefix-aware routing of prefill requests: a Ray Serve request router.

With ``routing.prefix_aware`` the prefill deployment's ``request_router_config`` names
``PrefixAwareRouter`` (``prefill_router_config``). Serve builds one router per deployment
handle, in the process holding the handle: the ingress replica. For each
``generate(GenerateRequest)`` call it hashes the prompt's token ids in blocks, asks
``policies.prefix_routing`` for the replica holding the longest prefix (balanced against
the replicas' queue lengths, from Serve's queue-length cache or a probe), and offers Serve
that replica first, the others after it (Serve skips a replica whose queue is full). When
Serve has sent the request (``on_request_routed``, with the replica that accepted it), the
router records the prompt's blocks against that replica and leaves its choice and reason
in ``orchestrator.cluster.route_notes`` for the turn's report.

The index lives in each router, so each ingress replica keeps its own (best effort, as
Ray Serve LLM's prefix router in local mode): with several ingress replicas a
conversation's turns reach the same prefill replica only when they reach the same
ingress replica. A request that is not a ``GenerateRequest`` (or a handle without
Serve's rejection protocol, which never calls ``on_request_routed``) is routed by
Serve's power-of-two choice and leaves no note.

With ``routing.prefix_kv_events`` the index also hears from the engines themselves
(``orchestrator.cluster.kv_events``): the blocks each prefill engine reports caching
count as held there (``policies.prefix_routing.EngineBlocks`` maps the engine's block
hashes to the index's), and those it reports evicting stop counting. The events arrive
on a thread of their own; a lock keeps the index whole.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ray.serve._private.replica_result import ReplicaResult
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from engines.base import GenerateRequest
from engines.kv_events import EventBatch
from orchestrator.bounded import BoundedMap
from orchestrator.cluster import route_notes
from orchestrator.cluster.kv_events import KVEventsSubscriber, apply_kv_events, lookup_endpoint
from policies.prefix_routing import (
    EngineBlocks,
    PrefixRouter,
    PrefixRoutingSettings,
    RouteChoice,
)

__all__ = ["PrefixAwareRouter", "prefill_router_config"]

# Serve pickles this module *by value* with the router class (``RequestRouterConfig``):
# its functions carry copies of the module-level objects they use. The notes must be
# this process's own book, so they are reached through ``route_notes.put`` (a module
# function, pickled by name).

log = logging.getLogger("kvtide.prefix_router")

# Routed-but-not-yet-sent requests remembered (one per request being routed).
_MAX_PENDING = 4096
# How often a replica whose events endpoint was not registered yet is looked up again.
_LOOKUP_EVERY_S = 1.0


def prefill_router_config(
    settings: PrefixRoutingSettings, *, kv_events: bool = False
) -> RequestRouterConfig:
    """The prefill deployment's ``request_router_config`` for prefix-aware routing
    (``kv_events``: also from the engines' KV cache events)."""
    return RequestRouterConfig(
        request_router_class=f"{__name__}.PrefixAwareRouter",
        request_router_kwargs={
            "block_size_tokens": settings.block_size_tokens,
            "imbalance_threshold": settings.imbalance_threshold,
            "max_index_entries": settings.max_index_entries,
            "ttl_s": settings.ttl_s,
            "kv_events": kv_events,
        },
    )


def _request_of(pending: PendingRequest | None) -> GenerateRequest | None:
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    return first if isinstance(first, GenerateRequest) else None


class PrefixAwareRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Serve's request router for a prefill deployment (see the module docstring).
    Replicas are named by ``ReplicaID.unique_id``, the suffix of their engine ids."""

    def initialize_state(self, **kwargs: Any) -> None:
        kv_events = bool(kwargs.pop("kv_events", False))
        self._prefix = PrefixRouter(PrefixRoutingSettings(**kwargs))
        self._clock = time.monotonic
        self._lock = threading.Lock()  # the index, against the events thread
        self._engines: dict[str, EngineBlocks] = {}
        self._looked_up: dict[str, float] = {}
        self._events = KVEventsSubscriber(self._apply_events) if kv_events else None
        # internal request id -> (the prompt's block hashes, the choice offered to Serve)
        self._routing: BoundedMap[str, tuple[list[int], RouteChoice]] = BoundedMap(
            max_entries=_MAX_PENDING
        )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        request = _request_of(pending_request)
        if request is None or not candidate_replicas:
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(
                self, candidate_replicas, pending_request
            )
        assert pending_request is not None
        loads = await self._queue_lengths(candidate_replicas)
        if not loads:  # no replica answered: let Serve probe them all
            return [candidate_replicas]
        if len(loads) < len(candidate_replicas):
            log.warning(
                "prefill routing chose among %s: %d of %d replicas did not report their "
                "queue length in time",
                sorted(loads),
                len(candidate_replicas) - len(loads),
                len(candidate_replicas),
            )
        self._find_publishers(candidate_replicas)
        hashes = self._prefix.hashes(request.prompt_token_ids)
        with self._lock:
            choice = self._prefix.choose(hashes, loads, self._clock())
        key = pending_request.metadata.internal_request_id
        self._routing.put(key, (hashes, choice))
        first = [r for r in candidate_replicas if r.replica_id.unique_id == choice.replica]
        rest = sorted(
            (r for r in candidate_replicas if r.replica_id.unique_id != choice.replica),
            key=lambda r: loads.get(r.replica_id.unique_id, r.max_ongoing_requests),
        )
        return [ranks for ranks in (first, rest) if ranks]

    async def _queue_lengths(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Each replica's requests in flight: Serve's cached figure, else a probe
        (replicas that do not answer are left out)."""
        loads: dict[str, int] = {}
        missing: list[RunningReplica] = []
        for r in replicas:
            queue_len = (
                self._replica_queue_len_cache.get(r.replica_id)
                if self._use_replica_queue_len_cache
                else None
            )
            if queue_len is None:
                missing.append(r)
            else:
                loads[r.replica_id.unique_id] = queue_len
        if missing:
            for r, queue_len in await self._probe_queue_lens(missing, 0):
                if queue_len is not None:
                    loads[r.replica_id.unique_id] = queue_len
        # Keep the candidates' order: ties in the policy go to the first given.
        order = [r.replica_id.unique_id for r in replicas]
        return {k: loads[k] for k in order if k in loads}

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        request = _request_of(pending_request)
        if request is None:
            return
        routing = self._routing.pop(pending_request.metadata.internal_request_id)
        if routing is None:
            return
        hashes, choice = routing
        replica = replica_id.unique_id
        if replica != choice.replica:
            # The chosen replica's queue was full: Serve sent it to a less loaded one.
            choice = RouteChoice(replica=replica, reason="load_imbalance")
        with self._lock:
            self._prefix.record(hashes, replica, self._clock())
        route_notes.put(request.request_id, choice)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = {r.unique_id for r in self._replica_id_set} - {
            r.replica_id.unique_id for r in replicas
        }
        super().update_replicas(replicas)
        for replica in gone:
            self._remove(replica)
        self._find_publishers(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._remove(replica_id.unique_id)

    def _remove(self, replica: str) -> None:
        if self._events is not None:
            self._events.unsubscribe(replica)
        self._looked_up.pop(replica, None)
        with self._lock:
            self._engines.pop(replica, None)
            self._prefix.remove_replica(replica)

    # ---- the engines' KV cache events ------------------------------------------------

    def _find_publishers(self, replicas: list[RunningReplica]) -> None:
        """Subscribe to the events of replicas not subscribed yet whose engines registered
        an endpoint (looked up at most every ``_LOOKUP_EVERY_S`` per replica)."""
        events = self._events
        if events is None:
            return
        now = self._clock()
        for r in replicas:
            replica = r.replica_id.unique_id
            if events.subscribed(replica) or now - self._looked_up.get(replica, -1e9) < (
                _LOOKUP_EVERY_S
            ):
                continue
            self._looked_up[replica] = now
            try:
                endpoint = lookup_endpoint(replica)
            except Exception:  # the GCS is unreachable: routed by kvtide's record alone
                continue
            if endpoint is not None:
                events.subscribe(replica, endpoint)

    def _apply_events(self, replica: str, batch: EventBatch) -> None:
        """One batch of ``replica``'s engine's events, into the index (events thread)."""
        with self._lock:
            counts = apply_kv_events(self._prefix, self._engines, replica, batch, self._clock())
        route_notes.count_events(**counts)
