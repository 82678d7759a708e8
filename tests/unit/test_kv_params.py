"""vLLM's kv_transfer_params, typed: the round trip through kvtide and the shapes it makes.

The dicts here are the ones vLLM 0.32's ``NixlConnector.request_finished`` returns
(``nixl/pull_scheduler.py``), plus keys a newer vLLM might add.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import msgspec
import pytest

import engines.kv_params
from engines.base import GenerateChunk, GenerateRequest
from engines.kv_params import KVTransferParams
from engines.vllm_engine import _expires_in_s, sampling_args_for
from orchestrator.kv.decider import KVDecider, kv_lifecycle_config, params_of
from orchestrator.kv.messages import KeptBlocks, KVDecision, LedgerReport, TurnDone

# Unknown to kvtide: a key vLLM reads (remote_block_size), internal bookkeeping and a
# nested value a later vLLM might send. All must reach vLLM again unchanged.
UNKNOWN = {
    "remote_block_size": 16,
    "_p_side_truncated": True,
    "future_key": {"nested": [1, 2], "none": None},
}


def prefill_output() -> dict[str, Any]:
    """A prefill's finished params (``do_remote_decode`` in): decode, pull these."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": ([0, 1, 2],),  # in-process: a tuple of lists, one per group
        "remote_engine_id": "prefill-0",
        "remote_request_id": "t1-p",
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 40,
        "remote_blocks_expiry_time": None,  # only a decode engine exports its expiry
        "transfer_mode": "pull",
    }


def decode_output(expiry: float = 1234.5) -> dict[str, Any]:
    """A decode's final params with ``bidirectional_kv_xfer``: the blocks it kept."""
    return {
        **prefill_output(),
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [[7, 8, 9], [3, 4, 5]],  # two KV-cache groups (HMA)
        "remote_engine_id": "decode-0",
        "remote_request_id": "t1-d",
        "remote_num_tokens": 47,
        "remote_blocks_expiry_time": expiry,
        **UNKNOWN,
    }


def test_vllm_params_come_back_to_vllm_as_they_were_sent() -> None:
    # A decode's final params, unknown keys included, round-trip exactly.
    sent = decode_output()
    params = KVTransferParams.from_vllm(sent)
    assert params.remote_block_ids == ((7, 8, 9), (3, 4, 5))
    assert params.remote_blocks_expiry_time == 1234.5
    assert params.extra == UNKNOWN
    assert params.to_vllm() == sent
    # A prefill's params: the same, except that a known key set to None is left out
    # (vLLM reads each with .get(): None and absent are one to it) and block ids come
    # back as lists.
    sent = prefill_output()
    back = KVTransferParams.from_vllm(sent).to_vllm()
    assert "remote_blocks_expiry_time" not in back
    del sent["remote_blocks_expiry_time"]
    assert back == {**sent, "remote_block_ids": [[0, 1, 2]]}


def test_none_stays_none_and_a_flat_block_list_is_one_group() -> None:
    assert KVTransferParams.from_vllm(None) is None
    assert KVTransferParams.from_vllm({}) == KVTransferParams()
    flat = KVTransferParams.from_vllm({"remote_block_ids": [4, 5]})
    assert flat.remote_block_ids == ((4, 5),)
    assert flat.to_vllm()["remote_block_ids"] == [[4, 5]]


def test_a_known_key_of_another_type_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="remote_port"):
        KVTransferParams.from_vllm({**decode_output(), "remote_port": "5600"})
    with pytest.raises(ValueError, match="typed keys"):
        KVTransferParams(extra={"remote_engine_id": "x"})


def test_the_shapes_kvtide_sends() -> None:
    # A prefill that keeps its prompt's KV for decode: both flags are always written.
    assert KVTransferParams.keep_for_decode().to_vllm() == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
    }
    # The next turn's prefill reads decode's kept blocks back: the kept params, unknown
    # keys included, with the flags of a prefill that keeps its copy for decode.
    kept = KVTransferParams.from_vllm(decode_output())
    pull = kept.pull_back(keep=True)
    assert pull.to_vllm() == {**decode_output(), "do_remote_decode": True, "kvtide_keep": True}
    assert pull.read_target() == ("decode-0", "t1-d")
    # A drain reads them the same way, but nobody decodes after it: its copy is freed.
    drain = kept.pull_back(keep=False)
    assert drain.to_vllm() == {**decode_output(), "do_remote_decode": True, "kvtide_keep": False}
    assert drain.read_target() == ("decode-0", "t1-d")
    # A prefill's own params read back: it pulls nothing.
    assert KVTransferParams.keep_for_decode().read_target() is None


def test_a_decode_keeps_its_blocks_only_when_its_params_ask() -> None:
    prefill = KVTransferParams.from_vllm(prefill_output())
    # A session's turn: decode keeps its blocks for the next turn's prefill.
    turn = prefill.for_decode(keep=True).to_vllm()
    expected = {**prefill_output(), "remote_block_ids": [[0, 1, 2]], "kvtide_keep": True}
    del expected["remote_blocks_expiry_time"]  # None: left out, as ever
    assert turn == expected
    assert not KVTransferParams.frees_at_once(turn)
    # A sessionless request: decode frees its blocks when it finishes.
    single = prefill.for_decode(keep=False).to_vllm()
    assert single["kvtide_keep"] is False and KVTransferParams.frees_at_once(single)
    # vLLM's own shapes (no kvtide key) and no params at all: vLLM's behaviour.
    assert not KVTransferParams.frees_at_once(prefill_output())
    assert not KVTransferParams.frees_at_once(None)
    # The key survives vLLM's dict and comes back typed.
    assert KVTransferParams.from_vllm(single).kvtide_keep is False


def test_blocks_are_counted_per_group_and_flattened_in_group_order() -> None:
    kept = KVTransferParams.from_vllm(decode_output())
    assert kept.block_ids == (7, 8, 9, 3, 4, 5)
    one = KVTransferParams.from_vllm({"remote_block_ids": [[1, 2], [9, 10, 11]]})
    assert one.num_blocks == 3  # the largest group: every group covers the same tokens
    assert KVTransferParams.from_vllm({"remote_block_ids": [[1, 2, 3]]}).num_blocks == 3
    assert KVTransferParams.from_vllm({"remote_block_ids": [4, 5]}).num_blocks == 2
    assert KVTransferParams.keep_for_decode().num_blocks == 0
    assert KVTransferParams().block_ids == ()


def test_kept_blocks_name_what_a_decode_engine_kept_and_nothing_else() -> None:
    kept = KVTransferParams.from_vllm(decode_output())
    assert kept.kept_blocks() == ("decode-0", "t1-d", (7, 8, 9, 3, 4, 5), 47)
    # A prefill's params ask decode to pull: the prefill keeps them only for that read.
    assert KVTransferParams.from_vllm(prefill_output()).kept_blocks() is None
    replace = msgspec.structs.replace
    assert replace(kept, remote_num_tokens=None).kept_blocks() is None
    assert replace(kept, remote_block_ids=((),)).kept_blocks() is None
    assert replace(kept, remote_request_id="").kept_blocks() is None


def test_messages_carrying_params_encode_and_pickle() -> None:
    params = KVTransferParams.from_vllm(decode_output())
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=KVTransferParams) == params
    assert pickle.loads(pickle.dumps(params)) == params
    # Defaults stay off the wire.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(KVTransferParams.keep_for_decode())) == {
        "do_remote_decode": True
    }
    messages: list[msgspec.Struct] = [
        GenerateRequest(
            request_id="r", prompt_token_ids=[1], max_tokens=1, kv_transfer_params=params
        ),
        GenerateChunk(request_id="r", finished=True, kv_transfer_params=params),
        KVDecision(kind="pull", kv_transfer_params=params),
        TurnDone(session_id="s", token_ids=[1, 2], kv_transfer_params=params),
        LedgerReport(
            engine_id="decode-0",
            role="decode",
            kept=[
                KeptBlocks(
                    engine_id="decode-0",
                    request_id="t1-d",
                    session_id="s",
                    block_ids=[7, 8, 9],
                    num_tokens=47,
                    token_ids=list(range(48)),
                    kv_transfer_params=params,
                    expires_in_s=400.0,
                    age_s=1.0,
                )
            ],
        ),
    ]
    for message in messages:
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=type(message))
        assert wire == message
        assert getattr(wire, "kv_transfer_params", params) == params
        assert pickle.loads(pickle.dumps(message)) == message


def test_the_vllm_adapter_converts_at_vllms_boundary() -> None:
    # Out to vLLM: SamplingParams.extra_args carries vLLM's own dict.
    kept = KVTransferParams.from_vllm(decode_output())
    request = GenerateRequest(
        request_id="t2-p",
        prompt_token_ids=[1],
        max_tokens=1,
        kv_transfer_params=kept.pull_back(keep=True),
    )
    extra_args = sampling_args_for(request)["extra_args"]
    assert extra_args == {
        "kv_transfer_params": {**decode_output(), "do_remote_decode": True, "kvtide_keep": True}
    }
    # In from vLLM: decode's expiry, on the engine's perf_counter, becomes seconds left.
    soon = KVTransferParams.from_vllm(decode_output(expiry=time.perf_counter() + 100.0))
    assert _expires_in_s(soon) == pytest.approx(100.0, abs=1.0)
    assert _expires_in_s(KVTransferParams.from_vllm(prefill_output())) is None
    assert _expires_in_s(None) is None


def test_the_kv_records_carry_the_params_as_given() -> None:
    planner = KVDecider(
        kv_lifecycle_config(
            ttl_s=480.0,
            safety_margin_s=15.0,
            recompute_threshold_tokens=4,
            kv_bytes_per_token=100,
            block_size_tokens=16,
        )
    )
    # 2,000 tokens: pulling them back is cheaper than recomputing.
    kept = msgspec.structs.replace(
        KVTransferParams.from_vllm(decode_output()), remote_num_tokens=2_000
    )
    prompt = list(range(2_001))
    planner.decide_turn("s", prompt[:1_990], now_s=0.0)
    planner.turn_finished("s", prompt, kept, now_s=1.0)
    record = planner.lifecycle.record("s")
    assert record is not None and record.transfer_params is kept and params_of(record) is kept
    plan = planner.decide_turn("s", [*prompt, 99], now_s=2.0)
    assert plan.kind == "pull" and plan.kv_transfer_params is kept
    # A record booked with anything else is a bug, named as such.
    planner.lifecycle.on_turn_finished(
        "t",
        engine_id="decode-0",
        token_ids_covered=[1, 2, 3, 4],
        block_ids=[1],
        transfer_params={"remote_engine_id": "decode-0"},
        expiry_s=None,
        now_s=3.0,
    )
    odd = planner.lifecycle.record("t")
    assert odd is not None
    with pytest.raises(TypeError, match="session 't'"):
        params_of(odd)


def test_public_names_are_pinned() -> None:
    assert engines.kv_params.__all__ == ["KVTransferParams"]
