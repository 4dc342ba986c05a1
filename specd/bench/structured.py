"""`specd bench --local --structured`: structured output under speculation, side by side in one run.

A structured workload (three JSON schemas: a flat record, a nested object, an enum-heavy one; prompts
that ask for them; greedy) and the same prompts free (no grammar), at batch 1 and 8. Per
configuration (speculation off; each draft at a fixed γ and at γ auto), interleaved per round so
machine noise hits all alike:
  tokens/s with the grammar and its ratio to speculation off (with the grammar);
  the same ratio on the free workload (is JSON more predictable?);
  acceptance; the grammar's own cost (computing and applying masks: `BatcherStats.grammar_s`) per
  step and as a share of the wall time; schema-valid outputs (every one that ended must be; one
  cut by max_tokens before the grammar's end is counted apart: JSON cut short cannot parse).
A model draft (truncated, EAGLE head: `Drafter.grammar_masking`) runs twice under the grammar: with
its chain drafts masked to the grammar (`grammar.DraftMasks`, the default) and without (a draft
the grammar forbids is then only rejected at verification): acceptance with and without draft
masking. n-gram and suffix drafts copy text and are not masked.
Writes JSON and prints a table.
"""
from __future__ import annotations

import json
import time

SCHEMAS = [
    ("flat record", {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                      "city": {"type": "string"}, "email": {"type": "string"}},
                     "required": ["name", "age", "city", "email"], "additionalProperties": False},
     ["Give me a JSON record for Alice, 30, from Paris, alice@example.com.",
      "A JSON record for Bob Smith, aged 42, living in Berlin, email bob@smith.de.",
      "Make up a person and give their record as JSON."]),
    ("nested", {"type": "object", "properties": {
        "title": {"type": "string"},
        "author": {"type": "object", "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                   "required": ["first", "last"], "additionalProperties": False},
        "year": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["title", "author", "year", "tags"], "additionalProperties": False},
     ["Describe the book Dune by Frank Herbert (1965) as JSON.",
      "Describe Pride and Prejudice as a JSON object.",
      "Give a JSON description of a famous science fiction novel."]),
    ("enums", {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue", "black", "white"]}, "size": {"enum": ["S", "M", "L", "XL"]},
        "material": {"enum": ["cotton", "wool", "polyester"]}, "in_stock": {"type": "boolean"}},
        "required": ["color", "size", "material", "in_stock"], "additionalProperties": False},
     ["A large blue cotton shirt that is in stock, as JSON.",
      "A small black wool sweater, sold out, as a JSON product.",
      "Describe a white polyester jacket in size M that is in stock, as JSON."]),
]


def structured_bench(model: str = "smollm2", drafts=("ngram", "default"), gamma: int = 4, dtype: str = "auto",
                     batches=(1, 8), max_tokens: int = 128, rounds: int = 2, progress: bool = True) -> dict:
    import jsonschema
    import torch
    from tqdm import tqdm

    from actors.build import build_engine
    from actors.hardware import hardware
    from actors.schema import Request, SamplingParams, SpeculationParams
    from actors.text import encode_prompt

    built = build_engine(model, {d: d for d in drafts}, dtype, max_batch=max(batches), max_len=512)
    eng, tok = built.engine, built.target.tokenizer
    work = [(name, schema, encode_prompt(tok, messages=[{"role": "user", "content": ask}]))
            for name, schema, asks in SCHEMAS for ask in asks]
    # (draft, γ, constrained, draft masking): free prompts once per draft and γ, grammar ones with and
    # without masking where the draft masks
    configs = [(d, g, c, m) for d, g in [("none", 0)] + [(d, g) for d in drafts for g in (gamma, "auto")]
               for c in (True, False)
               for m in ((True, False) if c and d != "none" and eng.drafters[d].grammar_masking else (True,))]
    runs: dict = {}
    total = rounds * len(batches) * len(configs)
    bar = tqdm(total=total, desc="structured bench", disable=not progress)
    with torch.inference_mode():
        for r in range(rounds):
            for batch in batches:
                order = configs if r % 2 == 0 else configs[::-1]
                for draft, g, constrained, masking in order:
                    if draft != "none":
                        eng.drafters[draft].grammar_masking = masking and type(eng.drafters[draft]).grammar_masking
                    key = (batch, draft, str(g), constrained, masking)
                    acc = runs.setdefault(key, {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0,
                                                "valid": 0, "outputs": 0, "cut": 0, "grammar_s": 0.0, "passes": 0})
                    for i in range(0, len(work), batch):
                        chunk = work[i:i + batch]
                        reqs = [Request(f"{n}{j}", ids, SamplingParams(
                            max_tokens=max_tokens, grammar=("json_schema", json.dumps(s)) if constrained else None),
                            SpeculationParams(draft=draft, gamma=g)) for j, (n, s, ids) in enumerate(chunk)]
                        g0, p0 = eng.batcher.grammar_s, eng.batcher.target_passes
                        t0 = time.perf_counter()
                        done = eng.generate(reqs)
                        acc["seconds"] += time.perf_counter() - t0
                        acc["grammar_s"] += eng.batcher.grammar_s - g0
                        acc["passes"] += eng.batcher.target_passes - p0
                        for (n, s, _), c in zip(chunk, done):
                            acc["tokens"] += len(c.token_ids)
                            acc["drafted"] += c.stats.draft_tokens
                            acc["accepted"] += c.stats.accepted_tokens
                            if constrained and c.finish_reason == "length":
                                acc["cut"] += 1  # max_tokens came before the grammar's end: cannot parse
                            elif constrained:
                                acc["outputs"] += 1
                                try:
                                    jsonschema.validate(json.loads(c.text), s)
                                    acc["valid"] += 1
                                except (ValueError, jsonschema.ValidationError):
                                    pass
                    bar.update(1)
    bar.close()
    rows = []
    for (batch, draft, g, constrained, masking), a in sorted(runs.items(),
                                                            key=lambda kv: (kv[0][0], kv[0][3] is False)):
        base = runs[(batch, "none", "0", constrained, True)]
        tps = a["tokens"] / a["seconds"]
        masks = constrained and draft != "none" and type(eng.drafters[draft]).grammar_masking
        rows.append({"batch": batch, "draft": draft, "gamma": g, "grammar": constrained,
                     "draft_masking": masking if masks else None, "tokens_per_s": tps,
                     "vs_off": tps / (base["tokens"] / base["seconds"]),
                     "acceptance": a["accepted"] / a["drafted"] if a["drafted"] else None,
                     "grammar_ms_per_pass": 1e3 * a["grammar_s"] / a["passes"] if a["passes"] else None,
                     "grammar_share": a["grammar_s"] / a["seconds"],
                     "valid": a["valid"] / a["outputs"] if a["outputs"] else None, "cut_by_max_tokens": a["cut"]})
    hw = hardware("cpu")
    return {"model": model, "dtype": built.engine.info.get("dtype"), "hardware": hw, "gamma": gamma,
            "max_tokens": max_tokens, "rounds": rounds, "prompts": len(work), "rows": rows}


def render(report: dict) -> str:
    hw = report["hardware"]
    lines = [f"structured output, {report['model']} ({report['dtype']}), {hw.get('name')} "
             f"({', '.join(hw.get('flags', []))}), {hw.get('threads')} threads; {report['prompts']} prompts, "
             f"{report['rounds']} rounds, greedy, up to {report['max_tokens']} tokens",
             f"{'batch':>5} {'draft':<8} {'γ':>4} {'grammar':>7} {'draft mask':>10} {'tok/s':>7} {'×off':>6} {'α':>5} "
             f"{'mask ms/pass':>12} {'mask share':>10} {'valid':>6} {'cut':>4}"]
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in report["rows"]:
        dm = {None: "-", True: "on", False: "off"}[r.get("draft_masking")]
        lines.append(f"{r['batch']:>5} {r['draft']:<8} {r['gamma']:>4} {str(r['grammar']):>7} {dm:>10} "
                     f"{r['tokens_per_s']:7.1f} "
                     f"{r['vs_off']:6.2f} {f(r['acceptance'], '5.2f')} {f(r['grammar_ms_per_pass'], '12.2f')} "
                     f"{r['grammar_share']:10.1%} {f(r['valid'], '6.0%')} {r.get('cut_by_max_tokens', 0):>4}")
    return "\n".join(lines)


def main(args) -> int:
    from pathlib import Path

    report = structured_bench(args.model, tuple(args.draft or ("ngram", "default")),
                              args.gamma if args.gamma is not None else 4, args.dtype,
                              tuple(int(b) for b in args.batch_sizes.split(",")),
                              args.max_tokens if args.max_tokens is not None else 128, args.rounds or 2)
    out = Path(args.json_path or "out/bench_structured.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(render(report))
    print(f"wrote {out}")
    bad = [r for r in report["rows"] if r["grammar"] and r["valid"] != 1.0]
    return 1 if bad else 0
