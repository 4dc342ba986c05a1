"""The fast runner on each model family it serves, against `transformers`' own modeling code.

Each family's tiny random-weight model is built from its own `transformers` config class (so
the layer math compared is that family's modeling file, not a llama stand-in), with its norm
weights moved off their init: Llama (tied and untied embeddings, attention bias, and Llama 3.1's
llama3, linear, yarn and dynamic rope scalings), Qwen2 (q/k/v bias) and Qwen3 (per-head q/k
RMSNorm), each also with sliding layers, Mistral with and without its sliding window, Phi-3
(fused projections, partial rotary, sliding window; longrope) and Gemma 2 and 3 (scaled
embeddings, (1 + w) and sandwich norms, query_pre_attn_scalar, soft-capping, alternating
sliding/global layers, Gemma3's q/k norms and local RoPE base), and the mixture-of-experts
families (Mixtral with and without its window, Qwen2-MoE with its shared expert and a dense layer,
Qwen3-MoE with renormalised top-k; top-k and renormalisation each have a twin; DeepSeek-V3 with
multi-head latent attention over its compressed cache, with and without a query LoRA, its dense
first layer, shared expert and grouped routing with its bias correction, the interleaved RoPE and
the expert groups each with a twin; GLM-4.5's MoE with its partial rotary, q/k/v bias and q/k norms,
on DeepSeek's routing; gpt-oss with its attention sinks, alternating sliding and full layers and clamped
SwiGLU experts with biases, the window and the clamp each with a twin). The engine decodes three prompts
in one batch with speculation on (n-gram and a truncated self-draft, both through rollback), and
every greedy output equals HF `generate` (fp32). Where a family's feature could go unnoticed, a
twin model without it (same weights) must give HF another output on the same prompts: the
context is long enough for windows and rope scalings to matter. Token trees (the drafter's tree
masks and the verifier's) run on the sliding-window families and the MoE ones. The RoPE tables equal HF's rotary
output at every position the runner serves. Families, rope types and configs the runner cannot
serve exactly are refused at load, naming what it does serve."""
from __future__ import annotations

import functools

import pytest
import torch

from actors.calibrate import PassCost, grid
from actors.drafters import ModelDrafter, NgramDrafter
from actors.drafters.base import KV_HEADROOM
from actors.engine import SpecEngine
from actors.llama import ROPE_TYPES, SUPPORTED_MODEL_TYPES, LlamaRunner
from helpers import rand_tokens, request, run

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
           "phi3": ("Phi3Config", "Phi3ForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
           "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
           "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
           "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"), "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
           "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}


def family(model_type: str, **kw):
    """A tiny random model of the family, weights scaled so greedy choices are not near-ties."""
    import transformers as T

    cfg_cls, model_cls = (getattr(T, n) for n in CLASSES[model_type])
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**SMALL, **kw}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # linears, and MoE experts stacked [experts, out, in]
                p.normal_(0.0, 0.08)
            elif name.endswith(".bias"):  # q/k/v (and o) biases: nonzero, so a runner that drops one fails
                p.normal_(0.0, 0.05)
            else:  # norm weights off their init (1; Gemma's 0), so a runner that misreads one fails
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's routing bias (0 at init): one that matters
                b.normal_(0.0, 0.1)
    return model.float().eval()


W = 8  # sliding windows: well below the test's context (prompts of 4-12 tokens, 20 generated)


def rope(rope_type: str = "default", theta: float = 10000.0, **kw) -> dict:
    return {"rope_type": rope_type, "rope_theta": theta, **kw}


LLAMA3 = rope("llama3", 500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)
SHORT, LONG = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0], [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=W)
ALTERNATING = ["sliding_attention", "full_attention"] * 2
ALL_FULL = ["full_attention"] * 4
# Mixture-of-experts families: few experts, so that every pass meets several and rows share them
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)
QWEN2_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                 mlp_only_layers=[1])  # a dense layer among the sparse ones
QWEN3_MOE = dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=2)
# DeepSeek-V3: MLA (q and kv LoRA ranks, split no-RoPE/RoPE head dims), a dense first layer, a shared expert,
# 8 routed experts in 4 groups of which rows choose from 2
DEEPSEEK = dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12,
                v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=4,
                topk_group=2, first_k_dense_replace=1, n_shared_experts=1)
GLM4_MOE = dict(head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
                topk_group=1, first_k_dense_replace=1, n_shared_experts=1, attention_bias=True)
# gpt-oss: sinks, sliding and full layers alternating, yarn RoPE, 4 experts with biases and the clamped SwiGLU
# (intermediate 64: a row of its elementwise ops fills whole vectors, see actors/moe.py)
GPT_OSS = dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=W,
               attention_bias=True, swiglu_limit=0.5,
               rope_parameters=rope("yarn", 150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                    original_max_position_embeddings=64))

# name -> (model_type, config, twins): each twin is a config change that must change HF's greedy output
# on the test's prompts (the context exercises what it takes away).
FAMILIES = {
    "llama-tied": ("llama", {"tie_word_embeddings": True}, []),
    "llama-untied": ("llama", {"tie_word_embeddings": False}, []),
    "llama-attention-bias": ("llama", {"attention_bias": True}, []),
    "llama3.1-rope": ("llama", {"rope_parameters": LLAMA3}, [{"rope_parameters": rope(theta=500000.0)}]),
    "llama-linear-rope": ("llama", {"rope_parameters": rope("linear", factor=4.0)}, [{"rope_parameters": rope()}]),
    "llama-yarn-rope": ("llama", {"rope_parameters": rope("yarn", factor=4.0, original_max_position_embeddings=64)},
                        [{"rope_parameters": rope()}]),
    "llama-dynamic-rope": ("llama", {"rope_parameters": rope("dynamic", factor=4.0)}, []),  # see the rope test
    "qwen2": ("qwen2", {"tie_word_embeddings": True}, []),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 2},
                     [{"use_sliding_window": False}]),
    "qwen3": ("qwen3", {"head_dim": 16, "tie_word_embeddings": False}, []),
    "qwen3-window": ("qwen3", {"head_dim": 16, "use_sliding_window": True, "sliding_window": W,
                               "max_window_layers": 1}, [{"use_sliding_window": False}]),
    "mistral": ("mistral", {"sliding_window": None, "tie_word_embeddings": False}, []),
    "mistral-window": ("mistral", {"sliding_window": W, "tie_word_embeddings": True}, [{"sliding_window": None}]),
    "phi3": ("phi3", {"sliding_window": W, "tie_word_embeddings": True,
                      "rope_parameters": rope(partial_rotary_factor=0.5)},
             [{"sliding_window": None}, {"rope_parameters": rope(partial_rotary_factor=1.0)}]),
    "phi3-longrope": ("phi3", {"original_max_position_embeddings": 64,
                               "rope_parameters": rope("longrope", short_factor=SHORT, long_factor=LONG)},
                      [{"rope_parameters": rope()}]),
    "mixtral": ("mixtral", MIXTRAL, [{"num_experts_per_tok": 1}]),
    "mixtral-window": ("mixtral", {**MIXTRAL, "sliding_window": W}, [{"sliding_window": None}]),
    "qwen2_moe": ("qwen2_moe", {**QWEN2_MOE, "norm_topk_prob": False}, [{"norm_topk_prob": True}]),
    "qwen3_moe": ("qwen3_moe", {**QWEN3_MOE, "norm_topk_prob": True, "use_sliding_window": True, "sliding_window": W},
                  [{"norm_topk_prob": False}, {"use_sliding_window": False}]),
    "deepseek_v3": ("deepseek_v3", DEEPSEEK, [{"rope_interleave": False}, {"topk_group": 4}]),
    "deepseek_v3-no-q-lora": ("deepseek_v3", {**DEEPSEEK, "q_lora_rank": None}, []),
    "gpt_oss": ("gpt_oss", GPT_OSS, [{"layer_types": ALL_FULL}, {"swiglu_limit": 7.0}]),
    "glm4_moe": ("glm4_moe", {**GLM4_MOE, "use_qk_norm": True}, [{"rope_parameters": rope(partial_rotary_factor=1.0)},
                                                                {"use_qk_norm": False}]),
    "gemma2": ("gemma2", {**GEMMA, "attn_logit_softcapping": 0.5, "final_logit_softcapping": 3.0},
               [{"layer_types": ALL_FULL}, {"attn_logit_softcapping": None}]),
    "gemma3": ("gemma3_text", {**GEMMA, "layer_types": ALTERNATING, "tie_word_embeddings": False,
                               "final_logit_softcapping": 3.0,
                               "rope_parameters": {"sliding_attention": rope(),
                                                   "full_attention": rope("linear", 1e6, factor=8.0)}},
               [{"layer_types": ALL_FULL},
                {"rope_parameters": {"sliding_attention": rope(theta=1e6), "full_attention": rope(theta=1e6)}}]),
}
PROMPTS = [rand_tokens(6, 1, 256) * 2, rand_tokens(9, 2, 256), rand_tokens(4, 3, 256)]
N = 20


@functools.cache
def model_of(name: str, twin: int | None = None):
    """The family model (or its twin), kept for the module: `hf_greedy` memoises by model id."""
    model_type, kw, twins = FAMILIES[name]
    return family(model_type, **{**kw, **({} if twin is None else twins[twin])})


def engine(model, drafters: dict, max_batch: int = 3) -> SpecEngine:
    """drafters: name -> (max_len -> drafter). A fixed pass cost (γ is fixed per request: the policy
    is not consulted) instead of timing the runner at a context some of these models do not have."""
    runner = LlamaRunner(model)
    max_len = min(128, runner.max_position - KV_HEADROOM)  # phi3-longrope serves 64 positions
    cost = PassCost({(b, t): 0.01 * b * t for b, t in grid(max_batch)})
    return SpecEngine(runner, {k: d(max_len) for k, d in drafters.items()}, max_batch=max_batch, max_len=max_len,
                      pass_cost=cost)


def truncated(model, k: int):
    return lambda max_len: ModelDrafter.truncated(model, k, max_batch=3, max_len=max_len)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_greedy_equals_hf_with_speculation_batched(name, hf_greedy):
    model_type, kw, twins = FAMILIES[name]
    model = model_of(name)
    eng = engine(model, {"ngram": lambda n: NgramDrafter(), "truncated:2": truncated(model, 2)})
    if model_type == "qwen2":
        assert eng.target.layers[0].bqkv is not None
    if model_type in ("qwen3", "gemma3_text"):
        assert eng.target.layers[0].q_norm is not None
    refs = [hf_greedy(model, p, N, eos=None) for p in PROMPTS]
    for draft in ("ngram", "truncated:2"):
        out = run(eng, [request(f"{draft}{i}", p, draft, 3, max_tokens=N, ignore_eos=True)
                        for i, p in enumerate(PROMPTS)])
        assert [out[f"{draft}{i}"].token_ids for i in range(3)] == refs, draft
        assert sum(c.stats.draft_tokens for c in out.values()) > 0
    for t, twin in enumerate(twins):
        assert [hf_greedy(model_of(name, t), p, N, eos=None) for p in PROMPTS] != refs, f"{twin} does not matter here"


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral-window", "phi3", "qwen2-window", "mixtral-window",
                                  "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"])
def test_family_token_trees_with_sliding_windows_equal_hf(name, hf_greedy):
    """Tree drafts from a truncated self-draft and from one as deep as the target (both through
    the drafter's own tree masks, with earlier nodes in its cache), verified as token trees: the
    output stays HF's, and the full-depth draft, which is the target, gets whole paths accepted."""
    model = model_of(name)
    L = model.config.num_hidden_layers
    eng = engine(model, {"truncated:2": truncated(model, 2), f"truncated:{L}": truncated(model, L)})
    refs = [hf_greedy(model, p, N, eos=None) for p in PROMPTS]
    for draft in ("truncated:2", f"truncated:{L}"):
        reqs = [request(f"{draft}{i}", p, draft, 5, max_tokens=N, ignore_eos=True) for i, p in enumerate(PROMPTS)]
        for r in reqs:
            r.speculation.tree = 12
        out = run(eng, reqs)
        assert [out[f"{draft}{i}"].token_ids for i in range(3)] == refs, draft
        stats = [c.stats for c in out.values()]
        assert all(s.draft_tokens > sum(s.drafted_per_pos) for s in stats), "trees were drafted (nodes > depths)"
        if draft != "truncated:2":
            assert all(s.mean_accepted_length > 2.5 for s in stats), [s.mean_accepted_length for s in stats]


@pytest.mark.parametrize("model_type,kw", [("mistral", {}), ("gemma2", {**GEMMA, "attn_logit_softcapping": 0.5})])
def test_tree_nodes_under_a_window_shorter_than_the_tree_are_their_paths_as_chains(model_type, kw):
    """A window of 3 inside a tree 4 deep: each node sees its path's last 3 positions (counted along
    the path, not in feed order). Every node's hidden state equals that of its path fed as a chain,
    with the tree fed in one call (the verifier's way) and in two (the drafter's: earlier nodes
    already cached, `past` > 0)."""
    from actors.llama import TreeMask

    model = family(model_type, **{**kw, "sliding_window": 3})
    runner = LlamaRunner(model)
    assert any(w.window == 3 for w in runner.layers)
    context = rand_tokens(10, 5, 256)
    nodes = rand_tokens(8, 6, 256)  # nodes[0] is the root: the last committed token
    # node i+1's parent (feed index): branches 0-1-2 and 0-3-4-5-6 (4 deep), 7 under 2, so feed index
    # and depth disagree: node 3 (index 3, depth 1) is 3 path steps above node 6 (depth 4)
    parents = [0, 1, 0, 3, 4, 5, 2]
    tree = TreeMask.from_parents([parents], 8, runner.device)

    def prefilled():
        cache = runner.new_cache(1, 32)
        runner.forward(cache, [0], torch.tensor([context]))
        return cache

    cache = prefilled()
    one_call = runner.forward(cache, [0], torch.tensor([nodes]), tree=tree)[0]  # [8, E]
    cache = prefilled()
    first = runner.forward(cache, [0], torch.tensor([nodes[:4]]), tree=TreeMask(tree.depth[:, :4],
                                                                              tree.anc[:, :4, :4]))[0]
    second = runner.forward(cache, [0], torch.tensor([nodes[4:]]),
                            tree=TreeMask(tree.depth[:, 4:] - 4, tree.anc[:, 4:], past=4))[0]
    two_calls = torch.cat([first, second])
    for t in range(8):
        path, n = [], t
        while True:
            path.insert(0, nodes[n])
            if n == 0:
                break
            n = parents[n - 1]
        cache = runner.new_cache(1, 32)
        chain = runner.forward(cache, [0], torch.tensor([context + path]))[0, -1]
        assert torch.allclose(one_call[t], chain, atol=1e-5), t
        assert torch.allclose(two_calls[t], chain, atol=1e-5), t


@pytest.mark.parametrize("name", ["llama3.1-rope", "llama-linear-rope", "llama-yarn-rope", "llama-dynamic-rope",
                                  "phi3", "phi3-longrope", "gemma3"])
def test_rope_tables_equal_hf_rotary_at_every_served_position(name):
    """The runner's cos/sin tables are HF's rotary output, bit for bit, at every position it serves
    (dynamic NTK: HF rescales only past max_position_embeddings, which no cache reaches; longrope:
    the runner serves up to original_max_position_embeddings, where HF switches to the long factors)."""
    model = model_of(name)
    runner = LlamaRunner(model)
    rot = model.model.rotary_emb
    P = runner.max_position
    pos = torch.arange(P)[None]
    x = torch.zeros(1, P, runner.hidden_size)
    with torch.no_grad():
        if name == "gemma3":
            types = model.config.layer_types
            hf = {lt: rot(x, pos, lt) for lt in sorted(set(types))}
            for i, w in enumerate(runner.layers):
                assert all(torch.equal(a[0], b) for a, b in zip(hf[types[i]], runner.ropes[w.rope])), i
            assert len(runner.ropes) == 2
        else:
            cos, sin = rot(x, pos)
            assert torch.equal(cos[0], runner.cos) and torch.equal(sin[0], runner.sin)
    if name == "llama-dynamic-rope":
        plain = LlamaRunner(family("llama"))
        assert torch.equal(runner.cos, plain.cos) and P == 256
    if name == "phi3-longrope":
        assert P == 64 and runner.cos.shape == (64, 16)
        with pytest.raises(ValueError, match="64 positions this runner serves .*longrope"):
            runner.new_cache(1, 65)
        with torch.no_grad():  # one position further, HF rotates the whole call with the long factors
            long_cos = rot(torch.zeros(1, P + 1, runner.hidden_size), torch.arange(P + 1)[None])[0][0, :P]
        assert not torch.allclose(long_cos, runner.cos)
    if name == "phi3":
        assert runner.cos.shape[-1] == runner.head_dim // 2  # partial rotary: half of each head


def test_other_families_and_inexact_configs_are_refused_naming_what_is_served():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported .*'gemma3_text'.*'qwen3'"):
        LlamaRunner(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))
    with pytest.raises(ValueError, match=r"rope_type 'proportional' is not supported .*'llama3'"):
        LlamaRunner(family("llama", rope_parameters=rope("proportional", partial_rotary_factor=0.5)))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        LlamaRunner(family("gemma3_text", **GEMMA, use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="mlp_bias"):
        LlamaRunner(family("llama", mlp_bias=True))
    with pytest.raises(ValueError, match=r"hidden_act 'gelu' is not supported"):
        LlamaRunner(family("llama", hidden_act="gelu"))
    assert {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"} <= SUPPORTED_MODEL_TYPES
    assert {"default", "linear", "llama3", "yarn", "dynamic", "longrope"} == ROPE_TYPES


def test_default_draft_on_a_target_no_head_ships_for_drafts_ngrams(caplog, hf_greedy):
    """The shipped config names draft 'default' (the head shipped for SmolLM2). With another model
    it must still start: 'default' drafts n-grams there, says so once in the log, and the output
    stays the target's."""
    from actors.build import build_engine

    with caplog.at_level("WARNING", logger="specd"):
        built = build_engine("tiny", {"eagle": "default"}, "fp32", max_batch=2, max_len=128, device="cpu")
    assert isinstance(built.drafters["eagle"], NgramDrafter)
    assert any("no default draft ships for target 'tiny'" in r.getMessage() for r in caplog.records)
    prompt = rand_tokens(5, 4, 512) * 3
    out = run(built.engine, [request("r", prompt, "eagle", 3, max_tokens=16, ignore_eos=True)])
    assert out["r"].token_ids == hf_greedy(built.target.model, prompt, 16, eos=None)
