"""The KV service actor killed and restarted by Ray keeps session owners and idempotent
turns (in Ray's GCS table), and its client answers within its deadline.

A Ray cluster of a head and one GPU host, and the real actor (no engines:
``prefill=None`` means no drains).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import ray
from fake_cluster import FakeCluster, fake_cluster
from ray._common.test_utils import wait_for_condition
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator.config.sections import ObservabilityConfig
from orchestrator.errors import ServiceUnavailable
from orchestrator.kv.actor import (
    SERVICE_NAMESPACE,
    get_or_create_service,
    host_store_prefix,
    lookup_app_host_stores,
    lookup_service,
    service_client,
)
from orchestrator.kv.decider import kv_lifecycle_config
from orchestrator.kv.host_nodes import NodeStores
from orchestrator.kv.host_tier import HostTierSpec
from orchestrator.kv.ownership import Principal

pytestmark = pytest.mark.ray

ALICE = Principal(name="alice")
MALLORY = Principal(name="mallory")


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeCluster]:
    with fake_cluster(
        ("head", {"num_cpus": 2}), {"gpu0": {"num_cpus": 1, "num_gpus": 1}}
    ) as cluster:
        yield cluster


def lifecycle() -> object:
    return kv_lifecycle_config(
        ttl_s=480,
        safety_margin_s=15,
        recompute_threshold_tokens=4,
        kv_bytes_per_token=100,
        block_size_tokens=16,
    )


def test_owners_and_replays_survive_a_killed_service_actor(fake: FakeCluster) -> None:
    handle = get_or_create_service(
        "durable-test", lifecycle(), None, drain_timeout_s=5.0, num_prefill_engines=1
    )
    kv = service_client(handle, timeout_s=30.0)

    async def before() -> str:
        assert (await kv.claim_session("s1", ALICE)).outcome == "claimed"
        await kv.turn_abandoned("s1")
        assert (await kv.replay_begin("k1")).action == "run"
        await kv.replay_complete("k1", {"id": "chatcmpl-1"})
        return str(ray.get(handle.epoch.remote()))

    epoch = asyncio.run(before())
    ray.kill(handle, no_restart=False)  # Ray restarts it with empty memory
    wait_for_condition(lambda: ray.get(handle.epoch.remote()) != epoch, timeout=60)

    async def after() -> None:
        assert (await kv.claim_session("s1", MALLORY)).outcome == "not_found"
        assert not await kv.session_owned("s1", MALLORY)
        replay = await kv.replay_begin("k1")
        assert (replay.action, replay.body) == ("replay", {"id": "chatcmpl-1"})
        assert (await kv.claim_session("s1", ALICE)).outcome == "claimed"

    asyncio.run(after())
    ray.kill(handle, no_restart=True)


def test_a_call_to_a_service_that_does_not_answer_is_503_within_its_deadline(
    fake: FakeCluster,
) -> None:
    handle = get_or_create_service(
        "deadline-test", lifecycle(), None, drain_timeout_s=5.0, num_prefill_engines=1
    )
    ray.get(handle.epoch.remote())
    ray.kill(handle, no_restart=True)  # gone for good: every call fails
    kv = service_client(handle, timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(ServiceUnavailable) as caught:
        asyncio.run(kv.decide_turn("s1", [1, 2, 3]))
    assert time.monotonic() - started < 5.0
    body = caught.value.body()["error"]
    assert body["code"] == "service_unavailable" and "Actor" not in str(body)
    assert caught.value.headers()["Retry-After"] == "1"


def test_a_changed_config_replaces_the_service_and_keeps_its_owners(fake: FakeCluster) -> None:
    first = get_or_create_service(
        "redeploy-test", lifecycle(), None, drain_timeout_s=5.0, num_prefill_engines=1
    )
    kv = service_client(first, timeout_s=30.0)

    async def claim() -> None:
        assert (await kv.claim_session("s1", ALICE)).outcome == "claimed"
        await kv.turn_abandoned("s1")

    asyncio.run(claim())
    epoch = ray.get(first.epoch.remote())
    # The same config again (another ingress replica): the same actor.
    same = get_or_create_service(
        "redeploy-test", lifecycle(), None, drain_timeout_s=5.0, num_prefill_engines=1
    )
    assert ray.get(same.epoch.remote()) == epoch
    # A redeploy with a longer TTL: a new actor with the new config, same owners.
    changed = kv_lifecycle_config(
        ttl_s=900,
        safety_margin_s=15,
        recompute_threshold_tokens=4,
        kv_bytes_per_token=100,
        block_size_tokens=16,
    )
    new = get_or_create_service(
        "redeploy-test", changed, None, drain_timeout_s=5.0, num_prefill_engines=1
    )
    assert ray.get(new.epoch.remote()) != epoch
    assert ray.get(new.config.remote()).config == changed
    kv = service_client(new, timeout_s=30.0)
    assert asyncio.run(kv.claim_session("s1", MALLORY)).outcome == "not_found"
    # A redeploy that changes only the request deadline (how long a running turn's
    # claim holds), the hosts' call deadline (the kept-blocks check's margin), the
    # prefill pool's size or observability: the running actor would keep the old ones,
    # so it is replaced too.
    started: dict[str, object] = {"drain_timeout_s": 5.0, "num_prefill_engines": 1}
    for change in (
        {"running_grace_s": 30.0},
        {"call_timeout_s": 5.0},
        {"num_prefill_engines": 2},
        {"observability": ObservabilityConfig(metrics=False)},
    ):
        epoch = ray.get(new.epoch.remote())
        started |= change
        new = get_or_create_service("redeploy-test", changed, None, **started)  # type: ignore[arg-type]
        assert ray.get(new.epoch.remote()) != epoch, change
        setup = ray.get(new.config.remote())
        assert all(getattr(setup, k) == v for k, v in change.items()), (change, setup)
    ray.kill(new, no_restart=True)


def test_the_service_runs_on_the_head_host_whoever_starts_it(fake: FakeCluster) -> None:
    # An ingress replica on a GPU host starts it; losing that host must not take it.
    gpu0 = fake.nodes["gpu0"].node_id
    config = lifecycle()

    # Defined here so that Ray ships it by value (the worker cannot import this module).
    def start_from_this_host() -> tuple[str, str]:
        from orchestrator.kv.actor import get_or_create_service

        handle = get_or_create_service(
            "head-test", config, None, drain_timeout_s=5.0, num_prefill_engines=1
        )
        ray.get(handle.epoch.remote())
        return ray.get_runtime_context().get_node_id(), handle._actor_id.hex()

    task = ray.remote(num_cpus=0)(start_from_this_host).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(gpu0, soft=False)
    )
    starter, actor_id = ray.get(task.remote(), timeout=120)
    assert starter == gpu0
    from ray._private.state import actors  # the GCS actor table

    assert actors(actor_id)["Address"]["NodeID"] == fake.nodes["head"].node_id
    ray.kill(lookup_service("head-test"), no_restart=True)


def test_host_stores_start_on_evicting_nodes_outlive_a_restart_and_stop_with_the_tier(
    fake: FakeCluster,
) -> None:
    spec = HostTierSpec(capacity_bytes=16 * 2**20, ttl_s=60.0)
    handle = get_or_create_service(
        "host-test", lifecycle(), None, drain_timeout_s=5.0, num_prefill_engines=1, host_tier=spec
    )
    assert lookup_app_host_stores("host-test") == []  # started on first use, where needed
    # A decode engine on gpu0 (as its host's heartbeats say) evicts: its copy goes to a
    # store on gpu0; an engine the service has not heard of yet, to the service's node.
    gpu0, head = fake.node_id("gpu0"), fake.node_id("head")
    stores = NodeStores(
        spec,
        host_store_prefix("host-test"),
        SERVICE_NAMESPACE,
        node_of={"decode-gpu0": gpu0}.get,
        home_node=head,
    )
    on_gpu0, _ = asyncio.run(stores.store_for("decode-gpu0"))
    on_head, _ = asyncio.run(stores.store_for("decode-new"))
    assert _actor_node(on_gpu0) == gpu0 and _actor_node(on_head) == head
    assert len(lookup_app_host_stores("host-test")) == 2
    before = {a._actor_id for a in lookup_app_host_stores("host-test")}
    epoch = ray.get(handle.epoch.remote())
    # The service dies and Ray restarts it: the stores (and the copies they hold) stay.
    ray.kill(handle, no_restart=False)
    wait_for_condition(
        lambda: _answers(handle) and ray.get(handle.epoch.remote()) != epoch, timeout=60
    )
    assert {a._actor_id for a in lookup_app_host_stores("host-test")} == before
    # Redeployed without a tier: the stores go with it.
    get_or_create_service(
        "host-test", lifecycle(), None, drain_timeout_s=5.0, num_prefill_engines=1
    )
    wait_for_condition(lambda: lookup_app_host_stores("host-test") == [], timeout=60)


def _actor_node(name: str) -> str:
    store = ray.get_actor(name, namespace=SERVICE_NAMESPACE)
    return str(ray.get(store.stats.remote(), timeout=30)["node_id"])


def _answers(handle: object) -> bool:
    try:
        ray.get(handle.epoch.remote(), timeout=5)  # type: ignore[attr-defined]
    except Exception:
        return False
    return True
