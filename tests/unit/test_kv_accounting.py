"""The KV lifecycle's books never drift: random operation sequences with fixed seeds.

A small model of the conversations runs beside the policy (what each session's decode
engine covered, which sessions have turns in flight) and, after every call, the books
are checked against what the policy reports and against the model.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from policies.kv_lifecycle import (
    Effect,
    EvictReason,
    Expire,
    KVLifecycle,
    KVLifecycleConfig,
    KVRecord,
    RecomputeReason,
    TurnAction,
)

CONFIG = KVLifecycleConfig(
    prefill_tokens_per_s=1_000.0,
    link_bandwidth_gbps=8.0,
    transfer_setup_s=0.1,  # prefixes under ~100 tokens are cheaper to recompute
    kv_bytes_per_token=1_000,
    block_size_tokens=16,
    lease_ttl_s=300.0,
    linear_state_bytes_per_sequence=5_000,
    idle_budget_bytes_per_engine=4_000_000,  # a few records per engine
)
SESSIONS = [f"s{i}" for i in range(12)]
ENGINES = ["decode-0", "decode-1", "decode-2"]


def _identity(record: KVRecord) -> tuple[object, ...]:
    return (record.session_id, record.engine_id, record.block_ids, record.last_used_s)


@dataclass
class Model:
    """What the test knows independently of the policy."""

    rng: random.Random
    kv: KVLifecycle = field(default_factory=lambda: KVLifecycle(CONFIG))
    now_s: float = 0.0
    history: dict[str, list[int]] = field(default_factory=dict)  # tokens each session has seen
    covered: dict[tuple[object, ...], list[int]] = field(default_factory=dict)  # by record
    in_flight: Counter[str] = field(default_factory=Counter)
    reported: set[tuple[object, ...]] = field(default_factory=set)  # records in effects
    next_block: int = 0

    def prompt(self, session_id: str) -> list[int]:
        """Usually the history plus a new message; sometimes history rewritten or cut."""
        history = list(self.history.get(session_id, []))
        if len(history) > 3_000:  # a new conversation under the same id
            history = []
        roll = self.rng.random()
        if history and roll < 0.1:
            history[self.rng.randrange(len(history))] = -1  # rewritten
        elif history and roll < 0.15:
            history = history[: self.rng.randrange(len(history))]  # cut short
        new = [self.rng.randrange(50_000) for _ in range(self.rng.choice([1, 10, 200]))]
        return history + new

    def step(self) -> None:
        self.now_s += self.rng.choice([0.0, 0.5, 2.0, 10.0, 60.0])
        session_id = self.rng.choice(SESSIONS)
        op = self.rng.choices(
            [
                "start",
                "pull",
                "finish",
                "abandon",
                "renew",
                "close",
                "tick",
                "lost",
                "reuse",
                "retire",
            ],
            weights=[25, 10, 20, 8, 8, 4, 15, 2, 2, 2],
        )[0]
        before = self.booked()
        effects: list[Effect] = []
        if op == "start":
            self.start(session_id)
        elif op == "pull":
            effects = self.kv.on_pull_result(
                session_id, ok=self.rng.random() < 0.7, now_s=self.now_s
            )
        elif op == "finish":
            effects = self.finish(session_id)
        elif op == "abandon":
            effects = self.kv.on_turn_abandoned(session_id, now_s=self.now_s)
            self.end_turn(session_id)
        elif op == "renew":
            self.kv.renew(session_id, self.now_s)
        elif op == "close":
            effects = self.kv.close(session_id, self.now_s)
            self.in_flight.pop(session_id, None)
        elif op == "reuse":
            # An integrity check turned reuse off for an engine, or an operator turned it
            # back on: no booking changes, only later decisions.
            off = self.rng.random() < 0.5
            self.kv.set_reuse_off([self.rng.choice(ENGINES)] if off else [])
        elif op == "tick":
            effects = self.kv.on_tick(self.now_s)
            self.check_nothing_due()
        elif op == "retire":  # a scale-in or a redeploy stops an engine: its records go first
            why = self.rng.choice([EvictReason.SCALED_IN, EvictReason.REPLACED])
            effects = self.kv.retire(self.rng.choice(ENGINES), why)
        else:
            effects = self.kv.on_engine_lost(self.rng.choice(ENGINES), self.now_s)
        self.check_effects(effects, before)
        self.check_books()

    def start(self, session_id: str) -> None:
        prompt = self.prompt(session_id)
        offered = self.kv.record(session_id)
        decision = self.kv.on_turn_start(session_id, prompt, self.now_s)
        self.in_flight[session_id] += 1
        self.history[session_id] = prompt
        if decision.action is TurnAction.PULL_FROM_DECODE:
            # Only the session's own fresh record, for a prompt that truly extends it.
            record = decision.record
            assert record is not None and record == offered
            assert self.now_s < record.expiry_s - CONFIG.safety_margin_s
            assert prompt[: record.num_tokens] == self.covered[_identity(record)]
            assert record.num_tokens >= CONFIG.recompute_threshold_tokens

    def finish(self, session_id: str) -> list[Effect]:
        answer = [self.rng.randrange(50_000) for _ in range(self.rng.choice([1, 20, 100]))]
        covered = self.history.get(session_id, []) + answer
        self.history[session_id] = covered
        self.next_block += 1
        expiry_s = self.rng.choice([None, self.now_s + 480.0, self.now_s + 100.0, self.now_s])
        effects = self.kv.on_turn_finished(
            session_id,
            engine_id=self.rng.choice(ENGINES),
            token_ids_covered=covered,
            block_ids=(self.next_block,),
            transfer_params={"remote_block_ids": [self.next_block]},
            expiry_s=expiry_s,
            now_s=self.now_s,
        )
        record = self.kv.record(session_id)
        if record is not None:
            self.covered[_identity(record)] = covered
        self.end_turn(session_id)
        return effects

    def end_turn(self, session_id: str) -> None:
        if self.in_flight[session_id] > 0:
            self.in_flight[session_id] -= 1

    def booked(self) -> set[tuple[object, ...]]:
        return {_identity(r) for r in self.kv.records() + self.kv.pulls_in_flight()}

    def check_effects(self, effects: list[Effect], before: set[tuple[object, ...]]) -> None:
        after = self.booked()
        for effect in effects:
            identity = _identity(effect.record)
            # Never reported twice (no double free), and really gone from the books.
            assert identity not in self.reported
            self.reported.add(identity)
            assert identity not in after
            # It was booked before the call, unless the call itself booked it.
            assert identity in before or effect.record.last_used_s == self.now_s

    def check_books(self) -> None:
        kv = self.kv
        records = kv.records()
        pulls = kv.pulls_in_flight()
        for engine_id in ENGINES:
            held = sum(r.bytes_held for r in records + pulls if r.engine_id == engine_id)
            idle = sum(
                r.bytes_held
                for r in records
                if r.engine_id == engine_id and self.in_flight[r.session_id] == 0
            )
            assert kv.bytes_held(engine_id) == held
            blocks = sum(len(r.block_ids) for r in records + pulls if r.engine_id == engine_id)
            assert kv.blocks_held(engine_id) == blocks
            assert kv.idle_bytes(engine_id) == idle
            assert idle <= (CONFIG.idle_budget_bytes_per_engine or 0)
        stats = kv.stats()
        assert stats.num_records == len(records)
        assert stats.num_sessions == kv.num_sessions() >= len(records)
        assert len({r.session_id for r in records}) == len(records)  # one record a session

    def check_nothing_due(self) -> None:
        for record in self.kv.records():
            assert record.expiry_s - CONFIG.safety_margin_s > self.now_s
        for record in self.kv.pulls_in_flight():
            assert record.expiry_s > self.now_s


@pytest.mark.parametrize("seed", range(25))
def test_books_never_drift_under_random_operations(seed: int) -> None:
    model = Model(rng=random.Random(seed))
    for _ in range(400):
        model.step()
    # End every turn still in flight, then let everything run out: nothing leaks.
    for session_id, count in list(model.in_flight.items()):
        for _ in range(count):
            before = model.booked()
            model.check_effects(model.kv.on_turn_abandoned(session_id, now_s=model.now_s), before)
        model.in_flight[session_id] = 0
        model.check_books()
    model.now_s += 10_000.0
    before = model.booked()
    model.check_effects(model.kv.on_tick(model.now_s), before)
    assert model.kv.num_sessions() == 0
    assert model.kv.records() == model.kv.pulls_in_flight() == []
    assert all(model.kv.bytes_held(e) == model.kv.idle_bytes(e) == 0 for e in ENGINES)


def test_random_operations_exercise_every_path() -> None:
    """The seeds above reach pulls, declines, expiries, evictions, releases, every reason."""
    totals: Counter[str] = Counter()
    for seed in range(25):
        model = Model(rng=random.Random(seed))
        for _ in range(400):
            model.step()
        stats = model.kv.stats()
        totals.update(
            pulls=stats.num_pulls,
            declines=stats.num_declines,
            expiries=stats.num_expiries,
            evictions=stats.num_evictions,
            releases=stats.num_releases,
        )
        totals.update({reason.value: count for reason, count in stats.recomputes_by_reason})
    # A request without a session never reaches the lifecycle (the router plans it).
    totals.pop(RecomputeReason.NO_SESSION.value, None)
    assert all(count > 0 for count in totals.values()), totals
    assert len(totals) == 5 + len(RecomputeReason) - 1


def test_expire_effects_of_a_final_tick_cover_every_record() -> None:
    model = Model(rng=random.Random(7))
    for _ in range(200):
        model.step()
    for session_id in list(model.in_flight):
        while model.in_flight[session_id]:
            model.kv.on_turn_abandoned(session_id, now_s=model.now_s)
            model.in_flight[session_id] -= 1
    booked = {_identity(r) for r in model.kv.records()}
    expired = {
        _identity(e.record)
        for e in model.kv.on_tick(model.now_s + 1_000.0)
        if isinstance(e, Expire)
    }
    assert expired == booked
