"""The prefill deployment's Serve request router (``orchestrator.cluster.prefix_router``),
driven as Serve drives it — ``update_replicas``, ``choose_replicas`` with the pending
request, ``on_request_routed`` with the replica that took it — against hand-written
replicas that answer Serve's queue-length probe. No Ray is started."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from ray import cloudpickle
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve._private.request_router.common import PendingRequest

from engines.base import GenerateRequest
from orchestrator.cluster import route_notes
from orchestrator.cluster.deadlines import CallTimedOut
from orchestrator.cluster.prefix_router import PrefixAwareRouter, prefill_router_config
from policies.prefix_routing import PrefixRoutingSettings

DEPLOYMENT = DeploymentID(name="prefill-pool", app_name="kvtide")
BLOCK = 4


class FakeReplica:
    """What Serve's router reads of a running replica, and its queue-length answer."""

    def __init__(self, name: str, queue_len: int = 0) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.queue_len = queue_len
        self.max_ongoing_requests = 8
        self.node_id = "node"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def pending(request_id: str, prompt: list[int]) -> PendingRequest:
    request = GenerateRequest(request_id=request_id, prompt_token_ids=prompt, max_tokens=1)
    return PendingRequest(
        args=[request],
        kwargs={},
        metadata=RequestMetadata(request_id=request_id, internal_request_id=uuid.uuid4().hex),
    )


class Serve:
    """Serve's side of one routing: offer the request, send it to a replica."""

    def __init__(
        self, replicas: list[FakeReplica], router_cls: type[PrefixAwareRouter] = PrefixAwareRouter
    ) -> None:
        self.router = router_cls(
            deployment_id=DEPLOYMENT,
            handle_source=DeploymentHandleSource.UNKNOWN,
            self_node_id="node",
            use_replica_queue_len_cache=True,
            prefer_local_node_routing=False,
        )
        self.router.initialize_state(
            block_size_tokens=BLOCK, imbalance_threshold=2, max_index_entries=1000, ttl_s=600.0
        )
        self.replicas = replicas
        self.router.update_replicas(replicas)  # type: ignore[arg-type]

    async def offer(self, request_id: str, prompt: list[int]) -> tuple[PendingRequest, list[str]]:
        pr = pending(request_id, prompt)
        ranks = await self.router.choose_replicas(self.replicas, pr)  # type: ignore[arg-type]
        return pr, [r.replica_id.unique_id for rank in ranks for r in rank]

    async def route(self, request_id: str, prompt: list[int], sent_to: str | None = None) -> str:
        """Offer the request and send it to the first replica offered (or ``sent_to``)."""
        pr, order = await self.offer(request_id, prompt)
        target = sent_to or order[0]
        self.router.on_request_routed(
            pr, ReplicaID(unique_id=target, deployment_id=DEPLOYMENT), None
        )  # type: ignore[arg-type]
        return target


def test_a_conversation_stays_on_the_replica_that_computed_its_history() -> None:
    async def story() -> None:
        serve = Serve([FakeReplica("r0"), FakeReplica("r1")])
        a1, b1 = list(range(10)), list(range(100, 110))  # 2 full blocks each
        first_a = await serve.route("a-1", a1)
        note = route_notes.take("a-1")
        assert note is not None and (note.replica, note.reason) == (first_a, "least_loaded")
        # A new conversation goes to the other idle replica (it holds fewer blocks).
        first_b = await serve.route("b-1", b1)
        assert first_b != first_a
        # Turn 2 of each: its history's blocks are on its first replica, offered first.
        _, order = await serve.offer("a-2", [*a1, 1, 2, 3, 4, 5, 6])
        assert order == [first_a, first_b]
        assert await serve.route("b-2", [*b1, 9, 9, 9, 9]) == first_b
        note = route_notes.take("b-2")
        assert note is not None
        assert (note.reason, note.num_matched_tokens) == ("prefix_match", 2 * BLOCK)

    asyncio.run(story())


def test_a_busy_replica_loses_the_prompt_to_the_least_loaded() -> None:
    async def story() -> None:
        busy, idle = FakeReplica("r0"), FakeReplica("r1")
        serve = Serve([busy, idle])
        history = list(range(12))
        assert await serve.route("t1", history, sent_to="r0") == "r0"
        route_notes.take("t1")
        # r0 now runs 3 more requests than r1, over the threshold of 2.
        serve.router._replica_queue_len_cache.update(busy.replica_id, 3)
        serve.router._replica_queue_len_cache.update(idle.replica_id, 0)
        assert await serve.route("t2", [*history, 5, 5, 5, 5]) == "r1"
        note = route_notes.take("t2")
        assert note is not None and (note.replica, note.reason) == ("r1", "load_imbalance")

    asyncio.run(story())


def test_serve_sending_elsewhere_is_what_gets_recorded() -> None:
    async def story() -> None:
        serve = Serve([FakeReplica("r0"), FakeReplica("r1")])
        history = list(range(8))
        _, order = await serve.offer("x", history)
        other = order[1]
        # The first choice's queue was full: Serve sent the request to the other one.
        pr, _ = await serve.offer("t1", history)
        serve.router.on_request_routed(
            pr, ReplicaID(unique_id=other, deployment_id=DEPLOYMENT), None
        )  # type: ignore[arg-type]
        note = route_notes.take("t1")
        assert note is not None and (note.replica, note.reason) == (other, "load_imbalance")
        # The next turn follows the blocks to where they were computed.
        assert await serve.route("t2", [*history, 1, 1, 1, 1]) == other

    asyncio.run(story())


def test_a_replica_that_leaves_takes_its_blocks_with_it() -> None:
    async def story() -> None:
        r0, r1 = FakeReplica("r0"), FakeReplica("r1")
        serve = Serve([r0, r1])
        history = list(range(8))
        await serve.route("t1", history, sent_to="r0")
        serve.router.update_replicas([r1])  # type: ignore[list-item]
        serve.replicas = [r1]
        serve.router.update_replicas([r0, r1])  # type: ignore[list-item]
        serve.replicas = [r0, r1]
        # r0 came back empty: nothing matches, the least loaded with fewest blocks wins.
        await serve.route("t2", [*history, 1, 1, 1, 1])
        note = route_notes.take("t2")
        assert note is not None and note.reason == "least_loaded"

    asyncio.run(story())


def test_the_turn_reads_the_note_when_serve_ships_both_sides_by_value() -> None:
    """Serve ships the router class by value (``RequestRouterConfig`` cloudpickles its
    module), and the ingress class too (``@serve.ingress`` wraps it in a local class
    that closes over it): a function shipped by value carries copies of the objects it
    names. The router and the turn must still meet in this process's one book."""

    def ingress_init() -> Any:  # local, so pickled by value like the ingress class
        return route_notes.take  # what Ingress hands the Router as prefill_routes

    take = cloudpickle.loads(cloudpickle.dumps(ingress_init))()
    # The router class as a replica gets it (in this process cloudpickle hands back
    # the class it pickled; a replica's process builds a copy).
    config = prefill_router_config(PrefixRoutingSettings(block_size_tokens=BLOCK))
    shipped = config.get_request_router_class()

    async def story() -> None:
        serve = Serve([FakeReplica("r0"), FakeReplica("r1")], router_cls=shipped)
        replica = await serve.route("s-1", list(range(8)))
        note = take("s-1")
        assert note is not None and (note.replica, note.reason) == (replica, "least_loaded")

    asyncio.run(story())


def test_an_endpoint_lookup_past_its_deadline_routes_without_it_and_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The GCS does not answer the lookup of the engine's KV-event endpoint within its
    # deadline (orchestrator.cluster.kv_events.lookup_endpoint: 1 s).
    asked: list[str] = []

    def lookup(replica: str) -> str | None:
        asked.append(replica)
        raise CallTimedOut("the GCS lookup of an engine's KV events endpoint", 1.0)

    # Where the router's method finds it: once Serve has shipped the class by value
    # (the test above), its methods' globals are a copy of the module's.
    monkeypatch.setitem(PrefixAwareRouter._find_publishers.__globals__, "lookup_endpoint", lookup)

    async def story() -> None:
        serve = Serve([FakeReplica("a"), FakeReplica("b")])
        serve.router.initialize_state(
            block_size_tokens=BLOCK,
            imbalance_threshold=2,
            max_index_entries=1000,
            ttl_s=600.0,
            kv_events=True,
        )
        now = [100.0]
        serve.router._clock = lambda: now[0]
        prompt = list(range(16))
        # Routed all the same, by kvtide's record alone.
        first = await serve.route("r1", prompt)
        assert sorted(asked) == ["a", "b"]
        # Looked up again later: not within the second, then once it has passed.
        assert await serve.route("r2", prompt) == first and sorted(asked) == ["a", "b"]
        now[0] += 1.0
        assert await serve.route("r3", prompt) == first and sorted(asked) == ["a", "a", "b", "b"]

    asyncio.run(story())
