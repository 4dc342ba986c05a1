"""Speculative beam search returns exactly what Hugging Face's beam search returns.

`generate(num_beams=B, do_sample=False)` is the reference: on the tiny model (with an EOS that
the search actually meets, so finished hypotheses and the early-stop heuristic take part) and on
SmolLM2 in fp32 (its real EOS, chat prompts), for B = 2 and 4, with every drafter (n-gram, a
truncated self-draft as chains and as trees, a separate draft model, an EAGLE head, and the full
target as a "perfect" tree drafter so that passes take several beam steps), with prompts of mixed
lengths and ordinary requests in the same batch. A planted bug (a pass that keeps stepping while
only some beams stay on their drafts) must make it fail.
"""
from __future__ import annotations

import pytest
import torch

import actors.beam as beam_mod
from actors.beam import Advance, BeamSearch
from actors.calibrate import PassCost, grid
from actors.drafters import ModelDrafter, NgramDrafter
from actors.drafters.eagle import EagleDrafter, EagleHead
from actors.engine import SpecEngine
from actors.llama import LlamaRunner
from actors.schema import Request, SamplingParams, SpeculationParams
from helpers import chat_ids, rand_tokens

PROMPTS = [rand_tokens(7, 1), [42], rand_tokens(20, 2)]
NEW = 16
MAX_LEN = 64


def hf_beam(model, prompt: list[int], n: int, beams: int, eos, length_penalty=1.0, early_stopping=False):
    """HF beam search's best hypothesis (new tokens, up to and including the first EOS)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, num_beams=beams,
                             do_sample=False, eos_token_id=eos, pad_token_id=0, length_penalty=length_penalty,
                             early_stopping=early_stopping)
    toks = out[0, len(prompt):].tolist()
    ends = [i for i, t in enumerate(toks) if eos is not None and t in ([eos] if isinstance(eos, int) else eos)]
    return toks[:ends[0] + 1] if ends else toks


def beam_request(rid, prompt, beams, draft="none", gamma=0, tree=None, n=NEW, **kw) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=n, num_beams=beams, **kw),
                   SpeculationParams(draft=draft, gamma=gamma, tree=tree))


@pytest.fixture(scope="module")
def eos(tiny):
    """A token the tiny model's beam search emits early for PROMPTS[0]: with it as EOS, beams
    finish at different steps (the finished-hypotheses path and the stopping heuristic run)."""
    return hf_beam(tiny.model, PROMPTS[0], NEW, 2, None)[4]


@pytest.fixture(scope="module")
def tiny_engine(tiny, tiny_draft, eos):
    L = tiny.model.config.num_hidden_layers
    drafters = {"ngram": NgramDrafter(),
                "truncated:2": ModelDrafter.truncated(tiny.model, 2, max_batch=8, max_len=MAX_LEN),
                "full": ModelDrafter.truncated(tiny.model, L, max_batch=8, max_len=MAX_LEN),
                "draft": ModelDrafter(LlamaRunner(tiny_draft.model), "draft", max_batch=8, max_len=MAX_LEN),
                "eagle": EagleDrafter(EagleHead(tiny.model, torch.arange(512)).eval(), "eagle", max_batch=8,
                                      max_len=MAX_LEN)}
    return SpecEngine(LlamaRunner(tiny.model), drafters, eos_token_ids={eos}, max_batch=8, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def refs(tiny, eos):
    return {B: [hf_beam(tiny.model, p, NEW, B, eos) for p in PROMPTS] for B in (2, 4)}


DRAFTS = [("none", 0, None), ("ngram", 4, None), ("truncated:2", 4, None), ("truncated:2", 4, 8),
          ("draft", 3, None), ("draft", 3, 6), ("eagle", 4, 8), ("full", 4, None), ("full", 5, 12)]


@pytest.mark.parametrize("beams", [2, 4])
def test_tiny_beam_search_equals_hf_with_every_drafter(tiny, tiny_engine, refs, eos, hf_greedy, beams):
    """Mixed prompt lengths in one batch, plus an ordinary greedy request beside the beams (the
    batch holds 8 slots: with B = 4 the requests wait for slots and are admitted as they free)."""
    greedy_ref = hf_greedy(tiny.model, PROMPTS[2], NEW, eos=eos)
    for draft, gamma, tree in DRAFTS:
        reqs = [beam_request(f"b{i}", p, beams, draft, gamma, tree) for i, p in enumerate(PROMPTS)]
        reqs.append(Request("g", PROMPTS[2], SamplingParams(max_tokens=NEW),
                            SpeculationParams(draft=draft, gamma=gamma)))
        out = tiny_engine.generate(reqs)
        for i, ref in enumerate(refs[beams]):
            assert out[i].token_ids == ref, (draft, tree, i)
            assert out[i].finish_reason == ("stop" if ref[-1] == eos else "length")
        assert out[-1].token_ids == greedy_ref, draft
        assert tiny_engine.kv_slots_in_use() == 0
        if draft == "full" and tree:  # the target as its own drafter: several beam steps per pass
            assert out[0].stats.mean_accepted_length > 1.8, out[0].stats
    assert any(r[-1] == eos for r in refs[beams]) and any(r[-1] != eos for r in refs[beams])


def test_length_penalty_and_early_stopping_equal_hf(tiny, tiny_engine, eos):
    for lp, es in ((0.0, True), (2.0, False), (-1.0, True)):
        ref = [hf_beam(tiny.model, p, NEW, 3, eos, lp, es) for p in PROMPTS]
        out = tiny_engine.generate([beam_request(f"b{i}", p, 3, "full", 4, 8, length_penalty=lp, early_stopping=es)
                                    for i, p in enumerate(PROMPTS)])
        assert [o.token_ids for o in out] == ref, (lp, es)


def stale_advance(search: BeamSearch, log_probs, children) -> list[Advance]:
    """A plausible bug: keep stepping while the BEST beam stays on its draft; a beam that left
    its draft steps again from the last drafted node it had, so its new tokens are accepted from
    logits that do not follow it (tokens the plain search would have pruned)."""
    cur = [(i, 0, [], []) for i in range(search.B)]
    while True:
        new = search.step(torch.stack([log_probs(o, n) for o, n, _, _ in cur]))
        nxt = []
        for p, tok in new:
            o, node, toks, nodes = cur[p]
            child = children[o].get(node, {}).get(tok)
            nxt.append((o, node if child is None else child, toks + [tok], nodes + [node], child is not None))
        if search.done or not nxt[0][4]:
            return [Advance(o, toks, nodes[1:]) for o, _, toks, nodes, _ in nxt]
        cur = [x[:4] for x in nxt]


@pytest.mark.parametrize("beams", [2, 4])
def test_planted_bug_accepting_pruned_draft_tokens_fails(tiny_engine, refs, monkeypatch, beams):
    monkeypatch.setattr(beam_mod, "advance", stale_advance)
    out = tiny_engine.generate([beam_request(f"b{i}", p, beams, "truncated:2", 4, 8) for i, p in enumerate(PROMPTS)])
    assert [o.token_ids for o in out] != refs[beams]


def test_abort_frees_every_beam(tiny_engine):
    key = tiny_engine.add_request(beam_request("a", PROMPTS[2], 4, "truncated:2", 4))
    tiny_engine.step()
    tiny_engine.step()
    assert tiny_engine.kv_slots_in_use() == 4
    assert tiny_engine.abort(key)
    assert tiny_engine.kv_slots_in_use() == 0
    assert tiny_engine.drafters["truncated:2"].num_active() == 0


@pytest.mark.parametrize("field, kw, msg", [
    ("num_beams", {"num_beams": 9}, "sampling.num_beams must be in [1, 8]"),
    ("num_beams", {"num_beams": 0}, "sampling.num_beams"),
    ("temperature", {"num_beams": 2, "temperature": 0.7}, "sampling.temperature must be 0"),
    ("stop", {"num_beams": 2, "stop": ("x",)}, "sampling.stop"),
    ("length_penalty", {"num_beams": 2, "length_penalty": float("nan")}, "sampling.length_penalty"),
    ("early_stopping", {"num_beams": 2, "early_stopping": "never"}, "sampling.early_stopping"),
])
def test_invalid_beam_parameters_name_the_field(tiny_engine, field, kw, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        tiny_engine.add_request(Request("x", [5, 6], SamplingParams(max_tokens=8, **kw)))


SMOL_CHAT = ["Translate to French: The cat sleeps on the warm windowsill.",
             "Name three primary colors."]


@pytest.fixture(scope="module")
def smol_engine(smollm2):
    """ngram, and the whole target as its own draft ("truncated:30": its beam steps stay on the
    drafts whenever the beams do not fork, so passes take several steps on a real model)."""
    L = smollm2.model.config.num_hidden_layers
    drafters = {"ngram": NgramDrafter(),
                "self": ModelDrafter.truncated(smollm2.model, L, max_batch=8, max_len=128)}
    cost = PassCost({(b, t): 0.01 * b * t for b, t in grid(8)})  # (fixed γ: the policy is not consulted)
    return SpecEngine(LlamaRunner(smollm2.model), drafters, tokenizer=smollm2.tokenizer,
                      eos_token_ids=smollm2.eos_token_ids, max_batch=8, max_len=128, pass_cost=cost)


@pytest.mark.parametrize("beams", [4])  # 2 beams: the tiny model's tests above (and the cluster's)
def test_smollm2_beam_search_equals_hf(smollm2, smol_engine, beams):
    """SmolLM2 fp32, chat prompts of different lengths in one batch, its real EOS."""
    tok = smollm2.tokenizer
    prompts = [chat_ids(tok, c) for c in SMOL_CHAT]
    refs = [hf_beam(smollm2.model, p, 14, beams, sorted(smollm2.eos_token_ids)) for p in prompts]
    for draft, gamma, tree in (("ngram", 3, None), ("self", 2, 4)):
        out = smol_engine.generate([beam_request(f"b{i}", p, beams, draft, gamma, tree, n=14)
                                    for i, p in enumerate(prompts)])
        for o, ref in zip(out, refs):
            assert o.token_ids == ref, draft
            assert o.text == tok.decode(ref, skip_special_tokens=True)
        if draft == "self":
            assert out[0].stats.mean_accepted_length > 1.2, out[0].stats


def test_bench_beams_reports_speed_equality_and_kv(tmp_path):
    """`specd bench --local --beams`: every engine configuration returns HF's hypothesis, and the
    report carries tokens/s ratios, beam steps per pass and the KV copied at forks."""
    from specd.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "The three primary colors are"}\n')
    out = tmp_path / "bench.json"
    assert main(["bench", "--local", "--beams", "2", "--draft", "ngram", "--tree-budgets", "", "--prompts", str(prompts),
                 "--max-tokens", "6", "--dtype", "fp32", "--json", str(out)]) == 0
    import json
    rep = json.loads(out.with_name("bench_beams.json").read_text())
    rows = {r["config"]: r for r in rep["results"]}
    assert set(rows) == {"hf", "engine", "engine+ngram"} and rep["prompts"] == 1
    for name, r in rows.items():
        assert r["beams"] == 2 and r["exact_match_with_hf"] == 1.0 and 1 <= r["tokens"] <= 6
        assert r["tokens_per_s"] > 0 and r["speedup_vs_hf"] == pytest.approx(r["tokens_per_s"] / rows["hf"]["tokens_per_s"])
    assert rows["engine"]["beam_steps_per_pass"] == 1.0 and rows["engine"]["accepted_per_beam_step"] == 0
    assert rows["engine"]["kv_positions_copied_at_forks"] > 0  # the prompt's last, partial block (copy-on-write)
    assert rows["hf"]["hf_cache_reorder_positions"] > rows["engine"]["kv_positions_copied_at_forks"]
    assert rep["kv"]["block_positions"] == 16 and rep["kv"]["bytes_per_position"] > 0
    assert out.with_name("bench_beams.txt").read_text().count("engine+ngram") == 1


def test_beams_under_gamma_auto_do_not_speculate(tiny_engine, refs):
    """`gamma: auto` never drafts for beams (measured a loss: a pass rarely takes a second beam
    step); an explicit γ still does. Both return HF's hypothesis."""
    auto, fixed = tiny_engine.generate([beam_request("a", PROMPTS[0], 2, "ngram", "auto"),
                                        beam_request("f", PROMPTS[0], 2, "ngram", 4)])
    assert auto.token_ids == fixed.token_ids == refs[2][0]
    assert auto.stats.draft_tokens == 0 and fixed.stats.draft_tokens > 0
