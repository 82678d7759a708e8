"""The KV bytes a turn reports are the bytes its engines moved over NIXL.

Each turn of a session offers its reader the whole history (the prompt to decode, the
previous turn back to prefill), but both engines hold most of that history in their
prefix caches and read only the blocks they lack. The turn's ``kvtide`` object, the
``kvtide_kv_transfer_bytes_total`` counter and the engines' own NIXL counters must agree
on what moved; the offered figure is reported apart and, from the third turn on, is
several times larger.
"""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest
from app_calls import complete, engine_read_bytes, settled_read_bytes
from polling import wait_for

pytestmark = pytest.mark.engine

DIRECTIONS = ("prefill_to_decode", "decode_to_prefill")
# Which engine reads in each direction (the reader pulls): decode reads the prompt from
# prefill; prefill reads the previous turn back from decode.
READER = {"prefill_to_decode": "decode", "decode_to_prefill": "prefill"}


def _stats(app: Any) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(app.base_url + "/kvtide/stats", timeout=30).json()
    return body


def _counter(app: Any, name: str, direction: str) -> float:
    metrics = _stats(app)["metrics"]
    return float(metrics.get(f'{name}{{direction="{direction}"}}', 0.0))


def _turn(app: Any, prompt: list[int], session: str) -> dict[str, Any]:
    # An answer longer than a block (128 tokens): each turn's send-back has a full block
    # the prefill engine lacks (reads move whole blocks).
    return complete(app, prompt, session, max_tokens=160, ignore_eos=True)


def test_a_sessions_turns_report_the_bytes_their_engines_moved(kvtide_app: Any) -> None:
    rng = random.Random(32)
    session = "it-transfer-bytes"
    prompt = [rng.randrange(10, 1000) for _ in range(1000)]
    moved_sum = dict.fromkeys(DIRECTIONS, 0)
    offered_sum = dict.fromkeys(DIRECTIONS, 0)
    figures: list[tuple[int, dict[str, Any], dict[str, Any]]] = []
    settled_read_bytes()
    moved_before = {
        d: _counter(kvtide_app, "kvtide_kv_transfer_bytes_total", d) for d in DIRECTIONS
    }
    offered_before = {
        d: _counter(kvtide_app, "kvtide_kv_transfer_offered_bytes_total", d) for d in DIRECTIONS
    }
    try:
        for turn in range(1, 6):
            before = engine_read_bytes()
            body = _turn(kvtide_app, prompt, session)
            after = engine_read_bytes()
            report = body["kvtide"]
            moved, offered = report["kv_transfer_bytes"], report["kv_offered_bytes"]
            figures.append((turn, moved, offered))
            if turn > 1:
                assert report["kv_plan"] == "pull" and report["kv_source"] == "sent_back"
            for direction in DIRECTIONS:
                reader = READER[direction]
                # The turn's figure is its reading engine's own count of what NIXL moved.
                assert moved[direction] == after[reader] - before[reader], (turn, direction)
                moved_sum[direction] += moved[direction]
                offered_sum[direction] += offered[direction]
            assert moved["prefill_to_decode"] > 0  # every turn's decode reads something
            if turn == 1:
                assert offered["decode_to_prefill"] == moved["decode_to_prefill"] == 0
            else:
                assert moved["decode_to_prefill"] > 0
            if turn >= 3:
                # Both engines hold the history: the reads move a few blocks of new
                # tokens while the whole history is offered.
                for direction in DIRECTIONS:
                    assert 3 * moved[direction] < offered[direction], (turn, figures)
            # The next turn: this one's prompt and answer, and something new.
            prompt = [
                *prompt,
                *body["choices"][0]["token_ids"],
                *(rng.randrange(10, 1000) for _ in range(60)),
            ]
        # The ingress's counters say the same (the service sums them each second).
        for direction in DIRECTIONS:
            wait_for(
                lambda d=direction: (
                    _counter(kvtide_app, "kvtide_kv_transfer_bytes_total", d) - moved_before[d]
                    == moved_sum[d]
                    and _counter(kvtide_app, "kvtide_kv_transfer_offered_bytes_total", d)
                    - offered_before[d]
                    == offered_sum[d]
                ),
                timeout_s=30,
                what=f"the {direction} byte counters to reach the turns' sums",
            )
        print("turn, moved, offered:", *figures, sep="\n")
    finally:
        httpx.delete(f"{kvtide_app.base_url}/kvtide/sessions/{session}", timeout=30)
