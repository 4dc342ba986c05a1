"""Structured output under speculation (actors/grammar.py) on the embedded SmolLM2 (fp32): greedy
output with a grammar is identical with speculation off and on (n-gram and a truncated self-draft,
its drafts masked to the grammar and not, a requested token tree included: masked per node), every
output parses and validates against its schema and ends with finish_reason "stop", and a plausible
masking bug is caught."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

import actors.engine as engine_mod
import actors.grammar as grammar_mod
from actors.drafters import ModelDrafter, NgramDrafter
from actors.engine import SpecEngine
from actors.llama import LlamaRunner
from actors.schema import Request, SamplingParams, SpeculationParams
from actors.text import encode_prompt

SCHEMAS = {
    "flat record": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                      "city": {"type": "string"}},
                     "required": ["name", "age", "city"], "additionalProperties": False},
                    "Give me a JSON record for a person named Alice who is 30 and lives in Paris."),
    "nested": ({"type": "object", "properties": {
        "title": {"type": "string"},
        "author": {"type": "object", "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                   "required": ["first", "last"], "additionalProperties": False},
        "year": {"type": "integer"}}, "required": ["title", "author", "year"], "additionalProperties": False},
               "Describe the book Dune by Frank Herbert (1965) as JSON."),
    "enums": ({"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]},
        "in_stock": {"type": "boolean"}}, "required": ["color", "size", "in_stock"], "additionalProperties": False},
              "A large blue shirt that is in stock, as JSON."),
}
CONFIGS = [("none", 0, None), ("truncated:4", 4, None), ("ngram", 4, 16)]  # each drafter; chains and trees


@pytest.fixture(scope="module")
def engine(smollm2):
    m = smollm2.model
    drafters = {"ngram": NgramDrafter(), "truncated:4": ModelDrafter.truncated(m, 4, max_batch=4, max_len=512)}
    return SpecEngine(LlamaRunner(m), drafters, tokenizer=smollm2.tokenizer, eos_token_ids=smollm2.eos_token_ids,
                      max_batch=4, max_len=512)


def structured(tok, draft, gamma, tree, max_tokens=80) -> list[Request]:
    reqs = []
    for name, (schema, ask) in SCHEMAS.items():
        ids = encode_prompt(tok, messages=[{"role": "user", "content": ask}])
        r = Request(f"{name} {draft}", ids, SamplingParams(max_tokens=max_tokens,
                                                            grammar=("json_schema", json.dumps(schema))),
                    SpeculationParams(draft=draft, gamma=gamma, tree=tree))
        reqs.append(r)
    return reqs


def test_greedy_with_a_grammar_is_identical_with_speculation_and_valid(engine, smollm2):
    """Every configuration's output is the same, schema-valid and ends with "stop". The model draft
    runs with its chains masked to the grammar (`grammar.DraftMasks`, the default) and without:
    masked, it proposes fewer tokens the target must reject."""
    outs, alpha = {}, {}
    drafter = engine.drafters["truncated:4"]
    try:
        for draft, gamma, tree in CONFIGS + [("truncated:4", 4, "unmasked")]:
            drafter.grammar_masking = tree != "unmasked"
            done = engine.generate(structured(smollm2.tokenizer, draft, gamma, None if tree == "unmasked" else tree))
            for (name, (schema, _)), c in zip(SCHEMAS.items(), done):
                jsonschema.validate(json.loads(c.text), schema)
                assert c.finish_reason == "stop", (name, draft, c.text)
            outs[(draft, gamma, tree)] = [c.token_ids for c in done]
            if draft != "none":
                drafted = sum(c.stats.draft_tokens for c in done)
                assert drafted > 0
                alpha[(draft, tree)] = sum(c.stats.accepted_tokens for c in done) / drafted
    finally:
        del drafter.grammar_masking  # back to the class's
    assert all(v == outs[("none", 0, None)] for v in outs.values()), outs
    assert alpha[("truncated:4", None)] > alpha[("truncated:4", "unmasked")], alpha


def test_regex_and_choice_grammars(engine, smollm2):
    tok = smollm2.tokenizer
    ask = encode_prompt(tok, messages=[{"role": "user", "content": "Pick a color and give me a phone number."}])
    reqs = [Request("choice", ask, SamplingParams(max_tokens=20, grammar=("choice", json.dumps(["red", "green",
                                                                                                   "blue"]))),
                    SpeculationParams(draft="ngram", gamma=4)),
            Request("regex", ask, SamplingParams(max_tokens=20, grammar=("regex", r"[0-9]{3}-[0-9]{4}")),
                    SpeculationParams(draft="ngram", gamma=4))]
    choice, regex = engine.generate(reqs)
    assert choice.text in ("red", "green", "blue") and choice.finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.text) and regex.finish_reason == "stop"


def test_bad_grammars_are_refused_by_name(engine):
    for g in [("json_schema", '{"type": 5}'), ("json_schema", "{not json"), ("regex", "(unclosed"),
              ("choice", "[]"), ("yaml", "a: b")]:
        with pytest.raises(ValueError, match=r"sampling\.grammar"):
            engine.add_request(Request("bad", [1, 2], SamplingParams(max_tokens=4, grammar=g)))
    with pytest.raises(ValueError, match="sampling.grammar is not supported with sampling.num_beams"):
        engine.add_request(Request("beam", [1, 2], SamplingParams(max_tokens=4, num_beams=2,
                                                                  grammar=("json_object", ""))))
    assert not engine.has_work()


def test_a_grammar_needs_a_tokenizer(tiny):
    eng = SpecEngine(LlamaRunner(tiny.model), {}, max_batch=1, max_len=64)
    with pytest.raises(ValueError, match="sampling.grammar needs a model with a tokenizer"):
        eng.add_request(Request("r", [1, 2], SamplingParams(max_tokens=4, grammar=("json_object", ""))))


def test_the_check_catches_masks_that_ignore_the_drafts(engine, smollm2, monkeypatch):
    """The check can fail: a plausible bug masks every position of a row by the committed state
    alone (not after the drafts on its path). With speculation on, the target then accepts tokens
    the grammar forbids there: the engine refuses to commit them, or the output changes."""
    ref = [c.token_ids for c in engine.generate(structured(smollm2.tokenizer, "none", 0, None))]
    monkeypatch.setattr(grammar_mod, "feed_paths", lambda k, parents=None: [[] for _ in range(k + 1)])
    try:
        got = [c.token_ids for c in engine.generate(structured(smollm2.tokenizer, "ngram", 4, None))]
    except RuntimeError as e:
        assert "the grammar refused committed token" in str(e)
        for key in list(engine.active):  # leave the module's engine clean for the other tests
            engine.abort(key)
        return
    assert got != ref


def _fixed_drafter(token: int):
    """A deterministic drafter that proposes `token` every step."""
    import torch

    from actors.drafters.base import Drafter, Proposal

    class Fixed(Drafter):
        name = "fixed"

        def propose(self, seqs):
            return Proposal(tokens=torch.full((len(seqs), 1), token, dtype=torch.long), num_draft=[1] * len(seqs))

        def release(self, seq_id: int) -> None:
            pass
    return Fixed()


N_LAW = 200  # samples per law check: a planted bias still gives p < 1e-9, a true law p > 1e-3 but 1 run in 1000


@pytest.fixture(scope="module")
def law_engine(smollm2):
    """An engine whose drafter always proposes the digit "1". (Its pass cost is a stand-in: every
    request here has a fixed γ, so the speculation policy it feeds never decides anything.)"""
    from actors.calibrate import PassCost, grid

    tok = smollm2.tokenizer
    one = tok.encode("1", add_special_tokens=False)[0]
    return SpecEngine(LlamaRunner(smollm2.model), {"fixed": _fixed_drafter(one)}, tokenizer=tok,
                      eos_token_ids=smollm2.eos_token_ids, max_batch=100, max_len=64,
                      pass_cost=PassCost({(b, t): 0.01 * t for b, t in grid(100)}))


def _digit_law(smollm2, eng, seeded: bool):
    """Sampled requests under the grammar x=[123] with a drafter that always proposes "1": the
    digit is drawn by verification against the masked target (the draft is tested at that
    position). Returns (chi-square p-value against the masked target's law there, counts, stats)."""
    import scipy.stats
    import torch

    tok = smollm2.tokenizer
    x, eq = tok.encode("x=", add_special_tokens=False)
    digits = [tok.encode(d, add_special_tokens=False)[0] for d in "123"]
    ids = tok.encode("Pick a digit: x=", add_special_tokens=False)
    reqs = [Request(f"r{i}", ids, SamplingParams(max_tokens=6, temperature=1.0, seed=9_000 + i if seeded else None,
                                                 grammar=("regex", "x=[123]")),
                    SpeculationParams(draft="fixed", gamma=1)) for i in range(N_LAW)]
    done = eng.generate(reqs)
    assert all(c.text in ("x=1", "x=2", "x=3") and c.finish_reason == "stop" for c in done)
    counts = torch.bincount(torch.tensor([int(c.text[-1]) - 1 for c in done]), minlength=3).double()
    with torch.inference_mode():
        logits = smollm2.model(torch.tensor([ids + [x, eq]])).logits[0, -1].double()
    p = torch.softmax(logits[digits], -1)  # the target at the digit, masked to the grammar
    stats = (sum(c.stats.draft_tokens for c in done), sum(c.stats.accepted_tokens for c in done))
    return float(scipy.stats.chisquare(counts, p * N_LAW).pvalue), counts, stats


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "coupled"])
def test_sampled_output_keeps_the_masked_targets_law(smollm2, law_engine, seeded):
    pvalue, counts, (drafted, accepted) = _digit_law(smollm2, law_engine, seeded)
    assert drafted > N_LAW and 0 < accepted < drafted  # the draft was tested at the digit, and both ways
    assert pvalue > 1e-3, counts


def test_the_law_check_catches_accepting_every_allowed_draft(smollm2, law_engine, monkeypatch):
    """The check can fail: verification that accepts every draft the grammar allows (no
    rejection sampling: a one-token draft with masked probability > 0 is kept) emits "1" far more
    often than the masked target does."""
    import actors.acceptance as acceptance_mod

    def accept_all(p, q, draft, num_draft, gens):
        import torch

        from actors.sampling import sample

        ok = (p[:, 0].gather(-1, draft[:, :1]) > 0)[:, 0] & (num_draft > 0)  # [B]
        last = torch.where(ok, sample(p[:, -1], gens), sample(p[:, 0], gens))
        out = torch.stack([torch.where(ok, draft[:, 0], last), torch.where(ok, last, -1)], 1)
        return ok.long(), out
    monkeypatch.setattr(acceptance_mod, "verify_sampled", accept_all)
    pvalue, counts, _ = _digit_law(smollm2, law_engine, seeded=False)
    assert pvalue < 1e-9, counts


CHOICES = ["The quick brown fox jumps over the lazy dog near the river bank",
           "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod"]


def test_forced_tokens_are_drafted_for_free_and_change_nothing(engine, smollm2, monkeypatch):
    """Jump-forward drafts (`grammar.forced_drafts`): once a choice's first token is out, the grammar
    forces the rest; a speculating row that drafted nothing gets it as drafts and the target accepts
    it in a few passes, the output unchanged. Speculation off gets none. Without the forced drafts
    (the plausible bug: never computing them) it takes a pass per token."""
    ask = encode_prompt(smollm2.tokenizer, messages=[{"role": "user", "content": "Say a sentence."}])

    def run(draft: str, gamma: int) -> tuple[list[int], int]:
        p0 = engine.batcher.target_passes
        done = engine.generate([Request(f"choice {draft}", ask, SamplingParams(
            max_tokens=40, grammar=("choice", json.dumps(CHOICES))), SpeculationParams(draft=draft, gamma=gamma))])
        assert done[0].text in CHOICES and done[0].finish_reason == "stop"
        return done[0].token_ids, engine.batcher.target_passes - p0

    off, off_passes = run("none", 0)
    assert off_passes >= len(off) - 1  # a pass per token after the first (prefill's)
    on, on_passes = run("ngram", 4)
    assert on == off and on_passes <= len(off) // 3, (on_passes, len(off))
    monkeypatch.setattr(engine_mod, "forced_drafts", lambda rows, cost: None)
    bare, bare_passes = run("ngram", 4)
    assert bare == off and bare_passes >= len(off) - 1
