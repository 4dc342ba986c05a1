"""Structured output under speculation (actors/grammar.py) on the embedded SmolLM2 (fp32): greedy
output with a grammar is identical with speculation off and on (n-gram and a truncated self-draft,
a requested token tree included), every output parses and validates against its schema and ends
with finish_reason "stop", and a plausible masking bug is caught."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

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
CONFIGS = [("none", 0, None), ("ngram", 4, None), ("truncated:8", 4, None), ("ngram", 4, 16)]


@pytest.fixture(scope="module")
def engine(smollm2):
    m = smollm2.model
    drafters = {"ngram": NgramDrafter(), "truncated:8": ModelDrafter.truncated(m, 8, max_batch=4, max_len=512)}
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
    outs = {}
    for draft, gamma, tree in CONFIGS:
        done = engine.generate(structured(smollm2.tokenizer, draft, gamma, tree))
        for (name, (schema, _)), c in zip(SCHEMAS.items(), done):
            jsonschema.validate(json.loads(c.text), schema)
            assert c.finish_reason == "stop", (name, draft, c.text)
        outs[(draft, gamma, tree)] = [c.token_ids for c in done]
        if draft != "none":
            assert sum(c.stats.draft_tokens for c in done) > 0
    assert all(v == outs[("none", 0, None)] for v in outs.values()), outs


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
    """The check can fail: a plausible bug masks every position of a chain by the committed state
    alone (not after the drafts before it). With speculation on, the target then accepts tokens
    the grammar forbids there: the engine refuses to commit them, or the output changes."""
    def stale(self, logits, drafts):
        import llguidance.torch as lt

        lt.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        for j in range(len(drafts) + 1):
            lt.apply_token_bitmask_inplace(logits[j:j + 1], self.bitmask[:1])
    ref = [c.token_ids for c in engine.generate(structured(smollm2.tokenizer, "none", 0, None))]
    monkeypatch.setattr(grammar_mod.Constraint, "mask", stale)
    try:
        got = [c.token_ids for c in engine.generate(structured(smollm2.tokenizer, "ngram", 4, None))]
    except RuntimeError as e:
        assert "the grammar refused committed token" in str(e)
        for key in list(engine.active):  # leave the module's engine clean for the other tests
            engine.abort(key)
        return
    assert got != ref
