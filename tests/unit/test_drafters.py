"""Drafters: the n-gram lookup and the model drafter (separate draft model or
truncated self-draft), through the `Drafter` interface the engine uses.

The model-drafter oracle is either a fresh drafter fed the same committed tokens
(rollback + catch-up must be invisible) or Hugging Face greedy `generate`.
"""
from __future__ import annotations

import pytest
import torch

from actors.drafters import DraftSeq, ModelDrafter, NgramDrafter
from actors.drafters.base import apply_view
from actors.llama import LlamaRunner
from actors.sampling import process_logits
from helpers import rand_tokens


def proposed(prop, b: int = 0) -> list[int]:
    return prop.tokens[b, :prop.num_draft[b]].tolist()


# --------------------------------------------------------------------------- #
# NgramDrafter
# --------------------------------------------------------------------------- #
def test_ngram_finds_latest_match():
    d = NgramDrafter(max_n=2, min_n=1)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2]
    # suffix [1, 2] occurs at 0 and 4: the latest (4) is followed by 4, 8
    assert d.lookup(tokens, 2) == [4, 8]
    assert d.lookup(tokens, 10) == [4, 8, 1, 2]  # stops at the end of the sequence


def test_ngram_prefers_longer_n():
    tokens = [5, 1, 2, 7, 9, 2, 8, 1, 2]
    # n=2: [1, 2] at 1 -> 7 ...; n=1: [2] latest earlier at 5 -> 8
    assert NgramDrafter(max_n=2).lookup(tokens, 1) == [7]
    assert NgramDrafter(max_n=1).lookup(tokens, 1) == [8]
    # min_n=2 refuses to fall back to unigrams
    assert NgramDrafter(max_n=3, min_n=2).lookup([4, 5, 6, 7, 6], 3) == []
    assert NgramDrafter(max_n=3, min_n=1).lookup([4, 5, 6, 7, 6], 3) == [7, 6]


def test_ngram_no_match_proposes_nothing():
    d = NgramDrafter()
    prop = d.propose([DraftSeq(seq_id=0, keep=0, new_tokens=[1, 2, 3, 4], gamma=4)])
    assert prop.num_draft == [0] and prop.probs is None
    assert prop.tokens.shape == (1, 0)


def test_ngram_respects_gamma_and_lookahead():
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    prop = NgramDrafter(max_n=2).propose([DraftSeq(0, 0, tokens, gamma=3), DraftSeq(1, 0, tokens, gamma=5)])
    assert prop.num_draft == [3, 5]
    assert proposed(prop, 0) == [3, 4, 5] and proposed(prop, 1) == [3, 4, 5, 6, 7]
    assert prop.tokens.shape == (2, 5)
    prop = NgramDrafter(max_n=2, lookahead=2).propose([DraftSeq(0, 0, tokens, gamma=5)])
    assert proposed(prop) == [3, 4]


def test_ngram_keep_new_tokens_rollback_rule():
    d = NgramDrafter(max_n=2)
    prompt = [1, 2, 3, 4, 5, 1, 2]
    prop = d.propose([DraftSeq(7, 0, prompt, gamma=3)])
    assert proposed(prop) == [3, 4, 5]
    assert d.views[7] == prompt + [3, 4, 5]  # view = committed + its own drafts
    # the target accepted 1 draft (3) and then emitted 9: keep = prompt + 1
    prop = d.propose([DraftSeq(7, len(prompt) + 1, [9], gamma=3)])
    assert d.views[7][:len(prompt) + 2] == prompt + [3, 9]
    # the new view [.., 1, 2, 3, 9] has suffix [3, 9]/[9]: no match -> nothing
    assert proposed(prop) == []
    assert d.views[7] == prompt + [3, 9]
    # all drafts accepted plus a bonus: keep everything, append the bonus
    d2 = NgramDrafter(max_n=2)
    d2.propose([DraftSeq(0, 0, prompt, gamma=2)])  # proposes [3, 4]
    d2.propose([DraftSeq(0, len(prompt) + 2, [5], gamma=2)])
    assert d2.views[0][:len(prompt) + 3] == prompt + [3, 4, 5]


def test_ngram_bad_keep_raises_and_release_frees():
    d = NgramDrafter()
    d.propose([DraftSeq(0, 0, [1, 2, 1], gamma=2), DraftSeq(1, 0, [4, 4], gamma=2)])
    assert d.num_active() == 2
    with pytest.raises(ValueError, match="keep=10 outside"):
        d.propose([DraftSeq(0, 10, [3], gamma=2)])
    d.release(0)
    assert d.num_active() == 1 and 0 not in d.views
    d.release(0)  # idempotent
    d.release(1)
    assert d.num_active() == 0
    # a released (or lost) sequence is rebuilt from keep=0 and all committed tokens
    with pytest.raises(ValueError, match="keep=3 outside"):
        d.propose([DraftSeq(1, 3, [5], gamma=2)])


def test_ngram_constructor_validation():
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(max_n=1, min_n=2)
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(max_n=2, min_n=0)
    with pytest.raises(ValueError, match="lookahead"):
        NgramDrafter(lookahead=0)


def test_apply_view_rule():
    assert apply_view([1, 2, 3, 4], 2, [9]) == [1, 2, 9]
    assert apply_view([], 0, [5, 6]) == [5, 6]
    with pytest.raises(ValueError):
        apply_view([1], -1, [2])


# --------------------------------------------------------------------------- #
# ModelDrafter
# --------------------------------------------------------------------------- #
def test_model_drafter_rollback_catch_up_equals_fresh(tiny, tiny_draft):
    """Randomised rounds of propose -> accept a of the drafts -> append one committed
    token. After every rollback + catch-up, the proposals equal those of a fresh
    drafter fed keep=0 and all committed tokens. Covers a=0 (reject all), partial
    acceptance, and a=γ (the last draft was proposed but never fed, so the catch-up
    is two tokens)."""
    for runner in (LlamaRunner(tiny_draft.model), LlamaRunner(tiny.model, num_layers=2)):
        drafter = ModelDrafter(runner, "d", max_batch=4, max_len=128)
        committed = rand_tokens(6, seed=1)
        g = torch.Generator().manual_seed(2)
        keep, new = 0, list(committed)
        accepts = [0, 3, 1, 4, 2, 4, 0, 4]  # gamma is 4 except where reduced below
        for r, a in enumerate(accepts):
            gamma = 4 if r != 5 else 2
            a = min(a, gamma)
            prop = drafter.propose([DraftSeq(0, keep, new, gamma=gamma)])
            assert prop.num_draft == [gamma] and prop.probs is None
            ref_drafter = ModelDrafter(runner, "ref", max_batch=1, max_len=128)
            ref = ref_drafter.propose([DraftSeq(0, 0, list(committed), gamma=gamma)])
            assert proposed(prop) == proposed(ref), f"round {r}"
            drafts = proposed(prop)
            x = int(torch.randint(3, 512, (1,), generator=g))
            keep = len(committed) + a
            committed = committed + drafts[:a] + [x]
            new = [x]
            assert drafter.views[0] == committed[:-1] + drafts[a:]


def test_model_drafter_batch_rows_independent(tiny_draft):
    """Rows with different prompt lengths, γ and rollbacks in one propose call give the
    same drafts as each row alone."""
    runner = LlamaRunner(tiny_draft.model)
    prompts = [rand_tokens(n, seed=10 + n) for n in (3, 11, 6)]
    gammas = [2, 5, 3]
    batch = ModelDrafter(runner, "b", max_batch=4, max_len=64)
    p1 = batch.propose([DraftSeq(i, 0, p, gamma=g) for i, (p, g) in enumerate(zip(prompts, gammas))])
    accepted = [1, 5, 0]
    nxt = [[17], [23], [31]]
    p2 = batch.propose([DraftSeq(i, len(p) + a, x, gamma=g)
                        for i, (p, a, x, g) in enumerate(zip(prompts, accepted, nxt, gammas))])
    for i, (p, g) in enumerate(zip(prompts, gammas)):
        alone = ModelDrafter(runner, "a", max_batch=1, max_len=64)
        a1 = alone.propose([DraftSeq(0, 0, p, gamma=g)])
        assert proposed(p1, i) == proposed(a1)
        a2 = alone.propose([DraftSeq(0, len(p) + accepted[i], nxt[i], gamma=g)])
        assert proposed(p2, i) == proposed(a2)
    assert p2.num_draft == gammas and p2.tokens.shape == (3, 5)


def test_truncated_self_draft_shares_target_weights(tiny):
    """The self-draft holds the target's own tensors (same storage, no copy) for every
    weight, the fused Q/K/V and gate/up matrices included: fusing re-points the HF
    projections at views of the fused tensor, and the target runner and the self-draft
    both use that one tensor. So the self-draft costs only its KV cache."""
    hf = tiny.model
    target = LlamaRunner(hf)
    d = ModelDrafter.truncated(hf, 2, max_batch=1, max_len=32)
    r = d.runner
    assert d.name == "truncated:2" and r.num_layers == 2 and len(r.layers) == 2

    def same(a, b):
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.shape == b.shape

    assert same(r.embed, hf.model.embed_tokens.weight)
    assert same(r.norm, hf.model.norm.weight)
    assert same(r.lm_head, hf.lm_head.weight)
    for i, lw in enumerate(r.layers):
        layer = hf.model.layers[i]
        assert same(lw.attn_norm, layer.input_layernorm.weight)
        assert same(lw.wo, layer.self_attn.o_proj.weight)
        assert same(lw.mlp_norm, layer.post_attention_layernorm.weight)
        assert same(lw.w_down, layer.mlp.down_proj.weight)
        at = layer.self_attn
        assert torch.equal(lw.wqkv, torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]))
        assert torch.equal(lw.w_gate_up, torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]))
        assert same(lw.wqkv, target.layers[i].wqkv) and same(lw.w_gate_up, target.layers[i].w_gate_up)
        for proj in (at.q_proj, at.k_proj, at.v_proj):
            assert proj.weight.untyped_storage().data_ptr() == lw.wqkv.untyped_storage().data_ptr()


def test_truncated_all_layers_proposes_target_greedy(tiny, hf_greedy):
    """With K = all layers the self-draft is the target: its γ drafts are exactly the
    target's greedy continuation (HF generate), also after a rollback."""
    prompt = rand_tokens(7, seed=3)
    ref = hf_greedy(tiny.model, prompt, 12, eos=None)
    d = ModelDrafter.truncated(tiny.model, tiny.model.config.num_hidden_layers, max_batch=2, max_len=64)
    assert proposed(d.propose([DraftSeq(0, 0, prompt, gamma=8)])) == ref[:8]
    # accept 5, then the "target" commits ref[5]: the drafter continues from there
    assert proposed(d.propose([DraftSeq(0, len(prompt) + 5, [ref[5]], gamma=6)])) == ref[6:12]


def test_model_drafter_sampled_probs_are_processed_draft_distribution(tiny_draft):
    """In sampling mode the drafter returns q = process_logits(draft logits) for each
    draft position -- the distribution its token was drawn from -- computed here
    independently with the HF forward of the draft model."""
    runner = LlamaRunner(tiny_draft.model)
    d = ModelDrafter(runner, "d", max_batch=2, max_len=64)
    prompt = rand_tokens(5, seed=4)
    seqs = [DraftSeq(0, 0, prompt, gamma=3, temperature=0.7, top_k=50, top_p=0.9, seed=11),
            DraftSeq(1, 0, prompt, gamma=2)]  # a greedy row in the same batch
    prop = d.propose(seqs)
    assert prop.probs is not None and prop.probs.shape == (2, 3, 512)
    toks = proposed(prop, 0)
    with torch.inference_mode():
        logits = tiny_draft.model(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1:-1].float()
    q = process_logits(logits, torch.full((3,), 0.7), torch.full((3,), 50), torch.full((3,), 0.9))
    assert torch.allclose(prop.probs[0], q, atol=1e-5)
    assert all(prop.probs[0, j, t] > 0 for j, t in enumerate(toks))  # drawn from q's support
    assert int((prop.probs[0] > 0).sum(-1).max()) <= 50  # top-k applied
    assert torch.all(prop.probs[1] == 0)  # the greedy row gets no distribution
    # same seed, fresh drafter -> same draws
    d2 = ModelDrafter(runner, "d2", max_batch=2, max_len=64)
    assert proposed(d2.propose(seqs[:1])) == toks


def test_model_drafter_release_frees_slot(tiny_draft):
    runner = LlamaRunner(tiny_draft.model)
    d = ModelDrafter(runner, "d", max_batch=2, max_len=32)
    d.propose([DraftSeq(5, 0, [3, 4, 5], gamma=2), DraftSeq(9, 0, [6, 7], gamma=2)])
    assert d.num_active() == 2 and d.free == []
    slot = d.slots[5]
    assert d.cache.lengths[slot] > 0
    with pytest.raises(RuntimeError, match="no free KV slot"):
        d.propose([DraftSeq(11, 0, [1], gamma=1)])
    d.release(5)
    assert d.num_active() == 1 and d.free == [slot] and d.cache.lengths[slot] == 0
    assert 5 not in d.views and 5 not in d.gens
    d.release(5)  # idempotent
    assert d.num_active() == 1 and d.free == [slot]
    # the freed slot serves a new sequence correctly (no stale KV)
    prompt = [8, 9, 10, 11]
    got = proposed(d.propose([DraftSeq(12, 0, prompt, gamma=3)]))
    fresh = ModelDrafter(runner, "f", max_batch=1, max_len=32)
    assert got == proposed(fresh.propose([DraftSeq(0, 0, prompt, gamma=3)]))
    d.release(9)
    d.release(12)
    assert d.num_active() == 0 and d.free == [0, 1]


def test_feature_columns_pick_each_drafters_layers_from_the_kept_union():
    """The engine keeps the union of its drafts' feature layers, one block of E columns per layer;
    each draft is handed its own blocks in its own order: all of them (None), a contiguous run
    (a slice, so the history it is handed stays a view), or scattered blocks (an index)."""
    from actors.drafting import feature_columns, feature_union

    class D:
        def __init__(self, layers):
            self.feature_layers = layers

    kept = feature_union([D((-1,)), D((2, 15, -1)), D((5,))])
    assert kept == (2, 5, 15, -1)
    E = 3
    row = torch.arange(len(kept) * E)[None]  # column c holds c: block i is layer kept[i]
    assert feature_columns(kept, kept, E) is None
    tail = feature_columns(kept, (15, -1), E)
    assert tail == slice(2 * E, 4 * E)
    scattered = feature_columns(kept, (2, 15, -1), E)
    assert isinstance(scattered, torch.Tensor)
    assert row[:, scattered].tolist() == [[0, 1, 2, 6, 7, 8, 9, 10, 11]]
    assert row[:, feature_columns(kept, (-1,), E)].tolist() == [[9, 10, 11]]


def test_a_proposal_taken_apart_by_row_and_stacked_back_is_the_same():
    """`Proposal.rows` / `Proposal.stack`, the one take/scatter the engine's flights, the draft server
    and the remote drafter share: rows of different lengths, a tree row, probs, rows reordered."""
    from actors.drafters.base import Proposal

    torch.manual_seed(0)
    probs = torch.rand(3, 4, 5)
    prop = Proposal(tokens=torch.tensor([[7, 8, 9, 0], [4, 0, 0, 0], [1, 2, 3, 5]]), num_draft=[3, 1, 4], probs=probs,
                    parents=[None, None, [0, 1, 1, 2]])
    rows = prop.rows()
    assert [r.tokens for r in rows] == [[7, 8, 9], [4], [1, 2, 3, 5]]
    assert [r.parents for r in rows] == [None, None, [0, 1, 1, 2]]
    back = Proposal.stack([rows[2], rows[0], rows[1]], 4)
    assert back.num_draft == [4, 3, 1] and back.tokens.tolist() == [[1, 2, 3, 5], [7, 8, 9, 0], [4, 0, 0, 0]]
    assert back.parents == [[0, 1, 1, 2], None, None]
    assert torch.equal(back.probs[1, :3], probs[0, :3]) and not back.probs[2, 1:].any()
    chains = Proposal.stack([rows[0], rows[1]], 3)
    assert chains.parents is None and chains.tokens.shape == (2, 3)
