"""`specd bench --exact`: what exact passes promise, measured (issue "lossless means identical").

  agreement  greedy output of every draft configuration (chains at γ 4 and "auto", token trees,
             beams) against `draft none`, token for token, on the committed chat and code prompts;
             and each prompt run alone against the same prompt inside a batch of 8 others
  cost       exact passes against `exact: off`, interleaved in one process: the same engine's
             decode at batch 1 and 8, tokens/s with speculation off (what exactness costs a step)

Does not know: the cluster (`specd bench --serve` reports the served agreement).
"""
from __future__ import annotations

import time
import uuid

from actors.schema import Completion, Request, SamplingParams, SpeculationParams
from actors.text import encode_prompt

from ..data import load_prompts, mixed

CONFIGS = {  # label -> SpeculationParams fields (draft None: the engine's draft of that name)
    "ngram γ4": dict(draft="ngram", gamma=4, tree=0),
    "ngram auto": dict(draft="ngram", gamma="auto"),
    "head γ4": dict(draft="default", gamma=4, tree=0),
    "head auto": dict(draft="default", gamma="auto"),
    "head tree 8": dict(draft="default", gamma=4, tree=8),
    "truncated:4 γ4": dict(draft="truncated:4", gamma=4, tree=0),
    "suffix γ4": dict(draft="suffix", gamma=4, tree=0),
}


def run(engine, prompts: list[list[int]], spec: dict, max_tokens: int, beams: int = 1) -> list[list[int]]:
    """Greedy outputs of `prompts`, all admitted at once (the engine batches them)."""
    keys = {}
    for i, ids in enumerate(prompts):
        req = Request(uuid.uuid4().hex, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, num_beams=beams),
                      SpeculationParams(**spec))
        keys[engine.add_request(req)] = i
    deltas: dict[int, list] = {i: [] for i in keys.values()}
    while engine.has_work():
        for key, d in engine.step().items():
            deltas[keys[key]].append(d)
    return [Completion.join(deltas[i]).token_ids for i in range(len(prompts))]


def first_diff(a: list[int], b: list[int]) -> int | None:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return n if n is not None or len(a) == len(b) else min(len(a), len(b))


def agreement(engine, tokenizer, n_prompts: int = 16, max_tokens: int = 128, configs=None, progress=print) -> dict:
    prompts = [encode_prompt(tokenizer, prompt=p.get("prompt"), messages=p.get("messages"))
               for p in mixed(load_prompts(), n_prompts)]
    configs = {k: v for k, v in (configs or CONFIGS).items() if v["draft"] in engine.drafters or v["draft"] == "none"}
    base = [run(engine, [p], dict(draft="none", gamma=0), max_tokens)[0] for p in prompts]
    rows = {}
    for label, spec in configs.items():
        got = [run(engine, [p], spec, max_tokens)[0] for p in prompts]
        rows[label] = [first_diff(a, b) for a, b in zip(got, base)]
        progress(f"  {label}: {sum(d is None for d in rows[label])}/{len(prompts)} identical to draft none")
    batched = []
    for i in range(len(prompts)):  # prompt i among 8 others, speculating with the first config
        others = [prompts[(i + j) % len(prompts)] for j in range(1, 9)]
        spec = next(iter(configs.values()), dict(draft="none", gamma=0))
        batched.append(first_diff(run(engine, [prompts[i]] + others, spec, max_tokens)[0], base[i]))
    rows["in a batch of 9"] = batched
    progress(f"  in a batch of 9: {sum(d is None for d in batched)}/{len(prompts)} identical")
    return {label: {"identical": sum(d is None for d in diffs), "prompts": len(diffs),
                    "first_diff": [d for d in diffs if d is not None]} for label, diffs in rows.items()}


def cost(engine, tokenizer, batches=(1, 8), max_tokens: int = 64, rounds: int = 3) -> dict:
    """Decode tokens/s with exact passes against `exact: off` on the same engine, interleaved
    (speculation off: the step's own cost)."""
    runner = engine.target
    if not runner.plans:
        return {"skipped": "the runner is not exact (nothing to compare)"}
    prompts = [encode_prompt(tokenizer, prompt=p.get("prompt"), messages=p.get("messages"))
               for p in mixed(load_prompts(), max(batches))]
    best: dict = {}
    for _ in range(rounds):
        for b in batches:
            for on in (True, False):
                runner.exact = on
                t0 = time.perf_counter()
                n = sum(map(len, run(engine, prompts[:b], dict(draft="none", gamma=0), max_tokens)))
                key = (b, on)
                best[key] = max(best.get(key, 0.0), n / (time.perf_counter() - t0))
    runner.exact = True
    return {f"batch {b}": {"exact_tok_s": best[b, True], "off_tok_s": best[b, False],
                           "cost": best[b, False] / best[b, True] - 1} for b in batches}
