"""kvtide's INFO lines reach the log of the Ray process they run in: a Serve replica's
log file (set up by Serve's own function, as a replica calls it), or stderr in a plain
actor (the KV service's). Without ``route_kvtide_logs`` nothing gave ``kvtide.*`` a
level or a handler there, and an engine's "ready" or a scale-in's moves were dropped."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.observability.logs import route_kvtide_logs


@pytest.fixture
def loggers() -> Iterator[None]:
    """``ray.serve`` and ``kvtide`` as they were, after a test set them up."""
    saved = {
        name: (lg.level, lg.propagate, list(lg.handlers))
        for name, lg in ((n, logging.getLogger(n)) for n in ("ray.serve", "kvtide"))
    }
    yield
    for name, (level, propagate, handlers) in saved.items():
        logger = logging.getLogger(name)
        if name == "ray.serve":
            for handler in logger.handlers:
                handler.close()
                target = getattr(handler, "target", None)  # Serve's buffer and its file
                if target is not None:
                    target.close()
        logger.setLevel(level)
        logger.propagate = propagate
        logger.handlers[:] = handlers


def test_a_replicas_kvtide_info_lines_are_in_its_serve_log_file(
    tmp_path: Path, loggers: None
) -> None:
    from ray.serve._private.logging_utils import configure_component_logger
    from ray.serve.schema import LoggingConfig

    configure_component_logger(
        component_name="replica",
        component_id="decode-pool#abc",
        logging_config=LoggingConfig(logs_dir=str(tmp_path)),
        max_bytes=2**20,
        backup_count=1,
    )
    route_kvtide_logs()
    route_kvtide_logs()  # a second part of the same process: each line once
    logging.getLogger("kvtide.engine").info("engine decode-0 scaled in: %s", {"moved": 2})
    (log_file,) = tmp_path.glob("replica_*.log")
    logged = log_file.read_text()
    assert logged.count("engine decode-0 scaled in: {'moved': 2}") == 1, logged


def test_a_plain_actors_kvtide_info_lines_go_to_stderr(
    loggers: None, capfd: pytest.CaptureFixture[str]
) -> None:
    logging.getLogger("ray.serve").handlers[:] = []  # not a Serve replica
    route_kvtide_logs()
    logging.getLogger("kvtide.kv_service").info("3 kept entries nobody booked, sent to be drained")
    err = capfd.readouterr().err
    assert "INFO" in err and "kvtide.kv_service -- 3 kept entries nobody booked" in err
