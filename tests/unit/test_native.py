"""Native weights (`actors/native.py`): the embedded GGUF's own Q4_1 / Q8_0 blocks, in the block
kernel's tiles or (without it) ATen's int4 CPU layout. They are the model's weights (the blocks
dequantise exactly to the fp32 model's), the Q8_0 split into two int4 matrices is exact, speculation
over a native target is exact (its outputs are speculation off's, token for token), and a CPU
without either kernel (SPECD_DISABLE=int4pack,block-kernel) never gets them under auto and is told
why under `weights: native`."""
from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from actors import cpu, native
from actors.build import build_engine, load_target
from actors.llama import LlamaRunner
from actors.models import gguf_source
from actors.schema import Request, SamplingParams, SpeculationParams
from helpers import chat_ids


@pytest.fixture(autouse=True)
def native_kernels_on(monkeypatch):
    """These tests are about the native paths themselves: run them even where a run forces every
    optional path off (`make test-fallbacks`, SPECD_DISABLE=all); their absence is tested below by name."""
    monkeypatch.setenv(cpu.DISABLE_ENV, ",".join(sorted(cpu.forced_off() - {"int4pack", "block-kernel"})))
    cpu.reset()
    yield
    monkeypatch.undo()
    cpu.reset()


@pytest.mark.parametrize("kernel", ["block-kernel", "int4pack"])
def test_the_blocks_dequantise_to_the_models_weights_and_a_wrong_mapping_is_refused(smollm2, monkeypatch, kernel):
    """`apply` checks every matrix against the fp32 model (raising otherwise): two layers and the
    LM head pass. The block kernel holds the GGUF's blocks as they are: its weights are the fp32
    model's exactly. ATen's int4 matrices (where the block kernel is off) compute each weight up to
    bf16 rounding (of its group's scale and zero, and of the bf16 result). Without transformers'
    q/k row permutation (a plausible mapping bug) it refuses."""
    if kernel == "int4pack":
        monkeypatch.setenv(cpu.DISABLE_ENV, ",".join(sorted(cpu.forced_off() | {"block-kernel"})))
        cpu.reset()
    runner = LlamaRunner(smollm2.model, num_layers=2)
    dense = runner.layers[0].w_gate_up.clone(), runner.lm_head.clone()
    native.apply(runner, gguf_source("smollm2"))
    want = native.BlockWeight if kernel == "block-kernel" else native.Int4Weight
    assert runner.native and isinstance(runner.layers[1].wqkv, want)
    assert (runner.fused is not None) == (kernel == "block-kernel")  # one call per projection, norms folded in
    for w, ref in zip((runner.layers[0].w_gate_up, runner.lm_head), dense):
        got = w.dequantize()
        if kernel == "block-kernel":
            assert torch.equal(got, ref)
            continue
        assert got.shape == ref.shape and not torch.equal(got, ref)  # bf16 scales: close, not equal
        # per weight: within bf16's rounding of it (the kernel's output here) and of its group's scale and
        # zero, which is relative to the largest weight of its group of 32
        group = ref.view(ref.shape[0], -1, native.GROUP).abs().amax(-1).repeat_interleave(native.GROUP, -1)
        assert ((got - ref).abs() <= (ref.abs() + group) / 128).all()

    monkeypatch.setattr(native, "_BUILT", weakref.WeakValueDictionary())  # nothing built and checked before
    monkeypatch.setattr(native, "_llama_rows", lambda n, heads: torch.arange(n))
    with pytest.raises(ValueError, match="attn_q.weight.*does not dequantise to the model's weight"):
        native.apply(LlamaRunner(smollm2.model, num_layers=1), gguf_source("smollm2"))


def test_the_q8_0_split_into_two_int4_matrices_is_exact():
    """q = 16·hi + lo: with fp32 scales the two int4 matrices sum to exactly d·q (ATen's fp32
    kernel, slow but exact), and Q4_1's zero m + 8d to d·q + m up to one rounding."""
    g = torch.Generator().manual_seed(0)
    q8 = torch.randint(-128, 128, (48, 64), generator=g, dtype=torch.int8)
    d = (torch.rand(48, 2, generator=g) / 50).half().float()
    dense, parts = native.q8_0_weight(q8, d)
    assert torch.equal(native.Int4Weight(parts, torch.float32).dequantize(), dense)
    q4 = torch.randint(0, 16, (48, 64), generator=g)
    m = -(torch.rand(48, 2, generator=g) / 5).half().float()
    dense, part = native.q4_1_weight(q4, d, m)
    torch.testing.assert_close(native.Int4Weight([part], torch.float32).dequantize(), dense, rtol=0, atol=1e-6)


def _greedy(eng, prompts, draft="none", gamma=0, tree=None, n=20):
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True),
                    SpeculationParams(draft=draft, gamma=gamma, tree=tree)) for i, p in enumerate(prompts)]
    return [c.token_ids for c in eng.generate(reqs)]


def test_speculation_over_a_native_target_is_exact(smollm2):
    """Greedy, batched, n-gram chains and trees and the truncated self-draft (native too: the
    target's own int4 matrices, shared): with exact passes (the default) every row of a verify pass
    computes the single-token pass's bits, so outputs are identical to speculation off, token for
    token (ATen's int4 kernel agrees at every width; attention is the row-invariant kernel)."""
    built = build_engine("smollm2", ["ngram", "truncated:8"], "bf16", max_batch=2, max_len=256, device="cpu",
                         weights="native")
    eng = built.engine
    assert eng.info["weights"] == "native" and built.dtype_reason.startswith("bf16+native")
    assert eng.info["exact"]["exact"] and eng.info["exact"]["linears"]
    assert built.drafters["truncated:8"].runner.layers[0].wqkv is eng.target.layers[0].wqkv  # shared, not copied
    prompts = [chat_ids(smollm2.tokenizer, "Write a Python function that adds two numbers."),
               chat_ids(smollm2.tokenizer, "List the first five prime numbers, comma separated, twice.")]
    plain = _greedy(eng, prompts)
    for draft, gamma, tree in [("ngram", 4, None), ("ngram", 4, 12), ("truncated:8", 3, None)]:
        assert _greedy(eng, prompts, draft, gamma, tree) == plain, (draft, tree)


def test_without_either_kernel_auto_keeps_dense_weights_and_native_is_refused(cpu_paths_off):
    cpu_paths_off("int4pack,block-kernel")
    with pytest.raises(ValueError, match="weights: native needs the compiled GGUF block matmul.*Set weights: auto or dense"):
        load_target("smollm2", "bf16", max_batch=1, device="cpu", weights="native")
    assert build_engine("smollm2", [], "bf16", max_batch=1, max_len=64, device="cpu").engine.info["weights"] == "dense"


def test_native_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="weights: native needs a GGUF-born model; 'tiny'"):
        load_target("tiny", "auto", max_batch=1, device="cpu", weights="native")
    with pytest.raises(ValueError, match="bf16 activations; set dtype: auto or bf16"):
        load_target("smollm2", "fp32", max_batch=1, device="cpu", weights="native")


def test_a_cluster_config_refuses_native_with_what_it_cannot_combine():
    from cluster.config import ClusterConfig

    for extra in ({"dtype": "fp32"}, {"verifier": {"quant": "int8-weight"}}, {"verifier": {"compile": True}}):
        with pytest.raises(ValueError, match="weights: native .* is not combined with"):
            ClusterConfig.model_validate({"model": "smollm2", "weights": "native", **extra})
    assert ClusterConfig.model_validate({"model": "smollm2", "weights": "native"}).weights == "native"


def test_the_gguf_tensor_index_is_parsed_once_then_read_from_the_cache(tmp_path, monkeypatch):
    """The first load parses the GGUF with `gguf` (seconds: it decodes every tokenizer string) and keeps
    its tensor index in the specd cache; a later load reads the index and the same blocks without it."""
    import gguf

    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    path = Path(gguf_source("smollm2"))
    first = native.GGUFBlocks(path)
    assert list((tmp_path / "gguf-index").glob("*.json"))

    def parse(*a, **kw):
        raise AssertionError("parsed again")
    monkeypatch.setattr(gguf, "GGUFReader", parse)
    again = native.GGUFBlocks(path)
    assert again.arch == first.arch == "llama" and again.tensors == first.tensors
    kind, blocks = again.matrix("blk.0.ffn_down.weight")
    assert kind == first.matrix("blk.0.ffn_down.weight")[0] and all(
        torch.equal(a, b) for a, b in zip(blocks, first.matrix("blk.0.ffn_down.weight")[1]))
