"""What ``kvtide up`` says while Serve retries a replica that failed to start: the
error its traceback ends with, read from Serve's deployment status message."""

from __future__ import annotations

from orchestrator.runtime import replica_failure

TRACEBACK = """Traceback (most recent call last):
  File "/x/ray/serve/_private/replica.py", line 1100, in initialize_and_get_metadata
    await self._user_callable_wrapper.initialize_callable()
  File "/x/orchestrator/serve/engine_host.py", line 180, in __init__
    self.engine.start()
  File "/x/vllm/v1/engine/utils.py", line 900, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_error_a_failing_replica_ended_with_is_read_from_serves_message() -> None:
    # Serve's messages while it retries, and once it gave up (ray 2.60's wording).
    retrying = (
        f"A replica failed to start with exception. Retrying 2 more time(s). Error:\n{TRACEBACK}"
    )
    gave_up = (
        "The deployment failed to start 3 times in a row. This may be due to a problem with "
        "its constructor or initial health check failing. See controller logs for details. "
        f"Error:\n{TRACEBACK}"
    )
    line = TRACEBACK.splitlines()[-1]
    assert line.startswith("RuntimeError: Engine core initialization failed")
    assert replica_failure(retrying) == line
    assert replica_failure(gave_up) == line
    nested = retrying + "\nray.exceptions.RayActorError: The actor died unexpectedly"
    assert replica_failure(nested) == "ray.exceptions.RayActorError: The actor died unexpectedly"


def test_a_healthy_or_updating_deployment_has_no_failure() -> None:
    assert replica_failure("") is None
    assert replica_failure("Deployment is updating: 1 replica starting.") is None
