"""The fast runner on each model family it serves, against `transformers`' own modeling code.

Each family's tiny random-weight model is built from its own `transformers` config class (so
the layer math compared is that family's modeling file, not a llama stand-in): Llama with tied
and untied embeddings, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm) and Mistral. The engine
decodes three prompts in one batch with speculation on (n-gram and a truncated self-draft, both
through rollback), and every greedy output equals HF `generate` (fp32). Families the runner does
not serve are refused at load with the list of those it does."""
from __future__ import annotations

import pytest
import torch

from actors.drafters import ModelDrafter, NgramDrafter
from actors.engine import SpecEngine
from actors.llama import SUPPORTED_MODEL_TYPES, LlamaRunner
from helpers import rand_tokens, request, run

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def family(model_type: str, **kw):
    """A tiny random model of the family, weights scaled so greedy choices are not near-ties."""
    import transformers as T

    cls = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
           "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM), "mistral": (T.MistralConfig, T.MistralForCausalLM)}
    cfg_cls, model_cls = cls[model_type]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**{**SMALL, **kw}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith(".bias"):  # Qwen2's q/k/v bias: nonzero, so a runner that drops it fails
                p.normal_(0.0, 0.05)
    return model.float().eval()


FAMILIES = {
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 16, "tie_word_embeddings": False}),
    "mistral": ("mistral", {"sliding_window": None, "tie_word_embeddings": False}),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_greedy_equals_hf_with_speculation_batched(name, hf_greedy):
    model_type, kw = FAMILIES[name]
    model = family(model_type, **kw)
    runner = LlamaRunner(model)
    if model_type == "qwen2":
        assert runner.layers[0].bqkv is not None
    if model_type == "qwen3":
        assert runner.layers[0].q_norm is not None
    drafters = {"ngram": NgramDrafter(), "truncated:2": ModelDrafter.truncated(model, 2, max_batch=3, max_len=128)}
    eng = SpecEngine(runner, drafters, max_batch=3, max_len=128)
    prompts = [rand_tokens(6, 1, 256) * 2, rand_tokens(9, 2, 256), rand_tokens(4, 3, 256)]
    refs = [hf_greedy(model, p, 20, eos=None) for p in prompts]
    for draft in ("ngram", "truncated:2"):
        out = run(eng, [request(f"{draft}{i}", p, draft, 3, max_tokens=20, ignore_eos=True)
                        for i, p in enumerate(prompts)])
        assert [out[f"{draft}{i}"].token_ids for i in range(3)] == refs, draft
        assert sum(c.stats.draft_tokens for c in out.values()) > 0


def test_other_families_and_binding_windows_are_refused_naming_what_is_served():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported .*'qwen3'"):
        LlamaRunner(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))
    with pytest.raises(ValueError, match=r"sliding-window attention \(window 16 < max_position_embeddings 256\)"):
        LlamaRunner(family("mistral", sliding_window=16))
    assert {"llama", "mistral", "qwen2", "qwen3"} <= SUPPORTED_MODEL_TYPES


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
