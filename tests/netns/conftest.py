"""One cluster of fake hosts (``netns_cluster.py``) shared by every test in this
directory, whatever its tier.

    head   this machine's network, 4 CPUs, no GPUs: Serve's controller and proxy, the
           ingress, the KV service, this test process's driver
    p0     1 GPU, nvlink_domain=hgx-p          (the prefill engine)
    a0 a1  1 GPU each, nvlink_domain=nvl-a     (a TP2 engine spans both)
    b0 b1  1 GPU each, nvlink_domain=nvl-b     (where it goes when nvl-a loses a host)

Where namespaces cannot be made (not root, no iproute2, a kernel or container that
refuses them) every test here is skipped with the reason; there is no fallback to the
one-IP cluster, on which vLLM's engine core attaches to the wrong raylet.

The cluster starts for the first test that asks for it and stops after the last one
(``pytest_runtest_teardown``), so that its hosts do not hold cores and memory while the
rest of the suite runs; the root conftest keeps these tests together.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator

import pytest
from netns_cluster import HostSpec, NetnsCluster, unavailable_reason

HOSTS = [
    HostSpec(name="p0", num_cpus=4, num_gpus=1, labels={"nvlink_domain": "hgx-p"}),
    *(
        HostSpec(name=f"{rack}{i}", num_cpus=4, num_gpus=1, labels={"nvlink_domain": f"nvl-{rack}"})
        for rack in "ab"
        for i in range(2)
    ),
]

_cluster: NetnsCluster | None = None
_unavailable: list[str | None] = []  # why fake hosts cannot run here, once checked


@pytest.fixture(scope="session")
def hosts() -> Iterator[NetnsCluster]:
    """The fake-host cluster, this process connected to it as a driver on the head."""
    global _cluster
    import ray

    if ray.is_initialized():
        pytest.skip("this process is already connected to a Ray; run this tier on its own")
    if _cluster is None:
        if not _unavailable:
            _unavailable.append(unavailable_reason())
        if _unavailable[0] is not None:
            pytest.skip(f"fake hosts unavailable: {_unavailable[0]}")
        cluster = NetnsCluster(
            HostSpec(name="head", num_cpus=4),
            HOSTS,
            # No idle workers: the tests start what they need.
            system_config={"prestart_worker_first_driver": False},
        )
        cluster.start()
        _cluster = cluster
        cluster.connect()
    yield _cluster
    _cluster.close()


@pytest.fixture(scope="session")
def serve_on_head(hosts: NetnsCluster) -> int:
    """Serve on the fake hosts, started once, as `kvtide up` starts it (one HTTP proxy,
    on the head); returns its port. Tests delete their apps and leave Serve running:
    under load, a `serve.start()` right after a `serve.shutdown()` was seen to lose its
    new proxy ("killed by `ray.kill`", "never ran")."""
    from ray import serve

    from orchestrator.cluster.ports import free_port

    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    return port


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, None, None]:
    # After the last test on the fake hosts has torn down its own fixtures (a module's
    # Serve app), stop the hosts; the session fixture's teardown then finds nothing to do.
    result = yield
    if _cluster is not None and (nextitem is None or "netns" not in nextitem.keywords):
        _cluster.close()
    return result
