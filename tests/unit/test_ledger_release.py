"""A decode host's ledger and a release (``KVTransferParams.release``): once a turn
extended on the engine is booked, the engine frees the previous turn's kept blocks
unread, and the ledger's entry for them goes at once (not at the TTL), so that neither
the kept-blocks check nor a restarted service's adoption finds blocks the engine freed."""

from __future__ import annotations

from engines.base import GenerateChunk, GenerateRequest
from engines.kv_params import KVTransferParams
from orchestrator.serve.ledger import EngineLedger

ENGINE = "decode-r1"


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def kept_turn(ledger: EngineLedger, request_id: str, blocks: tuple[int, ...]) -> None:
    """A session's turn finished on the engine, its blocks kept for a later turn."""
    request = GenerateRequest(
        request_id=request_id,
        prompt_token_ids=list(range(40)),
        max_tokens=2,
        kv_transfer_params=KVTransferParams(kvtide_keep=True),
        session_id="s",
    )
    params = KVTransferParams(
        do_remote_decode=True,
        remote_engine_id=ENGINE,
        remote_request_id=request_id,
        remote_block_ids=(blocks,),
        remote_num_tokens=16 * len(blocks),
    )
    chunk = GenerateChunk(
        request_id=request_id, finished=True, finish_reason="length", kv_transfer_params=params
    )
    ledger.on_finished(request, [7, 8], chunk)


def release(ledger: EngineLedger, request_id: str, finish_reason: str = "length") -> None:
    request = GenerateRequest(
        request_id=f"{request_id}-release",
        prompt_token_ids=[0],
        max_tokens=1,
        kv_transfer_params=KVTransferParams.release(request_id),
    )
    chunk = GenerateChunk(request_id=request.request_id, finished=True, finish_reason=finish_reason)
    ledger.on_finished(request, [1], chunk)


def decode_ledger(clock: Clock) -> EngineLedger:
    return EngineLedger(engine_id=ENGINE, role="decode", ttl_s=60, clock=clock, check_grace_s=1)


def test_a_release_drops_the_released_entry_at_once_and_keeps_the_new_turns() -> None:
    clock = Clock()
    ledger = decode_ledger(clock)
    kept_turn(ledger, "t1", (1, 2, 3))
    kept_turn(ledger, "t2", (1, 2, 4, 5))  # extended on t1's blocks: shares two
    assert ledger.num_kept_blocks() == 7  # both held, the old one until its TTL
    release(ledger, "t1")
    assert ledger.num_kept_blocks() == 4
    assert [k.request_id for k in ledger.report().kept] == ["t2"]


def test_a_released_entry_is_not_checked_and_a_failed_release_drops_nothing() -> None:
    clock = Clock()
    ledger = decode_ledger(clock)
    kept_turn(ledger, "t1", (1, 2, 3))
    kept_turn(ledger, "t2", (1, 2, 4))
    release(ledger, "t2", finish_reason="error")  # the engine freed nothing
    release(ledger, "t1")
    clock.now_s += 2  # past the check's grace
    assert [ref.request_id for ref in ledger.due_checks()] == ["t2"]
