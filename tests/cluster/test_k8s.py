"""The KubeRay manifests in k8s/: they parse, their Serve config is one Ray accepts, the app's
import path resolves, its args validate as a ClusterConfig, and the placement they ask for
matches the worker groups that declare it. No Kubernetes needed."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import yaml

from cluster.app import SERVICER_FUNCTIONS, config_from_args
from cluster.config import ClusterConfig

K8S = Path(__file__).resolve().parents[2] / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def rayservices() -> list[dict]:
    return [d for p in MANIFESTS for d in docs(p) if d.get("kind") == "RayService"]


def test_every_manifest_parses():
    assert MANIFESTS, "k8s/ has no manifests"
    kinds = []
    for p in MANIFESTS:
        for d in docs(p):
            assert isinstance(d, dict), p
            if "apiVersion" in d:  # a Kubernetes object
                assert d.get("kind") and d.get("metadata", {}).get("name"), p
                kinds.append(d["kind"])
            else:  # a cluster config
                ClusterConfig.model_validate(d)
    assert "RayService" in kinds


@pytest.mark.parametrize("svc", rayservices(), ids=lambda s: s["metadata"]["name"])
def test_rayservice_serve_config(svc):
    from ray.serve.schema import ServeDeploySchema

    serve_cfg = yaml.safe_load(svc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_cfg)  # what the KubeRay operator hands to Serve
    grpc = serve_cfg["grpc_options"]
    assert grpc["grpc_servicer_functions"] == SERVICER_FUNCTIONS
    for fn in grpc["grpc_servicer_functions"]:
        mod, _, name = fn.rpartition(".")
        assert callable(getattr(importlib.import_module(mod), name))
    for app in serve_cfg["applications"]:
        mod, _, attr = app["import_path"].partition(":")
        assert callable(getattr(importlib.import_module(mod), attr))
        cfg = config_from_args(app.get("args"))
        assert app["name"] == cfg.app_name  # clients route by the `application` metadata key
        assert app["route_prefix"] == cfg.route_prefix
        assert grpc["port"] == cfg.grpc_port
        check_placement(svc["spec"]["rayClusterConfig"], cfg)
        # the builder turns it into a Serve application (no Ray needed to bind it)
        assert getattr(importlib.import_module(mod), attr)(app.get("args")) is not None


def _declared(group: dict) -> dict[str, float]:
    params = group.get("rayStartParams", {})
    res = json.loads(json.loads(params["resources"])) if "resources" in params else {}
    return {**res, "GPU": float(params.get("num-gpus", 0))}


def check_placement(ray_cluster: dict, cfg: ClusterConfig) -> None:
    """Each deployment that asks for a pool's custom resource can be placed only on worker groups
    declaring it; those groups must have the GPUs and the accelerator type it asks for."""
    groups = ray_cluster["workerGroupSpecs"]
    head = _declared(ray_cluster["headGroupSpec"])
    specs = [("verifier", cfg.verifier)] + [(f"draft {d.name}", d) for d in cfg.drafts if d.remote]
    for what, spec in specs:
        r = spec.resources
        assert r.custom, f"{what}: a production deployment names its pool"
        assert not set(r.custom) & set(head), f"{what} could land on the head"
        fits = [g for g in groups if all(_declared(g).get(k, 0) >= v for k, v in r.custom.items())]
        assert fits, f"{what}: no worker group declares {r.custom}"
        for g in fits:
            assert _declared(g)["GPU"] >= r.num_gpus, f"{what}: group {g['groupName']} lacks GPUs"
            product = g["template"]["spec"].get("nodeSelector", {}).get("nvidia.com/gpu.product", "")
            if r.accelerator_type:
                assert r.accelerator_type in product, f"{what} wants {r.accelerator_type}, {g['groupName']} selects {product!r}"
            tol = g["template"]["spec"].get("tolerations", [])
            assert any(t.get("key") == "nvidia.com/gpu" for t in tol), g["groupName"]
    # drafts and verifiers live on different pools
    pools = {what.split()[0]: set(spec.resources.custom) for what, spec in specs}
    assert not pools.get("draft", set()) & pools["verifier"]


def test_production_config_places_drafts_on_l4_and_verifiers_on_h100():
    cfg = ClusterConfig.load(K8S / "cluster-production.yaml")
    assert cfg.verifier.resources.accelerator_type == "H100" and cfg.verifier.resources.num_gpus >= 1
    remote = [d for d in cfg.drafts if d.remote]
    assert remote and all(d.resources.accelerator_type == "L4" and d.resources.num_gpus > 0 for d in remote)
    opts = cfg.verifier.resources.ray_actor_options()
    assert opts["accelerator_type"] == "H100" and opts["resources"] == {"large_accel": 1}
