"""The pools' latest signals, shared by their policies in Serve's controller process.

Serve builds each pool's ``PoolPolicy`` from bytes it pickled by value, so a policy's
own module is one copy per pool; this module is imported by name, once per process, and
so is the one place the two see each other's signals (decode sizes for the sequences
in prefill). Single-threaded: the controller's control loop calls the policies in turn.
"""

from __future__ import annotations

import time

from policies.autoscale import Pool, PoolSignals

__all__ = ["in_ray", "latest", "now_s", "publish"]

_LATEST: dict[tuple[str, Pool], PoolSignals] = {}


def publish(app: str, pool: Pool, signals: PoolSignals) -> None:
    _LATEST[(app, pool)] = signals


def latest(app: str, pool: Pool) -> PoolSignals:
    """The pool's last signals; none yet: an idle pool of no replicas."""
    return _LATEST.get((app, pool)) or PoolSignals(num_replicas=0)


def now_s() -> float:
    """The process's monotonic clock (when to look the KV service up again)."""
    return time.monotonic()


def in_ray() -> bool:
    """Whether this process is connected to Ray (Serve's controller is)."""
    import ray

    return bool(ray.is_initialized())
