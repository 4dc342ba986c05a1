"""Loading a target costs one copy of it: dtype "auto" times the options on slices of the model
(never a second full copy), converts the one copy in place, and the load reports the bytes of
weights and KV per part."""
from __future__ import annotations

import torch

from actors import build
from actors.build import SLICE_LAYERS, _slice, auto_dtypes, build_engine, load_target
from actors.llama import LlamaRunner
from actors.models import build_tiny
from helpers import save_tiny_qwen3

DEEP = 7  # layers: more than the largest slice, so the estimate is extrapolated


def test_auto_loads_the_model_once_and_converts_it_in_place(tmp_path, monkeypatch):
    save_tiny_qwen3(tmp_path / "deep", tokenizer=False, num_hidden_layers=DEEP)
    loads = []
    real = build.load_model
    monkeypatch.setattr(build, "load_model", lambda *a, **kw: loads.append(a) or real(*a, **kw))
    monkeypatch.setattr(build, "choose_dtype", lambda costs, *_: (("bf16", "off"), "bf16: forced by the test"))
    t = load_target(str(tmp_path / "deep"), "auto", max_batch=2, prepack="off", exact="off")  # timed
    assert len(loads) == 1  # one full model, whatever was timed
    assert t.dtype == "bf16" and next(t.model.model.parameters()).dtype == torch.bfloat16
    assert "extrapolated from 2- and 4-layer slices" in t.why
    # Runners built on it now run in bf16 throughout: the slices' runners fused layers 0-3 in fp32
    # first, and a stale fused weight would keep those layers in fp32.
    fresh = real(str(tmp_path / "deep"), "bf16").model
    ids = torch.tensor([[5, 9, 4, 7, 3]])
    got, want = (LlamaRunner(m) for m in (t.model.model, fresh))
    assert all(w.wqkv.dtype == torch.bfloat16 for w in got.layers)
    with torch.inference_mode():
        a = got.logits(got.forward(got.new_cache(1, 8), [0], ids))
        b = want.logits(want.forward(want.new_cache(1, 8), [0], ids))
    assert torch.equal(a, b)


def test_a_slice_is_the_models_first_layers_in_the_dtype():
    model = build_tiny(3, num_layers=6)
    part = _slice(model, SLICE_LAYERS[0], torch.bfloat16)
    assert len(part.model.layers) == SLICE_LAYERS[0] and next(part.parameters()).dtype == torch.bfloat16
    ref = build_tiny(3, num_layers=6)
    with torch.no_grad():  # parameters only, as from_pretrained(dtype=bf16) loads (RoPE's inv_freq stays fp32)
        for p in ref.parameters():
            p.data = p.data.to(torch.bfloat16)
    ids = torch.tensor([[7, 8, 9, 10]])
    a, b = LlamaRunner(part), LlamaRunner(ref, num_layers=SLICE_LAYERS[0])
    with torch.inference_mode():
        assert torch.equal(a.logits(a.forward(a.new_cache(1, 8), [0], ids)),
                           b.logits(b.forward(b.new_cache(1, 8), [0], ids)))


def test_auto_on_a_gpu_is_one_low_precision_dtype(monkeypatch):
    """No GPU here: the capability query is what is mocked."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **kw: True)
    assert auto_dtypes(on_cpu=False) == ["bf16"]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **kw: False)
    assert auto_dtypes(on_cpu=False) == ["fp16"]


def test_the_load_reports_weight_and_kv_bytes(caplog):
    with caplog.at_level("INFO", logger="specd"):
        built = build_engine("tiny", {"self": "truncated:2", "ngram": "ngram"}, "fp32", max_batch=2, max_len=64,
                             prepack="off")
    mem = built.engine.info["memory"]
    model = built.target.model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert mem["target"]["weights"] == params  # fp32, plain: the model's parameters, once
    cfg = model.config
    kv_per_slot_pos = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    cache = built.engine.cache  # the pool: by default blocks for every slot at max_len (whole blocks)
    assert mem["target"]["kv"] == kv_per_slot_pos * cache.num_blocks * cache.block_size
    assert cache.num_blocks == 2 * cache.blocks(cache.max_len)
    assert mem["self"]["weights"] == 0 and mem["self"]["kv"] > 0  # the self-draft shares the target's layers
    assert any("memory: target: weights" in r.getMessage() for r in caplog.records)
