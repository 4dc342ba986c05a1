"""Token-tree verification: the target scores every node of every row's tree in ONE pass (each
node sees the committed context and its own ancestors, at the position of its depth), the longest
matching path plus one target token is kept, and the accepted path's KV is moved together.

A test drafter proposes trees built around the target's own greedy continuation (the HF
reference): at every depth a wrong sibling (or two) next to the right token, in varying order,
with wrong subtrees hanging off them, so acceptance must follow the one right path. Greedy output
equals HF `generate` on the tiny model and on SmolLM2 (fp32), in mixed-length batches with chain
rows beside tree rows, and two planted bugs fail it: a mask that lets a node see a non-ancestor,
and no KV compaction. Sampling: the multi-draft rule (test children in order against the target
distribution with rejected children removed) matches the target law exactly; a naive rule that
accepts each child with probability p(x) without removing rejected ones does not.
"""
from __future__ import annotations

import pytest
import torch

import actors.acceptance as acceptance_mod
import actors.llama as llama_mod
from actors.drafters import Drafter, DraftSeq, NgramDrafter, Proposal
from actors.drafters.base import apply_view
from actors.engine import SpecEngine
from actors.llama import LlamaRunner
from helpers import chat_ids, rand_tokens, request, run

PROMPTS = [rand_tokens(7, 1), [42], rand_tokens(20, 2), rand_tokens(12, 4)]
MAX_TOKENS = [24, 17, 24, 20]


class TreeOracle(Drafter):
    """Trees around the reference continuation: depth `depth`, at each depth the right token
    and `width - 1` wrong siblings (order rotating with the position), each wrong sibling with
    one wrong child; a row may be asked for a chain (tree=0): then the right tokens only,
    but the last one wrong."""

    name = "tree-oracle"

    def __init__(self, refs: dict[tuple, list[int]], vocab: int, depth: int = 4, width: int = 3):
        self.refs, self.vocab, self.depth, self.width = refs, vocab, depth, width
        self.views: dict[int, list[int]] = {}

    def _ref(self, view: list[int]) -> list[int]:
        prompt = next(k for k in self.refs if tuple(view[:len(k)]) == k)
        return self.refs[prompt][len(view) - len(prompt):]

    def propose(self, seqs: list[DraftSeq]) -> Proposal:
        rows, parents = [], []
        for s in seqs:
            view = apply_view(self.views.setdefault(s.seq_id, []), s.keep, s.new_tokens)
            ref = self._ref(view) + [0] * 32
            if not s.tree:
                chain = ref[:s.gamma]
                if chain:
                    chain[-1] = (chain[-1] + 1) % self.vocab
                rows.append(chain)
                parents.append(None)
                view.extend(chain)
                continue
            toks, par, spine = [], [], 0  # spine: feed index of the right node at the current depth
            for d in range(min(self.depth, s.gamma)):
                kids = [ref[d]] + [(ref[d] + 7 * i) % self.vocab for i in range(1, self.width)]
                rot = (len(view) + d) % len(kids)
                kids = kids[rot:] + kids[:rot]
                new_spine = spine
                for tok in kids:
                    if len(toks) >= s.tree:
                        break
                    toks.append(tok)
                    par.append(spine)
                    if tok == ref[d]:
                        new_spine = len(toks)
                    elif len(toks) < s.tree:  # a wrong subtree below a wrong sibling
                        toks.append((tok + 3) % self.vocab)
                        par.append(len(toks) - 1)
                if new_spine == spine:
                    break
                spine = new_spine
            rows.append(toks)
            parents.append(par)
        G = max(len(r) for r in rows)
        tokens = torch.zeros(len(seqs), max(G, 1), dtype=torch.long)
        for b, r in enumerate(rows):
            tokens[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        return Proposal(tokens=tokens, num_draft=[len(r) for r in rows], parents=parents)

    def release(self, seq_id: int) -> None:
        self.views.pop(seq_id, None)

    def num_active(self) -> int:
        return len(self.views)


def tree_requests(tree: int, gammas=(6, 6, 6, 6), chains=(1,)):
    """Rows of tree budget `tree` (depth gamma), except the `chains` rows, which draft chains."""
    reqs = [request(f"r{i}", p, "oracle", g, max_tokens=n) for i, (p, n, g) in enumerate(zip(PROMPTS, MAX_TOKENS, gammas))]
    for i, r in enumerate(reqs):
        r.speculation.tree = 0 if i in chains else tree
    return reqs


@pytest.fixture(scope="module")
def refs(tiny, hf_greedy):
    return [hf_greedy(tiny.model, p, 40, eos=None) for p in PROMPTS]


def engine(tiny, refs, **kw) -> SpecEngine:
    oracle = TreeOracle({tuple(p): r for p, r in zip(PROMPTS, refs)}, 512, **kw)
    return SpecEngine(LlamaRunner(tiny.model), {"oracle": oracle, "ngram": NgramDrafter()}, max_batch=4,
                      max_len=128)


@pytest.mark.parametrize("tree", [4, 9, 16])
def test_tree_greedy_equals_hf_with_chains_in_the_batch(tiny, refs, tree):
    eng = engine(tiny, refs)
    res = run(eng, tree_requests(tree))
    for i, n in enumerate(MAX_TOKENS):
        assert res[f"r{i}"].token_ids == refs[i][:n], f"r{i}"
    tree_rows = [res[f"r{i}"] for i in (0, 2, 3)]
    assert all(r.stats.accepted_tokens > 0 for r in tree_rows)
    # the right path is followed through the wrong siblings: more than one token per pass
    assert all(r.stats.mean_accepted_length > (1.0 if tree < 9 else 1.8) for r in tree_rows)
    assert eng.kv_slots_in_use() == 0


def test_wrong_mask_planted_bug_is_caught(tiny, refs, monkeypatch):
    real = llama_mod.TreeMask.from_parents.__func__

    def leaky(cls, parents, T, device):
        m = real(cls, parents, T, device)
        m.anc[:, :, 1] = True  # every node also sees node 1 (for most, a non-ancestor)
        return m
    monkeypatch.setattr(llama_mod.TreeMask, "from_parents", classmethod(leaky))
    res = run(engine(tiny, refs), tree_requests(9))
    assert any(res[f"r{i}"].token_ids != refs[i][:n] for i, n in enumerate(MAX_TOKENS))


def test_no_compaction_planted_bug_is_caught(tiny, refs, monkeypatch):
    monkeypatch.setattr(llama_mod.KVCache, "compact", lambda self, slot, start, src: None)
    res = run(engine(tiny, refs), tree_requests(9))
    assert any(res[f"r{i}"].token_ids != refs[i][:n] for i, n in enumerate(MAX_TOKENS))


def test_smollm2_tree_greedy_equals_hf(smollm2, hf_greedy):
    prompts = [chat_ids(smollm2.tokenizer, c) for c in ("Name three colours.", "What is 2 + 2? Explain.")]
    refs = [hf_greedy(smollm2.model, p, 20) for p in prompts]
    oracle = TreeOracle({tuple(p): r + [0] * 40 for p, r in zip(prompts, refs)}, smollm2.model.config.vocab_size)
    eng = SpecEngine(LlamaRunner(smollm2.model), {"oracle": oracle}, tokenizer=smollm2.tokenizer,
                     eos_token_ids=smollm2.eos_token_ids, max_batch=2, max_len=128)
    reqs = [request(f"r{i}", p, "oracle", 6, max_tokens=20) for i, p in enumerate(prompts)]
    for r in reqs:
        r.speculation.tree = 9
    res = run(eng, reqs)
    assert [res[f"r{i}"].token_ids for i in range(2)] == refs
    assert all(res[f"r{i}"].stats.accepted_tokens > 0 for i in range(2))


# --------------------------------------------------------------------------- #
# Sampling down a tree (unseeded rows): exact, and a naive rule is not
# --------------------------------------------------------------------------- #
V8 = 8
N_DIST = 3000


class FixedTree(Drafter):
    """Deterministic trees on a vocabulary of 8: three children of the root (tokens 1, 2, 3),
    two children under each of them (tokens 4 and 5)."""
    name = "fixed"

    def propose(self, seqs: list[DraftSeq]) -> Proposal:
        toks = [1, 2, 3, 4, 5, 4, 5, 4, 5]
        par = [0, 0, 0, 1, 1, 2, 2, 3, 3]
        n = [min(len(toks), s.tree) for s in seqs]
        return Proposal(tokens=torch.tensor([toks] * len(seqs)), num_draft=n, parents=[par[:k] for k in n])

    def release(self, seq_id: int) -> None:
        pass


def naive_walk(logits, s, drafts, parents):
    """The planted bug: each child accepted with probability p(x), rejected children not removed."""
    from actors.acceptance import children, process
    from actors.sampling import sample

    kids = children(parents)
    path, cur = [], 0
    while True:
        p = process(logits[cur][None], [s])[0]
        for node in kids.get(cur, []):
            if float(torch.rand((), generator=s.gen)) < float(p[drafts[node - 1]] / p.sum()):
                path.append(node)
                cur = node
                break
        else:
            return path, int(sample(p[None], [s.gen])[0])


def first_two(target, monkeypatch, naive: bool) -> torch.Tensor:
    from actors.schema import Request

    monkeypatch.setattr(Request, "coupled", property(lambda self: False))  # the rejection rule, seeded
    if naive:
        monkeypatch.setattr(acceptance_mod, "walk_sampled", naive_walk)
    eng = SpecEngine(LlamaRunner(target.model), {"fixed": FixedTree()}, eos_token_ids=set(), max_batch=300,
                     max_len=16)
    reqs = [request(f"r{i}", [1, 5, 3, 6], "fixed", 2, max_tokens=3, temperature=1.0, seed=50_000 + i)
            for i in range(N_DIST)]
    for r in reqs:
        r.speculation.tree = 9
    res = run(eng, reqs)
    assert eng.stats.accepted_tokens > N_DIST // 4  # the tree was really walked
    return torch.tensor([res[f"r{i}"].token_ids[:2] for i in range(N_DIST)])


@pytest.fixture(scope="module")
def v8():
    from actors.models import LoadedModel, build_tiny

    target = LoadedModel(build_tiny(0, vocab_size=V8), None, "tiny8")
    ids = torch.tensor([[1, 5, 3, 6, t] for t in range(V8)])
    with torch.inference_mode():
        logp = target.model(ids).logits.double().log_softmax(-1)  # [V, 5, V]
    joint = (logp[0, 3][:, None] + logp[:, 4]).exp()  # P(t1, t2)
    return target, joint


@pytest.mark.parametrize("naive", [False, True], ids=["multi-draft-rule", "naive-rule"])
def test_tree_sampling_follows_the_target_law(v8, monkeypatch, naive):
    """3000 seeded requests (rejection rule forced): the joint law of the first two tokens,
    the second one coming out of the tree walk, matches the target's exact law for the
    multi-draft rule (p > 1e-3), and the naive rule is rejected (p < 1e-6). Seeds are fixed, so
    the outcome is deterministic for a torch build."""
    import scipy.stats

    target, joint = v8
    toks = first_two(target, monkeypatch, naive)
    counts = torch.bincount(toks[:, 0] * V8 + toks[:, 1], minlength=V8 * V8).double()
    exp = joint.flatten() * N_DIST
    small = exp < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    ex = torch.cat([exp[~small], exp[small].sum()[None]])
    p = float(scipy.stats.chisquare(obs.numpy(), ex.numpy() * obs.sum().item() / ex.sum().item()).pvalue)
    if naive:
        assert p < 1e-6, p
    else:
        assert p > 1e-3, p


@pytest.mark.parametrize("kind", ["ngram", "truncated:2", "truncated:4", "eagle"])
def test_drafters_propose_trees_losslessly(tiny, hf_greedy, kind):
    """The shipped drafters draft trees (EAGLE-2's dynamic expansion for model drafts and the
    head, a trie of matched continuations for n-gram); greedy output stays HF's, and a draft that
    IS the target (truncated:4) gets whole paths accepted."""
    from actors.drafters import ModelDrafter
    from actors.drafters.eagle import EagleDrafter, EagleHead

    if kind == "ngram":
        d = NgramDrafter()
    elif kind == "eagle":
        d = EagleDrafter(EagleHead(tiny.model, torch.arange(512)).eval(), "eagle", max_batch=4, max_len=128)
    else:
        d = ModelDrafter.truncated(tiny.model, int(kind.split(":")[1]), max_batch=4, max_len=128)
    eng = SpecEngine(LlamaRunner(tiny.model), {"d": d}, max_batch=4, max_len=128)
    prompts = PROMPTS[:3] + [[10, 11, 12, 13] * 4]
    reqs = [request(f"r{i}", p, "d", 5, max_tokens=20) for i, p in enumerate(prompts)]
    for r in reqs:
        r.speculation.tree = 12
    res = run(eng, reqs)
    for i, p in enumerate(prompts):
        assert res[f"r{i}"].token_ids == hf_greedy(tiny.model, p, 20, eos=None), (kind, i)
    if kind == "truncated:4":
        assert all(res[f"r{i}"].stats.mean_accepted_length > 2.5 for i in range(4))
    assert d.num_active() == 0
