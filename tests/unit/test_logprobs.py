"""Log-probabilities of generated tokens (`SamplingParams.logprobs`): exact under speculation.

Each emitted token's log-probability, and the k likeliest alternatives, must equal what a plain
forward of the target over prompt + output gives at that position, in fp32: log-softmax for greedy
requests, the log of the processed distribution (temperature, top-k, top-p) for sampled ones,
whatever the draft proposed and however much of it was accepted (chains and trees)."""
from __future__ import annotations

import pytest
import torch

from actors.acceptance import process
from actors.drafters import NgramDrafter
from actors.engine import SpecEngine
from actors.llama import LlamaRunner
from actors.schema import Request
from actors.sequence import Sequence
from helpers import rand_tokens, request, run

K = 3
REPETITIVE = [7, 8, 9, 10, 11] * 4  # n-gram drafts get accepted here


def reference(model, req: Request, output: list[int]) -> torch.Tensor:
    """[n, V] the target's log-distribution at each output position, by a plain fp32 forward."""
    ids = req.prompt_ids + output
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, len(req.prompt_ids) - 1:-1].float()  # [n, V]
    if req.sampling.greedy:
        return torch.log_softmax(logits, -1)
    s = Sequence(0, req, 0, list(ids), len(req.prompt_ids), 0, torch.Generator(), None)
    return torch.log(process(logits[None], [s])[0]).clamp_min(-9999.0)


@pytest.mark.parametrize("draft,gamma,tree,sampling", [
    (None, 0, None, {}),
    ("ngram", 4, None, {}),
    ("ngram", 4, 8, {}),
    ("ngram", 4, None, {"temperature": 0.8, "top_k": 50, "seed": 3}),
    ("ngram", 4, None, {"temperature": 0.5, "top_p": 0.9, "seed": 4, "rejection": True}),
])
def test_logprobs_equal_a_plain_forward(tiny, monkeypatch, draft, gamma, tree, sampling):
    """(Seeded, so each case is deterministic; "rejection": the rejection-sampling path instead of
    the coupled one a seed selects.)"""
    sampling = dict(sampling)
    if sampling.pop("rejection", False):
        monkeypatch.setattr(Request, "coupled", property(lambda self: False))
    eng = SpecEngine(LlamaRunner(tiny.model), {"ngram": NgramDrafter()}, max_batch=4, max_len=128)
    reqs = [request(f"r{i}", p, draft, gamma, max_tokens=24, logprobs=K, **sampling)
            for i, p in enumerate([REPETITIVE, rand_tokens(12, 5), REPETITIVE[3:]])]
    for r in reqs:
        r.speculation.tree = tree
    out = run(eng, reqs)
    if draft:  # speculation was exercised (greedy: drafts accepted too)
        assert sum(c.stats.draft_tokens for c in out.values()) > 0
        assert sum(c.stats.accepted_tokens for c in out.values()) > 0 or not reqs[0].sampling.greedy
    for r in reqs:
        c = out[r.request_id]
        ref = reference(tiny.model, r, c.token_ids)  # [n, V]
        assert [x.token for x in c.logprobs] == c.token_ids
        got = torch.tensor([x.logprob for x in c.logprobs])
        want = ref.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        for j, x in enumerate(c.logprobs):
            ids, vals = zip(*x.top)
            torch.testing.assert_close(torch.tensor(vals), ref[j].topk(K).values, atol=1e-4, rtol=0)
            assert set(ids) == set(ref[j].topk(K).indices.tolist()) or len(set(vals)) < K  # (ties may swap)


def test_logprobs_off_by_default_and_zero_means_the_chosen_tokens_only(tiny):
    eng = SpecEngine(LlamaRunner(tiny.model), {"ngram": NgramDrafter()}, max_batch=2, max_len=64)
    a, b = run(eng, [request("a", REPETITIVE, "ngram", 3, max_tokens=6),
                     request("b", REPETITIVE, "ngram", 3, max_tokens=6, logprobs=0)]).values()
    assert a.logprobs is None and a.token_ids == b.token_ids
    assert len(b.logprobs) == 6 and all(x.top == [] for x in b.logprobs)


def test_logprobs_are_refused_with_beam_search_and_past_the_limit(tiny):
    eng = SpecEngine(LlamaRunner(tiny.model), {}, max_batch=4, max_len=64)
    with pytest.raises(ValueError, match="sampling.logprobs is not supported with sampling.num_beams"):
        eng.add_request(request("a", [5, 6], max_tokens=4, num_beams=2, logprobs=1))
    with pytest.raises(ValueError, match=r"sampling.logprobs must be in \[0, 20\]"):
        eng.add_request(request("b", [5, 6], max_tokens=4, logprobs=21))


def test_the_check_catches_logprobs_taken_before_temperature(tiny, monkeypatch):
    """The check can fail: a plausible bug (the raw log-softmax for a sampled request, as if the
    temperature did not apply) differs from the reference by far more than the tolerance."""
    import actors.engine as engine_mod
    from actors.schema import TokenLogprob

    def raw(logits, s, tokens):
        lp = torch.log_softmax(logits.float(), -1)
        return [TokenLogprob(t, float(lp[j, t])) for j, t in enumerate(tokens)]
    monkeypatch.setattr(engine_mod, "token_logprobs", raw)
    eng = SpecEngine(LlamaRunner(tiny.model), {"ngram": NgramDrafter()}, max_batch=1, max_len=64)
    r = request("r", REPETITIVE, "ngram", 4, max_tokens=8, logprobs=0, temperature=0.5, seed=1)
    c = run(eng, [r])["r"]
    want = reference(tiny.model, r, c.token_ids).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
    assert (torch.tensor([x.logprob for x in c.logprobs]) - want).abs().max() > 1e-2
