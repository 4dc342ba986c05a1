"""The fast llama runner and its slotted KV cache, against the Hugging Face forward.

The oracle is `model(input_ids).logits` of the same Hugging Face model on the
whole sequence at once (fp32, batch 1, no padding). Tolerances: the runner uses
fused matmuls and its own attention call, so it agrees with HF to float32
rounding, not bit for bit; observed max |diff| is ~1e-6 on the tiny model
(|logits| < 5) and ~7e-5 on SmolLM2 (|logits| ~ 40, 30 layers). Any real bug
(wrong RoPE position, stale or missing KV, a mask off by one) moves logits by
O(0.1..1), orders of magnitude above these bounds. Runner-vs-runner comparisons
(batched vs alone, rolled back vs fresh) run the same kernels on differently
shaped batches and get a tighter bound.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from actors.llama import LlamaRunner
from actors.models import build_tiny
from helpers import rand_tokens

TINY_ATOL = 1e-4
SMOL_ATOL = 1e-3  # |logits| up to ~40: a relative error of ~2e-5
SAME_KERNELS_ATOL = 2e-5


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()  # [T, V]


def runner_logits(runner: LlamaRunner, cache, slot: int, tokens: list[int]) -> torch.Tensor:
    """Forward `tokens` for one slot; logits [T, V]."""
    h = runner.forward(cache, [slot], torch.tensor([tokens]))
    return runner.logits(h)[0].float()


def assert_close(a: torch.Tensor, b: torch.Tensor, atol: float) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float((a - b).abs().max())
    assert err <= atol, f"max |diff| {err:.3g} > {atol}"


# --------------------------------------------------------------------------- #
# Runner vs Hugging Face
# --------------------------------------------------------------------------- #
def incremental_vs_hf(model, tokens: list[int], chunks: list[int], atol: float) -> None:
    """Prefill chunks[0] tokens, then forward the rest in chunks; every position's
    logits must match HF's single forward over the whole sequence."""
    assert sum(chunks) == len(tokens)
    runner = LlamaRunner(model)
    cache = runner.new_cache(2, 64)
    ref = hf_logits(model, tokens)
    got, pos = [], 0
    for n in chunks:
        got.append(runner_logits(runner, cache, 1, tokens[pos:pos + n]))
        pos += n
        assert cache.lengths == [0, pos]
    assert_close(torch.cat(got), ref, atol)


def test_tiny_logits_match_hf_prefill_then_incremental(tiny):
    tokens = rand_tokens(20, seed=1)
    incremental_vs_hf(tiny.model, tokens, [11, 1, 1, 3, 1, 2, 1], TINY_ATOL)


def test_tiny_gqa_one_token_steps(tiny):
    """The tiny config has 4 query heads over 2 KV heads (GQA): a wrong head grouping
    would show up here as a large error."""
    assert tiny.model.config.num_key_value_heads < tiny.model.config.num_attention_heads
    tokens = rand_tokens(9, seed=2)
    incremental_vs_hf(tiny.model, tokens, [1, 1, 1, 1, 5], TINY_ATOL)


def test_smollm2_logits_match_hf(smollm2):
    tok = smollm2.tokenizer
    tokens = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_dict=False)
    tokens = list(tokens) + tok.encode("The capital of France is")
    incremental_vs_hf(smollm2.model, tokens, [len(tokens) - 6, 1, 1, 3, 1], SMOL_ATOL)


# --------------------------------------------------------------------------- #
# Batching, padding, slots
# --------------------------------------------------------------------------- #
def test_batch_with_padding_matches_rows_alone(tiny):
    """Rows of different lengths in one padded forward (num_new), then a second
    forward with different new-token counts per row, then a one-token step at
    unequal lengths (the masked path): each row equals that row run alone."""
    runner = LlamaRunner(tiny.model)
    prompts = [rand_tokens(n, seed=10 + n) for n in (5, 12, 8)]
    step2 = [rand_tokens(n, seed=20 + n) for n in (3, 1, 2)]
    step3 = rand_tokens(3, seed=30)

    cache = runner.new_cache(3, 64)
    P = max(map(len, prompts))
    feed = torch.zeros(3, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        feed[b, :len(p)] = torch.tensor(p)
    h1 = runner.logits(runner.forward(cache, [0, 1, 2], feed, [len(p) for p in prompts]))
    assert cache.lengths == [5, 12, 8]
    feed = torch.zeros(3, 3, dtype=torch.long)
    for b, t in enumerate(step2):
        feed[b, :len(t)] = torch.tensor(t)
    h2 = runner.logits(runner.forward(cache, [0, 1, 2], feed, [len(t) for t in step2]))
    assert cache.lengths == [8, 13, 10]
    h3 = runner.logits(runner.forward(cache, [0, 1, 2], torch.tensor(step3)[:, None]))
    assert cache.lengths == [9, 14, 11]

    for b in range(3):
        alone = runner.new_cache(1, 64)
        a1 = runner_logits(runner, alone, 0, prompts[b])
        a2 = runner_logits(runner, alone, 0, step2[b])
        a3 = runner_logits(runner, alone, 0, [step3[b]])
        assert_close(h1[b, :len(prompts[b])], a1, SAME_KERNELS_ATOL)
        assert_close(h2[b, :len(step2[b])], a2, SAME_KERNELS_ATOL)
        assert_close(h3[b], a3, SAME_KERNELS_ATOL)
        # and all of it is the Hugging Face forward of the row's whole sequence
        full = prompts[b] + step2[b] + [step3[b]]
        assert_close(torch.cat([a1, a2, a3]), hf_logits(tiny.model, full), TINY_ATOL)


def test_equal_length_single_token_batch(tiny):
    """T == 1 with equal lengths takes the mask-free path."""
    runner = LlamaRunner(tiny.model)
    seqs = [rand_tokens(7, seed=40 + b) for b in range(3)]
    cache = runner.new_cache(3, 32)
    runner.forward(cache, [0, 1, 2], torch.tensor([s[:6] for s in seqs]))
    got = runner.logits(runner.forward(cache, [0, 1, 2], torch.tensor([[s[6]] for s in seqs])))[:, 0]
    for b, s in enumerate(seqs):
        assert_close(got[b], hf_logits(tiny.model, s)[-1], TINY_ATOL)


def test_non_contiguous_and_unsorted_slots(tiny):
    runner = LlamaRunner(tiny.model)
    seqs = [rand_tokens(n, seed=50 + n) for n in (6, 9, 4)]
    slots = [4, 1, 3]  # not a range, not sorted
    cache = runner.new_cache(6, 32)
    # occupy the other slots with unrelated garbage
    runner.forward(cache, [0, 2, 5], torch.tensor([rand_tokens(10, seed=s) for s in (1, 2, 3)]))
    P = max(map(len, seqs))
    feed = torch.zeros(3, P, dtype=torch.long)
    for b, s in enumerate(seqs):
        feed[b, :len(s) - 1] = torch.tensor(s[:-1])
    runner.forward(cache, slots, feed, [len(s) - 1 for s in seqs])
    got = runner.logits(runner.forward(cache, slots, torch.tensor([[s[-1]] for s in seqs])))[:, 0]
    assert [cache.lengths[s] for s in slots] == [len(s) for s in seqs]
    assert [cache.lengths[s] for s in (0, 2, 5)] == [10, 10, 10]
    for b, s in enumerate(seqs):
        assert_close(got[b], hf_logits(tiny.model, s)[-1], TINY_ATOL)


# --------------------------------------------------------------------------- #
# Rollback
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("keep_extra", [0, 2, 4])
def test_logits_after_rollback_equal_fresh_prefill(tiny, keep_extra):
    """Logits after a rollback equal the logits from a fresh prefill of the same tokens.

    Forward 4 speculative tokens past a 10-token prefix, truncate the slot back to
    10 + keep_extra, then forward a token different from the rolled-back one: the
    logits must equal a fresh cache prefilled with exactly the surviving tokens plus
    that token (the stale K/V beyond the kept length must never be attended).
    A second slot, untouched, must be unaffected."""
    runner = LlamaRunner(tiny.model)
    prefix, spec = rand_tokens(10, seed=60), rand_tokens(4, seed=61)
    other = rand_tokens(13, seed=62)
    nxt = (spec[keep_extra] + 1) % 512 if keep_extra < 4 else 7

    cache = runner.new_cache(2, 32)
    runner.forward(cache, [0], torch.tensor([prefix]))
    runner.forward(cache, [1], torch.tensor([other[:-1]]))
    runner.forward(cache, [0], torch.tensor([spec]))
    assert cache.lengths == [14, 12]
    cache.truncate(0, 10 + keep_extra)
    assert cache.lengths == [10 + keep_extra, 12]
    # both rows in one batch: different lengths, so the masked path
    out = runner.logits(runner.forward(cache, [0, 1], torch.tensor([[nxt], [other[-1]]])))[:, 0]

    kept = prefix + spec[:keep_extra] + [nxt]
    fresh = runner.new_cache(1, 32)
    assert_close(out[0], runner_logits(runner, fresh, 0, kept)[-1], SAME_KERNELS_ATOL)
    assert_close(out[0], hf_logits(tiny.model, kept)[-1], TINY_ATOL)
    assert_close(out[1], hf_logits(tiny.model, other)[-1], TINY_ATOL)


def test_repeated_rollbacks_track_hf(tiny):
    """Many draft/rollback rounds on one slot: after each, the next logits are HF's."""
    runner = LlamaRunner(tiny.model)
    cache = runner.new_cache(1, 64)
    committed = rand_tokens(5, seed=70)
    runner.forward(cache, [0], torch.tensor([committed[:-1]]))
    g = torch.Generator().manual_seed(71)
    for r in range(6):
        drafts = torch.randint(3, 512, (3,), generator=g).tolist()
        logits = runner.logits(runner.forward(cache, [0], torch.tensor([committed[-1:] + drafts])))[0]
        assert_close(logits, hf_logits(tiny.model, committed + drafts)[-4:], TINY_ATOL)
        a = r % 4  # accept a drafts, then one token of our own
        committed = committed + drafts[:a] + [int(torch.randint(3, 512, (1,), generator=g))]
        cache.truncate(0, len(committed) - 1)


def test_truncate_validates_and_free_resets(tiny):
    runner = LlamaRunner(tiny.model)
    cache = runner.new_cache(2, 16)
    runner.forward(cache, [1], torch.tensor([rand_tokens(5, seed=80)]))
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(1, 6)
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(1, -1)
    cache.truncate(1, 5)  # no-op is fine
    assert cache.lengths == [0, 5]
    cache.free(1)
    assert cache.lengths == [0, 0]


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #
def test_cache_overflow_raises_and_leaves_cache_unchanged(tiny):
    runner = LlamaRunner(tiny.model)
    cache = runner.new_cache(2, 16)
    runner.forward(cache, [0, 1], torch.tensor([rand_tokens(10, seed=90), rand_tokens(10, seed=91)]),
                   [10, 4])
    with pytest.raises(ValueError, match="cache holds 16"):
        runner.forward(cache, [0], torch.tensor([rand_tokens(7, seed=92)]))
    # a batch fails as a whole if any row's end is past max_len (row 1 alone would fit)
    with pytest.raises(ValueError, match="cache holds 16"):
        runner.forward(cache, [0, 1], torch.tensor([rand_tokens(7, seed=93)] * 2), [1, 7])
    assert cache.lengths == [10, 4]
    runner.forward(cache, [0], torch.tensor([rand_tokens(6, seed=94)]))  # exactly full is fine
    assert cache.lengths == [16, 4]


def test_new_cache_beyond_max_position_raises(tiny):
    runner = LlamaRunner(tiny.model)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        runner.new_cache(1, tiny.model.config.max_position_embeddings + 1)


def test_unsupported_models_raise():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=32))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        LlamaRunner(gpt2)
    with pytest.raises(ValueError, match="model_type"):
        LlamaRunner(SimpleNamespace(config=SimpleNamespace(model_type="falcon")))
    gelu = build_tiny(0, vocab_size=32, num_layers=1)
    gelu.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaRunner(gelu)


def test_num_layers_range(tiny):
    for bad in (0, 5):
        with pytest.raises(ValueError, match=r"num_layers must be in \[1, 4\]"):
            LlamaRunner(tiny.model, num_layers=bad)
    assert LlamaRunner(tiny.model, num_layers=2).num_layers == 2


# --------------------------------------------------------------------------- #
# Token trees: one pass scores every node as if it were its own path
# --------------------------------------------------------------------------- #
TREE = [0, 0, 1, 1, 2, 4, 0]  # parents of nodes 1..7 (feed index; 0 = the root)


def path_of(node: int, parents: list[int]) -> list[int]:
    out = []
    while node:
        out.append(node)
        node = parents[node - 1]
    return out[::-1]


def test_tree_pass_scores_each_node_as_its_path(tiny):
    from actors.llama import TreeMask

    runner = LlamaRunner(tiny.model)
    prefixes = [rand_tokens(9, seed=200), rand_tokens(5, seed=201)]
    nodes = [rand_tokens(len(TREE), seed=202), rand_tokens(len(TREE), seed=203)]
    cache = runner.new_cache(2, 64)
    runner.forward(cache, [0], torch.tensor([prefixes[0][:-1]]))
    runner.forward(cache, [1], torch.tensor([prefixes[1][:-1]]))  # rows of different lengths
    feed = torch.tensor([[p[-1], *n] for p, n in zip(prefixes, nodes)])  # root = last committed token
    tree = TreeMask.from_parents([TREE, TREE], feed.shape[1], "cpu")
    got = runner.logits(runner.forward(cache, [0, 1], feed, tree=tree))  # [2, 8, V]
    for b in range(2):
        for node in range(len(TREE) + 1):
            path = [nodes[b][i - 1] for i in path_of(node, TREE)]
            ref = tiny.model(torch.tensor([prefixes[b] + path])).logits[0, -1]
            torch.testing.assert_close(got[b, node], ref, atol=2e-4, rtol=1e-4)


def test_tree_mask_planted_bug_is_caught(tiny):
    """A node that also sees a non-ancestor (its sibling) scores differently from its path."""
    from actors.llama import TreeMask

    runner = LlamaRunner(tiny.model)
    prefix, nodes = rand_tokens(6, seed=210), rand_tokens(len(TREE), seed=211)
    feed = torch.tensor([[prefix[-1], *nodes]])
    tree = TreeMask.from_parents([TREE], feed.shape[1], "cpu")
    tree.anc[0, 2, 1] = True  # node 2 (a child of the root) wrongly sees node 1, its sibling
    cache = runner.new_cache(1, 64)
    runner.forward(cache, [0], torch.tensor([prefix[:-1]]))
    got = runner.logits(runner.forward(cache, [0], feed, tree=tree))
    ref = tiny.model(torch.tensor([prefix + [nodes[1]]])).logits[0, -1]
    assert not torch.allclose(got[0, 2], ref, atol=1e-3)


def test_compacting_an_accepted_path_equals_feeding_it(tiny):
    from actors.llama import TreeMask

    runner = LlamaRunner(tiny.model)
    prefix, nodes = rand_tokens(8, seed=220), rand_tokens(len(TREE), seed=221)
    accepted = path_of(6, TREE)  # root -> 1 -> 4 -> 6
    cache = runner.new_cache(1, 64)
    runner.forward(cache, [0], torch.tensor([prefix[:-1]]))
    start = cache.lengths[0]
    runner.forward(cache, [0], torch.tensor([[prefix[-1], *nodes]]),
                   tree=TreeMask.from_parents([TREE], len(TREE) + 1, "cpu"))
    cache.compact(0, start, [0] + accepted)
    cache.truncate(0, start + 1 + len(accepted))
    nxt = rand_tokens(3, seed=222)
    got = runner.logits(runner.forward(cache, [0], torch.tensor([nxt])))[0]
    ref = tiny.model(torch.tensor([prefix + [nodes[i - 1] for i in accepted] + nxt])).logits[0, -3:]
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    # without compaction the same continuation reads the wrong KV (the planted bug fails)
    cache2 = runner.new_cache(1, 64)
    runner.forward(cache2, [0], torch.tensor([prefix[:-1]]))
    runner.forward(cache2, [0], torch.tensor([[prefix[-1], *nodes]]),
                   tree=TreeMask.from_parents([TREE], len(TREE) + 1, "cpu"))
    cache2.truncate(0, start + 1 + len(accepted))
    bad = runner.logits(runner.forward(cache2, [0], torch.tensor([nxt])))[0]
    assert not torch.allclose(bad, ref, atol=1e-3)


def _prefill_and_step(runner: LlamaRunner, toks: torch.Tensor) -> torch.Tensor:
    """Logits of a 2-row prefill, a 5-token pass and a 1-token pass, concatenated [rows, 12, V]."""
    cache = runner.new_cache(2, 64)
    out = [runner.logits(runner.forward(cache, [0, 1], toks[:, :6]))]
    out.append(runner.logits(runner.forward(cache, [0, 1], toks[:, 6:11])))
    out.append(runner.logits(runner.forward(cache, [0, 1], toks[:, 11:12])))
    return torch.cat(out, 1).float()


def test_prepacked_weights_compute_what_plain_ones_do():
    """bf16: oneDNN's prepacked linear is the kernel F.linear runs, minus the per-call reorder, so
    every logit is bit-identical (what lets prepack 'auto' take it without measuring). fp32: a
    different kernel than MKL's, equal to float32 rounding. Int8 (torchao) weights are left alone.
    Where this CPU cannot run a dtype's prepacked layout (`actors/cpu.py`; with SPECD_DISABLE set,
    on any CPU), "on" is refused naming what is missing and "auto" leaves the weights plain."""
    from actors import cpu
    from actors.build import with_prepack
    from actors.llama import PACKABLE
    from actors.quant import quantize_runner

    toks = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.bfloat16, torch.float32):
        model = build_tiny(0, dtype)
        if not cpu.available(PACKABLE[dtype]):
            with pytest.raises(ValueError, match=r"prepack: on \(dtype .*\) needs oneDNN's prepacked .* which this "
                                                 r"CPU cannot run: .* Set prepack: auto or off"):
                with_prepack(LlamaRunner(model), "on")
            assert not with_prepack(LlamaRunner(model), "auto").prepacked
            continue
        plain, packed = LlamaRunner(model), with_prepack(LlamaRunner(model), "on")
        assert packed.prepacked and all(l.wqkv.is_mkldnn and l.w_down.is_mkldnn for l in packed.layers)
        assert packed.lm_head.is_mkldnn and not plain.layers[0].wqkv.is_mkldnn
        a, b = _prefill_and_step(plain, toks), _prefill_and_step(packed, toks)
        if dtype == torch.bfloat16:
            assert torch.equal(a, b)
        else:
            assert_close(a, b, SAME_KERNELS_ATOL)
        assert with_prepack(LlamaRunner(model), "auto").prepacked == (dtype == torch.bfloat16)
        assert not with_prepack(LlamaRunner(model), "off").prepacked
    if cpu.available("prepack-bf16"):
        mixed = with_prepack(quantize_runner(LlamaRunner(build_tiny(0, torch.bfloat16)), "mixed"), "on")
        assert mixed.layers[0].wqkv.is_mkldnn and not mixed.layers[0].w_down.is_mkldnn  # int8 MLP stays torchao
        _prefill_and_step(mixed, toks)
    with pytest.raises(ValueError, match="prepack must be one of"):
        with_prepack(LlamaRunner(build_tiny(0)), "yes")


def test_engine_prepack_auto_takes_what_runs_and_keeps_its_output():
    """build_engine's prepack 'auto': a bf16 target and its model drafts run prepacked wherever
    this CPU runs that layout (plain where it does not), and the speculative greedy output is
    token for token the one prepack 'off' gives. An fp32 target without exact passes is measured
    both ways where prepacked fp32 runs (its reason names both), and keeps the one that measured faster."""
    from actors import cpu
    from actors.build import build_engine
    from actors.schema import Request, SamplingParams, SpeculationParams

    def outputs(prepack: str, dtype: str = "bf16", exact: str = "auto"):
        built = build_engine("tiny", ["truncated:2"], dtype, max_batch=2, max_len=128, device="cpu", prepack=prepack,
                             exact=exact)
        eng = built.engine
        reqs = [Request(f"r{i}", [5, 9, 33, 2 + i], SamplingParams(max_tokens=24, ignore_eos=True),
                        SpeculationParams(draft="truncated:2", gamma=4)) for i in range(2)]
        return eng, [c.token_ids for c in eng.generate(reqs)]
    on, out_on = outputs("auto")
    off, out_off = outputs("off")
    runs = cpu.available("prepack-bf16")
    assert on.info["prepacked"] == runs and on.drafters["truncated:2"].runner.prepacked == runs
    assert not off.info["prepacked"] and out_on == out_off
    fp32, _ = outputs("auto", "fp32", exact="off")  # timed, not chosen by rule as exact passes are
    why = fp32.info["dtype_reason"]
    if cpu.available("prepack-fp32"):
        assert "fp32+prepacked " in why and "fp32 " in why, why
        chosen = why.split(":")[0]
        assert fp32.info["prepacked"] == (chosen == "fp32+prepacked")
        assert fp32.drafters["truncated:2"].runner.prepacked == fp32.info["prepacked"]
    else:
        assert not fp32.info["prepacked"] and "fp32+prepacked" not in why


def test_row_buckets_bound_padding_and_keep_every_row_exact():
    """A CPU oneDNN linear pads its rows to a bucket (and splits past ROW_CHUNK): at most a quarter
    of the rows are padding (an eighth from 256 rows), the set of shapes is small and fixed, and
    the real rows' results are bit-identical to the unpadded call's, prepacked (where this CPU runs
    that layout) or not, bf16 or fp32, 2-D or 3-D."""
    from actors import cpu
    from actors import llama as L

    for m in range(1, L.ROW_CHUNK + 1):
        b = L.row_bucket(m)
        assert m <= b <= L.ROW_CHUNK and L.row_bucket(b) == b
        assert b - m <= (m / 8 if m >= 256 else m / 4)
    assert len(L.row_buckets()) < 50
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(96, 64, generator=g).to(dtype)
        bias = torch.randn(96, generator=g).to(dtype)
        packed = (torch.ops.mkldnn._reorder_linear_weight(w),) if cpu.available(L.PACKABLE[dtype]) else ()
        for weight in (w, *packed):
            for m in (1, 9, 37, 300, L.ROW_CHUNK + 77):
                x = torch.randn(m, 64, generator=g).to(dtype)
                assert torch.equal(L.linear(x, weight, bias), L._linear(x, weight, bias))
                assert torch.equal(L.linear(x.view(1, m, 64), weight), L._linear(x, weight).view(1, m, 96))


@pytest.mark.parametrize("off", ["", "prepack-bf16", "all"])
def test_engine_meets_no_kernel_shape_it_did_not_warm(monkeypatch, cpu_paths_off, off):
    """oneDNN compiles and caches a kernel per matmul shape (~0.5 MB each): a server meeting
    new row counts grows (issue 16's soak). An engine warms every bucketed shape of its target
    and drafts when built; then serving mixed prompt lengths, batches and γ (prefill, chains, a
    token tree) meets no shape it did not warm. Unbucketed rows (a 37-token prompt is a 37-row
    matmul) or a draft left out of the warm-up (the head's fc and its smaller LM head have shapes
    of their own) fail this. With the fast paths this CPU has: bf16 through oneDNN; without
    oneDNN's bf16 (an AVX2 CPU, `off`="prepack-bf16"): prepacked fp32; without either: no
    matmul is cached per shape, and the warm-up runs nothing."""
    from actors import cpu
    from actors import llama as L
    from actors.build import build_engine
    from actors.drafters.eagle import EagleDrafter, EagleHead
    from actors.schema import Request, SamplingParams, SpeculationParams

    if off:
        cpu_paths_off(off)
    dtype, prepack = ("bf16", "auto") if cpu.onednn_bf16() else \
        ("fp32", "on") if cpu.available("prepack-fp32") else ("fp32", "off")
    seen: list[set] = [set()]
    plain = L._linear

    def recording(x, w, b=None):
        if L.shape_cached(x, w):
            seen[-1].add((x.reshape(-1, x.shape[-1]).shape[0], tuple(w.shape), w.is_mkldnn, b is None))
        return plain(x, w, b)

    monkeypatch.setattr(L, "_linear", recording)
    monkeypatch.setattr(L, "_WARMED", set())  # record the warm-up even where another test warmed these shapes
    tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    head = EagleHead(build_tiny(0, tdt), torch.arange(256)).to(tdt).eval()
    eng = build_engine("tiny", ["truncated:2", "ngram"], dtype, max_batch=4, max_len=256, device="cpu",
                       prepack=prepack,
                       extra_drafters={"eagle": EagleDrafter(head, "eagle", max_batch=4, max_len=256)}).engine
    warmed = seen[-1]
    assert bool(warmed) == (prepack != "off") and all(m in L.row_buckets() for m, *_ in warmed)
    seen.append(set())
    rng = torch.Generator().manual_seed(1)
    reqs = [Request(f"r{i}", torch.randint(3, 500, (n,), generator=rng).tolist(),
                    SamplingParams(max_tokens=12, ignore_eos=True),
                    SpeculationParams(draft=d, gamma=g, tree=t))
            for i, (n, d, g, t) in enumerate([(37, "truncated:2", 3, None), (5, "ngram", 2, None),
                                              (61, "truncated:2", 0, None), (11, "truncated:2", 4, 6),
                                              (150, "ngram", 4, None), (23, "eagle", 3, None),
                                              (44, "eagle", 4, 6)])]
    assert all(len(c.token_ids) == 12 for c in eng.generate(reqs))
    assert bool(seen[-1]) == (prepack != "off") and seen[-1] <= warmed, sorted(seen[-1] - warmed)
