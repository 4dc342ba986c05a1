"""The paged KV cache (actors/kv.py) and what the engine does with it: blocks shared by prefixes,
forks and beams with copy-on-write, every block back in the pool when requests end, and preemption
when a running batch runs out of blocks, with nothing committed lost and the output unchanged."""
from __future__ import annotations

import pytest
import torch

from actors.drafters import ModelDrafter, NgramDrafter
from actors.engine import SpecEngine
from actors.kv import KVCache, OutOfBlocks
from actors.llama import LlamaRunner
from actors.schema import Request, SamplingParams, SpeculationParams
from helpers import rand_tokens, request, run

MAX_LEN = 96
PROMPTS = [rand_tokens(n, 40 + n) for n in (5, 23, 9, 30, 14, 2)] + [[7, 8, 9, 10] * 5]


@pytest.fixture(scope="module")
def runner(tiny):
    return LlamaRunner(tiny.model).make_exact()  # row-invariant: a recomputed prefix is the same KV, bit for bit


def engine(runner, tiny, block: int | None, positions: int | None = None, max_batch: int = 8,
           prefix_cache: bool = False) -> SpecEngine:
    drafters = {"ngram": NgramDrafter(),
                "truncated:2": ModelDrafter.truncated(tiny.model, 2, max_batch=max_batch, max_len=MAX_LEN)}
    memory = None if positions is None else positions * runner.bytes_per_position()
    return SpecEngine(runner, drafters, max_batch=max_batch, max_len=MAX_LEN, kv_block=block, kv_memory=memory,
                      prefix_cache=prefix_cache)


def mixed_requests() -> list[Request]:
    """Greedy chains of every draft, a token tree, a seeded sampled request, and a beam search."""
    kinds = [("ngram", 4, {}), ("truncated:2", 3, {}), (None, 0, {}), ("ngram", 2, {"temperature": 1.0, "seed": 5}),
             ("truncated:2", 0, {})]
    reqs = [request(f"r{i}", p, d, g, max_tokens=40, **kw) for i, (p, (d, g, kw)) in enumerate(zip(PROMPTS, kinds))]
    reqs.append(Request("tree", PROMPTS[5], SamplingParams(max_tokens=40),
                        SpeculationParams(draft="truncated:2", gamma=3, tree=6)))
    reqs.append(Request("beams", PROMPTS[6], SamplingParams(max_tokens=20, num_beams=3)))
    return reqs


def test_a_shared_block_is_copied_before_it_is_written(runner, monkeypatch):
    """copy_prefix shares blocks (no copy, the pool unchanged); each sharer's first write into the
    shared partial block copies it, so two continuations of one prefix do not overwrite each other.
    A cache that skips the copy fails."""
    def share_then_write(cache):
        runner.forward(cache, [0], torch.tensor([rand_tokens(10, 1)]))
        free = cache.free_blocks
        cache.copy_prefix(0, 1, 10)
        assert cache.free_blocks == free and cache.tables[1] == cache.tables[0]
        runner.forward(cache, [1], torch.tensor([rand_tokens(5, 2)]))  # slot 1 goes on one way ...
        before = cache.read(1, 15)
        runner.forward(cache, [0], torch.tensor([rand_tokens(5, 3)]))  # ... slot 0 another
        return all(torch.equal(a, b) for a, b in zip(before, cache.read(1, 15))), cache

    kept, cache = share_then_write(runner.new_cache(2, 64, block_size=4))
    assert kept and cache.tables[1][:2] == cache.tables[0][:2] and cache.tables[1][2] != cache.tables[0][2]
    assert [cache.refs[b] for b in cache.tables[0]] == [2, 2, 1, 1]
    cache.free(1)
    cache.free(0)
    assert cache.free_blocks == cache.num_blocks

    monkeypatch.setattr(KVCache, "_shared_write", lambda self, slot, end: False)
    kept, _ = share_then_write(runner.new_cache(2, 64, block_size=4))
    assert not kept  # the planted bug: slot 0 wrote into the block slot 1 reads


def test_reserve_refuses_past_the_pool_and_changes_nothing(runner):
    cache = runner.new_cache(2, 64, block_size=4, num_blocks=5)
    runner.forward(cache, [0], torch.tensor([rand_tokens(12, 3)]))  # 3 blocks
    with pytest.raises(OutOfBlocks, match="needs 3 KV blocks"):
        runner.forward(cache, [1], torch.tensor([rand_tokens(9, 4)]))
    assert cache.free_blocks == 2 and cache.lengths == [12, 0] and cache.tables[1] == []


def test_paged_output_equals_the_slotted_cache_and_every_block_returns(runner, tiny):
    """Chains, a tree, a sampled request and a beam search on blocks of 4 positions give the slotted
    cache's output; forks and beams share blocks while they run; the pool is whole afterwards."""
    want = run(engine(runner, tiny, None), mixed_requests())
    eng = engine(runner, tiny, 4)
    shared, step = [], eng.step
    eng.step = lambda: (shared.append(sum(r > 1 for r in eng.cache.refs)), step())[1]
    got = run(eng, mixed_requests())
    assert {k: c.token_ids for k, c in got.items()} == {k: c.token_ids for k, c in want.items()}
    assert max(shared) > 0  # the beams shared their prompt's blocks
    assert eng.cache.free_blocks == eng.cache.num_blocks and eng.kv_slots_in_use() == 0


def test_preemption_finishes_every_request_with_the_unpressured_output(runner, tiny):
    """A pool of 176 positions for 8 requests of up to 70: the youngest are preempted and recomputed;
    every request still ends with the output of a run with room for all, and every token it streamed
    is in it."""
    reqs = mixed_requests()[:6] + [request("late", PROMPTS[1], "truncated:2", 4, max_tokens=40)]
    want = run(engine(runner, tiny, 4), reqs)
    eng = engine(runner, tiny, 4, positions=176)
    streamed: dict[int, list[int]] = {}
    keys = {eng.add_request(r): r.request_id for r in reqs}
    done = {}
    while eng.has_work():
        for k, d in eng.step().items():
            streamed.setdefault(k, []).extend(d.token_ids)
            if d.finished:
                done[keys[k]] = (d.finish_reason, streamed[k])
    assert eng.batcher.preemptions > 0
    assert {rid: toks for rid, (_, toks) in done.items()} == {rid: c.token_ids for rid, c in want.items()}
    assert all(reason == "length" for reason, _ in done.values())
    assert eng.cache.free_blocks == eng.cache.num_blocks


def test_a_pool_smaller_than_one_sequence_is_refused(runner, tiny):
    with pytest.raises(ValueError, match="fewer than one sequence"):
        engine(runner, tiny, 4, positions=64)
