"""Stories of a session's turn state (``policies.turn_state``), told with a moved clock:
each rule of running marks and turn leases, and the exact effects the KV service is
told to apply. Leases last 30 s with a 5 s grace (a lease lapses 35 s after its grant);
a running mark is stale after 600 s."""

from __future__ import annotations

from dataclasses import replace

from kv_stories import CONFIG, tokens

from policies.kv_lifecycle import KVLifecycle, RecomputeReason
from policies.turn_leases import REFUSED_KEPT, LeaseGrants, RevokeLease, proposals_allowed
from policies.turn_state import ClearRunning, MarkRunning, TouchOwner, TurnState

DIGEST = 1234  # the digest of the session's last turn, as the service keeps it


def state(lasts_s: float = 30.0) -> TurnState:
    return TurnState(
        KVLifecycle(CONFIG),
        running_grace_s=600.0,
        leases=LeaseGrants(lasts_s=lasts_s, grace_s=5.0),
    )


def kept(s: TurnState, session_id: str, now_s: float, *, hold: bool = False) -> None:
    """A turn of the session ended at ``now_s`` with 100 tokens' KV kept on decode-0."""
    s.lifecycle.on_turn_finished(
        session_id,
        engine_id="decode-0",
        token_ids_covered=tokens(100),
        block_ids=(0, 1, 2),
        transfer_params={},
        expiry_s=None,
        now_s=now_s,
        hold=hold,
    )


def granted(s: TurnState, session_id: str = "s1", now_s: float = 0.0) -> int:
    """Book a record for the session and lease its next turn to replica-a (watching)."""
    kept(s, session_id, now_s)
    grant, effects = s.grant(session_id, "replica-a", now_s, watching=True, digest=DIGEST)
    assert grant is not None
    assert effects == [
        MarkRunning(session_id=session_id, lease_id=grant.lease_id, holder="replica-a")
    ]
    return grant.lease_id


# -- running marks ------------------------------------------------------------------------


def test_a_claimed_turn_is_marked_running_and_its_end_clears_the_mark() -> None:
    s = state()
    assert s.mark("s1", 10.0, holder="replica-a") == [MarkRunning(session_id="s1")]
    assert "s1" in s and s.running_since("s1") == 10.0 and s.holders == {"s1": "replica-a"}
    assert s.in_progress("s1", 609.9)
    assert s.clear("s1") == [ClearRunning(session_id="s1", marked=True)]
    assert "s1" not in s and s.holders == {}
    # Cleared twice: nothing to delete, but a turn waiting on it is still let go.
    assert s.clear("s1") == [ClearRunning(session_id="s1", marked=False)]


def test_a_turn_whose_deadline_passed_is_stale_and_the_tick_clears_it() -> None:
    s = state()
    s.mark("s1", 0.0)
    s.mark("s2", 100.0)
    assert s.on_tick(599.9) == []  # within the grace
    assert s.stale(600.0) == ["s1"] and not s.in_progress("s1", 600.0)
    assert s.on_tick(600.0) == [ClearRunning(session_id="s1", marked=True)]
    assert "s1" not in s and "s2" in s


def test_a_stale_turn_under_a_used_lease_ends_its_lease_too() -> None:
    s = state()
    lease_id = granted(s)
    assert s.use("s1", lease_id, None, 1.0)[0]
    assert s.on_tick(601.0) == [ClearRunning(session_id="s1", marked=True)]
    assert s.leases.grants == {}


def test_a_restored_mark_runs_until_its_grace_passes() -> None:
    s = state()
    s.restore("s1", -590.0)  # claimed 590 s before this instance started
    assert s.in_progress("s1", 9.9)
    assert s.on_tick(10.0) == [ClearRunning(session_id="s1", marked=True)]


# -- leases granted and refused -----------------------------------------------------------


def test_a_lease_holds_the_record_and_marks_the_turn_for_its_lessee() -> None:
    s = state()
    lease_id = granted(s, now_s=2.0)
    [grant] = s.leases.grants.values()
    assert (grant.holder, grant.lease_id, grant.lapses_s) == ("replica-a", lease_id, 37.0)
    assert grant.record == s.lifecycle.record("s1") and not grant.used
    assert s.lifecycle.held("s1") and "s1" in s and s.holders["s1"] == "replica-a"
    assert s.leases.num_unused() == 1 and s.leases.unused("s1") is grant


def test_a_lease_is_refused_for_each_reason_and_nothing_is_held() -> None:
    s = state()
    kept(s, "s1", 0.0)
    refusals = [
        dict(holder=None, watching=True, digest=DIGEST),  # no lessee named
        dict(holder="replica-a", watching=False, digest=DIGEST),  # its watch is not running
        dict(holder="replica-a", watching=True, digest=None),  # no last turn to check against
    ]
    for refusal in refusals:
        assert s.grant("s1", now_s=0.0, **refusal) == (None, [])  # type: ignore[arg-type]
    s.mark("s1", 0.0)  # a turn of the session runs
    assert s.grant("s1", "replica-a", 0.0, watching=True, digest=DIGEST) == (None, [])
    s.clear("s1")
    off = state(lasts_s=0.0)  # leases off
    kept(off, "s1", 0.0)
    assert off.grant("s1", "replica-a", 0.0, watching=True, digest=DIGEST) == (None, [])
    assert not s.lifecycle.held("s1") and not off.lifecycle.held("s1")
    assert s.leases.grants == {} and "s1" not in s


def test_a_proposed_lease_is_granted_without_a_watch_under_its_own_id() -> None:
    s = state()
    kept(s, "s1", 0.0, hold=True)  # booked held: its lessee may pull it already
    assert s.proposal(77, "replica-a") == 77
    grant, effects = s.grant("s1", "replica-a", 0.0, watching=False, digest=DIGEST, proposed=77)
    assert grant is not None and grant.lease_id == 77
    assert effects == [MarkRunning(session_id="s1", lease_id=77, holder="replica-a")]


def test_a_record_held_for_a_proposal_not_granted_is_let_go() -> None:
    s = state()
    kept(s, "s1", 0.0, hold=True)
    s.mark("s1", 0.0)  # say a claim raced it: the lease is refused
    grant, effects = s.grant("s1", "replica-a", 1.0, watching=False, digest=DIGEST, proposed=77)
    assert grant is None and effects == [] and not s.lifecycle.held("s1")


def test_proposals_are_refused_when_off_under_a_budget_or_refused_before() -> None:
    s = state()
    assert s.proposal(None, "replica-a") is None and s.proposal(5, None) is None
    s.refuse(5)
    assert s.proposal(5, "replica-a") is None and s.proposal(6, "replica-a") == 6
    assert state(lasts_s=0.0).proposal(6, "replica-a") is None
    budget = replace(CONFIG, idle_budget_bytes_per_engine=10**9)
    assert not proposals_allowed(budget, 30.0) and proposals_allowed(CONFIG, 30.0)


def test_the_refused_proposals_kept_are_bounded_oldest_first() -> None:
    s = state()
    for lease_id in range(REFUSED_KEPT + 1):
        s.refuse(lease_id)
    assert s.proposal(0, "replica-a") == 0  # forgotten
    assert s.proposal(1, "replica-a") is None


# -- leases used, ended, released, lapsed -------------------------------------------------


def test_a_used_lease_remarks_its_turn_without_the_lease_and_touches_the_owner() -> None:
    s = state()
    lease_id = granted(s)
    ok, effects = s.use("s1", lease_id, None, 3.0)
    assert ok and effects == [MarkRunning(session_id="s1"), TouchOwner(session_id="s1")]
    assert s.running_since("s1") == 3.0 and s.holders["s1"] == "replica-a"
    assert s.leases.grants["s1"].used and s.leases.num_unused() == 0
    # Used twice (or its id replayed): refused, nothing changes.
    assert s.use("s1", lease_id, None, 4.0) == (False, [])
    assert s.running_since("s1") == 3.0


def test_a_lease_used_to_recompute_runs_the_held_turn_and_counts_its_reason() -> None:
    s = state()
    lease_id = granted(s)
    assert s.use("s1", lease_id, RecomputeReason.PREFIX_MISMATCH.value, 1.0)[0]
    assert not s.lifecycle.held("s1")  # running now, no longer held
    assert s.lifecycle.stats().num_recomputes_for(RecomputeReason.PREFIX_MISMATCH) == 1


def test_a_use_the_books_refuse_ends_the_lease() -> None:
    # The record the lease carries is not the session's any more: its pull is refused,
    # the hold goes and the session is free.
    s = state()
    lease_id = granted(s)
    s.leases.grants["s1"].record = None
    ok, effects = s.use("s1", lease_id, None, 1.0)
    assert not ok and effects == [ClearRunning(session_id="s1", marked=True)]
    assert s.leases.grants == {} and not s.lifecycle.held("s1") and "s1" not in s


def test_a_use_of_an_unknown_lease_changes_nothing() -> None:
    s = state()
    granted(s)
    assert s.use("s1", 999, None, 1.0) == (False, [])
    assert s.use("s2", 999, None, 1.0) == (False, [])
    assert s.leases.num_unused() == 1


def test_an_unused_lease_given_back_releases_its_hold_and_mark_once() -> None:
    s = state()
    granted(s)
    [grant] = s.leases.grants.values()
    assert s.end(grant, 2.0) == [ClearRunning(session_id="s1", marked=True)]
    assert not s.lifecycle.held("s1") and "s1" not in s and s.leases.grants == {}
    # Released a second time (its return and its lapse crossing): nothing happens.
    assert s.end(grant, 3.0) == []


def test_ending_a_replaced_lease_leaves_the_new_one() -> None:
    s = state()
    granted(s)
    [old] = s.leases.grants.values()
    s.end(old, 1.0)
    new_id = granted(s, now_s=2.0)
    assert s.end(old, 3.0) == []
    assert s.leases.grants["s1"].lease_id == new_id and "s1" in s


def test_a_given_back_lease_over_the_idle_budget_is_evicted_as_it_ends() -> None:
    budget = replace(CONFIG, idle_budget_bytes_per_engine=1)
    s = TurnState(
        KVLifecycle(budget), running_grace_s=600.0, leases=LeaseGrants(lasts_s=30.0, grace_s=5.0)
    )
    kept(s, "s1", 0.0, hold=True)  # held, so not evicted at its booking
    grant, _ = s.grant("s1", "replica-a", 0.0, watching=True, digest=DIGEST)
    assert grant is not None
    effects = s.end(grant, 1.0)
    assert [type(e).__name__ for e in effects] == ["Evict", "ClearRunning"]
    assert s.lifecycle.record("s1") is None


def test_the_watch_gives_back_only_its_own_unused_leases() -> None:
    s = state()
    a = granted(s, "s1")
    b = granted(s, "s2")
    s.use("s2", b, None, 1.0)
    c_grant, _ = s.grant("s3", "replica-b", 1.0, watching=True, digest=DIGEST)
    assert c_grant is not None
    effects = s.released("replica-a", [a, b, c_grant.lease_id], None, 2.0)
    assert effects == [ClearRunning(session_id="s1", marked=True)]
    assert set(s.leases.grants) == {"s2", "s3"}


def test_a_lease_whose_lessee_went_silent_lapses_at_the_tick() -> None:
    s = state()
    granted(s, now_s=0.0)
    assert s.on_tick(34.9) == []
    assert s.on_tick(35.0) == [ClearRunning(session_id="s1", marked=True)]
    assert not s.lifecycle.held("s1") and s.leases.grants == {}


def test_a_used_lease_does_not_lapse() -> None:
    s = state()
    s.use("s1", granted(s), None, 1.0)
    assert s.on_tick(100.0) == [] and "s1" in s


def test_a_gone_record_revokes_the_unused_lease_that_would_read_it() -> None:
    s = state()
    lease_id = granted(s)
    record = s.lifecycle.record("s1")
    assert record is not None
    revoke = [RevokeLease(holder="replica-a", lease_id=lease_id)]
    assert s.leases.revocations(record) == revoke and s.leases.revoke_session("s1") == revoke
    assert (
        s.leases.revocations(replace(record, block_ids=(9,))) == []
    )  # another record of the session
    assert s.leases.revoke_session("s2") == []
    s.use("s1", lease_id, None, 1.0)
    assert (
        s.leases.revocations(record) == [] and s.leases.revoke_session("s1") == []
    )  # used: it ends with its turn


# -- a previous instance's leases ---------------------------------------------------------


def test_a_restored_lease_ends_when_given_back_used_or_not_vouched_for() -> None:
    s = state()
    for sid, lease_id in (("s1", 1), ("s2", 2), ("s3", 3), ("s4", 4)):
        s.restore(sid, 0.0)
        s.restored.add(lease_id, sid, "replica-a", 35.0)
    # Given back by its lessee.
    assert s.released("replica-a", [1], None, 1.0) == [ClearRunning(session_id="s1", marked=True)]
    # Used: refused (this instance never granted it), and its mark goes.
    assert s.use("s2", 2, None, 1.0) == (False, [ClearRunning(session_id="s2", marked=True)])
    # The lessee holds lease 3 only: 4 is over; 3 is its running turn from now on.
    assert s.released("replica-a", [], [3], 1.0) == [ClearRunning(session_id="s4", marked=True)]
    assert s.on_tick(100.0) == [] and "s3" in s  # vouched for: no lapse


def test_a_restored_lease_nobody_vouches_for_lapses() -> None:
    s = state()
    s.restore("s1", 0.0)
    s.restored.add(1, "s1", "replica-a", 35.0)
    s.released("replica-b", [], [], 1.0)  # another lessee's word says nothing of it
    assert s.on_tick(34.0) == []
    assert s.on_tick(35.0) == [ClearRunning(session_id="s1", marked=True)]


# -- a turn's end and a close -------------------------------------------------------------


def test_a_hand_over_ends_the_turn_and_its_lease() -> None:
    s = state()
    s.use("s1", granted(s), None, 1.0)
    assert s.hand_over("s1") == (False, [ClearRunning(session_id="s1", marked=True)])
    assert s.leases.grants == {} and "s1" not in s


def test_a_session_deleted_mid_turn_frees_that_turns_kv_at_its_hand_over() -> None:
    s = state()
    s.mark("s1", 5.0)
    s.closing("s1")  # the client closes while the turn runs
    closed, effects = s.hand_over("s1")
    assert closed and effects == [ClearRunning(session_id="s1", marked=True)]
    # Remembered once: the session's next turn hands over as any.
    s.mark("s1", 6.0)
    assert s.hand_over("s1")[0] is False


def test_a_close_remembered_for_an_ended_turn_does_not_reach_the_next_one() -> None:
    s = state()
    s.mark("s1", 5.0)
    s.closing("s1")
    s.abandoned("s1")  # that turn failed: the close is forgotten with it
    s.mark("s1", 6.0)
    assert s.hand_over("s1")[0] is False
    # A close seen by a turn whose mark changed since (stale, cleared, a new one) is
    # dropped at the next close.
    s.mark("s2", 1.0)
    s.closing("s2")
    s.clear("s2")
    s.mark("s2", 2.0)
    s.closing("s3")
    assert s.closed_running == {}
    assert s.hand_over("s2")[0] is False


def test_a_close_with_no_turn_running_remembers_nothing() -> None:
    s = state()
    s.closing("s1")
    assert s.closed_running == {} and s.hand_over("s1") == (
        False,
        [ClearRunning(session_id="s1", marked=False)],
    )


def test_an_abandoned_turn_under_a_lease_ends_it() -> None:
    s = state()
    s.use("s1", granted(s), None, 1.0)
    assert s.abandoned("s1") == [ClearRunning(session_id="s1", marked=True)]
    assert s.leases.grants == {}
