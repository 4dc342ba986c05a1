"""Mixture-of-experts targets (`actors/moe.py`) and MLA (`actors/mla.py`) beyond the family tests'
HF equality.

- Planted bugs part from HF, so the family tests can see them: top-k without the renormalisation
  Qwen3-MoE's config asks for; DeepSeek-V3's routing without its bias correction; MLA rotating its
  RoPE dims as halves where DeepSeek interleaves them, or caching its shared key part unrotated;
  gpt-oss attending without its sinks.
- Expert compute is grouped: one block over a 16-row pass runs the router once and each active
  expert once (two matmuls), not one loop per token.
- Exact passes stay row-invariant with experts (bf16 and fp32): a row's logits and KV do not depend
  on the width of the pass or on the rows beside it (test_exact's check), so speculation leaves
  greedy output bitwise as it was.
- What is not served is refused at load, naming what is: other MoE families, int8 experts."""
from __future__ import annotations

import pytest
import torch
from test_exact import invariance_failures
from test_families import FAMILIES, PROMPTS, N, engine, family, model_of, truncated

from actors import cpu, mla, moe
from actors.drafters import NgramDrafter
from actors.llama import LlamaRunner
from actors.quant import quantize_runner
from helpers import request, run


def _greedy(model) -> list[list[int]]:
    eng = engine(model, {"ngram": lambda n: NgramDrafter(), "truncated:2": truncated(model, 2)})
    out = run(eng, [request(f"r{i}", p, "truncated:2", 3, max_tokens=N, ignore_eos=True)
                    for i, p in enumerate(PROMPTS)])
    return [out[f"r{i}"].token_ids for i in range(len(PROMPTS))]


def test_top_k_without_the_renormalisation_the_config_asks_for_parts_from_hf(hf_greedy, monkeypatch):
    model = model_of("qwen3_moe")  # norm_topk_prob: true
    refs = [hf_greedy(model, p, N, eos=None) for p in PROMPTS]
    assert _greedy(model) == refs
    route = moe.MoE.route

    def unnormalised(self, x, linear):
        self.renormalise = False
        return route(self, x, linear)

    monkeypatch.setattr(moe.MoE, "route", unnormalised)
    assert _greedy(model) != refs


def _plant(monkeypatch, cls, name, change):
    """cls.name, with `change(self)` applied to the instance first."""
    original = getattr(cls, name)

    def planted(self, *a, **kw):
        change(self)
        return original(self, *a, **kw)
    monkeypatch.setattr(cls, name, planted)


@pytest.mark.parametrize("bug", ["no bias correction", "rope halves", "key unrotated"])
def test_deepseek_routing_and_mla_bugs_part_from_hf(hf_greedy, monkeypatch, bug):
    model = model_of("deepseek_v3")
    refs = [hf_greedy(model, p, N, eos=None) for p in PROMPTS]
    if bug == "no bias correction":
        _plant(monkeypatch, moe.MoE, "_route_grouped", lambda m: setattr(m, "correction", torch.zeros_like(m.correction)))
    elif bug == "rope halves":
        _plant(monkeypatch, mla.MLA, "pre", lambda m: setattr(m, "interleaved", False))
    else:  # the shared key part stored unrotated
        pre = mla.MLA.pre
        monkeypatch.setattr(mla.MLA, "pre", lambda self, qkv, rms, eps, linear, rope, cos, sin: pre(
            self, qkv, rms, eps, linear, lambda x, c, s: x if x.shape[2] == 1 else rope(x, c, s), cos, sin))
    assert _greedy(model) != refs


def test_gpt_oss_without_its_attention_sinks_parts_from_hf(hf_greedy):
    model = model_of("gpt_oss")
    refs = [hf_greedy(model, p, N, eos=None) for p in PROMPTS]
    eng = engine(model, {"truncated:2": truncated(model, 2)})
    for w in eng.target.layers:
        w.sinks = None
    out = run(eng, [request(f"r{i}", p, "truncated:2", 3, max_tokens=N, ignore_eos=True) for i, p in enumerate(PROMPTS)])
    assert [out[f"r{i}"].token_ids for i in range(len(PROMPTS))] != refs


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_a_pass_runs_each_active_expert_once_over_all_its_rows(name):
    runner = LlamaRunner(model_of(name))
    block = next(w.moe for w in runner.layers if w.moe is not None)
    calls = []

    def counting(x, w, b=None):
        calls.append((x.shape[0], w.data_ptr()))
        return torch.nn.functional.linear(x, w, b)

    h = torch.randn(2, 8, runner.hidden_size)  # 16 rows: 2 sequences x 8 tokens
    out = block(h, counting, runner.act)
    ref = block(h, lambda x, w, b=None: torch.nn.functional.linear(x, w, b), runner.act)
    assert torch.equal(out, ref)
    _, chosen = block.route(h.reshape(16, -1), torch.nn.functional.linear)
    active = chosen.unique().numel()
    shared = 2 if block.shared_gate_up is not None else 0
    assert len(calls) == 1 + 2 * active + shared  # router, gate/up and down per active expert, shared expert
    experts = calls[1:1 + 2 * active]
    assert sum(rows for rows, _ in experts[::2]) == 16 * block.top_k  # every (row, choice) pair, once
    assert len({ptr for _, ptr in experts}) == 2 * active


@pytest.mark.parametrize("name,dtype", [("mixtral", torch.bfloat16), ("qwen2_moe", torch.bfloat16),
                                        ("qwen2_moe", torch.float32), ("qwen3_moe", torch.float32),
                                        ("deepseek_v3", torch.bfloat16), ("deepseek_v3", torch.float32),
                                        ("glm4_moe", torch.float32), ("gpt_oss", torch.bfloat16),
                                        ("gpt_oss", torch.float32)])
def test_exact_moe_passes_are_row_invariant(name, dtype):
    """Rows routed to an expert together with other rows (wide passes, batches, a tree) compute the
    bits they compute alone: chosen experts, their weights and the sum over them. bf16 in the layout
    exact passes choose for it (oneDNN's prepacked weights, experts included: unpacked, its 16-row
    calls round about 1 value in 20,000 otherwise than one row does, which the row probe cannot see);
    where this CPU has no bf16 layout (`make test-fallbacks`), the fp32 model instead. In fp32 the same
    runner without exact passes fails the check (MKL's matmuls: the check can see a lapse). The
    Qwen2-MoE fp32 case failed while the shared expert's one-row gate was a matmul of its own. GLM-4.5's
    tiny model runs in fp32 here: in bf16 its 32-input expert down projection meets oneDNN rounding a
    few real rows of a 10-row call otherwise than alone, which the row probe's random rows do not show
    (realistic widths, 512 inputs and more, get their rows<=32 plans from the probe)."""
    if dtype == torch.bfloat16 and not cpu.available("prepack-bf16"):
        dtype = torch.float32
    model_type, kw, _ = FAMILIES[name]
    model = family(model_type, **kw).to(dtype)  # a model of its own: not model_of's
    if dtype == torch.float32:
        assert invariance_failures(LlamaRunner(model)) != []
    runner = LlamaRunner(model)
    if dtype == torch.bfloat16:
        runner.prepack()
        assert all(w.is_mkldnn for w in runner.layers[-1].moe.gate_up)
    assert invariance_failures(runner.make_exact()) == []


def test_unserved_moe_configs_are_refused_naming_what_is_served():
    """Qwen3-Next (hybrid linear attention, a recurrent state that rollback would have to restore) is
    refused naming the families served; so is a DeepSeek router whose experts do not split into its
    groups, and int8 experts."""
    import transformers as T
    from test_families import DEEPSEEK, SMALL

    cfg = T.Qwen3NextConfig(**{**SMALL, "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 16})
    with pytest.raises(ValueError, match=r"model_type 'qwen3_next' is not supported .*'deepseek_v3'.*'gpt_oss'"):
        LlamaRunner(T.Qwen3NextForCausalLM(cfg))
    ds = family("deepseek_v3", **DEEPSEEK)
    for layer in ds.model.layers[1:]:
        layer.mlp.gate.num_group = 3
    with pytest.raises(ValueError, match="8 experts do not split into n_group 3 groups"):
        LlamaRunner(ds)
    with pytest.raises(ValueError, match="experts of a mixture-of-experts model are not quantized"):
        quantize_runner(LlamaRunner(model_of("mixtral")), "int8-weight")
