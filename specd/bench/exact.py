"""`specd bench --exact`: what exact passes promise, measured (issue "lossless means identical").

  agreement  greedy output of every draft configuration (chains at γ 4 and "auto", token trees)
             against `draft none`, token for token, on the committed chat and code prompts; each
             prompt run alone against the same prompt inside a batch of 8 others; and beam search
             (2 beams, half the tokens) speculating against beam search without
  cost       exact passes against `exact: off`, interleaved in one process: the same engine's
             decode at batch 1 and 8, tokens/s with speculation off (what exactness costs a step)

Does not know: the cluster (`specd bench --serve` reports the served agreement).
"""
from __future__ import annotations

import time
import uuid

from actors.schema import Request, SamplingParams, SpeculationParams
from actors.text import encode_prompt

from ..data import load_prompts, mixed
from .records import write_report

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
    reqs = [Request(uuid.uuid4().hex, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, num_beams=beams),
                    SpeculationParams(**spec)) for ids in prompts]
    return [c.token_ids for c in engine.generate(reqs)]


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
    spec = next(iter(configs.values()), None)
    if spec is not None:  # beam search (2 beams) speculating with the first config, against beams without
        spec = {**spec, "gamma": 4 if spec.get("gamma") == "auto" else spec["gamma"], "tree": 0}
        beams = [first_diff(run(engine, [p], spec, max_tokens // 2, beams=2)[0],
                            run(engine, [p], dict(draft="none", gamma=0), max_tokens // 2, beams=2)[0])
                 for p in prompts]
        rows["beams 2"] = beams
        progress(f"  beams 2: {sum(d is None for d in beams)}/{len(prompts)} identical to beams without speculation")
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


def main(args) -> int:

    from actors.build import build_engine, draft_meta

    drafts = args.draft or ["ngram", "truncated:4", "suffix"] + (["default"] if draft_meta("default") else [])
    built = build_engine(args.model, drafts, args.dtype, max_batch=9, max_len=1024, device=args.device,
                         prepack=args.prepack, weights=args.weights, exact=args.exact)
    eng = built.engine
    print(f"[specd bench] target {built.dtype_reason}; {eng.info['exact']['why']}")
    n, max_tokens = args.limit or 16, args.max_tokens or 128
    print(f"agreement with draft none: {n} prompts × {max_tokens} tokens, greedy")
    agree = agreement(eng, built.target.tokenizer, n, max_tokens)
    batches = tuple(int(x) for x in args.batch_sizes.split(","))
    print(f"cost of exactness against exact off, batches {batches}, best of {args.rounds or 3} interleaved rounds")
    costs = cost(eng, built.target.tokenizer, batches, rounds=args.rounds or 3)
    report = {"model": args.model, "dtype": built.dtype, "dtype_reason": built.dtype_reason,
              "exact": eng.info["exact"], "hardware": eng.info["hardware"], "threads": __import__("torch").get_num_threads(),
              "agreement": agree, "cost": costs, "prompts": n, "max_tokens": max_tokens}
    lines = [f"specd bench --agreement ({args.model}, {built.dtype_reason})",
             f"hardware: {report['hardware']}; {report['threads']} threads",
             f"{'configuration':<18} identical to draft none"]
    lines += [f"{k:<18} {v['identical']}/{v['prompts']}" + (f" (first differences at {v['first_diff']})"
                                                           if v["first_diff"] else "") for k, v in agree.items()]
    lines += [f"{k}: exact {v['exact_tok_s']:.1f} tok/s, off {v['off_tok_s']:.1f} tok/s: exactness costs "
              f"{v['cost']:+.1%}" for k, v in costs.items() if isinstance(v, dict)]
    text = "\n".join(lines)
    print(text)
    write_report(report, text, _plot, args.json_path, "bench_exact")
    return 0


def _plot(report: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    agree = report["agreement"]
    a.barh(list(agree), [v["identical"] / v["prompts"] for v in agree.values()])
    a.set_xlim(0, 1)
    a.set_xlabel("share of prompts identical to draft none")
    costs = {k: v for k, v in report["cost"].items() if isinstance(v, dict)}
    x = range(len(costs))
    b.bar([i - 0.2 for i in x], [v["exact_tok_s"] for v in costs.values()], 0.4, label="exact")
    b.bar([i + 0.2 for i in x], [v["off_tok_s"] for v in costs.values()], 0.4, label="exact off")
    b.set_xticks(list(x), list(costs))
    b.set_ylabel("tokens/s (speculation off)")
    b.legend()
    fig.suptitle(f"exact passes: {report['dtype_reason'][:80]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
