"""Sampling through the fast runner keeps each family's target distribution.

For every family the runner serves, a vocabulary-8 tiny model of that family (its own
`transformers` classes, as in test_families.py) samples 2000 seeded requests at temperature 1
with speculation on (a truncated self-draft, γ = 3), and the joint law of the first two tokens
and the marginals of the third and fourth match the target's exact ancestral-sampling law,
computed from the HF forward: the machinery and thresholds of test_engine.py's
`test_sampled_distribution_equals_target` (see there: each Pearson p-value > 1e-3). The
families' distinguishing features sit inside these 8 positions: windows of 4 tokens, Gemma's
logits soft-capped at 1.5 (a cap greedy decoding cannot see; these
models' logits reach it), scaled rope; the MoE families route every position. A runner that drops
Gemma2's final soft-capping fails the same check."""
from __future__ import annotations

import pytest
from test_engine import N_DIST, P_MIN, V_SMALL, exact_law_of, law_pvalues, sample_first_tokens
from test_families import DEEPSEEK, GEMMA, GLM4_MOE, GPT_OSS, LLAMA3, MIXTRAL, QWEN2_MOE, QWEN3_MOE, family, rope

from actors.llama import LlamaRunner, linear
from actors.models import LoadedModel

SW = 4  # windows: shorter than the 4-token prompt plus the 4 sampled tokens
CASES = {
    "llama3.1": ("llama", {"rope_parameters": LLAMA3}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": SW, "max_window_layers": 2}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "mistral": ("mistral", {"sliding_window": SW}),
    "phi3": ("phi3", {"sliding_window": SW, "rope_parameters": rope(partial_rotary_factor=0.5)}),
    "gemma2": ("gemma2", {**GEMMA, "sliding_window": SW, "attn_logit_softcapping": 0.5,
                          "final_logit_softcapping": 1.5}),
    "gemma3": ("gemma3_text", {**GEMMA, "sliding_window": SW, "final_logit_softcapping": 1.5,
                               "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "mixtral": ("mixtral", {**MIXTRAL, "sliding_window": SW}),
    "qwen2_moe": ("qwen2_moe", QWEN2_MOE),
    "qwen3_moe": ("qwen3_moe", {**QWEN3_MOE, "norm_topk_prob": True}),
    "deepseek_v3": ("deepseek_v3", DEEPSEEK),
    "glm4_moe": ("glm4_moe", GLM4_MOE),
    "gpt_oss": ("gpt_oss", {**GPT_OSS, "sliding_window": SW}),
}


def small(name: str) -> LoadedModel:
    model_type, kw = CASES[name]
    return LoadedModel(family(model_type, **{**kw, "vocab_size": V_SMALL}), None, f"{name}-v8")


@pytest.mark.parametrize("name", sorted(CASES))
def test_family_sampling_keeps_the_target_law(name):
    target = small(name)
    toks, stats = sample_first_tokens(target, target, "self", 3, seed0=20_000)
    assert stats.draft_tokens > N_DIST // 2 and 0 < stats.accepted_tokens < stats.draft_tokens
    p = law_pvalues(toks, exact_law_of(target.model))
    assert min(p.values()) > P_MIN, p


def test_gemma2_sampling_without_its_final_softcap_is_detected(monkeypatch):
    """The check has the power to see a soft-cap greedy decoding cannot: a runner whose logits skip
    it drives a p-value below 1e-9."""
    monkeypatch.setattr(LlamaRunner, "logits", lambda self, h: linear(h, self.lm_head))
    target = small("gemma2")
    toks, _ = sample_first_tokens(target, target, "self", 3, seed0=20_000)
    p = law_pvalues(toks, exact_law_of(target.model))
    assert min(p.values()) < 1e-9, p
