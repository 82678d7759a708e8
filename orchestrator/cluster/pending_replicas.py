"""The replicas Ray never placed of the deployments kvtide deletes, let go at once.

Serve stops every replica of a deployment it deletes (``serve.delete`` of the app, a
deployment a redeploy drops) gracefully, a STARTING one too: its downscale calls
``DeploymentReplica.stop(graceful=True)``, which sends the replica actor
``perform_graceful_shutdown`` and sets the force-kill at the deployment's
``graceful_shutdown_timeout_s``, and ``check_stopped`` waits for that call's answer or
the force-kill (``ray/serve/_private/deployment_state.py``; only a rolling update stops
an outdated STARTING replica without grace). A replica whose placement group Ray has not
placed has no process to answer, so it holds the deletion for the whole timeout: for a
decode deployment its turns' deadline and the KV service call (635 s by default), though
it never started an engine and holds nothing, and ``serve.delete`` gives up after 60 s.
Removing the pending group leaves the actor waiting on it; killing the actor ends it,
and Serve's next check finds it gone (``ray.get_actor`` fails) and removes the group.

So whoever deletes kvtide's deployments (``orchestrator.runtime``: a deploy whose
engines Ray did not place, the shutdown, the supervisor's re-placement) waits for them
with ``release_while_deleting``: until Serve has let them go, it kills the actors of
their replicas still pending (a replica's group is named after its actor), within a
bound of its own. A replica that started is left to its drain: its running turns finish
and its sessions' KV moves (``EngineHost.__del__``), and one that holds nothing drains
within Serve's wait loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable

from orchestrator.cluster.deadlines import GCS_TIMEOUT_S, call_within
from orchestrator.cluster.supervisor import PendingGroup, read_pending_groups

__all__ = [
    "RELEASE_POLL_S",
    "kill_replica",
    "pending_of",
    "read_pending_of",
    "release_while_deleting",
]

log = logging.getLogger("kvtide.placement")

RELEASE_POLL_S = 0.5
"""How often Serve's progress is read and the pending replicas killed: Serve's control
loop stops a deleted deployment's replicas within a few of its 0.1 s rounds."""

SERVE_NAMESPACE = "serve"  # Ray's namespace of Serve's replica actors


def pending_of(
    pending: Iterable[PendingGroup], deployments: Collection[str] | None
) -> list[PendingGroup]:
    """The groups in ``pending`` of ``deployments`` (None: of every deployment)."""
    return [g for g in pending if deployments is None or g.deployment in deployments]


def release_while_deleting(
    *,
    deleted: Callable[[], bool],
    pending: Callable[[], Iterable[PendingGroup]],
    kill: Callable[[str], None],
    within_s: float,
    clock: Callable[[], float] = time.monotonic,
    wait: Callable[[float], object] = time.sleep,
) -> bool:
    """Until ``deleted()``, at most ``within_s``: every ``RELEASE_POLL_S``, ``kill`` the
    replica actor of each group ``pending()`` reads. True once ``deleted()``; False when
    the bound passed first (a started replica still draining)."""
    deadline = clock() + within_s
    while not deleted():
        if clock() >= deadline:
            return False
        # One round first: a replica killed before Serve marks it stopping counts as a
        # failed start of a deployment still wanted, and Serve would start another.
        wait(RELEASE_POLL_S)
        for group in pending():
            log.info("%s: its engine was never placed; stopping it now", group.replica)
            kill(group.replica)
    return True


def kill_replica(name: str) -> None:
    """Kill the Serve replica actor ``name`` (gone already: nothing), each GCS call
    within ``GCS_TIMEOUT_S``."""
    import ray

    try:
        actor = call_within(
            lambda: ray.get_actor(name, namespace=SERVE_NAMESPACE),
            GCS_TIMEOUT_S,
            f"the lookup of {name}",
        )
    except ValueError:
        return
    call_within(lambda: ray.kill(actor, no_restart=True), GCS_TIMEOUT_S, f"the kill of {name}")


def read_pending_of(app_name: str, deployments: Collection[str] | None) -> list[PendingGroup]:
    """The app's groups pending now of ``deployments`` (needs ``ray.init``), read within
    ``GCS_TIMEOUT_S``."""
    groups = call_within(
        lambda: read_pending_groups(app_name), GCS_TIMEOUT_S, "Ray's placement group table"
    )
    return pending_of(groups, deployments)
