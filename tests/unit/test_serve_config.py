"""The configs users bring: `specd serve`'s flags with no config file, and vLLM's speculative config,
each mapped onto this product's drafts (the README's table) or refused naming the field."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from actors.build import make_drafter
from actors.drafters import NgramDrafter
from cluster.config import ClusterConfig
from specd.cli import _parser, serve_config


def cfg_of(*argv: str) -> ClusterConfig:
    return serve_config(_parser().parse_args(["serve", *argv]))


def drafts(cfg: ClusterConfig) -> list[tuple]:
    return [(d.name, d.spec, d.placement, d.default_gamma) for d in cfg.drafts]


@pytest.mark.parametrize("vllm,want", [
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2},
     ("ngram", "ngram:2-5", "colocated", 4)),
    ({"method": "ngram"}, ("ngram", "ngram:1-3", "colocated", "auto")),
    ({"method": "eagle3", "model": "org/EAGLE3-head", "num_speculative_tokens": 3},
     ("eagle3", "org/EAGLE3-head", "colocated", 3)),
    ({"method": "eagle", "model": "/models/eagle-head"}, ("eagle", "/models/eagle-head", "colocated", "auto")),
    ({"method": "draft_model", "model": "org/small", "num_speculative_tokens": 5},
     ("draft_model", "org/small", "colocated", 5)),
    ({"method": "mtp", "num_speculative_tokens": 1}, ("mtp", "mtp", "colocated", 1)),
    ({"method": "deepseek_mtp", "model": "deepseek-ai/DeepSeek-V3"}, ("mtp", "mtp", "colocated", "auto")),
])
def test_vllm_speculative_config_maps_onto_one_draft(vllm, want):
    cfg = ClusterConfig.model_validate({"model": "tiny", "speculative_config": vllm})
    assert drafts(cfg) == [want] and cfg.router.default_draft == want[0]
    # the same through the CLI flag, and a config dumped and read back stays the same config
    import json

    assert drafts(cfg_of("--model", "tiny", "--speculative-config", json.dumps(vllm))) == [want]
    assert drafts(ClusterConfig.model_validate(cfg.model_dump(mode="json"))) == [want]


def test_vllm_ngram_bounds_reach_the_drafter():
    cfg = ClusterConfig.model_validate({"model": "tiny", "speculative_config": {
        "method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5}})
    d = make_drafter(cfg.drafts[0].spec, None, 1, 64)
    assert isinstance(d, NgramDrafter) and (d.min_n, d.max_n) == (2, 5)
    assert d.lookup([9, 4, 7, 1, 4, 7], 2) == [1, 4]  # the 2-gram (4, 7) matched
    assert d.lookup([9, 4, 7, 1, 3, 7], 2) == []  # a 1-gram match is below prompt_lookup_min


@pytest.mark.parametrize("vllm,message", [
    ({"method": "eagle3"}, "method 'eagle3' needs a model"),
    ({"method": "ngram", "model": "x"}, "method 'ngram' takes no model"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min \\(4\\) exceeds"),
    ({"method": "medusa", "model": "x"}, "'ngram', 'eagle', 'eagle3', 'draft_model', 'mtp' or 'deepseek_mtp'"),
    ({"method": "ngram", "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
])
def test_vllm_speculative_config_refused_naming_the_field(vllm, message):
    with pytest.raises(ValidationError, match=message):
        ClusterConfig.model_validate({"model": "tiny", "speculative_config": vllm})


def test_serve_flags_without_a_config(tmp_path):
    cfg = cfg_of("--model", "org/model@v2", "--dtype", "bf16", "--device", "cpu")
    assert (cfg.model, cfg.served_name, cfg.dtype, cfg.device) == ("org/model@v2", "org/model", "bf16", "cpu")
    assert drafts(cfg) == [("ngram", "ngram", "colocated", "auto")] and cfg.router.default_draft == "ngram"
    cfg = cfg_of("--model", "tiny", "--draft", "ngram:2-4", "--draft", "self=truncated:2",
                 "--served-model-name", "chat")
    assert drafts(cfg) == [("ngram:2-4", "ngram:2-4", "colocated", "auto"), ("self", "truncated:2", "colocated", "auto")]
    assert cfg.router.default_draft == "auto" and cfg.served_name == "chat"
    shipped = cfg_of()  # no flags: the shipped local config, as before
    assert shipped.model == "smollm2" and shipped.router.default_draft == "eagle"
    from cluster.config import LOCAL_CONFIG

    over = cfg_of("--config", str(LOCAL_CONFIG), "--model", str(tmp_path), "--draft", "ngram")
    assert over.model == str(tmp_path) and drafts(over) == [("ngram", "ngram", "colocated", "auto")]
    assert over.verifier.max_batch == shipped.verifier.max_batch  # the rest of the file stays


def test_default_resolves_per_target_everywhere(tmp_path):
    """'default' is the head shipped for SmolLM2 beside it, and n-gram beside any other target:
    in what ListModels reports and in the features a remote draft is handed, as in what loads."""
    from actors.build import draft_kind, spec_feature_layers
    from actors.models import model_name
    from cluster.router import Router
    from helpers import save_tiny_qwen3

    assert draft_kind("default", model_name("smollm2")) == "eagle"
    assert spec_feature_layers("default", model_name("smollm2"))  # the shipped head's layers
    save_tiny_qwen3(tmp_path / "mine", tokenizer=False)
    other = model_name(str(tmp_path / "mine"))
    assert other == "mine" and draft_kind("default", other) == "ngram" and spec_feature_layers("default", other) == ()
    cfg = {"model": str(tmp_path / "mine"), "drafts": [{"name": "eagle", "spec": "default"}],
           "router": {"default_draft": "eagle"}}
    kinds = {d["name"]: d["kind"] for d in Router(cfg, verifier=None).models()["drafts"]}
    assert kinds == {"none": "none", "eagle": "ngram"}


def _context(replicas: int, requests: float, held: list[float]):
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    dep = DeploymentID("Verifier", "specd")
    ids = [ReplicaID(str(i), dep) for i in range(replicas)]
    return AutoscalingContext(
        deployment_id=dep, deployment_name="Verifier", app_name="specd", current_num_replicas=replicas,
        target_num_replicas=replicas, running_replicas=ids, total_num_requests=requests, total_queued_requests=0,
        aggregated_metrics={"kv_blocks_held": dict(zip(ids, held))}, raw_metrics={},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=None,
        config=AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=16))


def test_verifiers_scale_on_kv_blocks_held_as_well_as_on_requests():
    """The verifier pool's policy (Serve's custom autoscaling metrics): few long requests that fill the
    KV pools ask for replicas the request count would not; many short ones scale as Serve's rule does."""
    from ray.serve.config import AutoscalingConfig

    from cluster.app import KV_POLICY, _options
    from cluster.autoscale import kv_policy

    assert kv_policy(_context(2, 8, [0.96, 0.92]))[0] == pytest.approx(2 * 0.94 / 0.8)  # 8 requests: blocks decide
    assert kv_policy(_context(2, 64, [0.2, 0.3]))[0] == pytest.approx(4.0)  # 64 requests over 16 each
    assert kv_policy(_context(2, 8, [0.5, 0.5]))[0] == pytest.approx(1.25)  # neither: scale down
    cfg = ClusterConfig.load("cluster/configs/local.yaml")  # what the verifier deployment gets, as Serve parses it
    parsed = AutoscalingConfig(**_options(cfg.verifier, "Verifier", policy=KV_POLICY)["autoscaling_config"])
    assert parsed.policy.policy_function == "cluster.autoscale:kv_policy" and parsed.max_replicas == 2
