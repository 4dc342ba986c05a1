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
masking. n-gram and suffix drafts copy text and are not masked. Each draft at γ auto also runs
without jump-forward drafts (`grammar.forced_drafts`: the tokens a grammar forces, drafted for a row
that drafted nothing).
`specd bench --serve --structured` runs the same workload through a local cluster over gRPC
(`serve_bench`): per concurrency (default 1 and 8), every draft the config serves at its own γ
(auto in the shipped configs), each colocated model draft also as an unmasked twin.
Writes JSON and a table.
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
                     batches=(1, 8), max_tokens: int = 128, rounds: int = 2, progress: bool = True,
                     compact: bool = False) -> dict:
    """compact: the schemas without optional whitespace (`grammar.compact_json`, vLLM's
    `disable_any_whitespace`)."""
    import torch
    from tqdm import tqdm

    from actors import grammar
    from actors.build import build_engine
    from actors.hardware import hardware
    from actors.schema import Request, SamplingParams, SpeculationParams
    from actors.text import encode_prompt

    spec = (lambda s: grammar.compact_json(json.dumps(s))) if compact else json.dumps  # noqa: E731
    built = build_engine(model, {d: d for d in drafts}, dtype, max_batch=max(batches), max_len=512)
    eng, tok = built.engine, built.target.tokenizer
    work = [(name, schema, encode_prompt(tok, messages=[{"role": "user", "content": ask}]))
            for name, schema, asks in SCHEMAS for ask in asks]
    # (draft, γ, constrained, draft masking, jump-forward): free prompts once per draft and γ, grammar
    # ones with and without masking where the draft masks, and at γ auto without jump-forward drafts
    configs = [(d, g, c, m, True) for d, g in [("none", 0)] + [(d, g) for d in drafts for g in (gamma, "auto")]
               for c in (True, False)
               for m in ((True, False) if c and d != "none" and eng.drafters[d].grammar_masking else (True,))]
    configs += [(d, "auto", True, True, False) for d in drafts]
    def run(acc: dict, batch: int, draft: str, g, constrained: bool) -> None:
        """The nine prompts, `batch` at a time, into one configuration's tally."""
        for i in range(0, len(work), batch):
            chunk = work[i:i + batch]
            reqs = [Request(f"{n}{j}", ids, SamplingParams(
                max_tokens=max_tokens, grammar=("json_schema", spec(s)) if constrained else None),
                SpeculationParams(draft=draft, gamma=g)) for j, (n, s, ids) in enumerate(chunk)]
            g0, p0 = eng.batcher.grammar_s, eng.batcher.target_passes
            t0 = time.perf_counter()
            done = eng.generate(reqs)
            acc["seconds"] += time.perf_counter() - t0
            acc["grammar_s"] += eng.batcher.grammar_s - g0
            acc["passes"] += eng.batcher.target_passes - p0
            for (_, s, _), c in zip(chunk, done):
                _count(acc, s if constrained else None, c.text, len(c.token_ids), c.stats.draft_tokens,
                       c.stats.accepted_tokens, c.finish_reason)

    runs: dict = {}
    bar = tqdm(total=rounds * len(batches) * len(configs), desc="structured bench", disable=not progress)
    try:
        with torch.inference_mode():
            for r, batch in ((r, b) for r in range(rounds) for b in batches):
                for draft, g, constrained, masking, forced in (configs if r % 2 == 0 else configs[::-1]):
                    if draft != "none":
                        eng.drafters[draft].grammar_masking = masking and type(eng.drafters[draft]).grammar_masking
                    grammar.JUMP_FORWARD = forced
                    run(runs.setdefault((batch, draft, str(g), constrained, masking, forced), _tally()),
                        batch, draft, g, constrained)
                    bar.update(1)
    finally:
        grammar.JUMP_FORWARD = True
    bar.close()
    masks = {d: type(eng.drafters[d]).grammar_masking for d in drafts}
    return {"model": model, "dtype": built.engine.info.get("dtype"), "hardware": hardware("cpu"), "gamma": gamma,
            "max_tokens": max_tokens, "rounds": rounds, "prompts": len(work), "side": "in-process",
            "compact_json": compact, "rows": _rows(runs, masks)}


def _tally() -> dict:
    return {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "valid": 0, "outputs": 0, "cut": 0,
            "grammar_s": 0.0, "passes": 0}


def _count(acc: dict, schema: dict | None, text: str, tokens: int, drafted: int, accepted: int, finish: str) -> None:
    """One output into a configuration's tally; schema: the grammar's (None: free text). An output
    cut by max_tokens before the grammar's end cannot parse and is counted apart."""
    import jsonschema

    acc["tokens"] += tokens
    acc["drafted"] += drafted
    acc["accepted"] += accepted
    if schema is None:
        return
    if finish == "length":
        acc["cut"] += 1
        return
    acc["outputs"] += 1
    try:
        jsonschema.validate(json.loads(text), schema)
        acc["valid"] += 1
    except (ValueError, jsonschema.ValidationError):
        pass


def _rows(runs: dict, masks: dict[str, bool]) -> list[dict]:
    """runs: (batch or concurrency, draft, γ, grammar, draft masking, jump-forward) -> tally; masks:
    per draft, whether it masks its drafts to a grammar (the column is "-" for the others)."""
    rows = []
    for (batch, draft, g, constrained, masking, forced), a in sorted(runs.items(),
                                                            key=lambda kv: (kv[0][0], kv[0][3] is False)):
        base = runs[(batch, "none", "0", constrained, True, True)]
        tps = a["tokens"] / a["seconds"]
        rows.append({"batch": batch, "draft": draft, "gamma": g, "grammar": constrained,
                     "draft_masking": masking if constrained and masks.get(draft) else None,
                     "jump_forward": forced if constrained and draft != "none" else None, "tokens_per_s": tps,
                     "vs_off": tps / (base["tokens"] / base["seconds"]),
                     "acceptance": a["accepted"] / a["drafted"] if a["drafted"] else None,
                     "grammar_ms_per_pass": 1e3 * a["grammar_s"] / a["passes"] if a["passes"] else None,
                     "grammar_share": a["grammar_s"] / a["seconds"],
                     "valid": a["valid"] / a["outputs"] if a["outputs"] else None, "cut_by_max_tokens": a["cut"],
                     "tokens": a["tokens"]})
    return rows


# ---------------------------------------------------------------------------------- through a cluster
def serve_config(base, drafts, concurrency):
    """The cluster `serve_bench` starts: `base` with one verifier replica (so the grammar's cost is
    one replica's accounting) wide enough for the top concurrency, remote drafts on one replica,
    only `drafts` (all when empty), and beside each colocated model draft its twin NAME-unmasked
    (`grammar_masking: false`)."""
    v = base.verifier.model_copy(update={
        "max_batch": max(base.verifier.max_batch, max(concurrency)),
        "autoscaling": base.verifier.autoscaling.model_copy(update={"min_replicas": 1, "max_replicas": 1})})
    chosen = [d for d in base.drafts if not drafts or d.name in drafts]
    missing = set(drafts or ()) - {d.name for d in chosen}
    if missing:
        raise ValueError(f"--draft {sorted(missing)}: the config serves {[d.name for d in base.drafts]}")
    one = lambda d: d.model_copy(update={"autoscaling": d.autoscaling.model_copy(  # noqa: E731
        update={"min_replicas": 1, "max_replicas": 1})}) if d.remote else d
    twins = [d.model_copy(update={"name": f"{d.name}-unmasked", "grammar_masking": False})
             for d in chosen if not d.remote and not d.model_free]
    return base.model_copy(update={"grpc_port": 0, "http_port": 0, "verifier": v,
                                   "drafts": [one(d) for d in chosen] + twins})


def serve_bench(config_path: str, drafts=(), concurrency=(1, 8), max_tokens: int = 128, rounds: int = 2,
                progress: bool = True) -> dict:
    """The structured workload through a local cluster started from `config_path` (`serve_config`),
    over gRPC with the SDK: per concurrency, each draft at its configured γ (auto in the shipped
    configs) against speculation off, with and without the grammar; a colocated model draft also
    unmasked. The grammar's cost per target pass from the verifier's batcher accounting (a Serve handle)."""
    import concurrent.futures as cf

    from ray import serve
    from tqdm import tqdm

    from actors.hardware import hardware
    from cluster import serve as S
    from cluster.config import ClusterConfig
    from cluster.serve import wait_serving
    from specd_client import SpecdClient

    from .records import verifier_stats

    cfg = serve_config(ClusterConfig.load(config_path), drafts, concurrency)
    names = [d.name for d in cfg.drafts if not d.name.endswith("-unmasked")]
    masks = {d.name: not d.remote and not d.model_free for d in cfg.drafts}
    work = [(s, ask) for _, s, asks in SCHEMAS for ask in asks]
    # (draft sent, draft reported, constrained, draft masking)
    configs = [(n, n, c, True) for n in ["none", *names] for c in (True, False)]
    configs += [(f"{n}-unmasked", n, True, False) for n in names if masks[n]]
    runs: dict = {}
    address = S.start(cfg)
    try:
        verifier = serve.get_deployment_handle("Verifier", app_name=cfg.app_name)
        with SpecdClient(address, timeout=600) as client:
            wait_serving(client, timeout=300)
            info = client.list_models()
            gammas = {d.name: str(d.default_gamma) for d in info.drafts}

            def one(sent, constrained, item, tokens):
                schema, ask = item
                return client.generate(messages=[{"role": "user", "content": ask}], max_tokens=tokens,
                                       temperature=0.0, draft=sent, gamma=0 if sent == "none" else None,
                                       grammar=("json_schema", json.dumps(schema)) if constrained else None)

            for sent, _, constrained, _ in configs:  # warm-up, untimed: every draft and schema once
                for _, s, asks in SCHEMAS:
                    one(sent, constrained, (s, asks[0]), 8)
            bar = tqdm(total=rounds * len(concurrency) * len(configs), desc="structured bench --serve",
                       disable=not progress)
            for r in range(rounds):
                for c in concurrency:
                    for sent, draft, constrained, masking in (configs if r % 2 == 0 else configs[::-1]):
                        key = (c, draft, "0" if draft == "none" else gammas.get(sent, "auto"), constrained, masking,
                               True)
                        acc = runs.setdefault(key, _tally())
                        b0 = verifier_stats(verifier)["batcher"]
                        t0 = time.perf_counter()
                        with cf.ThreadPoolExecutor(c) as ex:
                            done = list(ex.map(lambda w: one(sent, constrained, w, max_tokens), work))
                        acc["seconds"] += time.perf_counter() - t0
                        b1 = verifier_stats(verifier)["batcher"]
                        acc["grammar_s"] += b1["grammar_s"] - b0["grammar_s"]
                        acc["passes"] += b1["target_passes"] - b0["target_passes"]
                        for (s, _), res in zip(work, done):
                            st = res.spec_stats or {}
                            _count(acc, s if constrained else None, res.text, len(res.token_ids),
                                   st.get("draft_tokens", 0), st.get("accepted_tokens", 0), res.finish_reason)
                        bar.update(1)
            bar.close()
            ver = [x for x in client.stats().replicas if x.role == "verifier"]
    finally:
        S.stop()
    return {"model": info.target, "dtype": ver[0].dtype if ver else cfg.dtype, "hardware": hardware("cpu"),
            "gamma": "per draft (the config's default)", "max_tokens": max_tokens, "rounds": rounds,
            "prompts": len(work), "side": f"cluster ({config_path}, gRPC)", "rows": _rows(runs, masks)}


def render(report: dict) -> str:
    hw = report["hardware"]
    col = "batch" if report.get("side", "in-process") == "in-process" else "conc"
    lines = [f"structured output{' (compact JSON)' if report.get('compact_json') else ''}, {report['model']} "
             f"({report['dtype']}), {report.get('side', 'in-process')}, "
             f"{hw.get('name')} ({', '.join(hw.get('flags', []))}), {hw.get('threads')} threads; "
             f"{report['prompts']} prompts, {report['rounds']} rounds, greedy, up to {report['max_tokens']} tokens",
             f"{col:>5} {'draft':<12} {'γ':>4} {'grammar':>7} {'draft mask':>10} {'jump-fwd':>8} {'tok/s':>7} "
             f"{'×off':>6} {'α':>5} "
             f"{'mask ms/pass':>12} {'mask share':>10} {'valid':>6} {'cut':>4}"]
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in report["rows"]:
        dm, jf = ({None: "-", True: "on", False: "off"}[r.get(k)] for k in ("draft_masking", "jump_forward"))
        lines.append(f"{r['batch']:>5} {r['draft']:<12} {r['gamma']:>4} {str(r['grammar']):>7} {dm:>10} {jf:>8} "
                     f"{r['tokens_per_s']:7.1f} "
                     f"{r['vs_off']:6.2f} {f(r['acceptance'], '5.2f')} {f(r['grammar_ms_per_pass'], '12.2f')} "
                     f"{r['grammar_share']:10.1%} {f(r['valid'], '6.0%')} {r.get('cut_by_max_tokens', 0):>4}")
    return "\n".join(lines)


def main(args) -> int:
    """`specd bench --local --structured` or `specd bench --serve --structured [--config FILE]`."""
    from pathlib import Path

    max_tokens = args.max_tokens if args.max_tokens is not None else 128
    if args.serve:
        from cluster.config import LOCAL_CONFIG

        report = serve_bench(args.config or LOCAL_CONFIG, tuple(args.draft or ()),
                             tuple(int(c) for c in (args.concurrency or "1,8").split(",")), max_tokens,
                             args.rounds or 2)
        out = Path(args.json_path or "out/bench_structured_serve.json")
    else:
        report = structured_bench(args.model, tuple(args.draft or ("ngram", "default")),
                                  args.gamma if args.gamma is not None else 4, args.dtype,
                                  tuple(int(b) for b in args.batch_sizes.split(",")), max_tokens, args.rounds or 2,
                                  compact=args.compact_json)
        out = Path(args.json_path or "out/bench_structured.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    text = render(report)
    out.with_suffix(".txt").write_text(text)
    print(text)
    print(f"wrote {out} (.txt)")
    bad = [r for r in report["rows"] if r["grammar"] and r["valid"] is not None and r["valid"] < 1.0]
    return 1 if bad else 0
