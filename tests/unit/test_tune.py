"""`specd tune`: the prediction's arithmetic, and its profile reaching the speculation policy.

The formula tests use records whose frequencies give exact answers: at a constant acceptance α
the per-position formula must reduce to Leviathan's (1 - α^(γ+1)) / (1 - α), and a pass costs
what its widest row costs. The end-to-end test tunes the tiny model (a few seconds), then builds
an engine (profile found in the store) and a verifier replica from a cluster config naming the
profile, and checks that their policies hold the profile's numbers, not the load-time
calibration's and the cautious default prior that they hold when no profile matches.
"""
import json

import pytest
import torch

from actors.build import build_engine
from actors.calibrate import PassCost
from actors.engine import SpecEngine
from actors.hardware import hardware
from actors.llama import LlamaRunner
from actors.policy import AUTO_MAX_GAMMA, PRIOR_ACCEPT, PROFILE_WEIGHT
from actors.schema import Request, SamplingParams, SpeculationParams
from actors.tune_profile import TuneProfile, matching, store_path
from specd.tune import DraftRecord, StepOverhead, predict_tps, run_logged, tune


def test_per_position_formula_reduces_to_leviathan_at_constant_acceptance():
    """α = 1/2 at every position: of 8 steps drafting 3 tokens, 4 accept none, 2 one, 1 two, 1 all."""
    rec = DraftRecord(drafted=[3] * 8, accepted=[0] * 4 + [1] * 2 + [2, 3])
    assert rec.conditional(3) == [0.5, 0.5, 0.5]
    for gamma in range(4):
        assert rec.expected_tokens(gamma) == pytest.approx((1 - 0.5 ** (gamma + 1)) / (1 - 0.5))


def test_acceptance_is_conditional_on_reaching_and_drafting_the_position():
    """Position 2 is reached only by the step that accepted position 1; position 3 by none
    (a drafter that proposed 2 tokens), so it keeps the policy's prior."""
    rec = DraftRecord(drafted=[2, 2], accepted=[2, 0])
    assert rec.conditional(3) == [0.5, 1.0, PRIOR_ACCEPT]
    assert rec.mean_accepted() == 1.0 and DraftRecord([0, 4], [0, 2]).mean_accepted() == 2.0


def test_a_pass_costs_what_its_widest_row_costs():
    """Half the steps draft nothing (n-gram without a match), half draft 4; t(B, T) = T. One row:
    E[t] = (1 + 5) / 2. Two rows: the pass is 1 token wide only when both drafted nothing (1/4)."""
    cost = PassCost({(b, t): float(t) for b in (1, 2) for t in (1, 5)})
    rec = DraftRecord(drafted=[0, 4], accepted=[0, 4])
    assert rec.expected_pass_s(cost, 1, 4) == pytest.approx(3.0)
    assert rec.expected_pass_s(cost, 2, 4) == pytest.approx(0.25 * 1 + 0.75 * 5)
    assert rec.expected_pass_s(cost, 2, 0) == pytest.approx(1.0)
    # tokens/s = rows · E(γ) / (E[t] + drafting): E(4) = 1 + 0.5 · 4
    assert predict_tps(cost, rec, 2, 4, draft_s=1.0) == pytest.approx(2 * 3.0 / (4.0 + 1.0))
    assert predict_tps(cost, None, 2, 0, draft_s=0.0) == pytest.approx(2 / 1.0)


def test_step_overhead_is_fitted_and_charged_to_every_step():
    """The engine's cost beyond pass and drafting, o = 1 ms + 0.5 ms/row + 2 ms while drafting
    + 0.1 ms per row and draft position, is recovered from steps that cost exactly that, and a
    prediction charges it: a wide draft that looked free no longer does."""
    true = StepOverhead((1e-3, 5e-4, 2e-3, 1e-4))
    samples = [(b, w, d, true(b, w, d)) for b in (1, 3, 8) for w in (0, 2, 6) for d in (False, True)]
    fit = StepOverhead.fit(samples)
    assert fit.coef == pytest.approx(true.coef, abs=1e-9)
    cost = PassCost({(b, t): 0.01 for b in (1, 8) for t in (1, 7)})  # a wider pass costs nothing
    rec = DraftRecord(drafted=[6] * 4, accepted=[1] * 4)  # 2 tokens per pass, always 6 drafted
    assert predict_tps(cost, rec, 8, 6, 0.0, fit) == pytest.approx(8 * 2 / (0.01 + true(8, 6, True)))
    assert predict_tps(cost, None, 8, 0, 0.0, fit) == pytest.approx(8 / (0.01 + true(8, 0, False)))
    assert predict_tps(cost, rec, 8, 6, 0.0) > predict_tps(cost, rec, 8, 6, 0.0, fit)


def test_step_overhead_never_fits_a_negative_cost():
    """Steps whose overhead falls as drafts widen (noise, or a cheaper path at some width) must
    not fit a negative per-position term: unconstrained least squares would, and would then
    charge a lone row drafting a wide draft more than any step ever cost."""
    samples = [(b, 0, False, 1e-3) for b in (1, 4, 8)]
    samples += [(8, w, True, 4e-3 - 2e-4 * w) for w in (1, 2, 4, 6) for _ in range(3)]
    import numpy as np

    x = np.array([[1.0, b, float(d), b * w] for b, w, d, _ in samples])
    free = np.linalg.lstsq(x, np.array([s for *_, s in samples]), rcond=None)[0]
    assert free[3] < 0  # these samples do pull an unconstrained fit's per-position term negative
    fit = StepOverhead.fit(samples)
    assert fit(1, 6, True) <= max(s for *_, s in samples)
    assert fit(8, 1, True) == pytest.approx(sum(s for b, w, d, s in samples if d) / 12, rel=0.2)


def test_sweep_times_the_full_batch_decode_steps_only(tiny):
    """The sweep compares against a steady-state prediction, so it counts only the steps where
    every row is past its prefill and none has finished. Two rows of 5 and 8 tokens, plain
    decoding: the first step prefills both (2 tokens each here), the next three decode both (the
    short row ends in the third), the last three the long row alone. Counting the prefill step,
    or the steps after the short row left, gives 10 tokens instead of 6."""
    eng = SpecEngine(LlamaRunner(tiny.model), {}, eos_token_ids=set(), max_batch=2, max_len=64)
    reqs = [Request(f"r{n}", [5, 6, 7, 8], SamplingParams(max_tokens=n), SpeculationParams(draft="none"))
            for n in (5, 8)]
    run = run_logged(eng, reqs)
    assert run.tokens == 13
    assert run.decode_tokens == 6
    assert run.decode_s > 0


def test_tune_writes_a_profile_that_the_engine_and_a_verifier_use(tmp_path, monkeypatch):
    from cluster.config import ClusterConfig
    from cluster.verifier import VerifierServer

    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "cache"))  # the profile store and calibrations
    out = tmp_path / "out"
    report = tune("tiny", ("ngram",), "fp32", "cpu", batches=(1, 2), gammas=(0, 1, 2), tree_budgets=(4,), limit=2,
                  max_tokens=8, reps=1, out=out, progress=False)
    stored = store_path(json.loads((out / "profile-ngram.json").read_text())["key"])
    assert {p.rsplit("/", 1)[-1] for p in report["drafts"]["ngram"]["profiles"]} == {"profile-ngram.json",
                                                                                    stored.name}
    prof = TuneProfile.from_json(json.loads(stored.read_text()))
    assert prof.key["hardware"] == hardware("cpu") and prof.key["quant"] == "none"
    assert len(prof.accept) == AUTO_MAX_GAMMA and set(prof.step_s) == {1, 2} and set(prof.tree) == {4}
    assert set(prof.tree_row_s) == {4} and prof.tree_row_s[4] > 0
    assert (out / "tune.png").stat().st_size > 0 and "predicted best" in (out / "tune.txt").read_text()
    assert set(report["drafts"]["ngram"]["by_batch"]) == {1, 2}
    # the prompts repeat themselves: the n-gram drafter's measured acceptance is not the cautious prior
    assert prof.accept[0] > 2 * PRIOR_ACCEPT

    def uses_profile(eng, name: str) -> bool:
        e = eng.policy.estimate(name)
        return (eng.policy.cost.points == prof.pass_cost.points and e.prior == prof.accept
                and e.prior_weight == PROFILE_WEIGHT and e.step_s == prof.step_s[1]
                and e.tree_len == {4: (prof.tree[4] * PROFILE_WEIGHT, PROFILE_WEIGHT)}
                and e.tree_row_s == prof.tree_row_s
                and eng.policy.state()["profiled_drafters"] == [name])

    # an engine on this machine finds it in the store
    eng = build_engine("tiny", ["ngram"], "fp32", max_batch=2, max_len=128, device="cpu").engine
    assert uses_profile(eng, "ngram") and eng.info["tune_profiles"] == {"ngram": str(stored)}
    curve = eng.policy.estimate("ngram").accept_curve(lcb=False)
    assert curve[1] == pytest.approx(prof.accept[0] * prof.accept[1])

    # none matches (another machine's, or an empty store): the load-time calibration and the cautious prior
    other = {**prof.key["hardware"], "name": "another accelerator"}
    assert matching(other, "tiny", "fp32", {"ngram": "ngram"}) == {}
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "empty"))
    eng = build_engine("tiny", ["ngram"], "fp32", max_batch=2, max_len=128, device="cpu").engine
    e = eng.policy.estimate("ngram")
    assert not uses_profile(eng, "ngram") and eng.policy.cost.points != prof.pass_cost.points
    assert e.prior == [PRIOR_ACCEPT] * AUTO_MAX_GAMMA and e.step_s is None and eng.info["tune_profiles"] == {}

    # a verifier pool whose config names the profile directory (the store is still empty): the draft
    # is matched by its spec, whatever its name in the config
    cfg = ClusterConfig.model_validate({
        "model": "tiny", "dtype": "fp32", "device": "cpu", "max_len": 128,
        "router": {"max_tokens": 64, "default_max_tokens": 32},
        "verifier": {"max_batch": 2, "torch_threads": torch.get_num_threads(), "tune_profile": str(out)},
        "drafts": [{"name": "lookup", "spec": "ngram"}]})
    server = VerifierServer(cfg.model_dump())
    assert uses_profile(server.engine, "lookup")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_engine("tiny", ["ngram"], "fp32", max_batch=2, max_len=128, device="cpu",
                     tune_profile=str(tmp_path / "missing.json"))


def test_calibration_takes_the_prompt_file_a_user_writes(tmp_path):
    """A file of chat messages without the committed set's "kind" field fills the calibration (it
    gave 0 prompts, "cannot fill a batch of 8"); the committed set still alternates chat and code."""
    import json

    from actors.models import load_tokenizer
    from specd.data import load_prompts
    from specd.tune import calibration_prompts

    tok = load_tokenizer("smollm2")
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Tell me about topic {i}"}]})
                              for i in range(10)))
    assert len(calibration_prompts(tok, str(path), 8)) == 8
    from actors.text import encode_prompt
    from specd.data import mixed

    first = mixed(load_prompts(), 4)  # the committed set: chat and code in turn
    assert [p["kind"] for p in first] == ["chat", "code", "chat", "code"]
    assert calibration_prompts(tok, None, 4) == [encode_prompt(tok, prompt=p.get("prompt"), messages=p.get("messages"))
                                                 for p in first]
