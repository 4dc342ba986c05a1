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


def test_demo_config_places_drafts_on_l4_and_verifiers_on_h100():
    cfg = ClusterConfig.load(K8S / "cluster-demo.yaml")
    assert cfg.verifier.resources.accelerator_type == "H100" and cfg.verifier.resources.num_gpus >= 1
    remote = [d for d in cfg.drafts if d.remote]
    assert remote and all(d.resources.accelerator_type == "L4" and d.resources.num_gpus > 0 for d in remote)
    opts = cfg.verifier.resources.ray_actor_options()
    assert opts["accelerator_type"] == "H100" and opts["resources"] == {"large_accel": 1}


# Llama-3.1-8B-Instruct's config.json (the hub is not reachable from tests): what sizes its GPU.
LLAMA31_8B = dict(num_hidden_layers=32, num_key_value_heads=8, head_dim=128, params=8.03e9, vocab_size=128256,
                  hidden_size=4096)
H100_BYTES = 80e9


# Qwen3-30B-A3B's config.json: what sizes its GPU (every expert resides on it).
QWEN3_30B_A3B = dict(num_hidden_layers=48, num_key_value_heads=4, head_dim=128, params=30.53e9, vocab_size=151936,
                     hidden_size=2048)
H200_BYTES = 141e9


def _kv_and_features(cfg, m) -> tuple[int, int]:
    """The verifier's KV pool in bytes (sized by memory: at least one max_len sequence, and less than the
    slotted cache of max_batch x max_len it replaces) and its EAGLE-3 head's per-slot target features."""
    per_position = 2 * m["num_hidden_layers"] * m["num_key_value_heads"] * m["head_dim"] * 2
    kv = cfg.verifier.kv_memory
    assert cfg.max_len * per_position < kv < cfg.verifier.max_batch * cfg.max_len * per_position
    return kv, cfg.verifier.max_batch * (cfg.max_len + 17) * 3 * m["hidden_size"] * 2


def test_moe_example_is_sized_for_its_gpu():
    """k8s/cluster-qwen3-30b-a3b.yaml: a hub MoE in bf16 on CUDA with an EAGLE-3 head inside the verifier;
    all experts' weights + the KV cache fit the H200 it asks for, and would not fit an H100; the RayService
    runs that config on H200 nodes with the shared cache and the hub token."""
    from actors.models import is_hub_id

    cfg = ClusterConfig.load(K8S / "cluster-qwen3-30b-a3b.yaml")
    assert is_hub_id(cfg.model) and (cfg.device, cfg.dtype) == ("cuda", "bf16")
    assert cfg.router.default_draft == "eagle3" and is_hub_id(cfg.draft("eagle3").spec)
    assert all(d.placement == "colocated" for d in cfg.drafts)
    assert cfg.verifier.resources.num_gpus == 1 and cfg.verifier.resources.accelerator_type == "H200"
    m = QWEN3_30B_A3B
    weights = 2 * m["params"] + 2 * 32000 * 2048 + 2 * 4 * 2048 * 2048  # + the head's LM head and layer
    kv, features = _kv_and_features(cfg, m)
    assert weights + kv + features < 0.8 * H200_BYTES and weights + kv > 0.8 * H100_BYTES, (weights / 1e9, kv / 1e9)
    svc, = [d for d in docs(K8S / "rayservice-qwen3-30b-a3b.yaml") if d.get("kind") == "RayService"]
    assert "config: k8s/cluster-qwen3-30b-a3b.yaml" in svc["spec"]["serveConfigV2"]
    verifier, = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    spec = verifier["template"]["spec"]
    assert spec["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token" and cfg.auth.tokens_env in env
    limits = spec["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1" and int(limits["memory"].removesuffix("Gi")) * 2**30 > 2 * m["params"]


def test_real_model_example_is_sized_for_its_gpu():
    """k8s/cluster-llama31-8b.yaml: a hub model in bf16 on CUDA with its published EAGLE-3 head and
    n-gram inside the verifier (on its GPU); weights + the KV cache the config preallocates fit the
    GPU the verifier asks for, with room left; the pods read the hub token and share the cache volume."""
    from actors.models import is_hub_id

    cfg = ClusterConfig.load(K8S / "cluster-llama31-8b.yaml")
    assert is_hub_id(cfg.model) and cfg.served_name == "llama-3.1-8b-instruct"
    assert (cfg.device, cfg.dtype) == ("cuda", "bf16")
    assert cfg.router.default_draft == "eagle3" and all(d.placement == "colocated" for d in cfg.drafts)
    assert is_hub_id(cfg.draft("eagle3").spec)
    assert cfg.verifier.resources.num_gpus == 1 and cfg.verifier.resources.accelerator_type == "H100"
    m = LLAMA31_8B
    weights = 2 * m["params"] + 2 * (m["vocab_size"] // 4 + 4 * m["hidden_size"]) * m["hidden_size"]  # + head
    kv, features = _kv_and_features(cfg, m)
    assert weights + kv + features < 0.8 * H100_BYTES, (weights / 1e9, kv / 1e9, features / 1e9)
    svc, = [d for d in docs(K8S / "rayservice-llama31-8b.yaml") if d.get("kind") == "RayService"]
    pods = [svc["spec"]["rayClusterConfig"]["headGroupSpec"]] + svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    for group in pods:
        container = group["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
        assert env["HF_HOME"]["value"].startswith(container["volumeMounts"][0]["mountPath"])
        assert cfg.auth.tokens_env in env
    verifier, = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    limits = verifier["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1" and int(limits["memory"].removesuffix("Gi")) * 2**30 > 2 * m["params"]


# Llama-3.3-70B-Instruct's config.json: what sizes its GPUs.
LLAMA33_70B = dict(num_hidden_layers=80, num_key_value_heads=8, head_dim=128, params=70.55e9, vocab_size=128256,
                   hidden_size=8192, intermediate_size=28672)
H200_PER_GPU = 141e9


def test_tensor_parallel_example_is_sized_for_its_gpus():
    """k8s/cluster-llama33-70b.yaml: a target no single GPU holds, each verifier replica a tensor-parallel
    group of 2 ranks on one node's H200s; per rank its half of the weights + its KV pool (+ the head and its
    features on rank 0) fit one H200, the whole weights would not; the RayService gives each verifier pod
    the 2 GPUs of one node."""
    cfg = ClusterConfig.load(K8S / "cluster-llama33-70b.yaml")
    v, m = cfg.verifier, LLAMA33_70B
    assert (v.tensor_parallel_size, v.placement_strategy) == (2, "STRICT_PACK")
    assert (cfg.device, cfg.dtype, cfg.weights) == ("cuda", "bf16", "auto") and v.resources.num_gpus == 1
    assert v.resources.accelerator_type == "H200" and cfg.router.default_draft == "eagle3"
    weights = 2 * m["params"]
    E, inter = m["hidden_size"], m["intermediate_size"]
    head = 2 * (32000 * E + 3 * E * E + 4 * E * E + 3 * E * inter)  # LM head, fc, attention, MLP of its layer
    per_rank_kv = 2 * m["num_hidden_layers"] * (m["num_key_value_heads"] // 2) * m["head_dim"] * 2
    assert cfg.max_len * per_rank_kv < v.kv_memory
    features = v.max_batch * (cfg.max_len + 17) * 3 * E * 2
    rank0 = weights / 2 + head + v.kv_memory + features
    assert rank0 < 0.85 * H200_PER_GPU < weights, (rank0 / 1e9, weights / 1e9)
    svc, = [d for d in docs(K8S / "rayservice-llama33-70b.yaml") if d.get("kind") == "RayService"]
    assert "config: k8s/cluster-llama33-70b.yaml" in svc["spec"]["serveConfigV2"]
    verifier, = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert verifier["rayStartParams"]["num-gpus"] == "2"
    spec = verifier["template"]["spec"]
    assert spec["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
