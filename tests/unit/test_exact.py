"""Exact passes (`actors/kernels`, `LlamaRunner.make_exact`, `build.with_exact`): every row of a
wide pass computes the bits its single-token pass computes, so speculation never changes greedy
output in any dtype the engine picks.

The runner-level check: on the embedded model (its first 4 layers, its LM head: the kernels and
shapes of the whole model, at a seventh of the cost) in every CPU path this machine runs (fp32 plain
and prepacked, bf16 prepacked, native int4; `make test-fallbacks` runs it again with every optional
path forced off: MKL's fp32 matmuls and one SDPA call per query row), random contexts fed as
chains of widths 1-16, batches of 1-16 rows of different lengths and a token tree give logits and
written KV bitwise equal to single-token passes of one row. With the ordinary SDPA attention or the
unplanned matmuls planted back, the same check fails."""
from __future__ import annotations

import pytest
import torch

from actors import cpu, kernels, llama
from actors.build import build_engine, exact_option, with_exact, with_layout
from actors.llama import LlamaRunner, TreeMask
from actors.models import gguf_source
from actors.schema import Request, SamplingParams, SpeculationParams
from helpers import chat_ids

LAYERS = 4
CTX = 12  # context tokens before the wide pass; the pass adds up to 16


@pytest.fixture(scope="module")
def models(smollm2):
    """The embedded model in fp32 (the session's) and in bf16 (loaded once here): dtype -> model."""
    from actors.models import load_model

    return {"fp32": smollm2.model, "bf16": load_model("smollm2", "bf16").model}


def _runner(models, layout: str) -> LlamaRunner:
    dtype, _, kind = layout.partition("+")
    lay = {"": "off", "prepacked": "on", "native": "native"}[kind]
    return with_layout(LlamaRunner(models[dtype], num_layers=LAYERS), lay, gguf_source("smollm2")).make_exact()


BLOCK = 16  # the engine's KV blocks: a row's keys span several, as in serving


def _single(runner, seq: torch.Tensor):
    """Logits [n, V] and K, V [layers, n, Hkv, D] of `seq` fed one token per pass, batch 1 (one block of
    the whole context: the slotted cache)."""
    cache = runner.new_cache(1, seq.numel() + 1)
    out = [runner.logits(runner.forward(cache, [0], seq[None, t:t + 1]))[0, 0] for t in range(seq.numel())]
    return (torch.stack(out), *cache.read(0, seq.numel()))


def invariance_failures(runner) -> list[str]:
    """Where wide passes part from single-token passes (empty: none)."""
    g = torch.Generator().manual_seed(0)
    V = runner.vocab_size
    fails = []
    seqs = [torch.randint(0, V, (CTX + 16 + r,), generator=g) for r in range(3)]  # three rows of other lengths
    refs = [_single(runner, s) for s in seqs]

    def check(what, logits, cache, slot, row, start, n):
        ref_l, ref_k, ref_v = refs[row]
        if not torch.equal(logits, ref_l[start:start + n]):
            fails.append(f"{what}: logits")
        k, v = cache.read(slot, start + n)
        if not (torch.equal(k, ref_k[:, :start + n]) and torch.equal(v, ref_v[:, :start + n])):
            fails.append(f"{what}: KV")

    for width in (1, 2, 3, 5, 8, 16):  # one row: a prefill chunk of CTX, then a chain of `width`
        cache = runner.new_cache(1, 64, block_size=BLOCK)
        runner.forward(cache, [0], seqs[0][None, :CTX])
        logits = runner.logits(runner.forward(cache, [0], seqs[0][None, CTX:CTX + width]))[0]
        check(f"width {width}", logits, cache, 0, 0, CTX, width)
    for batch in (2, 7, 16):  # rows 0..2 among random ones, each row's context of its own length
        for width in (1, 5, 16):
            cache = runner.new_cache(batch, 64, block_size=BLOCK)
            rows = [seqs[b % 3] if b < 3 else torch.randint(0, V, (CTX + 16 + b,), generator=g) for b in range(batch)]
            starts = [CTX + (b % 3) for b in range(batch)]
            for b in range(batch):
                runner.forward(cache, [b], rows[b][None, :starts[b]])
            feed = torch.stack([rows[b][starts[b]:starts[b] + width] for b in range(batch)])
            logits = runner.logits(runner.forward(cache, list(range(batch)), feed))
            for b in range(min(batch, 3)):
                check(f"batch {batch} width {width} row {b}", logits[b], cache, b, b, starts[b], width)
    # a token tree: the root (the last context token) with two children; the first child's path is
    # seqs[0]'s chain, the second a sibling. Its nodes are compared with the chain's passes.
    cache = runner.new_cache(1, 64, block_size=BLOCK)
    runner.forward(cache, [0], seqs[0][None, :CTX - 1])
    s0 = seqs[0]
    feed = torch.stack([s0[CTX - 1], s0[CTX], (s0[CTX] + 1) % V, s0[CTX + 1]])[None]  # nodes 0..3
    tree = TreeMask.from_parents([[0, 0, 1]], 4, runner.device)  # node 3's parent: node 1
    logits = runner.logits(runner.forward(cache, [0], feed, tree=tree))[0]
    ref_l = refs[0][0]
    if not torch.equal(logits[[0, 1, 3]], ref_l[[CTX - 1, CTX, CTX + 1]]):
        fails.append("tree: logits")
    return fails


PATHS = ["fp32", "fp32+prepacked", "bf16+prepacked", "bf16+native", "bf16+native/aten"]
NEEDS = {"fp32+prepacked": "prepack-fp32", "bf16+prepacked": "prepack-bf16", "bf16+native": "block-kernel",
         "bf16+native/aten": "int4pack"}


@pytest.mark.parametrize("layout", PATHS)
def test_wide_passes_compute_the_single_token_passes_bits(models, layout, cpu_paths_off):
    """Every path this machine runs is row-invariant (native weights in the block kernel's fused
    layers, and in ATen's int4 kernel where the block kernel is off); a path it cannot run (forced
    off in `make test-fallbacks`) is refused by its probe, and the fp32 case checks what runs instead."""
    if layout in NEEDS and not cpu.available(NEEDS[layout]):
        assert not cpu.probe(NEEDS[layout]).ok and cpu.probe(NEEDS[layout]).reason  # the fallback run: refused
        return
    if layout.endswith("/aten"):
        cpu_paths_off("block-kernel")
    runner = _runner(models, layout.removesuffix("/aten"))
    assert runner.exact and (runner.fused is not None) == (layout == "bf16+native")
    assert invariance_failures(runner) == []


def test_ordinary_attention_or_matmuls_planted_back_fail_the_check(models, monkeypatch):
    """The check above can fail: the runner's ordinary SDPA path (its exact flag off for attention
    alone), or bf16 matmuls called without their row plans, part from the single-token passes."""
    runner = _runner(models, "fp32+prepacked" if cpu.available("prepack-fp32") else "fp32")

    def sdpa(q, kc, vc, table, mask, lo, end, scale, softcap=None, compiled=True, sinks=None):  # the ordinary path
        at = torch.arange(lo, end)
        at = table[:, at // kc.shape[1]] * kc.shape[1] + at % kc.shape[1]  # [B, end - lo]
        keys, vals = kc.flatten(0, 1)[at].transpose(1, 2), vc.flatten(0, 1)[at].transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.to(kc.dtype).transpose(1, 2), keys, vals, attn_mask=None if mask is None else mask[:, None],
            scale=scale, enable_gqa=True)
        return a.transpose(1, 2).flatten(2)

    monkeypatch.setattr(kernels, "attention", sdpa)
    fails = invariance_failures(runner)
    assert any("logits" in f for f in fails), fails
    monkeypatch.undo()
    if cpu.available("prepack-bf16"):  # oneDNN's bf16 rows past 32 per call differ here (its row plan)
        bf16 = _runner(models, "bf16+prepacked")
        plans = dict(bf16.plans)
        if any(p.chunk < kernels.UNBOUNDED for p in plans.values()):
            monkeypatch.setattr(bf16, "plans", {k: kernels.RowPlan(kernels.UNBOUNDED) for k in plans})
            assert invariance_failures(bf16) != []


def test_row_plans_are_found_by_probing_the_kernel():
    """A kernel whose rows depend on the call's rows past 4 gets padded 8-row calls (a fixed shape
    agrees by construction), and chunks of 4 only where padded calls disagree too; one whose rows
    depend on the rows at every width but agree at a fixed 8 gets padded 8-row calls; an invariant
    one any rows; and `apply_plan` computes each row as the plan's calls do."""
    w = torch.randn(24, 64)

    def rowwise(x):  # each row's dot products on their own: the same bits at any row count
        return (x[:, None, :] * w[None]).sum(-1)

    def chunky(x):  # rows computed rowwise up to 4 rows, in fp64 beyond (another rounding)
        return rowwise(x) if x.shape[0] <= 4 else (x.double() @ w.T.double()).float()

    plan = kernels.probe_plan(chunky, 64, torch.float32, "cpu")  # fixed 8-row calls come before 4-row chunks
    assert (plan.chunk, plan.pad) == (8, 8) and plan.cheap
    x = torch.randn(11, 64)
    assert torch.equal(kernels.apply_plan(chunky, x, plan),
                       torch.cat([chunky(torch.nn.functional.pad(x[i:i + 1], (0, 0, 0, 7)))[:1] for i in range(11)]))

    def no_fixed_size(x):  # rowwise up to 4 rows, but never beside padding rows (zeros)
        padding = (x == 0).all(-1).sum()
        return (rowwise(x) if x.shape[0] <= 4 else rowwise(x) * (1 + x.shape[0] * 1e-3)) * (1 + padding * 1e-3)
    plan = kernels.probe_plan(no_fixed_size, 64, torch.float32, "cpu")
    assert plan.chunk == 4 and not plan.pad and not plan.cheap
    assert torch.equal(kernels.apply_plan(no_fixed_size, x, plan), rowwise(x))

    def fixed8(x):  # each row's result depends on the call's row count unless it is 8
        return rowwise(x) * (1 + (x.shape[0] != 8) * x.shape[0] * 1e-3)
    plan = kernels.probe_plan(fixed8, 64, torch.float32, "cpu")
    assert (plan.chunk, plan.pad) == (8, 8) and plan.cheap
    assert kernels.probe_plan(lambda x: x * 2, 64, torch.float32, "cpu").chunk == kernels.UNBOUNDED


def test_exact_settings_choose_numerics_by_rule_and_report_them(smollm2):
    """exact auto picks native > bf16 (with oneDNN's bf16) > fp32 without timing anything; off keeps
    the kernels' own order and says so; a bad value is refused naming the choices."""
    assert exact_option([("bf16", "on"), ("fp32", "on"), ("fp32", "off"), ("bf16", "native")])[0] == ("bf16", "native")
    fp32 = exact_option([("fp32", "off"), ("fp32", "on")])[0]
    assert fp32 == ("fp32", "on")
    bf16_or_fp32 = exact_option([("bf16", "on"), ("fp32", "on")])[0]
    assert bf16_or_fp32 == (("bf16", "on") if cpu.onednn_bf16() else ("fp32", "on"))
    off = with_exact(LlamaRunner(smollm2.model, num_layers=1), "off")
    assert not off.exact and "off" in off.exact_why
    with pytest.raises(ValueError, match="exact must be one of"):
        with_exact(LlamaRunner(smollm2.model, num_layers=1), "always")


def test_a_costly_plan_leaves_auto_inexact_and_require_exact(smollm2, monkeypatch):
    """Where a linear's rows agree only one per call (MKL's fp32 GEMV against GEMM, were no fixed
    width to agree), auto keeps the ordinary kernels and says which linear; require pays."""
    monkeypatch.setattr(llama, "_PLANS", {})
    monkeypatch.setattr(kernels, "probe_plan", lambda *a, **k: kernels.RowPlan(1, 0, "planted"))
    auto = with_exact(LlamaRunner(smollm2.model, num_layers=1), "auto")
    assert not auto.exact and "one row per call" in auto.exact_why and "(576, 1536)" in auto.exact_why
    req = with_exact(LlamaRunner(smollm2.model, num_layers=1), "require")
    assert req.exact and "rows<=1" in req.exact_why


@pytest.fixture(scope="module")
def exact_engine():
    return build_engine("smollm2", ["ngram", "truncated:4"], max_batch=8, max_len=512)


def _greedy(engine, ids, spec, n=32, beams=1, **sampling):
    sampling = {"temperature": 0.0, **sampling}
    req = Request("r", ids, SamplingParams(max_tokens=n, num_beams=beams, **sampling), SpeculationParams(**spec))
    return engine.generate([req])[0].token_ids


def test_default_engine_speculates_without_changing_a_bit_of_greedy_output(exact_engine):
    """In the default settings (exact auto: here the dtype by rule, the machine's fastest exact path),
    greedy output with n-gram chains and trees, the truncated self-draft and speculative beams
    equals `draft none` token for token, on chat and code prompts; so does a seeded sampled request
    (the coupled rule: its tokens depend on the seed and the target's logits alone)."""
    eng = exact_engine.engine
    assert eng.info["exact"]["exact"], eng.info["exact"]
    prompts = [chat_ids(exact_engine.target.tokenizer, q) for q in
               ("Write a python function that checks whether a number is prime.",
                "Explain photosynthesis to a ten-year-old.")]
    for ids in prompts:
        base = _greedy(eng, ids, dict(draft="none", gamma=0))
        for spec in (dict(draft="ngram", gamma=4, tree=0), dict(draft="ngram", gamma=4, tree=8),
                     dict(draft="truncated:4", gamma=3, tree=0), dict(draft="truncated:4", gamma="auto")):
            assert _greedy(eng, ids, spec) == base, spec
    ids = prompts[0]
    beams = _greedy(eng, ids, dict(draft="none", gamma=0), n=16, beams=2)
    assert _greedy(eng, ids, dict(draft="ngram", gamma=3, tree=0), n=16, beams=2) == beams
    seeded = _greedy(eng, ids, dict(draft="none", gamma=0), temperature=0.9, seed=11)
    assert _greedy(eng, ids, dict(draft="truncated:4", gamma=4, tree=0), temperature=0.9, seed=11) == seeded


def test_without_a_compiler_exact_passes_run_one_sdpa_call_per_query_row(smollm2, monkeypatch):
    """A machine that cannot build the kernel (no compiler: the build raises) still loads, exact:
    the probe says why and `with_exact` names the fallback (whose rows are invariant too: checked
    in `make test-fallbacks`, SPECD_DISABLE=all)."""
    from torch.utils import cpp_extension

    def no_compiler(*a, **k):
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.delenv(cpu.DISABLE_ENV, raising=False)  # the build itself fails, whatever a run forces off
    kernels.extension.cache_clear()
    kernels.blocks_extension.cache_clear()
    cpu.reset()
    try:
        for path in ("attn-kernel", "block-kernel"):
            p = cpu.probe(path)
            assert not p.ok and "could not be built" in p.reason
        runner = with_exact(LlamaRunner(smollm2.model, num_layers=1), "require")  # whatever MKL's plans cost
        assert runner.exact and "one SDPA call per query row" in runner.exact_why, runner.exact_why
        # native weights fall back to ATen's int4 kernel, per op
        native_runner = with_layout(LlamaRunner(smollm2.model, num_layers=1), "native", gguf_source("smollm2"))
        assert type(native_runner.layers[0].wqkv).__name__ == "Int4Weight" and native_runner.fused is None
    finally:
        monkeypatch.undo()
        kernels.extension.cache_clear()
        kernels.blocks_extension.cache_clear()
        cpu.reset()
    assert cpu.probe("attn-kernel").ok == ("attn-kernel" not in cpu.forced_off())
