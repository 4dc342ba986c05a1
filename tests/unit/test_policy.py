"""The speculation policy (`gamma: auto`) and the calibration it reads.

Synthetic cost curves stand for the two kinds of machine: one where a pass over many tokens
costs about as much as over one (native bf16 matmuls, a GPU), one where it costs about T
times as much (bf16 on an AVX2-only CPU). The policy must speculate on the first when drafts
are accepted, and switch off on the second, in both directions, and the engine on the tiny
model must follow it while its output stays exact. Seeded sampled requests give the same tokens
whatever γ the policy chose and whatever shares their batch (coupled acceptance).
"""
import pytest

from actors.calibrate import PassCost, choose_dtype, grid, measure
from actors.drafters import ModelDrafter, NgramDrafter
from actors.engine import SpecEngine
from actors.hardware import hardware
from actors.llama import LlamaRunner
from actors.policy import AUTO_MAX_GAMMA, SpeculationPolicy
from actors.schema import Request, SamplingParams, SpeculationParams
from helpers import rand_tokens, request, run


def flat(base: float = 0.010) -> PassCost:
    """A multi-token pass costs 2% more per extra token (bandwidth-bound)."""
    return PassCost({(b, t): base * b ** 0.2 * (1 + 0.02 * (t - 1)) for b, t in grid(8)})


def steep(base: float = 0.010) -> PassCost:
    """Compute-bound, like bf16 on an AVX2-only CPU: each extra token in a pass costs 0.7 of one
    more pass (2.6x at T=5 was measured there), and rows add up."""
    return PassCost({(b, t): base * b * (1 + 0.7 * (t - 1)) for b, t in grid(8)})


def trained(policy: SpeculationPolicy, drafter: str, alpha: float, drafted: int = 4, steps: int = 200):
    """Observe `steps` verify steps whose drafts are each accepted with probability alpha (i.i.d.)."""
    import random

    rng = random.Random(0)
    for _ in range(steps):
        accepted = next((j for j in range(drafted) if rng.random() >= alpha), drafted)
        policy.observe_verified(drafter, [drafted], [accepted])


def test_pass_cost_grid_interpolates_and_extrapolates():
    c = PassCost({(1, 1): 1.0, (1, 3): 3.0, (4, 1): 2.0, (4, 3): 6.0})
    assert c(1, 1) == 1.0 and c(4, 3) == 6.0
    assert c(1, 2) == pytest.approx(2.0) and c(2, 1) == pytest.approx(1 + 1 / 3)
    assert c(1, 5) == pytest.approx(5.0)  # beyond the grid: the last segment's slope
    assert PassCost.from_json(c.to_json()).points == c.points


@pytest.mark.parametrize("alpha,expect_on", [(0.95, True), (0.4, True), (0.0, False)])
def test_where_a_wide_pass_is_cheap_speculate_if_drafts_are_accepted(alpha, expect_on):
    p = SpeculationPolicy(flat())
    trained(p, "d", alpha)
    g = p.choose([("d", AUTO_MAX_GAMMA, True)])[0]
    assert (g > 0) == expect_on
    if alpha > 0.9:
        assert g >= 4


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.38])
def test_where_a_wide_pass_costs_its_tokens_switch_off(alpha):
    """Compute-bound (steep): at the shipped head's α ≈ 0.38, a wider pass never pays."""
    p = SpeculationPolicy(steep())
    trained(p, "d", alpha)
    assert p.choose([("d", AUTO_MAX_GAMMA, True)]) == [0]


def test_steep_machine_still_speculates_when_nearly_everything_is_accepted():
    p = SpeculationPolicy(steep())
    trained(p, "d", alpha=0.97, drafted=8)
    assert p.choose([("d", AUTO_MAX_GAMMA, True)])[0] > 0


def test_thin_evidence_never_switches_it_on_and_a_fixed_row_keeps_its_gamma():
    p = SpeculationPolicy(flat())
    assert p.choose([("d", 8, True), ("e", 3, False), (None, 0, False)]) == [0, 3, 0]


def test_acceptance_falling_switches_it_off_again():
    p = SpeculationPolicy(flat())
    trained(p, "d", alpha=0.9)
    assert p.choose([("d", 8, True)])[0] > 0
    trained(p, "d", alpha=0.0, steps=300)
    assert p.choose([("d", 8, True)]) == [0]


def test_load_shrinks_gamma_on_a_machine_that_batches_into_compute():
    """The same acceptance at batch 1 pays on a bandwidth-bound pass but not when 8 rows make the
    pass compute-bound (cost ∝ B·T beyond one row)."""
    cost = PassCost({(b, t): 0.010 * max(1.0, b * t / 4) for b, t in grid(8)})
    p = SpeculationPolicy(cost)
    trained(p, "d", alpha=0.5)
    alone = p.choose([("d", 8, True)])[0]
    loaded = p.choose([("d", 8, True)] * 8)[0]
    assert alone > 0 and loaded < alone


def test_shadow_drafts_cost_what_they_measured_within_the_budget():
    """A shadow call drafts every row after catching up on the tokens committed since the last
    one, so it can cost far more than γ draft steps: the shadow period must follow the measured
    call, keeping shadow time within its budget (1% of target time) of the steps it spans. A lookup
    drafter (n-gram: no model time) shadows every step while its measured call fits the budget, and
    less often where it does not."""
    p = SpeculationPolicy(flat())  # a one-row pass: 10 ms
    p.observe_draft_time("d", 8, 8 * 0.0005)  # 0.5 ms per drafted position: 4 ms for γ=8

    def shadows(steps: int, d: str = "d", free: bool = False) -> int:
        return sum(p.wants_shadow(d, free=free) for _ in range(steps))
    assert shadows(400) == 10  # 4 ms / (1% of 10 ms): one step in 40
    p.observe_shadow_time("d", 0.040)  # but a real shadow call took 40 ms (its catch-up)
    n = shadows(2000)
    assert n == 5 and n * 0.040 <= p.shadow_budget * 2000 * p.last_pass_s * (1 + 1e-9)
    assert shadows(10, "n", free=True) == 10  # a lookup drafter not yet measured: every step
    p.observe_shadow_time("n", 0.00005)  # 0.05 ms: within 1% of a 10 ms pass
    assert shadows(10, "n", free=True) == 10
    p.observe_shadow_time("n", 0.001)  # measured at 1 ms (EMA): 10% of the pass
    assert 0 < shadows(200, "n", free=True) * p.estimate("n").shadow_s <= p.shadow_budget * 200 * p.last_pass_s


def test_a_tree_costs_what_drafting_it_measured():
    """A token tree is weighed against the chain at its drafting cost: by the model (1.5 x depth
    chain steps) until measured, then per row as measured. Here 8-node trees accept 5 tokens
    and win while cheap by the model; measured at 30 ms a row (a 10 ms pass), the chain wins.
    A policy that keeps the model's charge (as it did) keeps choosing the tree."""
    p = SpeculationPolicy(flat())
    trained(p, "d", 0.8)
    p.observe_draft_time("d", 4, 4 * 0.001)  # 1 ms per chain position
    for _ in range(20):
        p.observe_tree("d", [8], [5])
    rows = [("d", 8, True)]
    p.choose(rows, trees={"d"})
    assert p.tree_for("d") == 8
    for _ in range(20):
        p.observe_tree_time("d", 8, 1, 0.030)
    assert p.choose(rows, trees={"d"})[0] > 0 and p.tree_for("d") == 0
    assert p.state()["drafters"]["d"]["tree_draft_ms_per_row"] == {8: pytest.approx(30.0)}


def test_engine_reports_tree_drafting_per_row_and_chains_per_position(tiny):
    """The engine tells the policy what a tree call cost apart from chain steps: requests asking
    for trees (tree=4) leave a per-row tree cost and no chain cost; a chain request, the reverse."""
    eng = engine(tiny, flat())
    tree = SpeculationParams(draft="truncated:2", gamma=3, tree=4)
    run(eng, [Request(f"t{i}", RANDOM[:8 + i], SamplingParams(max_tokens=10), tree) for i in range(2)])
    est = eng.policy.est["truncated:2"]
    assert set(est.tree_row_s) == {4} and est.tree_row_s[4] > 0 and est.step_s is None
    run(eng, [request("c", RANDOM, "truncated:2", 3, max_tokens=10)])
    assert est.step_s is not None and est.step_s > 0


def test_dtype_choice_follows_the_expected_batch():
    bf16 = PassCost({(b, t): 0.040 * b * t for b, t in grid(8)}, "bf16")  # no native bf16: compute-bound
    fp32 = PassCost({(b, t): 0.070 * (1 + 0.2 * (b * t - 1)) for b, t in grid(8)}, "fp32")
    assert choose_dtype({"bf16": bf16, "fp32": fp32}, 1)[0] == "bf16"
    dt, why = choose_dtype({"bf16": bf16, "fp32": fp32}, 8)
    assert dt == "fp32" and "batch 8" in why


def test_calibration_measures_the_grid_and_the_hardware_is_recorded(tiny):
    cost = measure(LlamaRunner(tiny.model), max_batch=4, reps=1)
    assert set(cost.points) == set(grid(4)) and all(s > 0 for s in cost.points.values())
    hw = hardware()
    assert hw["device"] == "cpu" and hw["threads"] >= 1 and "name" in hw and "flags" in hw


def test_calibration_on_a_busy_machine_is_measured_again_and_not_cached(tiny, tmp_path, monkeypatch, caplog):
    """A calibration while another process keeps a core busy (a real busy loop here) is measured
    twice and not cached, with a warning in the load log; a quiet one is cached and read back
    (the quiet machine is simulated: nothing in a test run can promise one)."""
    import subprocess
    import sys
    import time

    from actors import calibrate as C

    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    runner = LlamaRunner(tiny.model)
    calls = []
    real = C.measure
    def timed(*a, **k):  # a tiny model's grid takes milliseconds: /proc counts CPU in 10 ms ticks
        calls.append(1)
        time.sleep(0.3)
        return real(*a, **k)
    monkeypatch.setattr(C, "measure", timed)
    burner = subprocess.Popen([sys.executable, "-c", "print('up', flush=True)\nwhile True: pass"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert burner.stdout.readline().strip() == "up"  # spinning before the calibration starts
        with caplog.at_level("WARNING", logger="specd"):
            busy = C.calibrated(runner, "tiny", 2, reps=1)
    finally:
        burner.kill()
        burner.wait()
    assert len(calls) == 2 and busy.meta["busy_cores"] > C.BUSY_CORES
    assert not list(tmp_path.rglob("*.json")) and "not cached" in caplog.text

    calls.clear()
    monkeypatch.setattr(C, "others_busy_s", lambda: (0.0, 0.0))  # a quiet machine
    quiet = C.calibrated(runner, "tiny", 2, reps=1)
    assert len(calls) == 1 and quiet.meta["busy_cores"] == 0.0 and len(list(tmp_path.rglob("*.json"))) == 1
    again = C.calibrated(runner, "tiny", 2, reps=1)
    assert len(calls) == 1 and "cached" in again.meta and again.points == quiet.points


# --------------------------------------------------------------------------- #
# The engine under the policy (tiny model, injected cost curves)
# --------------------------------------------------------------------------- #
REPETITIVE = [10, 11, 12, 13, 14, 15] * 6
RANDOM = rand_tokens(20, 3)


def engine(tiny, cost: PassCost, max_batch: int = 8, other=None) -> SpecEngine:
    drafters = {"ngram": NgramDrafter(),
                "truncated:2": ModelDrafter.truncated(tiny.model, 2, max_batch=max_batch, max_len=160)}
    if other is not None:  # a separate random model: its drafts are (almost) never accepted
        drafters["other"] = ModelDrafter(LlamaRunner(other.model), "other", max_batch=max_batch, max_len=160)
    return SpecEngine(LlamaRunner(tiny.model), drafters, max_batch=max_batch, max_len=160, pass_cost=cost)


def test_engine_speculates_where_it_pays_and_stays_exact(tiny, hf_greedy):
    """Flat costs, a prompt the n-gram drafter continues well: the policy turns speculation on
    (from shadow drafts, before verifying a single draft) and the output is HF's."""
    eng = engine(tiny, flat())
    out = run(eng, [request("r", REPETITIVE, "ngram", "auto", max_tokens=60)])["r"]
    assert out.token_ids == hf_greedy(tiny.model, REPETITIVE, 60, eos=None)
    st = eng.policy.state()["drafters"]["ngram"]
    assert st["speculated_share"] > 0.5 and out.stats.accepted_tokens > 20
    assert out.stats.target_passes < 40  # fewer passes than tokens


def test_engine_switches_off_where_it_does_not_pay_and_stays_exact(tiny, tiny_draft, hf_greedy):
    """Steep costs and a draft model that disagrees with the target: the policy keeps it off
    from the start (thin evidence never switches it on), learns from shadow drafts within their
    budget that it would not pay, and every step is a plain one; the output is HF's."""
    eng = engine(tiny, steep(), other=tiny_draft)
    out = run(eng, [request("r", RANDOM, "other", "auto", max_tokens=60)])["r"]
    assert out.token_ids == hf_greedy(tiny.model, RANDOM, 60, eos=None)
    st = eng.policy.state()["drafters"]["other"]
    assert st["speculated_share"] == 0 and st["shadow_drafts"] >= 1 and st["shadow_call_ms"] > 0
    assert out.stats.draft_tokens == 0 and out.stats.target_passes == 59


def test_seeded_tokens_do_not_depend_on_gamma_drafter_or_batch(tiny):
    """Coupled acceptance: a seeded sampled request gives the same tokens alone without a
    draft, with γ=auto, with a fixed γ and another drafter, and at concurrency 8 beside other
    sampled, greedy and speculative requests."""
    params = dict(max_tokens=40, temperature=0.9, top_p=0.95, seed=1234)
    ref = run(engine(tiny, flat()), [request("x", RANDOM, **params)])["x"].token_ids
    for draft, gamma in [("ngram", "auto"), ("truncated:2", 4), ("truncated:2", "auto"), ("ngram", 7)]:
        alone = run(engine(tiny, flat()), [request("x", RANDOM, draft, gamma, **params)])["x"].token_ids
        others = [request(f"o{i}", rand_tokens(5 + i, 40 + i), ["ngram", "truncated:2", None][i % 3],
                          [3, "auto", 0][i % 3], max_tokens=10 + 5 * i, temperature=[0.0, 1.0][i % 2], seed=i)
                  for i in range(7)]
        busy = run(engine(tiny, flat()), others[:3] + [request("x", RANDOM, draft, gamma, **params)] + others[3:])
        assert alone == ref and busy["x"].token_ids == ref, (draft, gamma)


def test_coupled_drafts_use_the_target_s_noise(tiny):
    """A draft that IS the target (all 4 layers) must have every seeded sampled draft accepted:
    drafter and verifier draw the same Gumbel noise for the same position. (Regression: the
    drafter sampled with its own generator and coupled acceptance fell to ~0.)"""
    eng = SpecEngine(LlamaRunner(tiny.model), {"self": ModelDrafter.truncated(tiny.model, 4, max_batch=2, max_len=160)},
                     max_batch=2, max_len=160, pass_cost=flat())
    out = run(eng, [request("x", RANDOM, "self", 4, max_tokens=30, temperature=0.9, seed=5)])["x"]
    assert out.stats.draft_tokens > 10 and out.stats.acceptance_rate == 1.0


def test_one_observation_switches_no_tree_on():
    """An unmeasured tree is judged at the chain's lower confidence bound, as chains are: after one
    fully matched shadow draft, 8 rows on a machine where width costs 15% a token get at most a
    short chain, not a tree (judged at the mean, a 4-node tree was chosen: passes of 40 tokens)."""
    cost = PassCost({(b, t): 0.010 * b ** 0.5 * (1 + 0.15 * (t - 1)) for b, t in grid(8)})
    p = SpeculationPolicy(cost)
    p.observe_shadow("d", 8, 8)
    g = p.choose([("d", 8, True)] * 8, {"d"})
    assert p.tree_for("d") == 0 and g[0] <= 1


def test_measured_throughput_overrules_the_model():
    """Where steps that speculated realize half of their predicted rate and steps that did not
    realize all of theirs, the model's 'speculate' is discounted by that ratio and speculation goes
    off; before there is evidence of both kinds, the model alone decides, and once plain steps
    have run a while the old shortfall fades and it tries again."""
    p = SpeculationPolicy(flat())
    trained(p, "d", alpha=0.6)
    trained(p, "e", alpha=0.0)
    on, off = [("d", 8, True)], [("e", 8, True)]
    assert p.choose(on)[0] > 0 and p.choose(off) == [0] and p.discount() == 1.0
    for _ in range(4):  # evidence of 4 steps of each kind (the discount waits for 3)
        assert p.choose(on)[0] > 0
        p.observe_step(5, 10 / p._predicted[1])  # half the predicted tokens per second
        p.choose(off)
        p.observe_step(10, 10 / p._predicted[1])  # exactly the prediction
    assert p.discount() == pytest.approx(0.5, abs=0.03)
    assert p.choose(on) == [0]
    for _ in range(300):  # plain steps that realize their prediction: the old shortfall fades
        p.choose(off)
        p.observe_step(10, 10 / p._predicted[1])
    assert p.discount() > 0.95 and p.choose(on)[0] > 0


def test_a_shortfall_at_one_batch_size_does_not_switch_off_another():
    """The discount is kept per batch size class: speculative steps of 8 rows that realize half their
    prediction switch 8-row speculation off, and single-row steps (which realized theirs) keep it."""
    p = SpeculationPolicy(flat())
    trained(p, "d", alpha=0.6)
    trained(p, "e", alpha=0.0)
    for rows, realized in ((8, 0.5), (1, 1.0)):
        on, off = [("d", 8, True)] * rows, [("e", 8, True)] * rows
        for _ in range(4):
            assert p.choose(on)[0] > 0
            p.observe_step(10 * realized, 10 / p._predicted[1])
            p.choose(off)
            p.observe_step(10, 10 / p._predicted[1])
    assert p.discount(8) == pytest.approx(0.5, abs=0.03) and p.discount(1) == pytest.approx(1.0)
    assert p.choose([("d", 8, True)] * 8) == [0] * 8 and p.choose([("d", 8, True)])[0] > 0


def test_shadow_budget_follows_what_the_drafter_could_gain():
    """A drafter that could not gain even at its mean acceptance shadows a tenth as often as one
    whose upside is large: staying ready costs what it can buy."""
    def period(cost: PassCost, alpha: float) -> int:
        p = SpeculationPolicy(cost)
        trained(p, "d", alpha, steps=100)
        p.observe_draft_time("d", 8, 8 * 0.0005)  # 4 ms for γ=8 against a 10 ms pass
        return 4000 // max(sum(p.wants_shadow("d", free=False) for _ in range(4000)), 1)
    assert period(flat(), 0.97) == 40  # the whole 1% budget
    assert period(steep(), 0.05) == 400  # a tenth of it
