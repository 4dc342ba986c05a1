"""Build the Serve application from a ClusterConfig.

    Router (gRPC ingress) -> VerifierServer (large pool) -> DraftServer per model draft (small pool)

`app_builder` is the import path `serve run` / `serve deploy` accept:
    serve run cluster.app:app_builder config=cluster/configs/local.yaml
"""
from __future__ import annotations

from pathlib import Path

from ray import serve
from ray.serve.config import RequestRouterConfig

from actors.serving import DraftServer, VerifierServer

from .config import ClusterConfig, DeploymentSpec
from .router import Router

SERVICER_FUNCTIONS = [
    "protos.specd_pb2_grpc.add_SpecDecodeServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


def _options(spec: DeploymentSpec, name: str, **extra) -> dict:
    return {"name": name, "ray_actor_options": spec.resources.ray_actor_options(),
            "autoscaling_config": spec.autoscaling.serve(),
            "graceful_shutdown_timeout_s": spec.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": 0.5, **extra}


def build_app(cfg: ClusterConfig):
    raw = cfg.model_dump(mode="json")
    drafts = {}
    for d in cfg.drafts:
        if not d.remote:
            continue
        dep = serve.deployment(DraftServer).options(
            **_options(d, f"Draft-{d.name.replace(':', '-').replace('/', '_')}",
                       max_ongoing_requests=max(8, d.max_batch),
                       request_router_config=RequestRouterConfig(
                           request_router_class="cluster.routing.PinnedRouter")))
        drafts[d.name] = dep.bind(cfg.model, cfg.dtype, d.spec, d.max_batch, cfg.max_len, d.torch_threads)
    verifier = serve.deployment(VerifierServer).options(
        **_options(cfg.verifier, "Verifier", max_ongoing_requests=4 * cfg.verifier.max_batch)
    ).bind(raw, drafts)
    router = serve.deployment(Router).options(
        **_options(cfg.router, "Router", max_ongoing_requests=cfg.router.max_queue * 2)
    ).bind(raw, verifier, drafts)
    return router


def _resolve(path: str | None) -> Path | None:
    """A config path as given, else relative to the project root (a RayService's working
    directory is not the repository's)."""
    if path is None:
        return None
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    rooted = Path(__file__).resolve().parent.parent / p
    return rooted if rooted.exists() else p


def config_from_args(args: dict | None) -> ClusterConfig:
    """The ClusterConfig that `app_builder` deploys for these Serve `args`: `config` (a YAML path)
    and/or inline top-level keys of the config, which override the file's."""
    args = dict(args or {})
    cfg = ClusterConfig.load(_resolve(args.pop("config", None)))
    if args:
        cfg = ClusterConfig.model_validate({**cfg.model_dump(mode="json"), **args})
    return cfg


def app_builder(args: dict):
    """`serve run cluster.app:app_builder config=PATH` (or inline keys of the config); the import
    path of the KubeRay RayService in k8s/."""
    return build_app(config_from_args(args))
