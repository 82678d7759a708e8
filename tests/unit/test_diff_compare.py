"""The differential suite's comparison (``tests/engine/diff_compare.py``) fails on what
it must: a field either server adds, a token, a streamed log probability, an error body;
and counts each allowed difference under its reason."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from diff_compare import Tally, assembled


def _body(**choice: object) -> dict[str, object]:
    return {
        "status": 200,
        "body": {
            "id": "chatcmpl-1",
            "created": 1,
            "choices": [{"index": 0, "message": {"content": "a b"}, **choice}],
            "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}},
        },
    }


def test_equal_answers_count_their_fields_and_the_generated_ids_as_allowed() -> None:
    tally = Tally()
    a = assembled(_body(token_ids=[1, 2]), tally)
    b = _body(token_ids=[1, 2])
    b["body"]["id"] = "chatcmpl-2"  # type: ignore[index]
    b["body"]["kvtide"] = {"kv_source": "recomputed"}  # type: ignore[index]
    tally.compare(a, assembled(b, tally))
    assert tally.failures == []
    assert tally.compared >= 5
    assert tally.allowed["generated ids"] == 4 and tally.allowed["the kvtide object"] == 1


def test_a_token_a_field_or_a_log_probability_past_the_tolerance_fails() -> None:
    for other in (
        _body(token_ids=[1, 3]),
        _body(token_ids=[1, 2], extra_field=True),
        _body(token_ids=[1, 2], logprobs={"content": [{"token": "a", "logprob": -1.01}]}),
    ):
        tally = Tally()
        base = _body(token_ids=[1, 2], logprobs={"content": [{"token": "a", "logprob": -1.0}]})
        if "extra_field" in other["body"]["choices"][0]:  # type: ignore[index]
            base = _body(token_ids=[1, 2])
        tally.compare(assembled(base, tally), assembled(other, tally))
        assert tally.failures, other


def test_a_log_probability_within_the_tolerance_is_allowed_and_counted() -> None:
    tally = Tally()
    lp = lambda v: _body(logprobs={"content": [{"token": "a", "logprob": v}]})  # noqa: E731
    tally.compare(assembled(lp(-1.0), tally), assembled(lp(-1.0005), tally))
    assert tally.failures == [] and tally.allowed["logprob within 1e-3"] == 1


def test_streams_are_compared_with_their_log_probabilities_and_token_ids() -> None:
    def stream(lp: float, ids: list[int]) -> dict[str, object]:
        event = {
            "id": "x",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "a"},
                    "token_ids": ids,
                    "logprobs": {"content": [{"token": "a", "logprob": lp}]},
                }
            ],
        }
        return {"status": 200, "events": [event]}

    tally = Tally()
    tally.compare(assembled(stream(-1.0, [4]), tally), assembled(stream(-2.0, [4]), tally))
    assert len(tally.failures) == 1 and "logprob" in tally.failures[0]
    tally = Tally()
    tally.compare(assembled(stream(-1.0, [4]), tally), assembled(stream(-1.0, [5]), tally))
    assert len(tally.failures) == 1 and "token_ids" in tally.failures[0]
