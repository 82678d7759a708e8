"""What ``kvtide up`` says while Serve retries a replica that failed to start: the
error its traceback ends with, read from Serve's deployment status message, at once;
and the deploy's failure, with that error, once Serve gave up."""

from __future__ import annotations

from types import SimpleNamespace

from orchestrator.runtime import DeployProgress, replica_failure

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


def app_status(status: str, message: str, **deployments: tuple[str, str, dict[str, int]]) -> object:
    """Serve's ``ApplicationStatusOverview``, as much of it as kvtide reads."""
    return SimpleNamespace(
        status=status,
        message=message,
        deployments={
            name: SimpleNamespace(status=s, message=m, replica_states=states)
            for name, (s, m, states) in deployments.items()
        },
    )


def test_a_pool_whose_replicas_fail_to_start_shows_their_error_at_once_and_in_the_failure() -> None:
    error = "ValueError: simulated engine decode-x: unknown extra_engine_args [...]"
    trace = f'Traceback (most recent call last):\n  File "x.py", line 1\n{error}\n'
    retrying = f"A replica failed to start with exception. Retrying 2 more time(s). Error:\n{trace}"
    gave_up = f"The deployment failed to start 3 times in a row. Error:\n{trace}"
    progress = DeployProgress(started_s=100.0, every_s=10.0)
    prefill = ("HEALTHY", "", {"RUNNING": 1})
    # One second in: the replica's own error, said at once (not at the next 10 s line).
    lines, failure = progress.read(
        app_status(
            "DEPLOYING", "", prefill_pool=prefill,
            decode_pool=("UPDATING", retrying, {"STARTING": 1}),
        ),
        now_s=101.0,
    )  # fmt: skip
    assert failure is None and len(lines) == 1
    assert lines[0].startswith(f"decode_pool: a replica failed to start: {error}")
    # Serve gave up: its app message names the deployment only; the failure says why.
    lines, failure = progress.read(
        app_status(
            "DEPLOY_FAILED", "Failed to update the deployments ['decode_pool'].",
            prefill_pool=prefill, decode_pool=("DEPLOY_FAILED", gave_up, {}),
        ),
        now_s=103.0,
    )  # fmt: skip
    assert lines == []  # the same error is not said twice
    assert failure == f"app 'kvtide' failed to deploy: decode_pool: {error}"


def test_progress_says_the_running_replicas_every_interval() -> None:
    progress = DeployProgress(started_s=0.0, every_s=10.0)
    starting = app_status("DEPLOYING", "", decode_pool=("UPDATING", "", {"STARTING": 1}))
    assert progress.read(None, now_s=5.0) == ([], None)
    assert progress.read(starting, now_s=5.0) == ([], None)
    assert progress.read(starting, now_s=10.0) == (
        ["starting engines (10s): decode_pool 0/1"],
        None,
    )
    assert progress.read(starting, now_s=15.0) == ([], None)
