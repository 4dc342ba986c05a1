"""Adaptive γ: the goodput rule picks long drafts when verification is nearly free and
acceptance is high, and switches speculation off when the pass is compute-bound and
drafts are mostly rejected; the engine stays exact under it."""
import pytest

from actors.drafters import ModelDrafter, NgramDrafter
from actors.engine import SpecEngine
from actors.gamma import AdaptiveGamma, PassCost
from actors.llama import LlamaRunner
from helpers import request, run


def trained(policy: AdaptiveGamma, name: str, accepted: int, gamma: int = 4, rows: int = 1, steps: int = 40):
    for _ in range(steps):
        policy.observe(name, [gamma] * rows, [accepted] * rows, draft_s=0.0)


def test_pass_cost_interpolates_and_extrapolates():
    c = PassCost([(1, 0.020), (8, 0.030), (16, 0.050)])
    assert c(1) == 0.020 and c(8) == 0.030
    assert c(4) == pytest.approx(0.020 + 0.010 * 3 / 7)
    assert c(32) == pytest.approx(0.050 + 0.020 * 16 / 8)  # last slope


def test_flat_cost_and_good_drafts_pick_full_gamma():
    """Bandwidth-bound: 5 tokens cost what 1 costs; every draft accepted -> draft γ_max."""
    p = AdaptiveGamma(PassCost([(1, 0.02), (64, 0.021)]), explore_every=1000)
    trained(p, "d", accepted=4)
    assert p.choose("d", 4, rows_with=1, rows_without=0) == 4


def test_compute_bound_and_bad_drafts_switch_speculation_off():
    """Cost linear in tokens (compute-bound, batch 8) and drafts nearly always rejected:
    any γ > 0 only adds verify work, so γ* = 0. A planted inverted rule (always γ_max)
    would fail this."""
    p = AdaptiveGamma(PassCost([(1, 0.001), (8, 0.008), (64, 0.064)]), explore_every=1000)
    trained(p, "d", accepted=0, rows=8)
    assert p.choose("d", 4, rows_with=8, rows_without=0) == 0


def test_middle_ground_and_exploration():
    """Per-position rates [1, 1, 0, 0]: positions 3-4 are never accepted, so γ* = 2; the
    explore step still drafts γ_max so the estimates stay current."""
    p = AdaptiveGamma(PassCost([(1, 0.010), (40, 0.050)]), explore_every=5)
    trained(p, "d", accepted=2, rows=8)
    picks = [p.choose("d", 4, rows_with=8, rows_without=0) for _ in range(10)]
    assert picks.count(4) == 2 and set(picks) == {2, 4}
    assert p.rates("d")[:2] == pytest.approx([1.0, 1.0], abs=1e-2) and p.rates("d")[2] < 0.05


def test_unseen_drafter_explores_first():
    p = AdaptiveGamma(PassCost([(1, 0.001), (64, 0.064)]))
    assert p.choose("new", 3, rows_with=4, rows_without=0) == 3


def test_engine_with_adaptive_gamma_stays_exact(tiny, hf_greedy):
    """Whatever γ the policy picks per step, greedy output equals HF generate."""
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [42], list(range(10, 30))]
    refs = [hf_greedy(tiny.model, p, 20, eos=None) for p in prompts]
    drafters = {"ngram": NgramDrafter(),
                "truncated:2": ModelDrafter.truncated(tiny.model, 2, max_batch=4, max_len=64)}
    eng = SpecEngine(LlamaRunner(tiny.model), drafters, max_batch=4, max_len=64, adaptive_gamma=True)
    for draft in ("ngram", "truncated:2"):
        res = run(eng, [request(f"{draft}{i}", p, draft, 4, max_tokens=20) for i, p in enumerate(prompts)])
        assert [res[f"{draft}{i}"].token_ids for i in range(3)] == [r[:20] for r in refs]
    assert eng.gamma_policy.est["truncated:2"].steps > 0
