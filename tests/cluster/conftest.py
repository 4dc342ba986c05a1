"""The one way a cluster test module gets a cluster: `start_cluster(config)`.

It starts Ray locally (or joins `address`, e.g. a `ray.cluster_utils.Cluster`), deploys the
config with free ports, waits until the gRPC health check says SERVING, and returns
`(address, SpecdClient)`. Module-scoped: every module gets its own cluster, shut down when
the module ends (Ray lives once per process, so two modules cannot share one with different
configs, and one module must not see another's state).
"""
from __future__ import annotations

import os

import pytest

from cluster import serve as S
from cluster.config import ClusterConfig
from specd_client import SpecdClient

# pytest-timeout's limit for each test here (pyproject's default is 300 s): the first test of a module
# also starts Ray and Serve and waits for the replicas; `make fuzz` adds its own time budget.
CLUSTER_TIMEOUT = 900 + int(os.environ.get("SPECD_FUZZ_SECONDS", "0"))


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/cluster/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.timeout(CLUSTER_TIMEOUT))


@pytest.fixture(scope="module")
def start_cluster():
    clients: list[SpecdClient] = []

    def start(config: dict | ClusterConfig, address: str | None = None, timeout: float = 120,
              client_timeout: float = 120) -> tuple[str, SpecdClient]:
        cfg = config if isinstance(config, ClusterConfig) else ClusterConfig.model_validate(config)
        cfg = cfg.model_copy(update={"grpc_port": 0, "http_port": 0})
        addr = S.start(cfg, address=address)
        client = SpecdClient(addr, timeout=client_timeout)
        clients.append(client)
        S.wait_serving(client, timeout=timeout)
        return addr, client

    yield start
    for c in clients:
        c.close()
    if clients:
        S.stop()
