"""kvtide's log lines where a Ray process writes its own.

kvtide logs under ``kvtide.*``. In a Ray worker nothing gives that logger a level or a
handler, so its INFO lines (an engine ready, a scale-in's moves, a step stream ended, a
kept entry drained) were dropped and its warnings reached stderr bare through Python's
last-resort handler. ``route_kvtide_logs`` is called where kvtide's parts start in a
Ray process (a Serve replica's constructor, the KV service actor's): the lines go to
the handlers Serve gave that replica (its log file under the session's
``logs/serve/``, and its stderr), or, in a plain actor, to stderr (the worker's log file
under ``logs/``), at INFO. The driver (``kvtide up``, the tests) is left as it is.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["route_kvtide_logs"]

_FORMAT = "%(levelname)s %(asctime)s %(name)s -- %(message)s"


def route_kvtide_logs() -> None:
    """Send ``kvtide.*`` at INFO to this process's Serve handlers, or to stderr."""
    kvtide = logging.getLogger("kvtide")
    kvtide.setLevel(logging.INFO)
    handlers = logging.getLogger("ray.serve").handlers
    if not handlers:
        stderr = logging.StreamHandler(sys.stderr)
        stderr.setFormatter(logging.Formatter(_FORMAT))
        handlers = [stderr]
    for handler in handlers:
        if handler not in kvtide.handlers:
            kvtide.addHandler(handler)
    kvtide.propagate = False  # once, where the handlers above put it
