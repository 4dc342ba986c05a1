"""Build the Serve application from a ClusterConfig.

    Router (gRPC ingress, and the OpenAI-compatible HTTP API as its Serve ingress app)
        -> VerifierServer (large pool) -> DraftDeployment per remote draft (small pool)

`app_builder` is the import path `serve run` / `serve deploy` accept:
    serve run cluster.app:app_builder config=cluster/configs/local.yaml
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from ray import serve
from ray.serve.config import RequestRouterConfig

from actors.drafters.base import DraftSeq

from .config import ClusterConfig, DeploymentSpec, draft_deployment_name
from .draft_server import DraftAnswer, DraftServer
from .grpc_api import RouterDeployment
from .metrics import DraftMetrics
from .runtime import node_id, replica_id, start_heap_trim
from .verifier import VerifierServer

DRAFT_BATCH = 16  # concurrent propose calls one draft replica answers in one batch

SERVICER_FUNCTIONS = [
    "protos.specd_pb2_grpc.add_SpecDecodeServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


KV_POLICY = {"policy_function": "cluster.autoscale:kv_policy"}  # verifiers scale on KV blocks held too


def _options(spec: DeploymentSpec, name: str, policy: dict | None = None, **extra) -> dict:
    opts = spec.resources.ray_actor_options()
    if spec.env_vars:
        opts["runtime_env"] = {"env_vars": dict(spec.env_vars)}
    return {"name": name, "ray_actor_options": opts,
            "autoscaling_config": {**spec.autoscaling.serve(), **({"policy": policy} if policy else {})},
            "graceful_shutdown_timeout_s": spec.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": 0.5, **extra}


class DraftDeployment:
    """A draft replica (small-accelerator pool): `serve.batch` gathers concurrent propose calls
    (several verifiers, or a pipelining one) into one drafter batch, run off the event loop."""

    def __init__(self, config: dict, name: str):
        """The replica of the config's draft `name` (as `VerifierServer` takes the config)."""
        from actors.build import load_target, make_drafter, ready_drafter

        cfg = ClusterConfig.model_validate(config)
        d = cfg.draft(name)
        torch.set_num_threads(d.torch_threads)
        target = load_target(cfg.model, cfg.dtype, d.max_batch, cfg.device, decode_only=True, prepack=cfg.prepack,
                             weights=cfg.weights)
        drafter = ready_drafter(make_drafter(d.spec, target.model, d.max_batch, cfg.max_len), d.spec, d.quant,
                                target.layout, target.gguf)
        drafter.warm()
        self.core = DraftServer(drafter, replica_id(), d.lease_s, overlap=d.overlap, branches=d.overlap_branches)
        start_heap_trim()
        self.node = node_id()
        self.metrics = DraftMetrics(cfg.served_name, name, kv=self._kv)

    def _kv(self) -> tuple[int, int]:
        st = self.core.stats()
        return st["kv_slots_in_use"], st["kv_slots_total"]

    @serve.batch(max_batch_size=DRAFT_BATCH, batch_wait_timeout_s=0.0)
    async def propose(self, calls: list[list[DraftSeq]]) -> list[DraftAnswer]:
        return await asyncio.to_thread(self.core.propose_batch, calls)

    async def release(self, seq_ids: list[int]) -> int:
        return await asyncio.to_thread(self.core.release, seq_ids)

    async def stats(self) -> dict:
        return {**self.core.stats(), "node_id": self.node}


def _verifier_routing(v) -> RequestRouterConfig:
    """Pinned calls always; generations by prompt prefix (the prefix tree bounded: 1 M tokens) or by
    Serve's default choice. A pool that never has a second replica skips the prefix tree (its actor
    calls cost every request a few milliseconds and could not change the choice)."""
    if v.routing == "power_of_two" or v.autoscaling.max_replicas < 2:
        return RequestRouterConfig(request_router_class="cluster.routing.PinnedRouter")
    return RequestRouterConfig(request_router_class="cluster.routing.PrefixRouter", request_router_kwargs={
        "imbalanced_threshold": v.prefix_imbalance, "do_eviction": True, "eviction_threshold_chars": 1_000_000,
        "eviction_target_chars": 800_000})


def build_app(cfg: ClusterConfig):
    raw = cfg.model_dump(mode="json")
    drafts = {}
    for d in cfg.drafts:
        if not d.remote:
            continue
        dep = serve.deployment(DraftDeployment).options(
            **_options(d, draft_deployment_name(d.name),
                       max_ongoing_requests=max(DRAFT_BATCH, d.max_batch),
                       request_router_config=RequestRouterConfig(
                           request_router_class="cluster.routing.PinnedRouter")))
        drafts[d.name] = dep.bind(raw, d.name)
    v = cfg.verifier
    ranks = ({"placement_group_bundles": [v.resources.bundle()] * v.tensor_parallel_size,
              "placement_group_strategy": v.placement_strategy} if v.tensor_parallel_size > 1 else {})
    verifier = serve.deployment(VerifierServer).options(
        **ranks, **_options(cfg.verifier, "Verifier", max_ongoing_requests=4 * cfg.verifier.max_batch, policy=KV_POLICY,
                   # the router reaches every replica (GetStats, GetLoad, Abort) by pinning calls
                   request_router_config=_verifier_routing(cfg.verifier))
    ).bind(raw, drafts)
    # Serve's late-bound ingress: the replica builds its FastAPI app (RouterDeployment.__serve_build_asgi_app__)
    # once constructed; gRPC calls still reach the RPC methods by name.
    router = serve.deployment(serve.ingress()(RouterDeployment)).options(
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
