"""Tests for actors.sampling: logit processing and speculative-decoding acceptance.

Everything is seeded, so each test is deterministic. Statistical thresholds are
justified where they are used; the key one is the distribution test, which also
runs two deliberately broken samplers ("planted bugs") through the *same* check
and asserts that the check rejects them.
"""

from __future__ import annotations

import math

import pytest
import scipy.stats
import torch

from actors.sampling import process_logits, sample, verify_greedy, verify_sampled


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #
def assert_close(actual, expected, atol=1e-6, rtol=1e-5):
    """Like torch.testing.assert_close (whose first call costs ~1 s of imports)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.double(), expected.double()
    assert torch.allclose(a, e, atol=atol, rtol=rtol), float((a - e).abs().max())


def gens(n: int, seed: int = 0) -> list[torch.Generator]:
    """One generator per row, seeded from a master seed."""
    return [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(n)]


def params(B, temperature=1.0, top_k=0, top_p=1.0):
    """Per-row sampling parameters; scalars broadcast to all rows, lists are per row."""

    def t(v, dtype):
        return torch.tensor(v if isinstance(v, list) else [v] * B, dtype=dtype)

    return t(temperature, torch.float32), t(top_k, torch.int64), t(top_p, torch.float32)


def reference_verify_sampled(
    target_probs, draft_probs, draft_tokens, num_draft, generators, *, accept_all=False, resample_from_p=False
):
    """Slow textbook speculative sampling (Leviathan et al. 2023, Algorithm 1), a loop.

    Follows the same randomness contract as ``verify_sampled`` (per row: G
    uniforms, then one multinomial draw), so on identical generators it must give
    identical outputs. The two keyword flags plant bugs:

    * ``accept_all``: every draft is accepted, then the bonus token is sampled
      (a verifier that never rejects -- emitted tokens follow q, not p).
    * ``resample_from_p``: on rejection, sample from p instead of the residual
      norm(max(0, p - q)) (the classic mistake -- it double-counts min(p, q)).
    """
    B, G1, V = target_probs.shape
    G = G1 - 1
    num_accepted, out = [], []
    for b in range(B):
        g = generators[b]
        u = torch.rand(G, generator=g).tolist()
        p = target_probs[b].float()  # [G+1, V]
        n = int(num_draft[b])
        emitted = []
        j, dist = n, p[n]  # bonus unless something is rejected below
        for i in range(n):
            x = int(draft_tokens[b, i])
            if draft_probs is None:
                q_i = torch.zeros(V)
                q_i[x] = 1.0  # deterministic drafter: q is one-hot at the draft
            else:
                q_i = draft_probs[b, i].float()
            p_x, q_x = p[i, x].item(), q_i[x].item()
            ratio = p_x / q_x if q_x > 0 else math.inf
            if accept_all or u[i] < min(1.0, ratio):  # accept x with prob min(1, p(x)/q(x))
                emitted.append(x)
                continue
            residual = p[i] if resample_from_p else torch.clamp(p[i] - q_i, min=0)  # max(0, p - q)
            j, dist = i, (residual if residual.sum() > 0 else p[i])
            break
        emitted.append(int(torch.multinomial(dist, 1, generator=g)))  # recovered or bonus
        num_accepted.append(j)
        out.append(emitted + [-1] * (G + 1 - len(emitted)))
    return torch.tensor(num_accepted, dtype=torch.int64), torch.tensor(out, dtype=torch.int64).view(B, G + 1)


def fit(tokens: torch.Tensor, p: torch.Tensor):
    """Chi-square goodness of fit of observed tokens to p; returns (p-value, TV, n)."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    expected = p.double() / p.double().sum() * n  # exact float64 normalisation for scipy
    pvalue = float(scipy.stats.chisquare(counts.numpy(), expected.numpy()).pvalue)
    tv = 0.5 * float((counts / n - p.double()).abs().sum())
    return pvalue, tv, n


def tv_bound(n: int, V: int, delta: float = 1e-6) -> float:
    """TV distance that an n-sample empirical distribution exceeds with prob <= delta.

    Bretagnolle-Huber-Carol: P(||p_hat - p||_1 >= eps) <= 2^V exp(-n eps^2 / 2), so
    with prob >= 1 - delta, TV = ||.||_1 / 2 <= sqrt(2 (V ln 2 + ln(1/delta)) / n) / 2.
    """
    return 0.5 * math.sqrt(2 * (V * math.log(2) + math.log(1 / delta)) / n)


# --------------------------------------------------------------------------- #
# process_logits
# --------------------------------------------------------------------------- #
def test_process_logits_temperature_matches_manual_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    temps = [0.3, 1.0, 2.5]
    probs = process_logits(logits, *params(3, temperature=temps))
    expected = torch.stack([torch.softmax(logits[i].double() / t, -1) for i, t in enumerate(temps)])
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    assert_close(probs.double(), expected, atol=1e-6, rtol=1e-5)


def test_process_logits_low_precision_input_returns_float32():
    torch.manual_seed(0)
    logits = (torch.randn(2, 4, 100) * 3).to(torch.bfloat16)
    probs = process_logits(logits, *params(2, temperature=0.7, top_k=[0, 10], top_p=[0.9, 1.0]))
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    assert_close(probs.sum(-1), torch.ones(2, 4))


def test_process_logits_top_k_keeps_exactly_k():
    torch.manual_seed(1)
    logits = torch.randn(4, 1000)
    ks = [1, 5, 77, 999]
    probs = process_logits(logits, *params(4, top_k=ks))
    for i, k in enumerate(ks):
        kept = (probs[i] > 0).nonzero().squeeze(1)
        assert kept.numel() == k
        assert set(kept.tolist()) == set(logits[i].topk(k).indices.tolist())
        assert_close(probs[i, kept], torch.softmax(logits[i, kept], -1))


def test_process_logits_top_p_minimal_nucleus_exact():
    # probabilities 0.4, 0.3, 0.2, 0.1 (in scrambled vocab order)
    base = torch.tensor([0.1, 0.4, 0.2, 0.3]).log()
    logits = base.expand(4, 4)
    probs = process_logits(logits, *params(4, top_p=[0.05, 0.35, 0.6, 0.95]))
    expected_kept = [{1}, {1}, {1, 3}, {0, 1, 2, 3}]  # 0.4 < 0.6 <= 0.7; 0.9 < 0.95
    for i, kept in enumerate(expected_kept):
        assert set((probs[i] > 0).nonzero().squeeze(1).tolist()) == kept
        mass = sum(float(base[t].exp()) for t in kept)
        for t in kept:
            assert float(probs[i, t]) == pytest.approx(float(base[t].exp()) / mass, rel=1e-5)


def brute_force_filter(logits, temperature, top_k, top_p):
    """One row, float64, literally following the definition (top-k, then top-p)."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True)
    k = probs.numel() if top_k == 0 else min(top_k, probs.numel())
    order = order[:k]
    kept_mass = probs[order] / probs[order].sum()
    cum = kept_mass.cumsum(0)
    m = int((cum < top_p).sum()) + 1  # minimal prefix with mass >= top_p
    keep = order[: min(m, k)]
    out = torch.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


def test_process_logits_matches_brute_force_per_row_params_3d():
    """Per-row params differ within one batch; a [B, T, V] input broadcasts them over T.

    V is large enough (3000) that nucleus sizes cross the first candidate count
    (256) of the implementation, exercising its grow-the-candidates path.
    """
    torch.manual_seed(2)
    B, T, V = 6, 3, 3000
    logits = torch.randn(B, T, V) * torch.tensor([0.5, 1, 2, 4, 8, 1.0]).view(B, 1, 1)
    temps = [1.0, 0.5, 1.5, 1.0, 0.8, 2.0]
    ks = [0, 0, 40, 700, 0, 5]
    ps = [1.0, 0.9, 0.8, 0.97, 0.5, 1.0]
    probs = process_logits(logits, *params(B, temps, ks, ps))
    assert probs.shape == (B, T, V)
    for b in range(B):
        for t in range(T):
            ref = brute_force_filter(logits[b, t], temps[b], ks[b], ps[b])
            assert torch.equal(probs[b, t] > 0, ref > 0), (b, t)
            assert_close(probs[b, t].double(), ref, atol=1e-6, rtol=1e-4)
    assert_close(probs.sum(-1), torch.ones(B, T))


def test_process_logits_extreme_logits_no_nan():
    V = 16
    logits = torch.zeros(4, V)
    logits[0, :] = -1e4
    logits[0, 3] = 1e4
    logits[1, ::2] = -math.inf
    logits[1, 1] = 1e4
    logits[2, :] = -math.inf
    logits[2, 7] = -1e4  # the only finite logit is very negative
    logits[3, :8] = 1e4  # eight-way tie at the top
    logits[3, 8:] = -math.inf
    for temperature in (1e-3, 1.0, 50.0):
        for top_k, top_p in ((0, 1.0), (3, 1.0), (0, 0.5), (2, 0.3)):
            probs = process_logits(logits, *params(4, temperature, top_k, top_p))
            assert not probs.isnan().any() and (probs >= 0).all()
            assert_close(probs.sum(-1), torch.ones(4))
            assert probs[0].argmax() == 3 and probs[1].argmax() == 1 and probs[2, 7] == 1
            assert (probs[1, ::2] == 0).all() and (probs[3, 8:] == 0).all()
    half = process_logits(logits.half(), *params(4, 0.05, 0, 0.9))
    assert not half.isnan().any()


# --------------------------------------------------------------------------- #
# verify_greedy
# --------------------------------------------------------------------------- #
def peaked_logits(argmax: torch.Tensor, V: int, dtype=torch.float16) -> torch.Tensor:
    """[B, G+1] argmax ids -> [B, G+1, V] logits of -1e4 / -inf with +1e4 at the argmax."""
    logits = torch.full((*argmax.shape, V), -1e4)
    logits[..., ::3] = -math.inf
    logits.scatter_(-1, argmax[..., None], 1e4)
    return logits.to(dtype)


def test_verify_greedy_all_accepted_emits_bonus():
    target = torch.tensor([[5, 2, 7, 1]])
    n_acc, out = verify_greedy(peaked_logits(target, 10), torch.tensor([[5, 2, 7]]), torch.tensor([3]))
    assert n_acc.tolist() == [3]
    assert out.tolist() == [[5, 2, 7, 1]]  # three accepted drafts + bonus argmax at position 3


def test_verify_greedy_first_mismatch():
    target = torch.tensor([[5, 2, 7, 1]])
    # mismatch at j=1 (draft 3 vs target 2); the later "match" at j=2 must not count
    n_acc, out = verify_greedy(peaked_logits(target, 10), torch.tensor([[5, 3, 7]]), torch.tensor([3]))
    assert n_acc.tolist() == [1]
    assert out.tolist() == [[5, 2, -1, -1]]  # accepted 5, recovered argmax 2


def test_verify_greedy_num_draft_zero():
    target = torch.tensor([[4, 2, 7]])
    n_acc, out = verify_greedy(peaked_logits(target, 10), torch.tensor([[4, 2]]), torch.tensor([0]))
    assert n_acc.tolist() == [0]
    assert out.tolist() == [[4, -1, -1]]  # just the argmax at position 0, drafts ignored


def test_verify_greedy_mixed_num_draft_batch():
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [9, 8, 7, 6], [1, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 3], [1, 2, 0], [1, 2, 3], [9, 0, -5], [0, 2, 3]])  # -5: garbage padding
    num_draft = torch.tensor([3, 3, 1, 1, 2])
    n_acc, out = verify_greedy(peaked_logits(target, 10, torch.bfloat16), drafts, num_draft)
    assert n_acc.tolist() == [3, 2, 1, 1, 0]
    assert out.tolist() == [
        [1, 2, 3, 4],  # all accepted + bonus
        [1, 2, 3, -1],  # rejected at 2, recovered 3
        [1, 2, -1, -1],  # num_draft=1: accepted, bonus is argmax at position 1
        [9, 8, -1, -1],  # garbage beyond num_draft ignored
        [1, -1, -1, -1],  # rejected at 0
    ]


# --------------------------------------------------------------------------- #
# verify_sampled: agreement with the slow reference
# --------------------------------------------------------------------------- #
def random_case(B=24, G=4, V=12, seed=0, deterministic_draft=False):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(B, G + 1, V, generator=g) * 1.5, -1)
    draft = torch.softmax(torch.randn(B, G, V, generator=g) * 1.5, -1)
    draft[0, 0] = target[0, 0]  # p == q at one position (ratio exactly 1 everywhere)
    tokens = torch.multinomial(draft.view(-1, V), 1, generator=g).view(B, G)
    num_draft = torch.randint(0, G + 1, (B,), generator=g)
    num_draft[:3] = torch.tensor([G, 0, G])
    pad = torch.arange(G) >= num_draft[:, None]
    tokens = torch.where(pad, -7, tokens)  # garbage padding must be ignored
    return target, (None if deterministic_draft else draft), tokens, num_draft


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_verify_sampled_matches_reference(deterministic_draft):
    """Same inputs and generator seeds -> bit-identical outputs to the textbook loop."""
    for seed in range(3):
        target, draft, tokens, num_draft = random_case(seed=seed, deterministic_draft=deterministic_draft)
        got = verify_sampled(target, draft, tokens, num_draft, gens(len(num_draft), seed))
        ref = reference_verify_sampled(target, draft, tokens, num_draft, gens(len(num_draft), seed))
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        n_acc, out = got
        assert (n_acc <= num_draft).all()
        for b in range(len(n_acc)):  # output convention: accepted drafts, one token, -1s
            n = int(n_acc[b])
            assert torch.equal(out[b, :n], tokens[b, :n])
            assert 0 <= out[b, n] < target.shape[-1] and (out[b, n + 1 :] == -1).all()


def test_verify_sampled_low_precision_inputs():
    target, draft, tokens, num_draft = random_case(seed=5)
    got = verify_sampled(target.half(), draft.bfloat16(), tokens, num_draft, gens(len(num_draft), 5))
    assert got[1].dtype == torch.int64 and got[0].dtype == torch.int64
    ref = reference_verify_sampled(target.half().float(), draft.bfloat16().float(), tokens, num_draft, gens(24, 5))
    assert torch.equal(got[1], ref[1])


# --------------------------------------------------------------------------- #
# verify_sampled: output distribution, with planted bugs
# --------------------------------------------------------------------------- #
# Target p and a deliberately different draft q over V = 8 tokens; q is p reversed.
# TV(p, q) = 0.5, so each draft is rejected half of the time and all three
# branches (accept, recover, bonus) are well exercised.
P = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
Q = P.flip(0)
G_DIST = 3
N_DIST = 8_000


def run_trials(sampler, p=P, q=Q, n=N_DIST, G=G_DIST, seed=1234, deterministic_draft=False):
    """n independent trials as n rows (own generator each); p, q the same at every position."""
    g = torch.Generator().manual_seed(seed)
    V = p.numel()
    if deterministic_draft:
        # Fixed proposals alternating between the two likeliest tokens. (Proposals
        # spread uniformly over the vocabulary would hide the resample-from-p bug:
        # averaged over a uniform x, its law p(x) 1[y=x] + (1 - p(x)) p(y) is p.)
        tokens = (torch.arange(n)[:, None] + torch.arange(G)) % 2
        draft = None
    else:
        tokens = torch.multinomial(q, n * G, replacement=True, generator=g).view(n, G)
        draft = q.expand(n, G, V)
    target = p.expand(n, G + 1, V)
    return sampler(target, draft, tokens, torch.full((n,), G), gens(n, seed))


def emitted_fits(n_acc, out, p=P):
    """Fit of the token emitted at position 0 (every row) and at position 1 (rows that accepted draft 0).

    With p and q position-independent and drafts drawn independently, each is
    exactly ~ p under a correct sampler (the position-1 token is conditioned only
    on the acceptance at position 0, which is independent of the later drafts).
    """
    return fit(out[:, 0], p), fit(out[n_acc >= 1, 1], p)


def fast(*args):
    return verify_sampled(*args)


def bug_accept_all(*args):
    return reference_verify_sampled(*args, accept_all=True)


def bug_resample_from_p(*args):
    return reference_verify_sampled(*args, resample_from_p=True)


def assert_consistent_with_p(fits):
    """Pass criterion for a correct sampler.

    * chi-square p-value > 1e-3: under a correct sampler the p-value is uniform,
      so a fresh seed would fail with probability 1e-3; the seed is fixed, so
      the outcome is deterministic (observed values are far from the threshold).
    * TV(empirical, p) below tv_bound(n, V, 1e-6): exceeded with prob <= 1e-6.
    """
    for pvalue, tv, n in fits:
        assert pvalue > 1e-3, (pvalue, tv, n)
        assert tv < tv_bound(n, P.numel()), (pvalue, tv, n)


def assert_detects_bug(fits):
    """Fail criterion: both position checks reject with p-value < 1e-6 and TV above the bound.

    Expected first-token laws: accept-all emits q (TV(q, p) = 0.5);
    resample-from-p emits min(p, q) + TV(p, q) * p (TV 0.18 from p). With
    n = 8000 (position 0) and ~4000 (position 1, acceptance rate 1/2) the TV
    bounds are ~0.035 and ~0.049, while the chi-square statistics are in the
    hundreds to thousands (p-values ~1e-120 or smaller), so both bugs fail
    decisively; the correct sampler sits at TV ~0.01 with p-values ~0.3-0.5.
    """
    for pvalue, tv, n in fits:
        assert pvalue < 1e-6 and tv > tv_bound(n, P.numel()), (pvalue, tv, n)


def test_verify_sampled_distribution_matches_target():
    assert_consistent_with_p(emitted_fits(*run_trials(fast)))


@pytest.mark.parametrize("bug", [bug_accept_all, bug_resample_from_p])
def test_planted_bugs_fail_distribution_check(bug):
    assert_detects_bug(emitted_fits(*run_trials(bug)))


def test_reference_passes_distribution_check():
    """Sanity: the slow reference itself (no bug flags) passes the same check."""
    assert_consistent_with_p(emitted_fits(*run_trials(reference_verify_sampled, n=4000)))


def test_verify_sampled_deterministic_draft_distribution():
    """draft_probs=None (q one-hot at a fixed proposal): emitted tokens are still ~ p.

    Same thresholds as assert_consistent_with_p (acceptance is now p(x) ~ 1/4, so
    ~1000 rows reach position 1; bound ~0.096 there). The planted resample-from-p
    bug must fail here too: with proposals x alternating 0/1 it emits
    p(x) 1[y=x] + (1 - p(x)) p(y), averaged over x: TV 0.125 from p, vs a bound
    of ~0.035 at n = 8000.
    """
    assert_consistent_with_p(emitted_fits(*run_trials(fast, deterministic_draft=True)))
    pvalue, tv, n = fit(run_trials(bug_resample_from_p, deterministic_draft=True)[1][:, 0], P)
    assert pvalue < 1e-6 and tv > tv_bound(n, P.numel()), (pvalue, tv, n)


def test_verify_sampled_peaked_agrees_with_greedy():
    """With (numerically) one-hot target and draft distributions, sampling == greedy."""
    torch.manual_seed(3)
    B, G, V = 16, 4, 40
    logits = torch.randn(B, G + 1, V) * 5
    t, k, p = params(B, temperature=1e-4)
    target = process_logits(logits, t, k, p)
    assert (target.max(-1).values == 1).all()  # exactly one-hot in float32
    argmax = logits.argmax(-1)
    tokens = torch.where(torch.rand(B, G) < 0.8, argmax[:, :G], torch.randint(0, V, (B, G)))
    num_draft = torch.randint(0, G + 1, (B,))
    want = verify_greedy(logits, tokens, num_draft)
    draft = torch.nn.functional.one_hot(tokens, V).float()  # a greedy draft model
    for d in (None, draft):
        got = verify_sampled(target, d, tokens, num_draft, gens(B, 9))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# --------------------------------------------------------------------------- #
# Reproducibility
# --------------------------------------------------------------------------- #
def test_verify_sampled_reproducible_and_row_independent():
    target, draft, tokens, num_draft = random_case(B=8, G=4, seed=11)
    a = verify_sampled(target, draft, tokens, num_draft, gens(8, 1))
    b = verify_sampled(target, draft, tokens, num_draft, gens(8, 1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    # change every other row (contents, num_draft, generator seeds) but keep G:
    # row 0 must be unaffected.
    t2, d2, tok2, nd2 = random_case(B=8, G=4, seed=12)
    for x, y in ((t2, target), (d2, draft), (tok2, tokens), (nd2, num_draft)):
        x[0] = y[0]
    g2 = gens(8, 2)
    g2[0] = gens(8, 1)[0]
    c = verify_sampled(t2, d2, tok2, nd2, g2)
    assert torch.equal(c[0][0], a[0][0]) and torch.equal(c[1][0], a[1][0])
    # and a row alone in its batch gives the same result as inside the batch
    solo = verify_sampled(target[:1], draft[:1], tokens[:1], num_draft[:1], gens(8, 1)[:1])
    assert torch.equal(solo[1][0], a[1][0])


def test_verify_sampled_draw_contract():
    """Each row consumes exactly G uniforms + one multinomial, whatever happens."""
    target, draft, tokens, num_draft = random_case(B=8, G=4, seed=13)
    used = gens(8, 3)
    verify_sampled(target, draft, tokens, num_draft, used)
    fresh = gens(8, 3)
    for b in range(8):
        torch.rand(4, generator=fresh[b])
        torch.multinomial(target[b, 0], 1, generator=fresh[b])
        assert torch.equal(used[b].get_state(), fresh[b].get_state()), b


def test_sample_distribution_and_reproducibility():
    """sample(): one draw per row with that row's generator.

    n = 8000 draws of P; same p-value / TV criteria as assert_consistent_with_p.
    """
    n = 8_000
    draws = sample(P.expand(n, -1), gens(n, 7))
    assert draws.dtype == torch.int64 and draws.shape == (n,)
    assert_consistent_with_p([fit(draws, P)])
    again = sample(P.expand(n, -1), gens(n, 7))
    assert torch.equal(draws, again)
    probs = torch.softmax(torch.randn(3, 50), -1).half()
    assert torch.equal(sample(probs, gens(3, 1)), sample(probs, gens(3, 1)))


# --------------------------------------------------------------------------- #
# Bad arguments
# --------------------------------------------------------------------------- #
def _vs_args(**over):
    B, G, V = 2, 3, 5
    args = dict(
        target_probs=torch.full((B, G + 1, V), 1 / V),
        draft_probs=torch.full((B, G, V), 1 / V),
        draft_tokens=torch.zeros(B, G, dtype=torch.int64),
        num_draft=torch.full((B,), G),
        generators=gens(B),
    )
    args.update(over)
    return args


BAD_CALLS = {
    "temperature zero": (lambda: process_logits(torch.randn(2, 5), *params(2, temperature=[1.0, 0.0])), "temperature"),
    "temperature negative": (lambda: process_logits(torch.randn(2, 5), *params(2, temperature=-1.0)), "temperature"),
    "temperature shape": (
        lambda: process_logits(torch.randn(2, 5), torch.ones(3), *params(2)[1:]),
        "temperature must be a tensor of shape",
    ),
    "top_k dtype": (lambda: process_logits(torch.randn(2, 5), torch.ones(2), torch.zeros(2), torch.ones(2)), "top_k"),
    "top_k negative": (lambda: process_logits(torch.randn(2, 5), *params(2, top_k=-1)), "top_k"),
    "top_p zero": (lambda: process_logits(torch.randn(2, 5), *params(2, top_p=0.0)), "top_p"),
    "top_p above one": (lambda: process_logits(torch.randn(2, 5), *params(2, top_p=1.5)), "top_p"),
    "logits 1-d": (lambda: process_logits(torch.randn(5), *params(5)), "logits must be"),
    "logits int": (lambda: process_logits(torch.zeros(2, 5, dtype=torch.int64), *params(2)), "floating"),
    "greedy logits 2-d": (
        lambda: verify_greedy(torch.randn(2, 5), torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)),
        "target_logits must be",
    ),
    "greedy draft shape": (
        lambda: verify_greedy(torch.randn(2, 4, 5), torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)),
        "draft_tokens must be",
    ),
    "greedy draft dtype": (
        lambda: verify_greedy(torch.randn(2, 4, 5), torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)),
        "int64",
    ),
    "greedy num_draft > G": (
        lambda: verify_greedy(torch.randn(2, 4, 5), torch.zeros(2, 3, dtype=torch.int64), torch.tensor([1, 4])),
        "num_draft",
    ),
    "greedy num_draft negative": (
        lambda: verify_greedy(torch.randn(2, 4, 5), torch.zeros(2, 3, dtype=torch.int64), torch.tensor([-1, 0])),
        "num_draft",
    ),
    "greedy num_draft shape": (
        lambda: verify_greedy(torch.randn(2, 4, 5), torch.zeros(2, 3, dtype=torch.int64), torch.tensor([1])),
        "num_draft",
    ),
    "sampled num_draft > G": (lambda: verify_sampled(**_vs_args(num_draft=torch.tensor([3, 4]))), "num_draft"),
    "sampled too few generators": (lambda: verify_sampled(**_vs_args(generators=gens(1))), "generator"),
    "sampled too many generators": (lambda: verify_sampled(**_vs_args(generators=gens(3))), "generator"),
    "sampled generator type": (lambda: verify_sampled(**_vs_args(generators=[0, 1])), "torch.Generator"),
    "sampled draft_probs shape": (
        lambda: verify_sampled(**_vs_args(draft_probs=torch.full((2, 4, 5), 0.2))),
        "draft_probs must be",
    ),
    "sampled token out of range": (
        lambda: verify_sampled(**_vs_args(draft_tokens=torch.tensor([[0, 5, 0], [0, 0, 0]]))),
        "draft_tokens",
    ),
    "sample 3-d": (lambda: sample(torch.full((2, 3, 5), 0.2), gens(2)), "probs must be"),
    "sample generators": (lambda: sample(torch.full((2, 5), 0.2), gens(3)), "generator"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_raise_clear_errors(name):
    call, match = BAD_CALLS[name]
    with pytest.raises(ValueError, match=match):
        call()
