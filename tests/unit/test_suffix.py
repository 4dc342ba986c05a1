"""Suffix decoding (actors/drafters/suffix.py) on the embedded SmolLM2 (fp32): greedy output equals
HF `generate`, batched, chains and trees, with drafts from the request and from past outputs; a
tenant's outputs never seed another tenant's drafts under scope per_token (and do under global: the
check can fail); the cache of past outputs stays within its bounds, evicting the least recently used;
and a cached token costs no more than BYTES_PER_TOKEN."""
from __future__ import annotations

import random
import tracemalloc

import pytest

from actors.build import suffix_drafter
from actors.drafters import suffix as suffix_mod
from actors.drafters.suffix import SuffixCache, SuffixDrafter, TokenIndex
from actors.engine import SpecEngine
from actors.llama import LlamaRunner
from actors.schema import Request, SamplingParams, SpeculationParams
from actors.text import encode_prompt

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
ASKS = [f"Here is some code:\n{CODE}\nRepeat it exactly, then add a mul function in the same style.",
        "Count from 1 to 20 in words, separated by commas.",
        f"Rename add to plus in this code and show the whole file:\n{CODE}"]
N = 32


def engine_with(smollm2, drafter, max_batch=3):
    return SpecEngine(LlamaRunner(smollm2.model), {"suffix": drafter}, tokenizer=smollm2.tokenizer,
                      eos_token_ids=smollm2.eos_token_ids, max_batch=max_batch, max_len=512)


def requests(tok, asks, tree=None, tenant="", n=N):
    return [Request(f"r{i}", encode_prompt(tok, messages=[{"role": "user", "content": a}]),
                    SamplingParams(max_tokens=n), SpeculationParams(draft="suffix", gamma=6, tree=tree), tenant)
            for i, a in enumerate(asks)]


@pytest.mark.parametrize("tree", [None, 12], ids=["chains", "trees"])
def test_greedy_equals_hf_generate_batched(smollm2, hf_greedy, tree):
    eng = engine_with(smollm2, SuffixDrafter(max_spec_factor=2.0))
    reqs = requests(smollm2.tokenizer, ASKS, tree)
    first = eng.generate(reqs)
    again = eng.generate(requests(smollm2.tokenizer, ASKS, tree))  # now past outputs are cached too
    for r, a, b in zip(reqs, first, again):
        want = hf_greedy(smollm2.model, r.prompt_ids, N)
        assert a.token_ids == want and b.token_ids == want
    assert sum(c.stats.accepted_tokens for c in first) > 20
    # the cached outputs supply drafts the second time: more tokens per pass
    assert sum(c.stats.accepted_tokens for c in again) > sum(c.stats.accepted_tokens for c in first)


def _recorded(drafter: SuffixDrafter) -> list:
    """Every proposal the drafter makes, as (tenant, tokens)."""
    seen, propose = [], drafter.propose

    def spy(seqs):
        p = propose(seqs)
        seen.extend((s.tenant, row.tokens) for s, row in zip(seqs, p.rows()))
        return p
    drafter.propose = spy
    return seen


@pytest.mark.parametrize("scope,isolated", [("per_token", True), ("global", False)])
def test_one_tenants_outputs_never_seed_anothers_drafts(smollm2, scope, isolated):
    """Tenant B asks what tenant A asked before. Under per_token, B's drafts are exactly those of a
    server that never saw A; under global, A's output shapes them (the check can fail)."""
    tok = smollm2.tokenizer
    fresh = _recorded(d := SuffixDrafter(scope=scope))
    engine_with(smollm2, d, 1).generate(requests(tok, ASKS[1:2], tenant="B", n=16))
    shared = SuffixDrafter(scope=scope)
    eng = engine_with(smollm2, shared, 1)
    eng.generate(requests(tok, ASKS[1:2], tenant="A", n=16))
    after = _recorded(shared)
    out = eng.generate(requests(tok, ASKS[1:2], tenant="B", n=16))[0]
    assert (after == fresh) is isolated
    assert len(out.token_ids) == 16


def test_the_cache_is_bounded_in_requests_and_bytes_least_recently_used_first():
    c = SuffixCache(max_requests=3, max_bytes=100 * suffix_mod.BYTES_PER_TOKEN)
    for i in range(3):
        c.add("", [i] * 20)
    c.touch("", 1)  # the first output supplied a draft: the second is now the least recently used
    c.add("", [7] * 20)
    assert [doc for _, doc in c.lru] == [3, 1, 4]
    c.add("", [8] * 50)  # 110 tokens > 100: the least recently used go until it fits
    assert [doc for _, doc in c.lru] == [1, 4, 5] and c.tokens == 90
    assert sorted(c.indexes[""].docs) == [1, 4, 5]
    assert all(o >> 32 in (1, 4, 5) for occ in c.indexes[""].grams.values() for o in occ)
    c.add("", [9] * 101)  # larger than the whole cache: not kept
    assert c.tokens == 90
    assert SuffixDrafter(scope="per_request").cache.max_requests == 0


def test_a_cached_token_costs_at_most_bytes_per_token():
    rng = random.Random(0)
    docs = [[rng.randrange(49152) for _ in range(500)] for _ in range(20)]  # unique n-grams: the worst case
    tracemalloc.start()
    idx = TokenIndex()
    for i, d in enumerate(docs):
        idx.extend(i, d)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert used / idx.tokens() <= suffix_mod.BYTES_PER_TOKEN, used / idx.tokens()
    for i in range(0, 20, 2):  # removing and truncating leave no trace in the n-gram lists
        idx.remove(i)
    idx.truncate(1, 100)
    assert sum(len(v) for v in idx.grams.values()) == 3 * (9 * 500 + 100) - 3 * 10


def test_spec_options():
    d = suffix_drafter("suffix:scope=per_token,factor=2,min_prob=0.2,requests=5,mb=1")
    assert (d.scope, d.factor, d.min_prob, d.cache.max_requests, d.cache.max_bytes) == \
        ("per_token", 2.0, 0.2, 5, 1 << 20)
    with pytest.raises(ValueError, match="options are K=V"):
        suffix_drafter("suffix:alpha=2")
    with pytest.raises(ValueError, match="scope must be one of"):
        suffix_drafter("suffix:scope=everyone")
