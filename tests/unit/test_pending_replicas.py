"""A deleted deployment's replica that Ray never placed stops at once, not at its
force-kill (``orchestrator.cluster.pending_replicas``); one that started drains.

``FakeServe`` deletes replicas as Ray Serve 2.60 does (``deployment_state.py``): every
replica of a deleted deployment is stopped gracefully, and Serve waits for its answer to
``perform_graceful_shutdown`` or its force-kill at ``graceful_shutdown_timeout_s``. A
started replica answers once its drain ends (its ongoing requests, then ``__del__``); one
whose placement group is pending never answers, and leaves only when its actor is
killed. A decode deployment's timeout is its turns' deadline and the KV service call:
635 s with the defaults, past ``serve.delete``'s own 60 s.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.cluster.pending_replicas import RELEASE_POLL_S, pending_of, release_while_deleting
from orchestrator.cluster.supervisor import PendingGroup

DECODE_GRACE_S = 635.0
WAIT_LOOP_S = 2.0  # Serve's graceful_shutdown_wait_loop_s: a drain with nothing ongoing


@dataclass
class Replica:
    deployment: str
    placed: bool
    drain_s: float = WAIT_LOOP_S  # a started replica's drain: its turns, then its KV moved


class FakeServe:
    def __init__(self, replicas: dict[str, Replica]) -> None:
        self.now_s = 0.0
        self.replicas = replicas
        self.gone_at: dict[str, float] = {}
        self.killed: list[str] = []

    def delete(self, deployments: set[str]) -> None:
        for name, r in self.replicas.items():
            if r.deployment in deployments:  # stopped gracefully, placed or not
                self.gone_at[name] = self.now_s + (r.drain_s if r.placed else DECODE_GRACE_S)

    def wait(self, seconds: float) -> None:
        self.now_s += seconds

    def kill(self, name: str) -> None:
        self.killed.append(name)
        self.gone_at[name] = self.now_s

    def alive(self, deployment: str) -> list[str]:
        return [
            name
            for name, r in self.replicas.items()
            if r.deployment == deployment and self.now_s < self.gone_at.get(name, float("inf"))
        ]

    def pending(self) -> list[PendingGroup]:
        """Placement groups Ray has not placed, of the replicas not gone (as read from
        ``placement_group_table``)."""
        return [
            PendingGroup(
                group_id=name, replica=name, deployment=r.deployment, bundles=(), state="PENDING"
            )
            for name, r in self.replicas.items()
            if not r.placed and self.now_s < self.gone_at.get(name, float("inf"))
        ]


def replica(deployment: str, n: int) -> str:
    return f"SERVE_REPLICA::kvtide#{deployment}#{n}"


def test_a_deleted_app_whose_decode_engine_ray_never_placed_goes_within_serve_s_bounds() -> None:
    # A deploy whose TP16 decode engine Ray could not place: its prefill engine runs,
    # holding nothing; kvtide deletes the app.
    serve = FakeServe(
        {
            replica("prefill-pool-hgx-1", 1): Replica("prefill-pool-hgx-1", placed=True),
            replica("decode-pool-nvl72-a", 1): Replica("decode-pool-nvl72-a", placed=False),
        }
    )
    serve.delete({"prefill-pool-hgx-1", "decode-pool-nvl72-a"})
    deleted = release_while_deleting(
        deleted=lambda: (
            not any(serve.alive(d) for d in ("prefill-pool-hgx-1", "decode-pool-nvl72-a"))
        ),
        pending=lambda: pending_of(serve.pending(), None),
        kill=serve.kill,
        within_s=60.0,
        clock=lambda: serve.now_s,
        wait=serve.wait,
    )
    assert deleted
    # The unplaced replica was killed at the first round, and the started one left to
    # its drain, which ended with Serve's wait loop: the app went in 2 s, not 635 s.
    assert serve.killed == [replica("decode-pool-nvl72-a", 1)]
    assert serve.now_s == WAIT_LOOP_S


def test_a_redeploy_stops_only_the_dropped_deployment_s_unplaced_replica() -> None:
    # A re-placement: decode moves from nvl72-a (a tray lost; Serve's restarted replica
    # there pending) to nvl72-b, whose new replica is pending while Ray places it. A
    # replica of the dropped deployment that started drains its turns, up to 40 s.
    serve = FakeServe(
        {
            replica("decode-pool-nvl72-a", 1): Replica(
                "decode-pool-nvl72-a", placed=True, drain_s=40.0
            ),
            replica("decode-pool-nvl72-a", 2): Replica("decode-pool-nvl72-a", placed=False),
            replica("decode-pool-nvl72-b", 1): Replica("decode-pool-nvl72-b", placed=False),
        }
    )
    dropped = {"decode-pool-nvl72-a"}
    serve.delete(dropped)
    # Bounded by 10 s: the started replica still drains then, and is not cut.
    deleted = release_while_deleting(
        deleted=lambda: not serve.alive("decode-pool-nvl72-a"),
        pending=lambda: pending_of(serve.pending(), dropped),
        kill=serve.kill,
        within_s=10.0,
        clock=lambda: serve.now_s,
        wait=serve.wait,
    )
    assert not deleted and serve.now_s == 10.0
    # Only the dropped deployment's unplaced replica was killed: the new deployment's
    # replica is left to Ray, the started one to its drain.
    assert serve.killed == [replica("decode-pool-nvl72-a", 2)]
    assert serve.alive("decode-pool-nvl72-a") == [replica("decode-pool-nvl72-a", 1)]
    assert serve.alive("decode-pool-nvl72-b") == [replica("decode-pool-nvl72-b", 1)]


def test_nothing_is_killed_before_serve_has_had_a_round_to_stop_it() -> None:
    # A replica killed before Serve marks it stopping counts as a failed start of a
    # deployment still wanted, and Serve starts another: the first kill waits a round.
    serve = FakeServe({replica("decode", 1): Replica("decode", placed=False)})
    serve.delete({"decode"})
    kills_at: list[float] = []

    def kill(name: str) -> None:
        kills_at.append(serve.now_s)
        serve.kill(name)

    assert release_while_deleting(
        deleted=lambda: not serve.alive("decode"),
        pending=serve.pending,
        kill=kill,
        within_s=60.0,
        clock=lambda: serve.now_s,
        wait=serve.wait,
    )
    assert kills_at == [RELEASE_POLL_S]
