"""Acceptance rules as pure functions (actors/acceptance.py), without an engine, a model or a KV
cache: hand-made logits over a vocabulary of 8, rows of real `Sequence`s, and the verdicts.

The sampled rules are checked against the law they must keep (the first committed token is
distributed as the target's p, whatever the draft proposed), and each check is shown to fail
on a planted bug of the kind these rules invite."""
from __future__ import annotations

import pytest
import scipy.stats
import torch

import actors.acceptance as acceptance_mod
from actors.acceptance import Row, VerifyBatch, accept, coupled_row_scores, process
from actors.sampling import new_generator, sample
from actors.schema import Request, SamplingParams, SpeculationParams
from actors.sequence import Sequence, mode_of

V = 8
N = 4000


def seq(temperature: float = 0.0, seed: int | None = None, acceptance: str = "lossless", gen_seed: int = 0,
        tokens=(1, 2, 3)) -> Sequence:
    req = Request("r", list(tokens), SamplingParams(max_tokens=16, temperature=temperature, seed=seed),
                  SpeculationParams(acceptance=acceptance))
    return Sequence(key=0, req=req, slot=0, tokens=list(tokens), num_prompt=len(tokens),
                    seed=seed if seed is not None else gen_seed, gen=new_generator("cpu").manual_seed(gen_seed),
                    text=None, mode=mode_of(req))


def peaked(choices: list[int]) -> torch.Tensor:
    """logits [len(choices), V] whose argmax at position j is choices[j]."""
    out = torch.zeros(len(choices), V)
    for j, c in enumerate(choices):
        out[j, c] = 5.0
    return out


def verdicts(rows: list[Row], logits: torch.Tensor):
    return accept(logits, VerifyBatch(rows).to_device("cpu"))


def test_greedy_chain_accepts_the_matching_prefix_then_the_targets_token():
    # the target would say 4, 5, 6, 7 after the root; drafts 4, 5, 0: two accepted, then 6
    logits = torch.stack([peaked([4, 5, 6, 7]), peaked([1, 1, 1, 1])])  # row 1: drafts nothing
    v = verdicts([Row(seq(), [4, 5, 0]), Row(seq(), [])], logits)
    assert (v[0].path, v[0].tokens) == ([1, 2], [4, 5, 6])
    assert (v[1].path, v[1].tokens) == ([], [1])


def test_greedy_tree_walks_the_child_equal_to_the_targets_choice():
    # root -> {1: token 4, 2: token 1}, node 1 -> {3: token 2, 4: token 5}; node 4 -> {5: token 6}
    drafts, parents = [4, 1, 2, 5, 6], [0, 0, 1, 1, 4]
    choice = [4, 5, 0, 0, 6, 3]  # per feed index: the target's argmax after that node
    v = verdicts([Row(seq(), drafts, parents)], peaked(choice)[None])
    assert (v[0].path, v[0].tokens) == ([1, 4, 5], [4, 5, 6, 3])


def test_coupled_rows_commit_the_noise_argmax_whatever_was_drafted():
    s = seq(temperature=1.0, seed=7)
    logits = torch.randn(1, 4, V, generator=torch.Generator().manual_seed(0))
    want = coupled_row_scores(logits, [s], 4).argmax(-1)[0].tolist()  # the coupled sample at each position
    full = verdicts([Row(s, want[:3])], logits)[0]
    assert full.tokens == want  # all three drafts are the samples: accepted, then the bonus
    wrong = [want[0], (want[1] + 1) % V, want[2]]
    part = verdicts([Row(seq(temperature=1.0, seed=7), wrong)], logits)[0]
    assert part.tokens == want[:2]  # the second draft differs from the sample: the sample replaces it


@pytest.mark.parametrize("k,accepted", [(1, 0), (2, 1)])
def test_topk_rule_accepts_a_draft_among_the_k_likeliest(k, accepted):
    logits = torch.tensor([[4.0, 3.0, 0, 0, 0, 0, 0, 0], [0, 0, 4.0, 0, 0, 0, 0, 0]])  # rank 2 for token 1
    v = verdicts([Row(seq(temperature=1.0, acceptance=f"topk:{k}"), [1])], logits[None])[0]
    assert len(v.path) == accepted and v.tokens[:accepted] == [1][:accepted]


def first_token_law(rows_for, logits: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Chi-square p-value of the first committed token over N unseeded rows against p."""
    counts = torch.zeros(V)
    for i in range(N):
        row = rows_for(i)
        v = verdicts([row], logits[None, :len(row.drafts) + 1])[0]
        counts[v.tokens[0]] += 1
    p = torch.softmax(logits[0].double(), -1)
    expected = p * N
    keep = expected > 5
    return float(scipy.stats.chisquare(counts[keep], expected[keep] * counts[keep].sum() / expected[keep].sum())
                 .pvalue), counts


LOGITS = torch.tensor([[1.0, 0.2, 0.8, 1.5, -0.5, 0.3, 1.2, 0.0]] * 4)


def test_sampled_chain_keeps_the_targets_law():
    p, _ = first_token_law(lambda i: Row(seq(temperature=1.0, gen_seed=i), [3, 6]), LOGITS)
    assert p > 1e-3


def test_sampled_chain_law_check_catches_accepting_every_draft(monkeypatch):
    def accept_all(p_target, q, draft_tokens, num_draft, generators):
        out = torch.cat([draft_tokens, sample(p_target[:, -1], generators)[:, None]], 1)
        return num_draft.clone(), out
    monkeypatch.setattr(acceptance_mod, "verify_sampled", accept_all)
    p, counts = first_token_law(lambda i: Row(seq(temperature=1.0, gen_seed=i), [3, 6]), LOGITS)
    assert p < 1e-9 and counts[3] == N


def test_sampled_tree_keeps_the_targets_law():
    p, _ = first_token_law(lambda i: Row(seq(temperature=1.0, gen_seed=i), [3, 6, 0], [0, 0, 1]), LOGITS)
    assert p > 1e-3


def test_sampled_tree_law_check_catches_not_removing_rejected_children(monkeypatch):
    """The planted bug: each child accepted with probability p(x) under the unrenormalised p."""
    def naive(logits, s, drafts, parents):
        kids = acceptance_mod.children(parents)
        p = process(logits[0][None], [s])[0]
        for node in kids[0]:
            if float(torch.rand((), generator=s.gen)) < float(p[drafts[node - 1]] / p.sum()):
                return [node], drafts[node - 1]
        return [], int(sample(p[None], [s.gen])[0])
    monkeypatch.setattr(acceptance_mod, "walk_sampled", naive)
    p, _ = first_token_law(lambda i: Row(seq(temperature=1.0, gen_seed=i), [3, 6, 0], [0, 0, 1]), LOGITS)
    assert p < 1e-9
