"""Admission control, pure: engine reports in, admit or refuse out; time is ``now_s``."""

from __future__ import annotations

import dataclasses

from orchestrator.config import parse_config
from policies.admission import (
    AdmissionSettings,
    EngineBook,
    EngineLoad,
    admit,
    pool_health,
    short_of_kv,
)

SETTINGS = AdmissionSettings(
    max_waiting_per_engine=4, max_kv_cache_usage=0.9, stall_s=10.0, max_report_age_s=5.0
)
TURN = ("prefill", "decode")


def load(
    engine_id: str,
    at_s: float,
    *,
    running: int = 0,
    waiting: int = 0,
    kv: float = 0.1,
    finished: int = 0,
) -> EngineLoad:
    return EngineLoad(
        engine_id=engine_id,
        pool=engine_id.rsplit("-", 1)[0],
        num_running=running,
        num_waiting=waiting,
        kv_cache_usage=kv,
        num_finished=finished,
        reported_s=at_s,
    )


def test_a_pool_whose_every_engine_has_a_full_queue_refuses_at_once() -> None:
    book = EngineBook()
    book.observe(
        [
            load("prefill-a", 100.0, running=2),
            load("decode-a", 100.0, running=8, waiting=4),
            load("decode-b", 100.0, running=8, waiting=1),
        ]
    )
    # decode-b can still take a turn: admitted.
    assert admit(book.views(), TURN, SETTINGS, 100.5).admitted
    book.observe(
        [
            load("prefill-a", 101.0, running=2),
            load("decode-a", 101.0, running=8, waiting=6, finished=3),
            load("decode-b", 101.0, running=8, waiting=1, kv=0.95, finished=3),
        ]
    )
    # Now decode-a's queue is full and decode-b waits with its KV cache full.
    refused = admit(book.views(), TURN, SETTINGS, 101.2)
    assert not refused.admitted and refused.pool == "decode"
    assert refused.retry_after_s == SETTINGS.retry_after_s
    assert "decode pool is full" in refused.reason
    health = pool_health(book.views(), TURN, SETTINGS, 101.2)
    assert (health.status, health.admits, health.refusing_pools) == (
        "degraded",
        False,
        ("decode",),
    )
    assert sorted(health.engines) == ["decode-a", "decode-b"]


def test_an_engine_with_requests_waiting_and_none_running_stalls_after_stall_s() -> None:
    # The report of the issue: 0 running, the waiting queue grows by one per turn (not
    # yet past max_waiting_per_engine here).
    settings = dataclasses.replace(SETTINGS, max_waiting_per_engine=100)
    book = EngineBook()
    book.observe([load("prefill-a", 0.0, running=1, finished=5), load("decode-a", 0.0)])
    for t in range(1, 11):
        book.observe([load("prefill-a", float(t), waiting=t, finished=6), load("decode-a", t)])
    views = book.views()
    # Progress was last seen at t=1 (a request finished between 0 and 1).
    assert admit(views, TURN, settings, 10.5).admitted
    health = pool_health(views, TURN, settings, 10.5)
    assert (health.status, health.admits) == ("ok", True)
    book.observe([load("prefill-a", 11.0, waiting=3, finished=6), load("decode-a", 11.0)])
    refused = admit(book.views(), TURN, settings, 11.0)
    assert not refused.admitted and refused.pool == "prefill"
    assert "makes no progress" in refused.reason
    health = pool_health(book.views(), TURN, settings, 11.0)
    assert health.status == "degraded" and health.engines["prefill-a"]["condition"] == "stalled"
    assert health.engines["prefill-a"]["no_progress_s"] == 10.0


def test_a_stalled_engine_beside_a_working_one_degrades_health_but_admits() -> None:
    book = EngineBook()
    book.observe([load("prefill-a", 0.0, waiting=1), load("prefill-b", 0.0)])
    book.observe([load("prefill-a", 12.0, waiting=2), load("prefill-b", 12.0, running=1)])
    assert admit(book.views(), TURN, SETTINGS, 12.0).admitted
    health = pool_health(book.views(), TURN, SETTINGS, 12.0)
    assert (health.status, health.admits, list(health.engines)) == (
        "degraded",
        True,
        ["prefill-a"],
    )


def test_the_pool_recovers_as_soon_as_an_engine_reports_progress() -> None:
    book = EngineBook()
    book.observe([load("decode-a", 0.0, waiting=9)])
    book.observe([load("decode-a", 20.0, waiting=9)])
    assert not admit(book.views(), TURN, SETTINGS, 20.0).admitted
    # The queued turns were aborted at their deadline: the queue empties.
    book.observe([load("decode-a", 21.0, finished=9)])
    assert admit(book.views(), TURN, SETTINGS, 21.0).admitted
    assert pool_health(book.views(), TURN, SETTINGS, 21.0).status == "ok"


def test_old_reports_and_unknown_pools_admit() -> None:
    book = EngineBook()
    book.observe([load("decode-a", 0.0, waiting=50)])
    assert not admit(book.views(), TURN, SETTINGS, 1.0).admitted
    # The engine has not reported for longer than max_report_age_s: not used.
    assert admit(book.views(), TURN, SETTINGS, 6.0).admitted
    assert pool_health(book.views(), TURN, SETTINGS, 6.0).status == "ok"
    # A turn for another pool is not held back by this one.
    assert admit(book.views(), ("prefill", "decode_long"), SETTINGS, 1.0).admitted
    # Switched off: everything is admitted.
    off = AdmissionSettings(enabled=False)
    assert admit(book.views(), TURN, off, 1.0).admitted


def test_an_engine_no_longer_reported_is_forgotten_and_older_reports_are_ignored() -> None:
    book = EngineBook()
    book.observe([load("decode-a", 5.0, waiting=9), load("decode-b", 5.0, waiting=9)])
    book.observe([load("decode-a", 4.0), load("decode-b", 6.0, waiting=9)])
    assert [v.load.reported_s for v in book.views()] == [5.0, 6.0]
    book.observe([load("decode-b", 7.0, running=1)])
    assert [v.load.engine_id for v in book.views()] == ["decode-b"]


def test_the_config_section_is_the_policy_s_settings() -> None:
    cfg = parse_config(
        {"admission": {"max_waiting_per_engine": 2, "stall_s": 3, "retry_after_s": 1}}
    )
    settings = cfg.admission.settings()
    assert (settings.max_waiting_per_engine, settings.stall_s, settings.retry_after_s) == (
        2,
        3.0,
        1.0,
    )
    assert settings.enabled and settings.max_kv_cache_usage == 0.95


def test_a_turn_of_n_sequences_needs_an_engine_with_room_for_all_of_them() -> None:
    book = EngineBook()
    book.observe(
        [
            load("prefill-a", 100.0, running=2),
            load("decode-a", 100.0, running=8, waiting=2),  # room for 2 more of 4
            load("decode-b", 100.0, running=8, waiting=3),  # room for 1 more
        ]
    )
    assert admit(book.views(), TURN, SETTINGS, 100.5).admitted
    assert admit(book.views(), TURN, SETTINGS, 100.5, num_sequences=2).admitted
    refused = admit(book.views(), TURN, SETTINGS, 100.5, num_sequences=3)
    assert not refused.admitted and refused.pool == "decode"
    assert "full for 3 more sequences" in refused.reason
    # A pool with no recent report admits, whatever n (nothing to judge by).
    assert admit(book.views(), TURN, SETTINGS, 200.0, num_sequences=3).admitted


def test_a_kv_cache_full_of_kept_blocks_with_nothing_running_admits_nothing() -> None:
    book = EngineBook()
    # The decode engine's KV cache is full of blocks kept for sessions: nothing runs,
    # nothing waits (each turn sent to it waited and was aborted at its deadline).
    book.observe([load("prefill-a", 100.0), load("decode-a", 100.0, kv=0.99, finished=30)])
    refused = admit(book.views(), TURN, SETTINGS, 100.5)
    assert not refused.admitted and refused.pool == "decode"
    health = pool_health(book.views(), TURN, SETTINGS, 100.5)
    assert (health.status, health.admits, health.refusing_pools) == ("degraded", False, ("decode",))
    assert health.engines["decode-a"]["condition"] == "full"
    # Busy at the same use (its running turns will free their blocks): admitted.
    book.observe([load("prefill-a", 101.0), load("decode-a", 101.0, running=3, kv=0.99)])
    assert admit(book.views(), TURN, SETTINGS, 101.5).admitted
    # Kept blocks drained: ok again.
    book.observe([load("prefill-a", 102.0), load("decode-a", 102.0, kv=0.6, finished=31)])
    assert pool_health(book.views(), TURN, SETTINGS, 102.5).status == "ok"


def test_an_engine_is_short_of_kv_when_kept_blocks_hold_it_back() -> None:
    def short(book: EngineBook, now_s: float) -> bool:
        return short_of_kv(book.views()[0], SETTINGS, now_s)

    book = EngineBook()
    # Busy running turns, its cache full: its turns free their blocks, not short.
    book.observe([load("decode-a", 100.0, running=4, kv=0.99)])
    assert not short(book, 100.0)
    # Full with nothing running, or full with turns waiting: short.
    book.observe([load("decode-a", 101.0, kv=0.99)])
    assert short(book, 101.0)
    book.observe([load("decode-a", 102.0, running=1, waiting=2, kv=0.99, finished=1)])
    assert short(book, 102.0)
    # Room to spare and idle: not short.
    book.observe([load("decode-a", 103.0, kv=0.5, finished=2)])
    assert not short(book, 103.0)
    # A turn waits (one too big for what kept blocks leave) and none runs: short once
    # it made no progress for stall_s.
    book.observe([load("decode-a", 104.0, waiting=1, kv=0.5, finished=2)])
    assert not short(book, 104.0)
    book.observe([load("decode-a", 114.0, waiting=1, kv=0.5, finished=2)])
    assert short(book, 114.0)
