"""Prefix caching (actors/prefix_cache.py) on the embedded SmolLM2 (fp32): a conversation's later
turn starts from the earlier turn's KV and prefills only the new tokens, and its greedy output
equals HF `generate` and the engine's with the cache off, batched, with n-gram chains and the
shipped EAGLE head's trees (the head reads the cached prefix's features); a shared prefix
serves two requests at once; cached slots are evicted before any request waits; the counters
count what was looked up and found."""
from __future__ import annotations

import pytest

from actors.build import make_drafter
from actors.drafters import NgramDrafter
from actors.engine import SpecEngine
from actors.llama import LlamaRunner
from actors.schema import Request, SamplingParams, SpeculationParams
from actors.text import encode_prompt

SYSTEM = ("You are a careful assistant for a small software team. Answer briefly, quote code exactly, "
          "and say so when you are unsure.")
TURNS = [["Write a Python function that returns the square of a number.", "Now make it cube the number."],
         ["What is the capital of France?", "And of Italy?"]]
N = 24


@pytest.fixture(scope="module")
def engines(smollm2):
    def make(on: bool) -> SpecEngine:
        drafters = {"ngram": NgramDrafter(), "eagle": make_drafter("default", smollm2, 4, 1024)}
        eng = SpecEngine(LlamaRunner(smollm2.model), drafters, tokenizer=smollm2.tokenizer,
                         eos_token_ids=smollm2.eos_token_ids, max_batch=4, max_len=1024)
        eng.prefix.on = on
        return eng
    return make(True), make(False)


def ask(tok, history: list[dict], draft: str, tree: int | None) -> Request:
    ids = encode_prompt(tok, messages=[{"role": "system", "content": SYSTEM}, *history])
    return Request(f"{draft} {len(history)}", ids, SamplingParams(max_tokens=N),
                   SpeculationParams(draft=draft, gamma=4, tree=tree))


@pytest.mark.parametrize("draft,tree", [("ngram", None), ("eagle", 8)])
def test_a_later_turn_reuses_the_earlier_turns_kv_and_decodes_the_same(engines, smollm2, hf_greedy, draft, tree):
    on, off = engines
    tok = smollm2.tokenizer
    hist = [[{"role": "user", "content": t[0]}] for t in TURNS]
    first = on.generate([ask(tok, h, draft, tree) for h in hist])  # two conversations, batched
    for h, c, t in zip(hist, first, TURNS):
        h += [{"role": "assistant", "content": c.text}, {"role": "user", "content": t[1]}]
    later = [ask(tok, h, draft, tree) for h in hist]
    hits, queries = on.prefix.hits, on.prefix.queries
    prefilled = on.batcher.prefill_tokens
    got = on.generate(later)
    assert on.prefix.queries - queries == sum(len(r.prompt_ids) for r in later)
    reused = on.prefix.hits - hits
    assert reused > 0.8 * sum(len(r.prompt_ids) for r in later) - 2 * 30  # all but each new turn's ~20 tokens
    assert on.batcher.prefill_tokens - prefilled == sum(len(r.prompt_ids) for r in later) - reused
    want = off.generate(later)
    for r, g, w in zip(later, got, want):
        assert g.token_ids == w.token_ids == hf_greedy(smollm2.model, r.prompt_ids, N)
        # the same drafts: the head read the cached prefix's features as if it had been prefilled
        assert g.stats.accepted_tokens == w.stats.accepted_tokens


def test_a_shared_prefix_serves_two_requests_at_once_and_cached_slots_give_way(engines, smollm2, hf_greedy):
    on, _ = engines
    tok = smollm2.tokenizer
    on.generate([ask(tok, [{"role": "user", "content": "Say hello."}], "ngram", None)])
    before = on.prefix.hit_requests
    two = [ask(tok, [{"role": "user", "content": q}], "ngram", None) for q in ("Say goodbye.", "Say thanks.")]
    got = on.generate(two)  # both start from the system prompt's KV, copied: the cached slot stays
    assert on.prefix.hit_requests - before == 2
    for r, c in zip(two, got):
        assert c.token_ids == hf_greedy(smollm2.model, r.prompt_ids, N)
    # every slot now holds a cached prefix: four new requests are all admitted at once
    assert on.kv_slots_in_use() == 0 and on.prefix.slots == on.max_batch
    four = [Request(f"x{i}", encode_prompt(tok, messages=[{"role": "user", "content": f"Count to {i + 3}."}]),
                    SamplingParams(max_tokens=4)) for i in range(4)]
    for r in four:
        on.add_request(r)
    on.step()
    assert on.num_waiting() == 0 and on.kv_slots_in_use() == 4
    while on.has_work():
        on.step()
