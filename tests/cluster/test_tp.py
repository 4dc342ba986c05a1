"""Tensor parallelism over gloo in a local Ray cluster: the target split over two processes (this one as
rank 0, running the engine; a Ray actor as rank 1) computes what one process computes.

On tiny random models of three families (Llama with 3 grouped KV heads split 1 + 2, an MLP split unevenly,
and tied embeddings; Qwen2-MoE, its experts split over the ranks and its gated shared expert on rank 0,
a dense layer among the sparse ones; Qwen3 with per-head q/k norms), saved as Hugging Face
directories that both ranks load: TP=2 gives greedy output identical to TP=1, with speculation off, an
n-gram draft, a truncated self-draft as chains and as trees, and seeded sampling; its logits are within
1e-5 of TP=1's (not bitwise: an all-reduce adds two partial products where one process summed one
matmul); and within TP=2, speculation changes no bit of the output. (A rank killed while serving:
test_tp_serve.py.)
"""
from __future__ import annotations

import pytest
import ray
import torch
import torch.distributed as dist

from actors import tp
from actors.build import with_exact
from actors.calibrate import PassCost, grid
from actors.drafters import ModelDrafter, NgramDrafter
from actors.engine import SpecEngine
from actors.llama import LlamaRunner
from actors.models import load_model
from actors.schema import Request, SamplingParams, SpeculationParams
from cluster import tp as ctp
from helpers import rand_tokens

SMALL = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM",  # 3 KV heads and an MLP of 130 over 2 ranks: uneven shares
                       {"tie_word_embeddings": True, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3,
                        "head_dim": 16, "intermediate_size": 130}),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "tie_word_embeddings": False}),
            "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",  # 4 experts, 2 per rank; a shared expert
                          {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                           "shared_expert_intermediate_size": 96, "mlp_only_layers": [1]}),
            }
PROMPTS = [rand_tokens(6, 1, 250) * 2, rand_tokens(9, 2, 250)]  # (the n-gram hits the repeat)
MAX_LEN = 96


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> a saved tiny model directory (vocabulary 250: the LM head splits unevenly, padded)."""
    import transformers as T

    out = {}
    for name, (cfg_cls, model_cls, kw) in FAMILIES.items():
        torch.manual_seed(0)
        model = getattr(T, model_cls)(getattr(T, cfg_cls)(**{**SMALL, **kw}))
        with torch.no_grad():
            for p in model.parameters():
                (p.normal_(0.0, 0.08) if p.dim() >= 2 else p.add_(torch.randn_like(p) * 0.1))
        out[name] = tmp_path_factory.mktemp(name)
        model.float().save_pretrained(out[name])
    return out


KINDS = [("none", 0, None), ("ngram", 3, None), ("truncated:2", 3, None), ("truncated:2", 4, 6)]  # (draft, γ, tree)


def requests() -> list[Request]:
    """Every prompt with speculation off, n-gram, a chain and a tree of the self-draft; one seeded sampled."""
    reqs = [Request(f"{p}/{d}/{g}/{t}", PROMPTS[p], SamplingParams(max_tokens=12), SpeculationParams(draft=d, gamma=g, tree=t))
            for p in range(len(PROMPTS)) for d, g, t in KINDS]
    return reqs + [Request("sampled", PROMPTS[0], SamplingParams(max_tokens=12, temperature=1.0, seed=7),
                           SpeculationParams(draft="truncated:2", gamma=3))]


def engine(runner, hf_model) -> SpecEngine:
    drafters = {"ngram": NgramDrafter(), "truncated:2": ModelDrafter.truncated(hf_model, 2, max_batch=5, max_len=MAX_LEN)}
    cost = PassCost({(b, t): 0.01 * b * t for b, t in grid(5)})  # γ is fixed per request: the policy is not asked
    return SpecEngine(runner, drafters, max_batch=5, max_len=MAX_LEN, pass_cost=cost, kv_block=4)


def outputs(eng) -> dict[str, list[int]]:
    return {r.request_id: c.token_ids for r, c in zip(requests(), eng.generate(requests()))}


def group_of(path, world: int = 2):
    """This process as rank 0 of a fresh group, rank 1 a Ray actor: (sharded runner, rank refs, actors)."""
    address, actors, refs = ctp.start_ranks(str(path), "fp32", world, exact="auto")
    group = tp.init(0, world, address)
    return ctp.shard_of(str(path), "fp32", group), refs, actors


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tensor_parallel_target_computes_what_one_process_computes(local_ray, models, family):
    hf = load_model(str(models[family]), "fp32").model
    single = with_exact(LlamaRunner(hf), "auto")
    want = outputs(engine(single, hf))
    ids = torch.tensor([PROMPTS[1]])
    ref = single.logits(single.forward(single.new_cache(1, 32), [0], ids))

    runner, refs, _ = group_of(models[family])
    try:
        assert runner.n_kv == single.n_kv // 2 and runner.n_heads == runner.n_kv * single.n_heads // single.n_kv
        assert runner.lm_head.shape[0] == 125
        got = runner.logits(runner.forward(runner.new_cache(1, 32), [0], ids))
        assert got.shape == ref.shape and (got - ref).abs().max() < 1e-5
        eng = engine(runner, hf)
        tp2 = outputs(eng)
        assert tp2 == want
        assert eng.stats.draft_tokens > 0 and runner.tp.calls > 0
        for rid, toks in tp2.items():  # under TP, speculation changes no greedy token: each equals plain decoding
            if rid != "sampled":
                assert toks == tp2[f"{rid.split('/')[0]}/none/0/None"], rid
    finally:
        tp.stop(runner)
        assert ray.get(refs)[0] > 0  # the follower ran passes
        dist.destroy_process_group()
