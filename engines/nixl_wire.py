"""vLLM 0.32's NIXL side channel and descriptor layout, spoken from both ends by
``engines.host_store``.

The handshake (vLLM's ``base_worker.NixlBaseConnectorWorker._nixl_handshake`` asks,
``base_scheduler.NixlBaseConnectorScheduler._nixl_handshake_listener`` answers): a ZMQ
REQ sends ``msgpack((GET_META_MSG, pp_rank, tp_rank))``; the ROUTER answers two frames,
``msgpack(NixlHandshakePayload(compatibility_hash, agent_metadata_bytes))`` and
``msgpack(time.perf_counter())`` (the asker estimates the clock offset it applies to
``remote_blocks_expiry_time`` from it); ``agent_metadata_bytes`` is
``msgpack(NixlAgentMetadata)`` (``NIXL_CONNECTOR_VERSION`` 14). vLLM's own structs
(``nixl/metadata.py``) are used, so a vLLM whose wire changed fails to decode here rather
than drifting silently.

A peer's descriptors are region-major, ``base_addr[r] + block * block_strides[r]`` with
length ``block_lens[r]`` (``_build_fa_remote``); block ``b`` of region ``r`` is descriptor
``region_offset[r] + b`` (``_compute_desc_ids``, one KV-cache group).

Importing this module imports neither vLLM nor ZMQ; the functions do.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

__all__ = [
    "UnsupportedEngine",
    "advertised_meta",
    "check_supported",
    "encode_payload",
    "handshake",
    "peer_descs",
    "region_descs",
    "region_offsets",
    "serve_handshakes",
]

log = logging.getLogger("kvtide.host_store")


class UnsupportedEngine(ValueError):
    """An engine whose KV layout the host store does not serve (``check_supported``)."""


def _get_meta_msg() -> bytes:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG

    msg: bytes = GET_META_MSG
    return msg


def handshake(
    host: str, port: int, clock: Callable[[], float], timeout_ms: int = 5000
) -> tuple[str, NixlAgentMetadata, float]:
    """vLLM's side-channel handshake with rank (0, 0) of the engine at host:port: the
    engine's compatibility hash, its agent metadata, and its clock's offset from
    ``clock`` (the engine's ``perf_counter`` minus ``clock``, from the round trip's
    midpoint, as vLLM estimates it to read ``remote_blocks_expiry_time``)."""
    import zmq
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlHandshakePayload,
    )

    sock: Any = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sent = clock()
        sock.send(msgspec.msgpack.encode((_get_meta_msg(), 0, 0)))
        payload_bytes, remote_clock = sock.recv_multipart()
        received = clock()
    finally:
        sock.close()
    offset_s = float(msgspec.msgpack.decode(remote_clock)) - (sent + received) / 2
    payload = msgspec.msgpack.decode(payload_bytes, type=NixlHandshakePayload)
    meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
    return payload.compatibility_hash, meta, offset_s


def encode_payload(compat_hash: str, meta: NixlAgentMetadata) -> bytes:
    """The first frame of a handshake's answer."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload

    return msgspec.msgpack.encode(
        NixlHandshakePayload(
            compatibility_hash=compat_hash, agent_metadata_bytes=msgspec.msgpack.encode(meta)
        )
    )


def serve_handshakes(
    payload: bytes,
    host: str,
    port: int,
    clock: Callable[[], float],
    stop: threading.Event,
    ready: threading.Event,
) -> None:
    """vLLM's ``_nixl_handshake_listener``: every ``(GET_META_MSG, 0, 0)`` is answered
    with ``payload`` and the time on ``clock``. Other ranks get no answer: the asker
    times out (5 s) and fails its request. Sets ``ready`` once bound; runs until
    ``stop``."""
    import zmq

    get_meta_msg = _get_meta_msg()
    sock: Any = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVTIMEO, 200)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://{host}:{port}")
    ready.set()
    try:
        while not stop.is_set():
            try:
                identity, _, msg = sock.recv_multipart()
            except zmq.Again:
                continue
            kind, pp_rank, tp_rank = msgspec.msgpack.decode(msg)
            if kind != get_meta_msg or (pp_rank, tp_rank) != (0, 0):
                log.warning("host store: unexpected handshake %r rank %s", kind, (pp_rank, tp_rank))
                continue
            sock.send_multipart((identity, b"", payload, msgspec.msgpack.encode(clock())))
    finally:
        sock.close()


def region_descs(
    bases: Sequence[int],
    strides: Sequence[int],
    block_lens: Sequence[int],
    region_blocks: Sequence[int],
    device_id: int,
) -> np.ndarray:
    """NIXL descriptors ``(addr, len, device)`` for every block of every region, region
    by region, as vLLM lays out a peer's (``_build_fa_remote``)."""
    return np.array(
        [
            (base + b * stride, block_len, device_id)
            for base, stride, block_len, n in zip(
                bases, strides, block_lens, region_blocks, strict=True
            )
            for b in range(n)
        ],
        dtype=np.uint64,
    )


def region_offsets(region_blocks: Sequence[int]) -> list[int]:
    """The descriptor id of each region's block 0 in ``region_descs``' list."""
    return [int(o) for o in np.cumsum([0, *region_blocks[:-1]])]


def peer_descs(meta: NixlAgentMetadata) -> tuple[np.ndarray, str, list[int]]:
    """A peer's blocks as NIXL descriptors (``region_descs``), their memory type, and
    each region's first descriptor id (``region_offsets``)."""
    region_blocks = meta.region_num_blocks or [meta.num_blocks] * len(meta.block_lens)
    mem_types = set(meta.region_mem_types or ["DRAM"])
    if len(mem_types) != 1:
        raise UnsupportedEngine(f"engine {meta.engine_id} mixes memory types {mem_types}")
    descs = region_descs(
        meta.kv_caches_base_addr, meta.block_strides, meta.block_lens, region_blocks, meta.device_id
    )
    return descs, mem_types.pop(), region_offsets(region_blocks)


def advertised_meta(
    engine: NixlAgentMetadata,
    store_id: str,
    agent_metadata: bytes,
    bases: list[int],
    num_blocks: int,
) -> NixlAgentMetadata:
    """What the store advertises: ``engine``'s metadata (so readers' layout checks pass)
    with the store's id, agent and DRAM regions of ``num_blocks`` packed blocks each."""
    num_regions = len(bases)
    return dataclasses.replace(
        engine,
        engine_id=store_id,
        agent_metadata=agent_metadata,
        kv_caches_base_addr=bases,
        device_id=0,
        num_blocks=num_blocks,
        block_strides=list(engine.block_lens),
        region_num_blocks=[num_blocks] * num_regions,
        region_mem_types=["DRAM"] * num_regions,
    )


def check_supported(meta: NixlAgentMetadata, params: dict[str, Any] | None = None) -> None:
    """Refuse, by name, what the host store does not handle: several ranks (TP, PP, DCP,
    PCP), several KV-cache groups (HMA, sliding window), mamba state, or more than one
    physical block per logical block."""
    problems = []
    if meta.physical_blocks_per_logical_kv_block != 1:
        problems.append(f"physical_blocks_per_logical={meta.physical_blocks_per_logical_kv_block}")
    if meta.ssm_sizes and any(meta.ssm_sizes):
        problems.append(f"mamba state (ssm_sizes={meta.ssm_sizes})")
    if len(set(meta.region_group_ids or [0])) != 1:
        problems.append(f"several KV-cache groups (region_group_ids={meta.region_group_ids})")
    if meta.dcp_size != 1 or meta.pcp_size != 1:
        problems.append(f"dcp/pcp {meta.dcp_size}/{meta.pcp_size}")
    if params is not None:
        if (params.get("tp_size") or 1) != 1 or (params.get("pp_size") or 1) != 1:
            problems.append(f"tp/pp {params.get('tp_size')}/{params.get('pp_size')}")
        if len(params.get("remote_block_ids") or []) != 1:
            problems.append("remote_block_ids is not one group")
    if problems:
        raise UnsupportedEngine(
            f"the host store does not handle engine {meta.engine_id}'s "
            + ", ".join(problems)
            + " (it serves TP 1 engines with one KV-cache group)"
        )
