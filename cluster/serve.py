"""Start (or join) Ray, deploy the application, and report its addresses.

Locally `start` declares the custom resources that stand for the accelerator pools
(`small_accel` for drafts, `large_accel` for verifiers) and exports Prometheus metrics on
`metrics_port` (0: a free port Ray picks); with `address` it joins an existing cluster
(KubeRay), whose nodes declare real accelerators. `http_address` and `metrics_endpoints`
report where the OpenAI-compatible API and each node's metrics are. (What runs inside the
replicas is `cluster.runtime`'s.)
"""
from __future__ import annotations

import os
import socket
import time

from .config import SERVE_ENV, ClusterConfig

POOLS = {"small_accel": 4, "large_accel": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cfg: ClusterConfig, address: str | None = None, num_cpus: int | None = None,
          resources: dict | None = None) -> str:
    """Deploy `cfg`; returns the gRPC address "127.0.0.1:PORT". Ray must not be running
    in this process unless `address` is "auto" or a cluster address."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from .app import SERVICER_FUNCTIONS, build_app

    if not ray.is_initialized():
        for k, v in SERVE_ENV.items():  # inherited by the Serve proxy and controller a local cluster starts
            os.environ.setdefault(k, v)
        if address:
            ray.init(address=address)
        else:
            # Logical CPUs: replicas ask for num_cpus=0 by default, so a 2-core machine fits them all.
            # address="local": always a new local cluster, never one a stale session file points at.
            ray.init(address="local", num_cpus=num_cpus or 8, resources=resources or dict(POOLS),
                     include_dashboard=False, log_to_driver=False, _metrics_export_port=cfg.metrics_port or None)
    grpc_port = cfg.grpc_port or free_port()
    http_port = cfg.http_port or free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=SERVICER_FUNCTIONS),
                proxy_location="HeadOnly")
    serve.run(build_app(cfg), name=cfg.app_name, route_prefix=cfg.route_prefix, blocking=False)
    return f"127.0.0.1:{grpc_port}"


def http_address() -> str:
    """"HOST:PORT" of the running Serve instance's HTTP proxy (the OpenAI-compatible API lives
    under the app's route_prefix there). Needs a connection to Ray."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    opts = ray.get(ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE).get_http_config.remote())
    return f"{opts.host}:{opts.port}"


def metrics_endpoints() -> list[str]:
    """Every live node's Prometheus endpoint, "http://HOST:PORT/metrics" (what KubeRay scrapes;
    each node's replicas export there). Needs a connection to Ray."""
    import ray

    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes() if n["Alive"]]


def stop() -> None:
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


def wait_serving(client, timeout: float = 120.0, poll: float = 0.3) -> None:
    """Block until the cluster behind `client` (a SpecdClient) reports SERVING; raise the last
    error (or TimeoutError) if it does not within `timeout` seconds."""
    end = time.time() + timeout
    while True:
        try:
            if client.health() == "SERVING":
                return
            err: Exception = TimeoutError(f"cluster not SERVING after {timeout:.0f} s")
        except Exception as e:  # not up yet: the proxy or the app is still starting
            err = e
        if time.time() > end:
            raise err
        time.sleep(poll)
