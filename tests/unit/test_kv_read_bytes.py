"""The KV bytes a turn moved, from the engine that read them.

vLLM's NIXL connector worker records each finished read's bytes (NIXL's transfer
telemetry) without saying whose they were. kvtide's connector (``engines/kv_connector.py``)
polls vLLM's reads one request at a time, so its stats list each read's request id; the
stats travel to the engine's front end with the scheduler stats, where the adapter's
stat logger books them by kvtide's request id, and the adapter hands them on the
request's first output (``GenerateChunk.kv_read_bytes``). Each step below runs vLLM's own
code where it can (its ``_pop_done_transfers``, its stats' aggregation, its
``SchedulerStats``), with a hand-written NIXL agent and front end around it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

import engines.kv_connector as kvc
from engines.base import EngineSpec, GenerateChunk, GenerateRequest, KVTransferSpec
from engines.kv_connector import READ_BYTES_KEY, READ_REQUESTS_KEY, pop_done_per_request
from engines.vllm_engine import VLLMEngine, _make_stat_logger, add_reads, engine_args_for

BLOCK_BYTES = 32 * 2_048  # a 32-token block of a model with 2,048 B of KV per token


# ---- the worker: which request each read was for ----------------------------------------


@dataclass
class Telemetry:
    """What NIXL's ``get_xfer_telemetry`` returns for a finished transfer (us, bytes)."""

    # NIXL's names.
    totalBytes: int
    xferDuration: int = 1_000
    postDuration: int = 10
    descCount: int = 1


@dataclass
class FakeNixlAgent:
    """Transfer handles by state, and each done handle's telemetry (None: NIXL gave none)."""

    states: dict[int, str]
    telemetry: dict[int, Telemetry | None]
    released: list[int] = field(default_factory=list)

    def check_xfer_state(self, handle: int) -> str:
        return self.states[handle]

    def get_xfer_telemetry(self, handle: int) -> Telemetry | None:
        return self.telemetry[handle]

    def release_xfer_handle(self, handle: int) -> None:
        self.released.append(handle)


class FakeWorker:
    """What vLLM's ``_pop_done_transfers`` reads of its worker on reads that finish."""

    def __init__(self, agent: FakeNixlAgent) -> None:
        self.nixl_wrapper = agent
        self.xfer_stats = kvc.NixlStats()


def vllms_pop(worker: FakeWorker) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
        NixlBaseConnectorWorker,
    )

    return functools.partial(NixlBaseConnectorWorker._pop_done_transfers, worker)


def test_each_finished_read_is_recorded_with_its_request_by_vllms_own_poll() -> None:
    # Request "a-1" read two blocks in two transfers, both done; "b-2" read one block
    # (done, but NIXL gave no telemetry) and has one transfer still running.
    agent = FakeNixlAgent(
        states={1: "DONE", 2: "DONE", 3: "DONE", 4: "PROC"},
        telemetry={1: Telemetry(BLOCK_BYTES), 2: Telemetry(BLOCK_BYTES), 3: None},
    )
    worker = FakeWorker(agent)
    transfers = {"a-1": [1, 2], "b-2": [3, 4]}
    done, failed = pop_done_per_request(vllms_pop(worker), transfers, worker.xfer_stats)
    # As vLLM's own poll: "a-1" is done and gone, "b-2" waits on handle 4.
    assert (done, failed) == ({"a-1"}, set())
    assert transfers == {"b-2": [4]}
    assert agent.released == [1, 2, 3]
    data = worker.xfer_stats.data
    assert data["bytes_transferred"] == [BLOCK_BYTES, BLOCK_BYTES]  # vLLM's own record
    assert data[READ_REQUESTS_KEY] == ["a-1", "a-1", "b-2"]
    assert data[READ_BYTES_KEY] == [BLOCK_BYTES, BLOCK_BYTES, None]
    assert worker.xfer_stats.reading is None  # nothing is noted outside a poll


def test_a_read_without_telemetry_is_still_news() -> None:
    # vLLM sends stats on only when they are not empty; a read NIXL gave no bytes for
    # must still reach the front end, or its request would look like it read nothing.
    agent = FakeNixlAgent(states={1: "DONE"}, telemetry={1: None})
    worker = FakeWorker(agent)
    pop_done_per_request(vllms_pop(worker), {"a-1": [1]}, worker.xfer_stats)
    assert not worker.xfer_stats.is_empty()
    assert kvc.NixlStats().is_empty()


def test_the_wrapper_keeps_the_poll_semantics_of_each_request() -> None:
    # A hand-written poll: handle 9 fails, odd handles are done, even ones running.
    seen: list[tuple[str | None, dict[str, list[int]]]] = []

    class Notes:
        reading: str | None = None

    notes = Notes()

    def pop(one: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        seen.append((notes.reading, dict(one)))
        ((req_id, handles),) = one.items()
        left = [h for h in handles if h % 2 == 0]
        if left:
            one[req_id] = left
        else:
            del one[req_id]
        return (set() if left else {req_id}), ({req_id} if 9 in handles else set())

    transfers = {"x": [1, 3], "y": [2, 5], "z": [9]}
    assert pop_done_per_request(pop, transfers, notes) == ({"x", "z"}, {"z"})
    assert transfers == {"y": [2]}
    assert seen == [("x", {"x": [1, 3]}), ("y", {"y": [2, 5]}), ("z", {"z": [9]})]
    assert notes.reading is None


# ---- from the workers to the front end ---------------------------------------------------


def test_the_stats_travel_to_the_front_end_and_are_booked_by_kvtides_request_id() -> None:
    from vllm.v1.metrics.stats import SchedulerStats

    # Two TP ranks read their halves of request "t1-d" (vLLM's internal id adds 8
    # characters); rank 0 also read for a request that ended here meanwhile.
    rank0, rank1 = kvc.NixlStats(), kvc.NixlStats()
    for stats, reads in (
        (rank0, [("t1-d-1a2b3c4d", 2), ("gone-0f0f0f0f", 1)]),
        (rank1, [("t1-d-1a2b3c4d", 2)]),
    ):
        for req_id, num_blocks in reads:
            stats.reading = req_id
            stats.record_transfer(Telemetry(num_blocks * BLOCK_BYTES))
            stats.reading = None
    # The engine core sums the ranks' stats and sends their data on (msgpack).
    step = rank0.clone_and_reset().aggregate(rank1.clone_and_reset())
    data = msgspec.msgpack.decode(msgspec.msgpack.encode(step.to_dict()))
    # vLLM's logging front end rebuilds them through the connector class and sums
    # intervals: kvtide's keys must survive that too.
    connector = kvc.NixlConnector
    interval = connector.build_kv_connector_stats()
    interval.aggregate(connector.build_kv_connector_stats(data))
    assert interval.reduce()["Num successful transfers"] == 3

    engine = VLLMEngine(vllm_spec())
    counters = engine._counters
    counters.live.add("t1-d")
    logger = _make_stat_logger(counters)(None)
    logger.record(scheduler_stats=SchedulerStats(kv_connector_stats=data), iteration_stats=None)
    assert counters.read == {"t1-d": 4 * BLOCK_BYTES}
    assert engine.stats().kv_transfer_bytes == 5 * BLOCK_BYTES  # the engine-wide counter


def test_reads_are_summed_per_request_and_an_unmeasured_one_makes_it_unknown() -> None:
    read: dict[str, int | None] = {}
    live = {"a", "b-p", "c"}
    add_reads(read, ["a-00000000", "b-p-12345678", "a-00000000", "c"], [10, 7, 5, 3], live)
    assert read == {"a": 15, "b-p": 7, "c": 3}  # "c": vLLM's randomisation off
    add_reads(read, ["b-p-12345678", "d-11111111"], [None, 99], live)
    assert read == {"a": 15, "b-p": None, "c": 3}  # "d" is not running here
    add_reads(read, ["b-p-12345678"], [4], live)
    assert read["b-p"] is None  # unknown stays unknown


# ---- the engine adapter: the request's bytes on its first output ---------------------------


def vllm_spec(**kv: Any) -> EngineSpec:
    return EngineSpec(
        engine_id="decode-0",
        role="decode",
        model_path="/m",
        served_model_name="m",
        kv_transfer=KVTransferSpec(**kv),
    )


@dataclass
class Completion:
    token_ids: list[int]
    text: str = "x"
    finish_reason: str | None = None
    logprobs: Any = None
    cumulative_logprob: float | None = None
    stop_reason: Any = None


@dataclass
class Output:
    """The fields of vLLM's ``RequestOutput`` the adapter reads."""

    outputs: list[Completion]
    finished: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    num_cached_tokens: int = 0
    prompt_logprobs: Any = None
    metrics: Any = None


class FakeFrontEnd:
    """vLLM's ``AsyncLLM`` as the adapter sees it: the engine step in which a request's
    read finished hands its stats to the stat loggers before the request's first
    output (vLLM's output handler records each step's stats before it takes the next)."""

    def __init__(self, logger: Any, reads: dict[str, list[int | None]]) -> None:
        self.logger = logger
        self.reads = reads  # request id -> its reads' bytes

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Output]:
        from vllm.v1.metrics.stats import SchedulerStats

        internal = f"{request_id}-0a1b2c3d"
        stats = kvc.NixlStats()
        stats.reading = internal
        for num_bytes in self.reads.get(request_id, []):
            stats.record_transfer(None if num_bytes is None else Telemetry(num_bytes))
        if not stats.is_empty():
            self.logger.record(
                scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict()),
                iteration_stats=None,
            )
        yield Output(outputs=[Completion(token_ids=[5])])
        yield Output(outputs=[Completion(token_ids=[6], finish_reason="length")], finished=True)


async def chunks(engine: VLLMEngine, request_id: str) -> list[GenerateChunk]:
    request = GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], max_tokens=2)
    return [chunk async for chunk in engine.generate(request)]


def engine_with(reads: dict[str, list[int | None]], **kv: Any) -> VLLMEngine:
    engine = VLLMEngine(vllm_spec(**kv))
    engine._llm = FakeFrontEnd(_make_stat_logger(engine._counters)(None), reads)
    return engine


def test_the_first_output_carries_what_the_engine_read_for_the_request() -> None:
    engine = engine_with({"t1-d": [BLOCK_BYTES, BLOCK_BYTES], "t2-d": [BLOCK_BYTES, None]})
    # Two reads of one block each; later chunks say nothing more.
    assert [c.kv_read_bytes for c in asyncio.run(chunks(engine, "t1-d"))] == [2 * BLOCK_BYTES, None]
    # A request that read nothing (its blocks all in the prefix cache): 0, not None.
    assert [c.kv_read_bytes for c in asyncio.run(chunks(engine, "t1-x"))] == [0, None]
    # One read NIXL gave no bytes for: unknown.
    assert asyncio.run(chunks(engine, "t2-d"))[0].kv_read_bytes is None
    # Nothing stays booked for requests that ended.
    assert engine._counters.read == {} and engine._counters.live == set()


def test_engines_with_vllms_own_connector_do_not_say() -> None:
    # Without kvtide's connector nobody records whose a read was: no figure at all.
    engine = engine_with({"t1-d": [BLOCK_BYTES]}, per_request_keep=False)
    assert "kv_connector_module_path" not in engine_args_for(engine.spec)["kv_transfer_config"]
    assert asyncio.run(chunks(engine, "t1-d"))[0].kv_read_bytes is None


@pytest.mark.parametrize("name", ["NixlConnector", "NixlStats"])
def test_the_built_classes_are_found_by_their_module_name(name: str) -> None:
    # The stats cross from TP workers to the engine core by pickle.
    import pickle

    cls = getattr(kvc, name)
    assert (cls.__module__, cls.__qualname__) == ("engines.kv_connector", name)
    assert pickle.loads(pickle.dumps(cls)) is cls
    stats = kvc.NixlStats()
    stats.reading = "a-1"
    stats.record_transfer(Telemetry(BLOCK_BYTES))
    assert pickle.loads(pickle.dumps(stats)).data[READ_BYTES_KEY] == [BLOCK_BYTES]
