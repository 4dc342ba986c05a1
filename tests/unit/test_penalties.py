"""Presence, frequency and repetition penalties under speculation (actors/penalties.py), on the
embedded SmolLM2 (fp32): greedy output equals a plain decoding loop that applies vLLM's
penalties to an HF forward (and HF `generate(repetition_penalty=...)`), with speculation off and
on (n-gram and a model draft, chains and trees); the log-probabilities are the penalised
distribution's; a plausible bug (drafts not counted at the positions after them) is caught; and
a model draft scores with the same penalties as the target."""
from __future__ import annotations

import pytest
import torch

import actors.penalties as penalties_mod
from actors.drafters import ModelDrafter, NgramDrafter
from actors.engine import SpecEngine
from actors.llama import LlamaRunner
from actors.schema import Request, SamplingParams, SpeculationParams
from actors.text import encode_prompt

PENALTIES = {"presence_penalty": 0.4, "frequency_penalty": 0.3, "repetition_penalty": 1.2}
ASK = "List the even numbers from 2 to 40, separated by commas, then say them again."
# "truncated:30" is the whole model as its own draft: with the penalties scored alike on both sides
# it proposes what the target chooses, so nearly every draft is accepted and counted.
CONFIGS = [("none", 0, None), ("ngram", 4, None), ("ngram", 4, 16), ("truncated:30", 4, None)]
N = 40


@pytest.fixture(scope="module")
def engine(smollm2):
    m = smollm2.model
    drafters = {"ngram": NgramDrafter(), "truncated:30": ModelDrafter.truncated(m, 30, max_batch=2, max_len=256)}
    return SpecEngine(LlamaRunner(m), drafters, tokenizer=smollm2.tokenizer, eos_token_ids=smollm2.eos_token_ids,
                      max_batch=2, max_len=256)


@pytest.fixture(scope="module")
def prompt(smollm2):
    return encode_prompt(smollm2.tokenizer, messages=[{"role": "user", "content": ASK}])


@pytest.fixture(scope="module")
def expected(smollm2, prompt):
    """Plain greedy decoding with vLLM's penalties written out here, on an HF forward: the tokens
    and each one's log-probability under the penalised distribution."""
    presence, frequency, repetition = PENALTIES.values()
    ids, out, lps, past = torch.tensor([prompt]), [], [], None
    seen = torch.zeros(smollm2.model.config.vocab_size, dtype=torch.bool)
    seen[prompt] = True  # prompt and output: the repetition penalty's set
    with torch.inference_mode():
        for _ in range(N):
            o = smollm2.model(ids, past_key_values=past, use_cache=True)
            logits, past = o.logits[0, -1].float(), o.past_key_values
            logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
            logits = logits - frequency * counts - presence * (counts > 0).float()
            tok = int(logits.argmax())
            out.append(tok)
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            seen[tok] = True
            ids = torch.tensor([[tok]])
    return out, lps


def run(engine, prompt, draft, gamma, tree, n=N, **sampling):
    req = Request(f"{draft} {tree}", prompt, SamplingParams(max_tokens=n, ignore_eos=True, **sampling),
                  SpeculationParams(draft=draft, gamma=gamma, tree=tree))
    return engine.generate([req])[0]


def test_greedy_with_penalties_is_plain_decoding_whatever_is_speculated(engine, prompt, expected):
    want, want_lp = expected
    for draft, gamma, tree in CONFIGS:
        c = run(engine, prompt, draft, gamma, tree, logprobs=0, **PENALTIES)
        assert c.token_ids == want, (draft, tree)
        # the verify pass's log-probabilities are the penalised distribution's, accepted drafts' included
        assert [x.logprob for x in c.logprobs] == pytest.approx(want_lp, abs=2e-3), (draft, tree)
        if draft != "none":
            assert c.stats.accepted_tokens >= (20 if draft == "truncated:30" else 1), (draft, tree)


def test_repetition_penalty_equals_hf_generate(engine, smollm2, prompt):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hf = smollm2.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                    repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    for draft, gamma, tree in (CONFIGS[0], CONFIGS[2]):  # off, and an n-gram tree
        assert run(engine, prompt, draft, gamma, tree, n=24, repetition_penalty=1.3).token_ids == hf.tolist()


def test_drafts_not_counted_after_them_is_caught(engine, prompt, expected, monkeypatch):
    """The plausible bug: every position of a row penalised by the committed output only. An
    accepted draft then escapes the penalty at the positions after it."""
    monkeypatch.setattr(penalties_mod, "feed_paths", lambda k, parents=None: [[] for _ in range(k + 1)])
    c = run(engine, prompt, "truncated:30", 4, None, logprobs=0, **PENALTIES)
    assert c.token_ids != expected[0] or [x.logprob for x in c.logprobs] != pytest.approx(expected[1], abs=2e-3)


def test_the_draft_scores_with_the_penalties_as_the_target_does(engine, prompt, monkeypatch):
    """The whole model as its own draft proposes exactly the target's penalised choices, so every
    draft is accepted; a draft that ignored the penalties would propose the unpenalised ones.
    (Losslessness does not depend on it: the first test holds either way.)"""
    on = run(engine, prompt, "truncated:30", 4, None, n=24, **PENALTIES)
    monkeypatch.setattr(penalties_mod.DraftPenalties, "apply", lambda self, logits, vocab_map=None: None)
    off = run(engine, prompt, "truncated:30", 4, None, n=24, **PENALTIES)
    assert on.token_ids == off.token_ids
    assert on.stats.acceptance_rate > 0.9 > off.stats.acceptance_rate, (on.stats.acceptance_rate,
                                                                       off.stats.acceptance_rate)
