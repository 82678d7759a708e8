"""Every GCS call on a turn's or an eviction's path has a deadline: a GCS that does not
answer (a fake that hangs until the test ends) costs the caller its deadline and a
``CallTimedOut`` naming the call, never a wait as long as the hang.

Each story's deadline is 0.2 s; the caller must be back within a second of it (the box
is shared and loaded), far short of the hang."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.cluster.deadlines import CallTimedOut, call_within, call_within_async
from orchestrator.kv.actor import EpochWatcher
from orchestrator.kv.durable import BoundedStore, MemoryStore, WriteBehind
from orchestrator.kv.host_nodes import NodeStores
from orchestrator.kv.host_tier import HostTierClient, HostTierSpec
from orchestrator.kv.integrity import ReuseOff, pair_key
from orchestrator.kv.messages import Beat, IntegrityMismatch, LedgerReport
from policies.kv_lifecycle import KVLifecycle

DEADLINE_S = 0.2
BACK_WITHIN_S = DEADLINE_S + 1.0


@pytest.fixture
def gcs_down() -> Iterator[threading.Event]:
    """Set when the GCS answers again: every hung call ends with the test."""
    answers = threading.Event()
    yield answers
    answers.set()


def timed(call: Callable[[], Any]) -> tuple[BaseException | None, float]:
    started = time.monotonic()
    try:
        call()
    except BaseException as exc:
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


class HangingStore(MemoryStore):
    """A durable store whose writes of keys in ``hang_on`` wait for the GCS."""

    def __init__(self, gcs_up: threading.Event, hang_on: Callable[[str], bool]) -> None:
        super().__init__()
        self.gcs_up = gcs_up
        self.hang_on = hang_on

    def put(self, key: str, value: bytes) -> None:
        if self.hang_on(key):
            self.gcs_up.wait()
        super().put(key, value)

    def delete(self, key: str) -> None:
        if self.hang_on(key):
            self.gcs_up.wait()
        super().delete(key)


def test_a_hung_call_returns_at_its_deadline_naming_the_call(gcs_down: threading.Event) -> None:
    exc, took_s = timed(lambda: call_within(gcs_down.wait, DEADLINE_S, "the GCS lookup of x"))
    assert isinstance(exc, CallTimedOut)
    assert str(exc) == "the GCS lookup of x did not answer within 0.2 s"
    assert DEADLINE_S <= took_s < BACK_WITHIN_S
    # An answer in time, and the call's own error, come through as they are.
    assert call_within(lambda: 7, DEADLINE_S, "x") == 7
    with pytest.raises(TimeoutError, match="its own") as own:
        call_within(lambda: (_ for _ in ()).throw(TimeoutError("its own")), DEADLINE_S, "x")
    assert not isinstance(own.value, CallTimedOut)


def test_an_event_loop_runs_on_while_a_call_hangs(gcs_down: threading.Event) -> None:
    async def story() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        with pytest.raises(CallTimedOut, match="the start of host store s"):
            await call_within_async(gcs_down.wait, DEADLINE_S, "the start of host store s")
        ticker.cancel()
        return ticks

    assert asyncio.run(story()) >= 5  # the loop was not held by the call


def test_a_durable_put_returns_at_its_deadline(gcs_down: threading.Event) -> None:
    store = BoundedStore(HangingStore(gcs_down, lambda _: True), timeout_s=DEADLINE_S)
    exc, took_s = timed(lambda: store.put("owner/s1", b"k"))
    assert isinstance(exc, CallTimedOut) and "owner/s1" in str(exc)
    assert took_s < BACK_WITHIN_S


def test_a_hung_mark_write_holds_no_later_mark(gcs_down: threading.Event) -> None:
    # The write of s1's mark hangs; the marks made after it land, in order, and the
    # hung one is counted.
    store = HangingStore(gcs_down, lambda key: key == "running/s1")
    marks = WriteBehind(store, timeout_s=DEADLINE_S)

    async def story() -> float:
        marks.put("running/s1", b"1")
        marks.put("running/s2", b"2")
        marks.delete("running/s2")
        marks.put("running/s3", b"3")
        started = time.monotonic()
        await marks.flush()
        return time.monotonic() - started

    assert asyncio.run(story()) < BACK_WITHIN_S
    assert store.data == {"running/s3": b"3"}
    assert marks.num_failed == 1


def test_reuse_turned_off_stays_off_when_its_write_hangs(gcs_down: threading.Event) -> None:
    lifecycle = KVLifecycle()
    store = BoundedStore(HangingStore(gcs_down, lambda _: True), timeout_s=DEADLINE_S)
    reuse_off = ReuseOff(store=store, lifecycle=lifecycle, wall_clock=lambda: 0.0)
    mismatch = IntegrityMismatch(prefill_engine_id="P", source_engine_id="D", max_abs_diff=1)
    ticks = 0

    async def story() -> None:
        async def tick() -> None:  # the service's other calls, meanwhile
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        try:
            await reuse_off.turn_off(mismatch)
        finally:
            ticker.cancel()

    exc, took_s = timed(lambda: asyncio.run(story()))
    assert isinstance(exc, CallTimedOut) and pair_key("P", "D") in str(exc)
    assert took_s < BACK_WITHIN_S
    assert ticks >= 5  # the write waited off the service's event loop
    # Fail closed: no pull reads from D, though the store does not know it.
    assert lifecycle.reuse_off == frozenset({"D"})


def test_a_hung_store_start_frees_its_node_for_the_next_take_in(
    gcs_down: threading.Event,
) -> None:
    # The first start on node A hangs (its GCS calls never answer); the next take-in for
    # A starts the store again instead of waiting on the first for ever.
    started: list[str] = []
    ready = HostTierClient(lambda *_: asyncio.sleep(0), timeout_s=1.0)

    def start(spec: HostTierSpec, name: str, namespace: str, node: str) -> HostTierClient:
        started.append(name)
        if len(started) == 1:
            gcs_down.wait()
        return ready

    stores = NodeStores(
        HostTierSpec(capacity_bytes=2**20, ttl_s=60.0),
        "kvtide-host-app",
        "kvtide",
        node_of=lambda _: "A" * 56,
        home_node="head",
        start=start,
        find=dict,
        start_timeout_s=DEADLINE_S,
    )

    async def story() -> tuple[BaseException | None, float, HostTierClient]:
        t0 = time.monotonic()
        try:
            await stores.store_for("decode-a")
            first: BaseException | None = None
        except CallTimedOut as exc:
            first = exc
        took_s = time.monotonic() - t0
        _, client = await asyncio.wait_for(stores.store_for("decode-a"), BACK_WITHIN_S)
        return first, took_s, client

    first, took_s, client = asyncio.run(story())
    assert isinstance(first, CallTimedOut)
    assert str(first).startswith("the start of host store kvtide-host-app.AAAAAAAAAAAA")
    assert took_s < BACK_WITHIN_S
    assert client is ready and len(started) == 2


def test_an_engine_hosts_heartbeat_returns_when_the_service_lookup_hangs(
    gcs_down: threading.Event,
) -> None:
    def lookup() -> None:
        gcs_down.wait()  # ray.get_actor with the GCS gone

    watcher = EpochWatcher(
        lookup, lambda: LedgerReport(engine_id="e", role="decode"), timeout_s=DEADLINE_S
    )

    async def story() -> tuple[BaseException | None, float]:
        t0 = time.monotonic()
        try:
            await watcher.check_once()
        except CallTimedOut as exc:
            return exc, time.monotonic() - t0
        return None, time.monotonic() - t0

    exc, took_s = asyncio.run(story())
    assert isinstance(exc, CallTimedOut) and "the KV service's lookup" in str(exc)
    assert took_s < BACK_WITHIN_S


def test_the_bounds_docs_reliability_states_are_the_ones_the_code_uses() -> None:
    """The stories above run at 0.2 s; these are the bounds they stand for in
    docs/reliability.md#nothing-waits-forever (and the config's defaults it quotes)."""
    from orchestrator.cluster.deadlines import GCS_TIMEOUT_S
    from orchestrator.cluster.kv_events import LOOKUP_TIMEOUT_S
    from orchestrator.config import parse_config
    from orchestrator.kv.actor import TICK_S
    from orchestrator.kv.service_settings import ServiceSettings
    from orchestrator.kv.turn_leases import HANDOVER_WAIT_S
    from orchestrator.serve.warm_up import warm_up_transfers

    def default(call: Callable[..., Any], name: str) -> Any:
        return inspect.signature(call).parameters[name].default

    assert GCS_TIMEOUT_S == 5.0 and default(WriteBehind, "timeout_s") == GCS_TIMEOUT_S
    assert LOOKUP_TIMEOUT_S == 1.0
    assert default(NodeStores, "start_timeout_s") == 130.0
    assert default(warm_up_transfers, "attempts") == 3
    assert HANDOVER_WAIT_S == 5.0
    # A heartbeat that fails is sent again next second; its ledger in pages of 4 MiB.
    assert default(EpochWatcher, "period_s") == TICK_S == 1.0
    assert default(EpochWatcher, "page_bytes") == 4 * 2**20
    config = parse_config({})
    server, kv = config.server, config.kv
    assert (server.request_body_timeout_s, server.request_timeout_s) == (30.0, 600.0)
    assert server.max_request_bytes == 4 * 2**20
    assert (kv.pull_timeout_s, kv.service_timeout_s, kv.service_start_timeout_s) == (30, 30, 120)
    assert (kv.kept_check_grace_s, kv.decoder_kv_blocks_ttl_s) == (60.0, 480.0)
    assert kv.replay_max_mib == 64.0
    # Sessions the service holds in all (docs/reliability.md#sessions-stay-owned).
    assert default(ServiceSettings, "max_sessions") == 50_000


def test_a_heartbeat_the_service_does_not_answer_in_time_is_sent_again_next_period() -> None:
    beats: list[float] = []
    answered = asyncio.Event()

    class Method:
        def __init__(self, answer: Callable[[], Any]) -> None:
            self.answer = answer

        def remote(self, *args: Any) -> Any:
            return self.answer()

    async def heartbeat() -> Beat:
        beats.append(time.monotonic())
        if len(beats) == 1:
            await asyncio.Event().wait()  # the service does not answer this one
        answered.set()
        return Beat(epoch="e1")

    async def restore() -> None:
        return None

    service = SimpleNamespace(heartbeat=Method(heartbeat), restore=Method(restore))
    watcher = EpochWatcher(
        lambda: service,
        lambda: LedgerReport(engine_id="e", role="decode"),
        engine_id="e",
        timeout_s=DEADLINE_S,
        period_s=0.05,
    )

    async def story() -> None:
        beating = asyncio.ensure_future(watcher.run_forever())
        try:
            await asyncio.wait_for(answered.wait(), BACK_WITHIN_S + 1.0)
        finally:
            beating.cancel()

    asyncio.run(story())
    # The first beat was given up at its deadline, the next sent a period later.
    assert len(beats) == 2 and beats[1] - beats[0] < BACK_WITHIN_S + 0.05
    assert watcher.reported_epoch == "e1"
