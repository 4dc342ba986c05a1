"""The speculative engine, end to end.

Headline property: speculation is lossless.
  * greedy: for every drafter, the engine's output for a batch of mixed-length
    prompts equals Hugging Face `generate(do_sample=False)` run per prompt
    (batch 1, no padding), token for token -- and two planted bugs (a verifier
    that accepts every draft, a rollback that does nothing) make that check fail;
  * sampling: the joint law of the first generated tokens equals the target's
    own ancestral-sampling law, computed exactly from the model; a planted
    accept-everything verifier fails the same check.
Plus stop conditions, speculation stats, continuous batching / abort, and
argument validation.
"""
from __future__ import annotations

import itertools
import math

import pytest
import scipy.stats
import torch

import actors.acceptance as acceptance_mod
from actors.drafters import Drafter, DraftSeq, ModelDrafter, NgramDrafter, Proposal
from actors.engine import SpecEngine
from actors.llama import LlamaRunner
from actors.models import LoadedModel, build_tiny, check_draft_compatible
from actors.sampling import sample
from actors.schema import MAX_GAMMA, Completion, Request, SamplingParams, SpecStats, SpeculationParams
from helpers import chat_ids, rand_tokens, request, run

MAX_LEN = 128

# Mixed lengths, including a one-token prompt and a repetitive one (n-gram hits).
PROMPTS = [rand_tokens(7, 1), [42], rand_tokens(20, 2), [10, 11, 12] * 4, rand_tokens(3, 3), rand_tokens(12, 4)]
MAX_TOKENS = [24, 24, 17, 24, 5, 24]  # different per request: drafting is capped by each one's room


class RandomDrafter(Drafter):
    """A deterministic drafter proposing garbage: losslessness must not depend on
    draft quality."""
    name = "garbage"

    def __init__(self, vocab: int = 512):
        self.vocab, self.gen, self.active = vocab, torch.Generator().manual_seed(123), set()

    def propose(self, seqs: list[DraftSeq]) -> Proposal:
        G = max(s.gamma for s in seqs)
        for s in seqs:
            self.active.add(s.seq_id)
        return Proposal(tokens=torch.randint(0, self.vocab, (len(seqs), G), generator=self.gen),
                        num_draft=[s.gamma for s in seqs])

    def release(self, seq_id: int) -> None:
        self.active.discard(seq_id)

    def num_active(self) -> int:
        return len(self.active)


def make_drafters(target: LoadedModel, draft: LoadedModel | None = None, max_batch: int = 8,
                  max_len: int = MAX_LEN, vocab: int = 512) -> dict[str, Drafter]:
    L = target.model.config.num_hidden_layers
    d = {"ngram": NgramDrafter(),
         "truncated:2": ModelDrafter.truncated(target.model, 2, max_batch=max_batch, max_len=max_len),
         f"truncated:{L}": ModelDrafter.truncated(target.model, L, max_batch=max_batch, max_len=max_len),
         "garbage": RandomDrafter(vocab)}
    if draft is not None:
        d["draft"] = ModelDrafter(LlamaRunner(draft.model), "draft", max_batch=max_batch, max_len=max_len)
    return d


def make_engine(target: LoadedModel, draft: LoadedModel | None = None, *, max_batch: int = 8,
                max_len: int = MAX_LEN, eos=frozenset(), drafters=None, prefill_chunk: int = 512) -> SpecEngine:
    """Tiny models have no tokenizer and eos disabled (as HF generate with eos_token_id=None)."""
    drafters = make_drafters(target, draft, max_batch, max_len) if drafters is None else drafters
    return SpecEngine(LlamaRunner(target.model), drafters, tokenizer=target.tokenizer,
                      eos_token_ids=set(eos), max_batch=max_batch, max_len=max_len, prefill_chunk=prefill_chunk)


def requests(draft, gamma, prompts=PROMPTS, max_tokens=MAX_TOKENS, **params) -> list[Request]:
    return [request(f"r{i}", p, draft, gamma, max_tokens=n, **params)
            for i, (p, n) in enumerate(zip(prompts, max_tokens))]


@pytest.fixture(scope="module")
def hf_refs(tiny, hf_greedy):
    """HF greedy continuations of PROMPTS (eos disabled), 24 tokens each."""
    return [hf_greedy(tiny.model, p, 24, eos=None) for p in PROMPTS]


def assert_hf_equal(results, hf_refs, max_tokens=MAX_TOKENS):
    for i, n in enumerate(max_tokens):
        seq = results[f"r{i}"]
        assert len(hf_refs[i]) >= n
        assert seq.token_ids == hf_refs[i][:n], f"request r{i} (prompt {seq.prompt_tokens} tokens)"
        assert seq.finish_reason == "length"


# --------------------------------------------------------------------------- #
# Greedy equivalence with Hugging Face
# --------------------------------------------------------------------------- #
GREEDY_CASES = [(None, 0), ("ngram", 3), ("ngram", 8), ("truncated:2", 3), ("truncated:4", 4),
                ("draft", 2), ("draft", 5), ("garbage", 5)]


@pytest.mark.parametrize("draft,gamma", GREEDY_CASES, ids=[f"{d}-g{g}" for d, g in GREEDY_CASES])
def test_greedy_batch_equals_hf_generate(tiny, tiny_draft, hf_refs, draft, gamma):
    """The batch (6 mixed-length prompts, per-request max_tokens) equals HF generate per prompt.
    truncated:4 is the whole target (every draft accepted: bonus path), "draft" is a separate
    random model (nearly every draft rejected), ngram hits on the repetitive prompt."""
    eng = make_engine(tiny, tiny_draft)
    res = run(eng, requests(draft, gamma))
    assert_hf_equal(res, hf_refs)
    if gamma:
        assert eng.stats.draft_tokens > 0  # the drafts were really exercised
    if draft == "truncated:4":
        assert eng.stats.acceptance_rate == 1.0
    assert eng.kv_slots_in_use() == 0 and not eng.has_work()
    for d in eng.drafters.values():
        assert d.num_active() == 0


def test_greedy_mixed_drafters_and_sampled_rows_in_one_batch(tiny, tiny_draft, hf_refs):
    """Every request uses a different drafter and γ, and sampled requests share the batch:
    the greedy requests still equal HF exactly."""
    eng = make_engine(tiny, tiny_draft)
    cfg = [(None, 0), ("ngram", 4), ("truncated:2", 2), ("truncated:4", 3), ("draft", 3), ("garbage", 6)]
    reqs = [request(f"r{i}", p, d, g, max_tokens=n) for i, (p, n, (d, g)) in enumerate(zip(PROMPTS, MAX_TOKENS, cfg))]
    reqs += [request(f"s{i}", PROMPTS[i], d, g, max_tokens=20, temperature=1.0, seed=i)
             for i, (d, g) in enumerate([("draft", 4), ("ngram", 2), ("truncated:4", 5)])]
    res = run(eng, reqs)  # 9 requests, 8 slots: one waits for a free slot
    assert_hf_equal(res, hf_refs)
    assert all(len(res[f"s{i}"].token_ids) == 20 for i in range(3))


def test_greedy_planted_bug_accept_all_is_detected(tiny, tiny_draft, hf_refs, monkeypatch):
    """Planted bug: a verifier that accepts every draft. With the separate random draft
    model (whose drafts the target almost never agrees with) the outputs must then
    differ from HF -- proof that the equivalence test above can fail."""
    def accept_all(logits, draft_tokens, num_draft):
        B, G = draft_tokens.shape
        out = torch.full((B, G + 1), -1, dtype=torch.long)
        for b in range(B):
            k = int(num_draft[b])
            out[b, :k] = draft_tokens[b, :k]
            out[b, k] = logits[b, k].argmax()
        return num_draft.clone(), out

    monkeypatch.setattr(acceptance_mod, "verify_greedy", accept_all)
    res = run(make_engine(tiny, tiny_draft), requests("draft", 3))
    wrong = [i for i in range(len(PROMPTS)) if res[f"r{i}"].token_ids != hf_refs[i][:MAX_TOKENS[i]]]
    assert len(wrong) == len(PROMPTS)


def test_greedy_planted_bug_no_rollback_is_detected(tiny, tiny_draft, hf_refs):
    """Planted bug: the target KV is never rolled back, so rejected drafts stay in the
    cache and are attended. The equivalence check must catch it."""
    eng = make_engine(tiny, tiny_draft, max_len=256)
    eng.cache.truncate = lambda slot, length: None
    res = run(eng, requests("draft", 3))
    wrong = [i for i in range(len(PROMPTS)) if res[f"r{i}"].token_ids != hf_refs[i][:MAX_TOKENS[i]]]
    assert len(wrong) >= len(PROMPTS) - 1  # r4 (5 tokens) may be short enough to survive


# --------------------------------------------------------------------------- #
# SmolLM2 (real model, real tokenizer)
# --------------------------------------------------------------------------- #
CHAT = ["What is the capital of France?", "Write a haiku about the sea.",
        "List three prime numbers.", "Explain photosynthesis briefly."]
SMOL_NEW = 24
SMOL_MAX_LEN = 96


@pytest.fixture(scope="module")
def smol_prompts(smollm2):
    return [chat_ids(smollm2.tokenizer, c) for c in CHAT]


@pytest.fixture(scope="module")
def smol_refs(smollm2, smol_prompts, hf_greedy):
    return [hf_greedy(smollm2.model, p, SMOL_NEW) for p in smol_prompts]  # eos from the config


@pytest.fixture(scope="module")
def smol_engine(smollm2):
    drafters = {"ngram": NgramDrafter(),
                "truncated:4": ModelDrafter.truncated(smollm2.model, 4, max_batch=4, max_len=SMOL_MAX_LEN)}
    return SpecEngine(LlamaRunner(smollm2.model), drafters, tokenizer=smollm2.tokenizer,
                      eos_token_ids=smollm2.eos_token_ids, max_batch=4, max_len=SMOL_MAX_LEN)


def test_smollm2_greedy_equals_hf_generate(smollm2, smol_engine, smol_prompts, smol_refs):
    """Chat prompts on SmolLM2 fp32 with its real EOS (<|im_end|>): γ=0, n-gram and the
    4-layer self-draft all equal HF generate token for token, and the text is the
    tokenizer's decoding of those tokens."""
    tok = smollm2.tokenizer
    assert any(r[-1] in smollm2.eos_token_ids and len(r) < SMOL_NEW for r in smol_refs)  # an EOS case
    for draft, gamma in [(None, 0), ("ngram", 3), ("truncated:4", 3)]:
        res = run(smol_engine, [request(f"{draft}{i}", p, draft, gamma, max_tokens=SMOL_NEW)
                                for i, p in enumerate(smol_prompts)])
        for i, ref in enumerate(smol_refs):
            seq = res[f"{draft}{i}"]
            assert seq.token_ids == ref, (draft, i, tok.decode(seq.token_ids), tok.decode(ref))
            assert seq.text == tok.decode(ref, skip_special_tokens=True)
            assert seq.finish_reason == ("stop" if ref[-1] in smollm2.eos_token_ids else "length")


@pytest.mark.parametrize("stop", ["\n", "sea, a"])
def test_smollm2_stop_strings(smollm2, smol_engine, smol_prompts, smol_refs, stop):
    """A stop string truncates the text before it, finishes with "stop", commits no token
    past the one completing it (even inside an accepted draft block), and the streamed
    text deltas add up to the final text."""
    tok = smollm2.tokenizer
    ref, prompt = smol_refs[1], smol_prompts[1]  # the haiku: "The waves of the sea, a ...\n..."
    ref_text = tok.decode(ref, skip_special_tokens=True)
    assert stop in ref_text
    k = next(k for k in range(1, len(ref) + 1) if stop in tok.decode(ref[:k], skip_special_tokens=True))
    for draft, gamma in [(None, 0), ("truncated:4", 4)]:
        key = smol_engine.add_request(request(f"stop-{draft}", prompt, draft, gamma, max_tokens=SMOL_NEW,
                                              stop=(stop,)))
        deltas = []
        while smol_engine.has_work():
            deltas += [d for k, d in smol_engine.step().items() if k == key]
        seq = Completion.join(deltas)
        assert seq.text == ref_text[:ref_text.index(stop)]
        assert seq.finish_reason == "stop"
        assert seq.token_ids == ref[:k]
        # The beginning of a (multi-token) stop string is held back, never streamed: every
        # delta's text is a piece of the final text, and they add up to it.
        assert "".join(d.text for d in deltas) == seq.text


# --------------------------------------------------------------------------- #
# Sampling: reproducibility
# --------------------------------------------------------------------------- #
SAMPLING_DRAFTS = [(None, 0), ("ngram", 3), ("truncated:2", 3), ("draft", 3)]


@pytest.mark.parametrize("draft,gamma", SAMPLING_DRAFTS, ids=[f"{d}-g{g}" for d, g in SAMPLING_DRAFTS])
def test_sampling_reproducible_with_seed(tiny, tiny_draft, draft, gamma):
    """Fixed seeds: the same batch on a fresh engine gives the same tokens; different seeds
    give different tokens (the tiny model's temperature-1 distribution is close to uniform
    over 512 tokens, so two seeds agreeing on 16 tokens by chance is ~impossible)."""
    def go(seed0):
        reqs = [request(f"r{i}", p, draft, gamma, max_tokens=16, temperature=1.0, top_p=0.95, seed=seed0 + i)
                for i, p in enumerate(PROMPTS[:4])]
        res = run(make_engine(tiny, tiny_draft), reqs)
        return [res[f"r{i}"].token_ids for i in range(4)]

    a, b, c = go(100), go(100), go(200)
    assert a == b
    assert all(len(o) == 16 for o in a)
    assert all(x != y for x, y in zip(a, c))
    assert len({tuple(o) for o in a}) == 4


def test_sampling_independent_of_batch_composition_plain(tiny):
    """γ = 0: a seeded request gives the same tokens alone and inside a batch with other
    sampled and greedy requests of other lengths (admitted in the same or later steps)."""
    target = dict(max_tokens=20, temperature=0.8, top_k=100, seed=7)
    alone = run(make_engine(tiny), [request("x", PROMPTS[2], **target)])["x"].token_ids
    others = [request(f"o{i}", p, max_tokens=5 + 3 * i, temperature=1.0, seed=i) for i, p in enumerate(PROMPTS[:3])]
    others.append(request("g", PROMPTS[3], max_tokens=9))
    for order in (others[:2] + [None] + others[2:], [None] + others):
        reqs = [request("x", PROMPTS[2], **target) if r is None else r for r in order]
        res = run(make_engine(tiny, max_batch=3), reqs)
        assert res["x"].token_ids == alone


@pytest.mark.parametrize("draft,gamma", [("ngram", 3), ("truncated:2", 3), ("draft", 4)])
def test_sampling_independent_of_batch_composition_speculative(tiny, tiny_draft, draft, gamma):
    """With speculation on, a seeded request's tokens do not depend on its batch-mates: each
    row is verified at its own draft length, and a drafter draws only for its own γ. Batch-
    mates here draft more (γ 8), fewer (n-gram misses) or not at all, and finish early.
    (Regression: verifying every row at the batch-wide width shifted the row's random draws.)"""
    target = dict(max_tokens=20, temperature=1.0, seed=11)
    alone = run(make_engine(tiny, tiny_draft), [request("x", PROMPTS[0], draft, gamma, **target)])["x"].token_ids
    mates = [request("m0", PROMPTS[3], "ngram", 8, max_tokens=24),
             request("m1", PROMPTS[2], "truncated:2", 8, max_tokens=6, temperature=1.0, seed=3),
             request("m2", PROMPTS[1], max_tokens=12, temperature=0.7, seed=5)]
    res = run(make_engine(tiny, tiny_draft), mates[:2] + [request("x", PROMPTS[0], draft, gamma, **target)] + mates[2:])
    assert res["x"].token_ids == alone


def test_shared_sampling_params_do_not_share_a_seed(tiny):
    """Requests that share one SamplingParams object without a seed get independent
    randomness, and the caller's object is left untouched."""
    shared = SamplingParams(max_tokens=12, temperature=1.0)
    res = run(make_engine(tiny), [Request(f"r{i}", PROMPTS[0], shared) for i in range(3)])
    assert shared.seed is None
    assert len({tuple(res[f"r{i}"].token_ids) for i in range(3)}) == 3


def test_rows_near_the_context_limit_batch_with_long_drafts(tiny, tiny_draft):
    """A row that ends exactly at max_len shares passes with a row drafting γ = MAX_GAMMA:
    padding to the widest row must not overflow either cache (target or draft), and
    the near-limit row still equals HF. (Regression: the batch died with a ValueError.)"""
    max_len = 64
    eng = make_engine(tiny, tiny_draft, max_len=max_len)
    long_prompt = rand_tokens(56, 9)
    reqs = [request("edge", long_prompt, max_tokens=max_len - 56),
            request("wide", PROMPTS[4], "truncated:2", MAX_GAMMA, max_tokens=40),
            request("wide2", PROMPTS[0], "draft", MAX_GAMMA, max_tokens=40)]
    res = run(eng, reqs)
    ref = tiny.model.generate(torch.tensor([long_prompt]), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, 56:].tolist()
    assert res["edge"].token_ids == ref
    assert len(res["wide"].token_ids) == 40 and len(res["wide2"].token_ids) == 40


# --------------------------------------------------------------------------- #
# Sampling: the output distribution is the target's
# --------------------------------------------------------------------------- #
V_SMALL = 8
N_DIST = 2000
P_MIN = 1e-3  # per-statistic threshold for "consistent with the target law"


@pytest.fixture(scope="module")
def small_models():
    """Vocabulary-8 target and a different vocabulary-8 draft model, so the joint law of
    the first tokens has few enough cells to test with a few hundred samples."""
    target = LoadedModel(build_tiny(0, vocab_size=V_SMALL), None, "tiny8:0")
    draft = LoadedModel(build_tiny(1, vocab_size=V_SMALL), None, "tiny8:1")
    return target, draft


DIST_PROMPT = [1, 5, 3, 6]


def exact_law_of(model) -> torch.Tensor:
    """Exact joint law [V, V, V, V] of the first 4 tokens after DIST_PROMPT under ancestral sampling
    from `model` at temperature 1, from the HF forward: P(t1..t4) = prod_i softmax(logits_i)[t_i]."""
    V = V_SMALL
    prefixes = torch.tensor(list(itertools.product(range(V), repeat=3)))  # [V^3, 3]
    ids = torch.cat([torch.tensor(DIST_PROMPT).expand(len(prefixes), -1), prefixes], 1)
    with torch.inference_mode():
        logp = model(ids).logits.double().log_softmax(-1)[:, len(DIST_PROMPT) - 1:]  # [V^3, 4, V]
    lp1 = logp[0, 0]  # same prompt for every row
    lp2 = logp[:, 1].view(V, V, V, V)[:, 0, 0]  # [t1, t2]
    lp3 = logp[:, 2].view(V, V, V, V)[:, :, 0]  # [t1, t2, t3]
    lp4 = logp[:, 3].view(V, V, V, V)  # [t1, t2, t3, t4]
    joint = (lp1[:, None, None, None] + lp2[:, :, None, None] + lp3[:, :, :, None] + lp4).exp()
    assert abs(float(joint.sum()) - 1) < 1e-9
    return joint


@pytest.fixture(scope="module")
def exact_law(small_models):
    """The target's exact law (`exact_law_of`)."""
    return exact_law_of(small_models[0].model)


def sample_first_tokens(target, draft, name, gamma, seed0, n=N_DIST):
    drafters = {"self": ModelDrafter.truncated(target.model, 2, max_batch=200, max_len=16),
                "draft": ModelDrafter(LlamaRunner(draft.model), "draft", max_batch=200, max_len=16),
                "ngram": NgramDrafter()}
    eng = SpecEngine(LlamaRunner(target.model), drafters, eos_token_ids=set(), max_batch=200, max_len=16)
    # max_tokens=5: the first verify step drafts min(γ, room=3) tokens after the prefilled t1
    reqs = [request(f"r{i}", DIST_PROMPT, name, gamma, max_tokens=5, temperature=1.0, seed=seed0 + i)
            for i in range(n)]
    res = run(eng, reqs)
    toks = torch.tensor([res[f"r{i}"].token_ids[:4] for i in range(n)])
    return toks, eng.stats


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one
    (the usual validity condition of the chi-square approximation)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = float(counts.sum())
    small = probs * n < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([probs[~small], probs[small].sum()[None]]) * n
    if float(exp[-1]) < 1e-12:
        obs, exp = obs[:-1], exp[:-1]
    return float(scipy.stats.chisquare(obs.numpy(), exp.numpy()).pvalue)


def law_pvalues(toks: torch.Tensor, joint: torch.Tensor) -> dict[str, float]:
    V = V_SMALL
    c12 = torch.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V)
    c3 = torch.bincount(toks[:, 2], minlength=V)
    c4 = torch.bincount(toks[:, 3], minlength=V)
    return {"t1,t2": chi2_pvalue(c12, joint.sum((2, 3))),
            "t3": chi2_pvalue(c3, joint.sum((0, 1, 3))),
            "t4": chi2_pvalue(c4, joint.sum((0, 1, 2)))}


DIST_CASES = [(None, 0), ("self", 3), ("draft", 3), ("ngram", 3)]


@pytest.fixture(params=["coupled", "rejection"])
def rule(request, monkeypatch):
    """Seeded requests use coupled acceptance; unseeded ones rejection sampling. The tests
    need fixed seeds for both, so "rejection" makes seeded requests take that path."""
    if request.param == "rejection":
        monkeypatch.setattr(Request, "coupled", property(lambda self: False))
    return request.param


@pytest.mark.parametrize("name,gamma", DIST_CASES, ids=[f"{d}-g{g}" for d, g in DIST_CASES])
def test_sampled_distribution_equals_target(small_models, exact_law, name, gamma, rule):
    """2000 seeded requests at temperature 1, for each acceptance rule (coupled Gumbel-max and
    rejection sampling): the joint law of (t1, t2) and the marginals of t3 and t4 match the
    target's exact ancestral-sampling law.

    t1 is sampled after prefill; t2..t4 come out of the first verify step (accepted drafts,
    the recovered token at the first rejection, or the bonus), so this covers acceptance at
    draft positions 1-3 and the residual distribution. Threshold: each Pearson chi-square
    p-value must exceed 1e-3; under the null (a correct engine) the 3 checks of a case
    fail together with probability <= 3e-3 (union bound). Seeds are fixed, so the outcome is
    deterministic for a given torch build. Power: the planted-bug verifiers below
    (accept everything; resample from p instead of the residual) drive the same check to
    p < 1e-9; N = 2000 is what the subtler resample-from-p bug needs (at N = 800 its
    p-values were only ~1e-5..1e-7). The drafts must actually be exercised: asserted via
    the stats."""
    target, draft = small_models
    toks, stats = sample_first_tokens(target, draft, name, gamma, seed0=10_000)
    if gamma:
        assert stats.draft_tokens > N_DIST // 2 and 0 < stats.accepted_tokens < stats.draft_tokens
    p = law_pvalues(toks, exact_law)
    assert min(p.values()) > P_MIN, p


def buggy_verify_sampled(mode: str):
    """A textbook rejection sampler (same randomness contract as the real one: G uniforms,
    then one multinomial per row) with a planted bug:
      accept_all      -- every draft is accepted (emitted tokens follow q, not p);
      resample_from_p -- on rejection the token is drawn from p instead of the residual
                         norm(max(0, p - q)) (the classic mistake: it double-counts min(p, q))."""
    def verify(p_target, q, draft_tokens, num_draft, generators):
        B, G1, V = p_target.shape
        out = torch.full((B, G1), -1, dtype=torch.long)
        n_acc = torch.zeros(B, dtype=torch.long)
        for b, g in enumerate(generators):
            u = torch.rand(G1 - 1, generator=g)
            k = j = int(num_draft[b])
            for i in range(k):
                x = int(draft_tokens[b, i])
                q_x = float(q[b, i, x]) if q is not None else 1.0
                if mode != "accept_all" and not u[i] * q_x < p_target[b, i, x]:
                    j = i
                    break
            out[b, :j] = draft_tokens[b, :j]
            out[b, j] = int(sample(p_target[b, j][None], [g]))
            n_acc[b] = j
        return n_acc, out
    return verify


@pytest.mark.parametrize("mode", ["accept_all", "resample_from_p"])
def test_sampled_distribution_planted_bug_is_detected(small_models, exact_law, monkeypatch, mode):
    """The distribution check above rejects a verifier with a planted bug overwhelmingly
    (p < 1e-9 on at least one statistic, against the 1e-3 the correct engine must pass),
    so it has the power to catch real acceptance-rule errors at this sample size."""
    monkeypatch.setattr(Request, "coupled", property(lambda self: False))  # the rejection-sampling path
    monkeypatch.setattr(acceptance_mod, "verify_sampled", buggy_verify_sampled(mode))
    target, draft = small_models
    toks, _ = sample_first_tokens(target, draft, "draft", 3, seed0=10_000)
    p = law_pvalues(toks, exact_law)
    assert min(p.values()) < 1e-9, p


# --------------------------------------------------------------------------- #
# Stop conditions (tiny model)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("draft,gamma", [(None, 0), ("truncated:4", 4), ("ngram", 8)])
def test_max_tokens_exact(tiny, hf_refs, draft, gamma):
    """max_tokens is hit exactly, even when a fully accepted draft block could overshoot."""
    for n in (1, 2, 3, 7, 13):
        res = run(make_engine(tiny), [request("r", PROMPTS[3], draft, gamma, max_tokens=n)])
        assert res["r"].token_ids == hf_refs[3][:n] and res["r"].finish_reason == "length"


@pytest.mark.parametrize("draft,gamma", [(None, 0), ("truncated:4", 4), ("draft", 3)])
def test_eos_stops_at_first_occurrence(tiny, tiny_draft, hf_refs, hf_greedy, draft, gamma):
    """Pick a token the tiny model emits greedily (first occurring at index k >= 3) as EOS:
    the output is the HF continuation up to and including its first occurrence, as HF
    generate with that eos_token_id gives; with ignore_eos it runs to max_tokens."""
    ref = hf_refs[0]
    k = next(k for k in range(3, len(ref)) if ref[k] not in ref[:k])
    eos = ref[k]
    assert hf_greedy(tiny.model, PROMPTS[0], 24, eos=eos) == ref[:k + 1]
    eng = make_engine(tiny, tiny_draft, eos={eos})
    res = run(eng, [request("a", PROMPTS[0], draft, gamma, max_tokens=24),
                    request("b", PROMPTS[0], draft, gamma, max_tokens=24, ignore_eos=True)])
    assert res["a"].token_ids == ref[:k + 1] and res["a"].finish_reason == "stop"
    assert res["b"].token_ids == ref and res["b"].finish_reason == "length"


# --------------------------------------------------------------------------- #
# Stats
# --------------------------------------------------------------------------- #
def check_stats_consistent(st: SpecStats, gamma: int) -> None:
    assert st.accepted_tokens <= st.draft_tokens <= gamma * st.drafts
    assert st.drafts <= st.target_passes
    assert sum(st.drafted_per_pos) == st.draft_tokens and sum(st.accepted_per_pos) == st.accepted_tokens
    assert st.drafted_per_pos[0] == st.drafts
    assert all(a <= d for a, d in zip(st.accepted_per_pos, st.drafted_per_pos))
    for seq in (st.drafted_per_pos, st.accepted_per_pos):
        assert all(x >= y for x, y in zip(seq, seq[1:])), seq  # monotone non-increasing
    assert all(x == 0 for x in st.drafted_per_pos[gamma:])
    if st.drafts:
        assert math.isclose(st.mean_accepted_length, 1 + st.accepted_tokens / st.drafts)
        assert math.isclose(st.acceptance_rate, st.accepted_tokens / st.draft_tokens)
        pp = st.per_position()
        assert len(pp) == sum(d > 0 for d in st.drafted_per_pos)
        assert all(0 <= x <= 1 for x in pp)
    d = st.to_dict()
    assert d["draft_tokens"] == st.draft_tokens and d["target_passes"] == st.target_passes
    assert SpecStats.from_dict(d) == st


@pytest.mark.parametrize("draft,gamma", [("ngram", 4), ("truncated:2", 3), ("draft", 2)])
def test_stats_consistent_and_aggregate(tiny, tiny_draft, draft, gamma):
    """Per-request counters are internally consistent, the tokens are accounted for
    exactly (1 from prefill + one per verify pass + the accepted drafts: drafting is
    capped by the room left, so no commit is cut by max_tokens), and the engine's
    aggregate is the sum over requests."""
    eng = make_engine(tiny, tiny_draft)
    res = run(eng, requests(draft, gamma))
    total = SpecStats()
    for seq in res.values():
        st = seq.stats
        check_stats_consistent(st, gamma)
        assert len(seq.token_ids) == 1 + st.target_passes + st.accepted_tokens
        total.add(st, times=False)
    for f in ("drafts", "draft_tokens", "accepted_tokens", "target_passes", "accepted_per_pos", "drafted_per_pos"):
        assert getattr(eng.stats, f) == getattr(total, f), f
    assert eng.stats.draft_tokens > 0
    check_stats_consistent(eng.stats, gamma)


def test_stats_full_self_draft_accepts_everything(tiny):
    """The self-draft with all layers is the target: acceptance 1.0 at every position, and
    each verify pass commits γ+1 tokens (except where capped by max_tokens)."""
    gamma = 3
    res = run(make_engine(tiny), requests("truncated:4", gamma))
    for seq, n in zip(res.values(), MAX_TOKENS):
        st = seq.stats
        assert st.acceptance_rate == 1.0 and st.accepted_tokens == st.draft_tokens
        assert st.per_position() == [1.0] * min(gamma, n - 2)  # room after t1 is n - 2
        assert st.target_passes == math.ceil((n - 1) / (gamma + 1))
        assert st.mean_accepted_length == (1 + st.accepted_tokens / st.drafts if st.drafts else 1.0)


def test_stats_gamma_zero_has_no_drafts(tiny):
    eng = make_engine(tiny)
    res = run(eng, requests(None, 0))
    for seq, n in zip(res.values(), MAX_TOKENS):
        assert seq.stats.drafts == 0 and seq.stats.draft_tokens == 0 and seq.stats.accepted_tokens == 0
        assert seq.stats.target_passes == n - 1  # one target pass per token after the prefill
        assert seq.stats.mean_accepted_length == 1.0 and seq.stats.acceptance_rate == 0.0
    assert eng.stats.draft_tokens == 0 and eng.stats.target_passes == sum(MAX_TOKENS) - len(MAX_TOKENS)


# --------------------------------------------------------------------------- #
# Continuous batching and abort
# --------------------------------------------------------------------------- #
def test_more_requests_than_slots(tiny, tiny_draft, hf_refs):
    """6 requests through 2 slots (engine and drafters): all complete, HF-equal; slots are
    reused; the streamed token deltas add up to each output; nothing is left held."""
    eng = make_engine(tiny, tiny_draft, max_batch=2)
    cfg = [("truncated:2", 3), ("ngram", 3), ("draft", 2), ("truncated:2", 1), (None, 0), ("draft", 4)]
    keys = {eng.add_request(request(f"r{i}", p, d, g, max_tokens=n)): f"r{i}"
            for i, (p, n, (d, g)) in enumerate(zip(PROMPTS, MAX_TOKENS, cfg))}
    deltas: dict[str, list] = {rid: [] for rid in keys.values()}
    slots = set()
    while eng.has_work():
        for k, d in eng.step().items():
            deltas[keys[k]].append(d)
        slots |= {s.slot for s in eng.active.values()}
        assert eng.kv_slots_in_use() <= 2 and eng.num_waiting() + eng.kv_slots_in_use() <= 6
        assert all(d.num_active() <= 2 for d in eng.drafters.values())
    res = {rid: Completion.join(ds) for rid, ds in deltas.items()}
    assert_hf_equal(res, hf_refs)
    assert slots == {0, 1}
    # every slot is free, or holds a finished prompt's KV for the prefix cache (admission may take it)
    assert eng.kv_slots_in_use() == 0 and sorted(eng.free_slots + list(eng.prefix.entries)) == [0, 1]
    assert all(eng.cache.lengths[s] == (len(t) if s in eng.prefix.entries else 0) for s, t in
               [(s, eng.prefix.entries.get(s, ())) for s in (0, 1)])
    assert all(d.num_active() == 0 for d in eng.drafters.values())


def test_abort_frees_target_and_drafter_state(tiny, tiny_draft, hf_refs):
    eng = make_engine(tiny, tiny_draft, max_batch=2)
    drafter = eng.drafters["truncated:2"]
    a = eng.add_request(request("a", PROMPTS[0], "truncated:2", 3, max_tokens=24))
    b = eng.add_request(request("b", PROMPTS[2], "truncated:2", 3, max_tokens=17))
    c = eng.add_request(request("c", PROMPTS[5], "truncated:2", 2, max_tokens=24))  # waits
    out = {k: [] for k in (a, b)}
    for _ in range(2):
        for k, d in eng.step().items():
            out[k].append(d)
    assert eng.kv_slots_in_use() == 2 and drafter.num_active() == 2 and eng.num_waiting() == 1
    slot_a = eng.active[a].slot
    assert eng.abort(a) is True
    assert eng.kv_slots_in_use() == 1 and drafter.num_active() == 1
    assert eng.cache.lengths[slot_a] == 0 and slot_a in eng.free_slots
    assert eng.abort(a) is False and eng.abort(12345) is False
    # a waiting request can be aborted too; then re-submitted (under the same request id)
    assert eng.abort(c) is True and not eng.num_waiting()
    c = eng.add_request(request("c", PROMPTS[5], "truncated:2", 2, max_tokens=24))
    out[c] = []
    while eng.has_work():
        for k, d in eng.step().items():
            out[k].append(d)
    assert Completion.join(out[b]).token_ids == hf_refs[2][:17]
    assert Completion.join(out[c]).token_ids == hf_refs[5][:24]  # reused a's slot: no stale KV
    assert eng.kv_slots_in_use() == 0 and drafter.num_active() == 0


def test_same_request_id_twice_in_flight(tiny, hf_refs):
    """Regression (defect: the engine keyed sequences by the caller's request id, so a second
    request with the same id overwrote the first). Two concurrent requests with one id and
    different prompts each complete with their own output, under their own keys."""
    eng = make_engine(tiny)
    k1 = eng.add_request(request("same", PROMPTS[0], "truncated:2", 3, max_tokens=20))
    k2 = eng.add_request(request("same", PROMPTS[2], max_tokens=17))
    assert k1 != k2
    out = {k1: [], k2: []}
    while eng.has_work():
        for k, d in eng.step().items():
            out[k].append(d)
    assert Completion.join(out[k1]).token_ids == hf_refs[0][:20]
    assert Completion.join(out[k2]).token_ids == hf_refs[2][:17]
    assert all(d.request_id == "same" for ds in out.values() for d in ds)


def test_chunked_prefill_keeps_running_streams_decoding(tiny, hf_greedy):
    """Regression (defect: every admissible prompt was prefilled in one pass before any decode
    step, stalling running streams). While a 900-token prompt is admitted under a per-step
    budget of 128 prompt tokens, each of 4 running streams commits at least one token in every
    step (counted in steps, not seconds), and every output, the long one included, still
    equals HF generate."""
    eng = make_engine(tiny, max_len=1000 - 17, prefill_chunk=128)
    runners = [eng.add_request(request(f"s{i}", PROMPTS[i], "truncated:2", 2, max_tokens=60)) for i in range(4)]
    out = {k: [] for k in runners}
    for _ in range(3):  # all four decoding
        for k, d in eng.step().items():
            out[k].append(d)
    long_prompt = rand_tokens(900, 77)
    big = eng.add_request(request("long", long_prompt, max_tokens=8))
    out[big] = []
    steps = 0
    while not out[big]:  # until the long prompt commits its first token
        step = eng.step()
        steps += 1
        for k in runners:
            assert len(step[k].token_ids) >= 1, f"stream {k} stalled in step {steps}"
        for k, d in step.items():
            out[k].append(d)
    assert steps == math.ceil(900 / 128)
    while eng.has_work():
        for k, d in eng.step().items():
            out[k].append(d)
    for i, k in enumerate(runners):
        assert Completion.join(out[k]).token_ids == hf_greedy(tiny.model, PROMPTS[i], 60, eos=None)
    assert Completion.join(out[big]).token_ids == hf_greedy(tiny.model, long_prompt, 8, eos=None)


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #
def SP(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8, **kw})


BAD = [
    (dict(prompt_ids=[]), "prompt must not be empty"),
    (dict(prompt_ids=[5, 512]), r"prompt token ids must be integers in \[0, 512\)"),
    (dict(sampling=SP(max_tokens=0)), r"sampling.max_tokens must be in \[1, 127\], got 0"),
    (dict(sampling=SP(max_tokens=MAX_LEN)), r"sampling.max_tokens must be in \[1, 127\]"),
    (dict(sampling=SP(max_tokens=MAX_LEN - 4)), r"prompt is 5 tokens; prompt \+ sampling.max_tokens"),
    (dict(sampling=SP(temperature=-0.1)), "sampling.temperature"),
    (dict(sampling=SP(temperature=float("nan"))), "sampling.temperature"),
    (dict(sampling=SP(top_p=0.0)), r"sampling.top_p must be in \[1e-06, 1\]"),
    (dict(sampling=SP(temperature=1e-300)), r"sampling.temperature must be 0 \(greedy\) or in \[0.001, 1000.0\]"),
    (dict(sampling=SP(top_p=1.5)), "sampling.top_p"),
    (dict(sampling=SP(top_k=-1)), "sampling.top_k must be >= 0"),
    (dict(sampling=SP(seed=-1)), "sampling.seed"),
    (dict(sampling=SP(stop=("",))), "sampling.stop"),
    (dict(speculation=SpeculationParams("ngram", MAX_GAMMA + 1)), rf"speculation.gamma must be in \[0, {MAX_GAMMA}\]"),
    (dict(speculation=SpeculationParams("ngram", -1)), "speculation.gamma must be in"),
    (dict(speculation=SpeculationParams("nope", 2)), "speculation.draft 'nope' is unknown"),
    (dict(request_id="x" * 129), "request_id must be a string of at most 128 bytes"),
]


@pytest.mark.parametrize("kw,msg", BAD, ids=[f"{i}-{next(iter(kw))}" for i, (kw, _) in enumerate(BAD)])
def test_bad_request_raises(tiny, kw, msg):
    """The engine validates with the request schema: the message names the field (by its path
    in the wire API) and the limit, as the router's INVALID_ARGUMENT does."""
    eng = make_engine(tiny, drafters={"ngram": NgramDrafter()})
    base = dict(request_id="x", prompt_ids=[5, 6, 7, 8, 9], sampling=SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match=msg):
        eng.add_request(Request(**{**base, **kw}))
    assert not eng.num_waiting()


def test_check_draft_compatible(tiny, tiny_draft):
    check_draft_compatible(tiny, tiny_draft)  # same vocabulary: fine
    other = LoadedModel(build_tiny(0, vocab_size=256), None, "tiny256")
    with pytest.raises(ValueError, match="vocab_size 256"):
        check_draft_compatible(tiny, other)

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    a = LoadedModel(tiny.model, Tok({"a": 0, "b": 1}), "a")
    b = LoadedModel(tiny_draft.model, Tok({"a": 1, "b": 0}), "b")
    with pytest.raises(ValueError, match="different tokenizer"):
        check_draft_compatible(a, b)
    check_draft_compatible(a, LoadedModel(tiny_draft.model, Tok({"a": 0, "b": 1}), "c"))


def test_coupled_distribution_planted_bug_is_detected(small_models, exact_law, monkeypatch):
    """Coupled acceptance is only exact if every position gets fresh noise: the planted bug
    keys the noise by the seed alone (one Gumbel vector reused at every position), which
    correlates the tokens of a request, and the joint law of (t1, t2) rejects it."""
    real = acceptance_mod.gumbel_noise
    monkeypatch.setattr(acceptance_mod, "gumbel_noise",
                        lambda seed, positions, vocab, device="cpu", generator=None:
                        real(seed, [0] * len(positions), vocab, device, generator))
    target, draft = small_models
    toks, _ = sample_first_tokens(target, draft, "ngram", 3, seed0=10_000)
    p = law_pvalues(toks, exact_law)
    assert min(p.values()) < 1e-9, p


def test_shadow_drafts_of_a_stochastic_drafter_are_never_verified(tiny, monkeypatch):
    """Regression (found by tests/cluster/test_fuzz.py): a sampled row whose auto drafter is off
    still drafts in the shadow (the policy compares those drafts with what the target commits);
    the drafter's q for them must not reach rejection sampling, which crashed the step on a
    draft of length 0 with a [k, V] q. Every row shadows here; the output is the plain one."""
    eng = make_engine(tiny)
    monkeypatch.setattr(eng.policy, "choose", lambda rows, trees=(): [0] * len(rows))
    monkeypatch.setattr(eng.policy, "wants_shadow", lambda d, free: True)
    reqs = [request(f"r{i}", p, "truncated:2", "auto", max_tokens=12, temperature=0.8)
            for i, p in enumerate(PROMPTS[:3])]
    out = run(eng, reqs)
    assert all(len(c.token_ids) == 12 for c in out.values())
    assert sum(c.stats.draft_tokens for c in out.values()) == 0  # nothing was verified from a draft
