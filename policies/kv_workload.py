"""Multi-turn agent workloads for the KV lifecycle simulator: a trace, a generator, JSONL.

A trace is a list of `TraceTurn`s, one per turn, that `policies.kv_sim.simulate`
replays through the KV lifecycle policy. It says when each turn's request arrives and
how the conversation grows; what happens to the KV is left to the policy.

Trace schema (JSON Lines, one object per turn; ``trace_to_jsonl`` writes it,
``trace_from_jsonl`` reads it)::

    {"session_id": "s00042", "t_s": 1234.567, "new_prompt_tokens": 412,
     "output_tokens": 187, "rewrite_history": false}

- ``session_id`` (string): the conversation; its turns are replayed in ``t_s`` order.
- ``t_s`` (number >= 0): when the client sends the turn, in seconds from the start of
  the trace. A turn that arrives before its session's previous turn has finished
  starts when that turn finishes.
- ``new_prompt_tokens`` (integer): tokens appended to the conversation before this
  turn (the user's message or a tool's result); on a session's first turn the whole
  first prompt (system prompt, tools, first message), so at least 1 there.
- ``output_tokens`` (integer >= 1): tokens the model generates. They become part of
  the next turn's prompt.
- ``rewrite_history`` (boolean, optional, default false): the client rewrote the
  earlier conversation before this turn (stripped reasoning, compacted or re-rendered
  history), so the prompt no longer extends what was generated; lengths are kept.

Keys beyond these are ignored, so traces may carry annotations.

The generator (`generate_workload`) draws sessions from a seeded `random.Random`:
Poisson arrivals; a geometric number of turns; a log-normal first prompt of a few
thousand tokens; between turns, a tool call (seconds, a tool result of hundreds of
tokens), a human thinking (about a minute, a short message) or someone who went away
(half an hour: longer than any TTL worth keeping blocks for).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

from policies.errors import PolicyError

__all__ = [
    "InvalidTrace",
    "TraceTurn",
    "WorkloadConfig",
    "generate_workload",
    "trace_from_jsonl",
    "trace_to_jsonl",
]


class InvalidTrace(PolicyError, ValueError):
    """A trace line is not a valid turn; the message names the line and the field."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceTurn:
    """One turn of a trace; the fields are the JSONL schema in the module docstring."""

    session_id: str
    t_s: float
    new_prompt_tokens: int
    output_tokens: int
    rewrite_history: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadConfig:
    """How the generator draws sessions. Medians and spreads of log-normal draws.

    A log-normal with median ``m`` and spread ``sigma`` has its 84th percentile at
    ``m x e^sigma``: sigma 1.0 puts one draw in six above 2.7 times the median.
    """

    num_sessions: int = 2000
    sessions_per_s: float = 0.25
    """Poisson arrival rate of new sessions."""
    mean_turns_per_session: float = 6.0
    """Turns per session: 1 + a geometric count with this mean in all."""
    max_turns_per_session: int = 64
    max_context_tokens: int = 128_000
    """A session ends before a turn whose prompt would exceed this."""
    first_prompt_median_tokens: float = 3_000.0
    first_prompt_sigma: float = 0.8
    output_median_tokens: float = 250.0
    output_sigma: float = 0.8
    tool_call_fraction: float = 0.60
    """Share of gaps that are tool calls: the agent's next turn carries a tool result."""
    tool_gap_median_s: float = 4.0
    tool_result_median_tokens: float = 400.0
    think_gap_median_s: float = 45.0
    """A human reads the answer and types the next message (the remaining gaps)."""
    user_message_median_tokens: float = 60.0
    away_fraction: float = 0.05
    """Share of gaps where the user went away and came back later."""
    away_gap_median_s: float = 1_800.0
    gap_sigma: float = 1.0
    """Spread of tool and think gaps (away gaps use half of it)."""
    rewrite_fraction: float = 0.02
    """Share of later turns that rewrite the history before them."""
    decode_tokens_per_s: float = 40.0
    """Decode speed per user, to place the next turn after this one's output."""

    def __post_init__(self) -> None:
        positive = (
            "sessions_per_s",
            "first_prompt_median_tokens",
            "output_median_tokens",
            "tool_gap_median_s",
            "tool_result_median_tokens",
            "think_gap_median_s",
            "user_message_median_tokens",
            "away_gap_median_s",
            "decode_tokens_per_s",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"WorkloadConfig.{name}={getattr(self, name)!r}: use > 0")
        if self.num_sessions < 1 or self.max_turns_per_session < 1:
            raise ValueError("WorkloadConfig: num_sessions and max_turns_per_session must be >= 1")
        if self.mean_turns_per_session < 1:
            raise ValueError(
                f"WorkloadConfig.mean_turns_per_session={self.mean_turns_per_session}: use >= 1"
            )
        if not 0 <= self.tool_call_fraction + self.away_fraction <= 1:
            raise ValueError(
                "WorkloadConfig: tool_call_fraction + away_fraction must lie in 0..1 "
                f"(got {self.tool_call_fraction} + {self.away_fraction})"
            )
        if not 0 <= self.rewrite_fraction <= 1:
            raise ValueError(f"WorkloadConfig.rewrite_fraction={self.rewrite_fraction}: use 0..1")


def generate_workload(config: WorkloadConfig, seed: int = 0) -> list[TraceTurn]:
    """Draw a trace; the same config and seed always give the same trace."""
    rng = random.Random(seed)
    turns: list[TraceTurn] = []
    arrival_s = 0.0
    for index in range(config.num_sessions):
        arrival_s += rng.expovariate(config.sessions_per_s)
        turns.extend(_session(rng, config, f"s{index:05d}", arrival_s))
    turns.sort(key=lambda turn: turn.t_s)  # stable: a session's turns keep their order
    return turns


def _session(
    rng: random.Random, config: WorkloadConfig, session_id: str, start_s: float
) -> list[TraceTurn]:
    p_stop = 1.0 / config.mean_turns_per_session  # geometric: mean 1/p turns
    num_turns = 1
    while num_turns < config.max_turns_per_session and rng.random() >= p_stop:
        num_turns += 1
    t_s = start_s
    new_tokens = _tokens(rng, config.first_prompt_median_tokens, config.first_prompt_sigma)
    context = 0
    turns: list[TraceTurn] = []
    for k in range(num_turns):
        output = _tokens(rng, config.output_median_tokens, config.output_sigma)
        rewrite = k > 0 and rng.random() < config.rewrite_fraction
        if context + new_tokens + output > config.max_context_tokens:
            break
        turns.append(
            TraceTurn(
                session_id=session_id,
                t_s=round(t_s, 3),
                new_prompt_tokens=new_tokens,
                output_tokens=output,
                rewrite_history=rewrite,
            )
        )
        context += new_tokens + output
        # What comes next: a tool result, a human's message, or a long absence.
        kind = rng.random()
        if kind < config.tool_call_fraction:
            gap_s = _lognormal(rng, config.tool_gap_median_s, config.gap_sigma)
            new_tokens = _tokens(rng, config.tool_result_median_tokens, 1.0)
        elif kind < config.tool_call_fraction + config.away_fraction:
            gap_s = _lognormal(rng, config.away_gap_median_s, config.gap_sigma / 2)
            new_tokens = _tokens(rng, config.user_message_median_tokens, 0.8)
        else:
            gap_s = _lognormal(rng, config.think_gap_median_s, config.gap_sigma)
            new_tokens = _tokens(rng, config.user_message_median_tokens, 0.8)
        t_s += output / config.decode_tokens_per_s + gap_s
    return turns


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def _tokens(rng: random.Random, median: float, sigma: float) -> int:
    return max(1, round(_lognormal(rng, median, sigma)))


# -- JSONL --------------------------------------------------------------------------

_FIELDS = ("session_id", "t_s", "new_prompt_tokens", "output_tokens")


def trace_to_jsonl(turns: Iterable[TraceTurn]) -> str:
    """The trace as JSON Lines (one object per turn, newline-terminated)."""
    lines = []
    for turn in turns:
        line: dict[str, object] = {name: getattr(turn, name) for name in _FIELDS}
        if turn.rewrite_history:
            line["rewrite_history"] = True
        lines.append(json.dumps(line) + "\n")
    return "".join(lines)


def trace_from_jsonl(lines: Iterable[str]) -> list[TraceTurn]:
    """Parse JSON Lines into turns ordered by ``t_s`` (stable); blank lines are skipped.

    Raises `InvalidTrace` naming the line number and the field for anything that is
    not a valid turn, including a session whose first turn has no prompt tokens.
    """
    turns: list[TraceTurn] = []
    for number, text in enumerate(lines, start=1):
        if text.strip():
            turns.append(_parse_line(number, text))
    turns.sort(key=lambda turn: turn.t_s)
    seen: set[str] = set()
    for turn in turns:
        if turn.session_id not in seen and turn.new_prompt_tokens < 1:
            raise InvalidTrace(
                f"session {turn.session_id!r}: its first turn (t_s={turn.t_s}) has "
                "new_prompt_tokens=0; a first turn carries the whole first prompt (>= 1)"
            )
        seen.add(turn.session_id)
    return turns


def _parse_line(number: int, text: str) -> TraceTurn:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidTrace(f"trace line {number}: not JSON ({err})") from None
    if not isinstance(obj, dict):
        raise InvalidTrace(f"trace line {number}: expected a JSON object, got {text.strip()!r}")
    missing = [name for name in _FIELDS if name not in obj]
    if missing:
        raise InvalidTrace(f"trace line {number}: missing {', '.join(missing)}")
    session_id, t_s = obj["session_id"], obj["t_s"]
    new_tokens, output = obj["new_prompt_tokens"], obj["output_tokens"]
    rewrite = obj.get("rewrite_history", False)
    problems = (
        (isinstance(session_id, str) and session_id != "", "session_id", "a non-empty string"),
        (
            isinstance(t_s, int | float) and not isinstance(t_s, bool) and 0 <= t_s < math.inf,
            "t_s",
            "a finite number of seconds >= 0",
        ),
        (_is_count(new_tokens, 0), "new_prompt_tokens", "an integer >= 0"),
        (_is_count(output, 1), "output_tokens", "an integer >= 1"),
        (isinstance(rewrite, bool), "rewrite_history", "true or false"),
    )
    for ok, name, expected in problems:
        if not ok:
            raise InvalidTrace(f"trace line {number}: {name}={obj.get(name)!r}; use {expected}")
    return TraceTurn(
        session_id=session_id,
        t_s=float(t_s),
        new_prompt_tokens=new_tokens,
        output_tokens=output,
        rewrite_history=rewrite,
    )


def _is_count(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
