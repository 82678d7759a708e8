"""The decode deployments' Serve request router: Serve's power-of-two choice, except
that a step stream (``orchestrator.cluster.step_streams.StepsOpen``) goes to the replica
it names. Serve offers no call pinned to a replica otherwise; a step stream must reach
the replica whose engine runs the requests it carries. A request that asks for an engine
(``GenerateRequest.engine_id``: a turn extended where its history is kept) goes to that
engine's replica once this process's step streams have named it
(``step_streams.engine_replica``), by Serve's choice before.

A step stream whose replica is gone (not among Serve's candidates) is routed like any
call; the host answers with its own id and the ingress, seeing another, fails it. A
replica that leaves the router's set is being stopped: the callers in this process are
told (``step_streams.replicas_gone``), so that their standing streams to it end and
Serve's drain of it can finish.
"""

from __future__ import annotations

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RunningReplica

from engines.base import GenerateRequest
from orchestrator.cluster import step_streams
from orchestrator.cluster.step_streams import StepsOpen

__all__ = ["StepRouter", "pinned_replica", "step_router_config"]


def step_router_config() -> RequestRouterConfig:
    """The ``request_router_config`` of an engine deployment that serves step streams."""
    return RequestRouterConfig(request_router_class=f"{__name__}.StepRouter")


def pinned_replica(pending: PendingRequest | None) -> str | None:
    """The replica a step stream names, or that runs the engine a request asks for;
    None for any other call."""
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    if isinstance(first, GenerateRequest) and first.engine_id is not None:
        return step_streams.engine_replica(first.engine_id)
    return first.replica if isinstance(first, StepsOpen) else None


class StepRouter(PowerOfTwoChoicesRequestRouter):
    """Power-of-two choice, with step streams pinned to their replica."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        replica = pinned_replica(pending_request)
        if replica is not None:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == replica]
            if pinned:
                return [pinned]
        return await super().choose_replicas(candidate_replicas, pending_request)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = {r.unique_id for r in self._replica_id_set} - {
            r.replica_id.unique_id for r in replicas
        }
        super().update_replicas(replicas)
        step_streams.replicas_gone(gone)
