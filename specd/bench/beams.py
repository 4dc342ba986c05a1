"""`specd bench --local --beams 2,4`: speculative beam search against plain beam search.

Per beam width B and prompt, interleaved so machine noise hits all alike (batch 1: one beam
request at a time, as HF runs it):
  hf                 Hugging Face `generate(num_beams=B, do_sample=False)`
  engine             this engine's beam search with speculation off (γ = 0)
  engine+SPEC        the same with drafter SPEC (chains at γ), and each tree-capable drafter as a
                     token tree of N nodes
Reported: tokens/s (new tokens of the returned hypothesis), the exact-match rate with HF's
output, beam steps per target pass and the draft tokens accepted per beam step, and the KV the
search used: slots reserved (B per request) and positions copied when beams fork, against
the positions HF's cache reorder copies (every layer's cache for every beam, every step).
"""
from __future__ import annotations

import time

import torch

from actors.build import build_engine
from actors.schema import Request, SamplingParams, SpecStats, SpeculationParams
from actors.text import encode_prompt

from ..data import load_prompts


def _hf_beam(model, ids: list[int], beams: int, max_new: int, eos: list[int]) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, num_beams=beams,
                             do_sample=False, eos_token_id=eos, pad_token_id=0)
    gen = out[0, len(ids):].tolist()
    ends = [i for i, t in enumerate(gen) if t in eos]
    return gen[:ends[0] + 1] if ends else gen


def run_beams(model: str = "smollm2", beams=(2, 4), drafts=("ngram", "default"), gamma: int = 4,
              trees: tuple[int, ...] = (8,), dtype: str = "fp32", max_tokens: int = 32, prompts_path=None,
              limit: int | None = 8, device: str = "auto", progress: bool = True) -> dict:
    from tqdm import tqdm

    prompts = load_prompts(prompts_path)[:limit]
    built = build_engine(model, list(drafts), dtype, max_batch=max(beams), device=device)
    eng, target = built.engine, built.target
    tok, hf = target.tokenizer, target.model
    ids = [encode_prompt(tok, prompt=p.get("prompt"), messages=p.get("messages")) for p in prompts]
    eos = sorted(target.eos_token_ids)
    kv_bytes_per_position = eng.target.bytes_per_position(eng.cache.k.dtype)

    configs = [("hf", None, 0, None), ("engine", "none", 0, None)]
    for spec in drafts:
        configs.append((f"engine+{spec}", spec, gamma, None))
        if eng.drafters[spec].tree_drafting:
            configs += [(f"engine+{spec} tree:{n}", spec, 6, n) for n in trees]

    def run(name, spec, g, tree, B, p, n):
        if name == "hf":
            return _hf_beam(hf, p, B, n, eos), None, 0
        before = eng.cache.forked_positions
        out = eng.generate([Request("beam", p, SamplingParams(max_tokens=n, num_beams=B),
                                    SpeculationParams(draft=spec, gamma=g, tree=tree))])[0]
        return out.token_ids, out.stats, eng.cache.forked_positions - before

    for B in beams:  # warm every path once, untimed
        for c in configs:
            run(*c, B, ids[0], 4)
    rows = {(B, c[0]): {"beams": B, "config": c[0], "tokens": 0, "seconds": 0.0, "stats": SpecStats(),
                        "exact": 0, "forked": 0, "hf_reorder": 0} for B in beams for c in configs}
    bar = tqdm(total=len(ids) * len(beams) * len(configs), desc="bench --beams", unit="req", disable=not progress)
    for p in ids:
        for B in beams:
            ref = None
            for c in configs:
                t0 = time.perf_counter()
                out, stats, forked = run(*c, B, p, max_tokens)
                dt = time.perf_counter() - t0
                r = rows[(B, c[0])]
                r["seconds"] += dt
                r["tokens"] += len(out)
                r["forked"] += forked
                # HF reorders the whole cache of all B beams at each of its steps (one per token)
                r["hf_reorder"] += sum(B * (len(p) + i) for i in range(len(out)))
                if stats is not None:
                    r["stats"].add(stats)
                if c[0] == "hf":
                    ref = out
                r["exact"] += out == ref
                bar.update(1)
    bar.close()

    results = []
    for (B, name), r in rows.items():
        st: SpecStats = r["stats"]
        steps = st.target_passes + st.accepted_tokens  # each pass takes one beam step plus its accepted ones
        results.append({
            "beams": B, "config": name, "tokens": r["tokens"], "seconds": r["seconds"],
            "tokens_per_s": r["tokens"] / r["seconds"] if r["seconds"] else 0.0,
            "exact_match_with_hf": r["exact"] / len(ids),
            "target_passes": st.target_passes if name != "hf" else None,
            "beam_steps_per_pass": steps / st.target_passes if st.target_passes else None,
            "accepted_per_beam_step": st.accepted_tokens / steps if steps else None,
            "draft_tokens_per_beam_per_pass": st.draft_tokens / st.drafts if st.drafts else None,
            "kv_positions_copied_at_forks": r["forked"] if name != "hf" else None,
            "hf_cache_reorder_positions": r["hf_reorder"] if name == "hf" else None})
    for res in results:
        same = {x["config"]: x["tokens_per_s"] for x in results if x["beams"] == res["beams"]}
        res["speedup_vs_hf"] = res["tokens_per_s"] / same["hf"] if same.get("hf") else None
        res["speedup_vs_engine_no_spec"] = res["tokens_per_s"] / same["engine"] if same.get("engine") else None
    return {"model": model, "dtype": built.dtype, "hardware": eng.info.get("hardware"), "gamma": gamma,
            "max_tokens": max_tokens, "prompts": len(ids), "threads": torch.get_num_threads(),
            "kv": {"bytes_per_position": kv_bytes_per_position, "block_positions": eng.cache.block_size},
            "results": results}


def render(rep: dict) -> str:
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    def f(x, fmt="{:.2f}"):
        return "—" if x is None else fmt.format(x)
    t = Table(title=f"specd bench --local --beams  ({rep['model']}, {rep['dtype']}, {rep['prompts']} prompts, "
                    f"≤{rep['max_tokens']} new tokens, chains γ={rep['gamma']}, trees depth ≤ 6, batch 1)")
    for h in ("B", "config", "tok/s", "× HF beams", "× engine beams", "= HF", "beam steps/pass",
              "accepted/beam step", "KV positions copied"):
        t.add_column(h, justify="left" if h == "config" else "right")
    for r in rep["results"]:
        copied = r["kv_positions_copied_at_forks"] if r["config"] != "hf" else r["hf_cache_reorder_positions"]
        t.add_row(str(r["beams"]), r["config"], f(r["tokens_per_s"], "{:.1f}"), f(r["speedup_vs_hf"]),
                  f(r["speedup_vs_engine_no_spec"]), f(r["exact_match_with_hf"], "{:.0%}"),
                  f(r["beam_steps_per_pass"]), f(r["accepted_per_beam_step"]), str(copied))
    buf = StringIO()
    Console(file=buf, width=160).print(t)
    kv = rep["kv"]
    buf.write(f"hardware: {rep['hardware']}, {rep['threads']} threads\n"
              f"KV: {kv['bytes_per_position']} bytes per position, blocks of {kv['block_positions']} positions; "
              "the beams share their prompt's blocks. KV positions copied: at forks and copy-on-write for the "
              "engine, the whole cache of every beam at every step for HF (its cache reorder)\n")
    return buf.getvalue()
