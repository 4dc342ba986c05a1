"""`specd bench --local --paged`: the paged KV cache against the slotted one, at equal KV memory.

One target (the embedded model, as `build_engine` loads it), several engines over it, each with its
own KV cache; no drafts (γ 0), so that only the cache differs. Interleaved per round:

  decode   batch 1 and 8, the chat and code prompts, --max-tokens each: tokens/s with the slotted
           cache (one block of max_len per slot) and with blocks of each --kv-blocks size, and their
           ratio to the slotted cache in the same round: the block size is chosen from this.
  mixed    --requests requests at once, prompts log-uniform in 100-4,000 tokens (windows of the
           benchmark prompts' text, tiled), --max-tokens 32 each, at equal KV memory: the slotted
           cache at 8 slots × max_len 4,096 against blocks of the default size with 8× the slots.
           Per cache: wall time, generated tokens/s, the most requests running at once (prefilling
           or decoding), preemptions, TTFT p50.
  prefix   the agent sessions' later turns (`specd bench --local --agent`'s TTFT part) with the
           prefix cache on, at batch 1: TTFT of the turns of >= 1,000 prompt tokens, each cache.

Writes out/bench_paged.{json,txt,png}.
"""
from __future__ import annotations

import math
import random
import statistics
import time
import uuid
from pathlib import Path

import torch

from .records import write_report

MIXED_SLOTS, MIXED_LEN, MIXED_SCALE = 8, 4096, 8  # the slotted cache's shape; the paged cache's slot factor


def _engine(built, block: int | None, max_batch: int, max_len: int, kv_memory: int | None = None):
    from actors.engine import SpecEngine

    e = built.engine
    return SpecEngine(e.target, {}, tokenizer=built.target.tokenizer, eos_token_ids=e.eos, max_batch=max_batch,
                      max_len=max_len, pass_cost=e.pass_cost, kv_block=block, kv_memory=kv_memory)


def _requests(prompts: list[list[int]], max_tokens: int):
    from actors.schema import Request, SamplingParams, SpeculationParams

    return [Request(uuid.uuid4().hex, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    SpeculationParams(draft="none", gamma=0)) for p in prompts]


def _decode(eng, prompts, batch: int, max_tokens: int) -> float:
    n, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        n += sum(len(c.token_ids) for c in eng.generate(_requests(prompts[i:i + batch], max_tokens)))
    return n / (time.perf_counter() - t0)


def _mixed(eng, prompts, max_tokens: int) -> dict:
    """Every request at once; per step the running count; TTFT per request."""
    keys = {eng.add_request(r): time.perf_counter() for r in _requests(prompts, max_tokens)}
    first, peak, tokens, t0 = {}, 0, 0, time.perf_counter()
    while eng.has_work():
        out = eng.step()
        peak = max(peak, len(eng.active))
        for k, d in out.items():
            tokens += len(d.token_ids)
            if d.token_ids and k not in first:
                first[k] = time.perf_counter() - keys[k]
    wall = time.perf_counter() - t0
    b = eng.batcher
    return {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "peak_running": peak,
            "preemptions": b.preemptions, "ttft_p50_s": statistics.median(first.values()),
            "prefill_share": b.prefill_s / wall, "verify_share": b.verify_s / wall,
            "decode_passes": b.target_passes, "rows_per_decode_pass": b.rows_verified / max(b.target_passes, 1)}


def mixed_prompts(tok, n: int, seed: int = 0, lo: int = 100, hi: int = 4000) -> list[list[int]]:
    """n prompts of log-uniform lengths in [lo, hi]: windows of the benchmark prompts' text, tiled."""
    from ..data import load_prompts

    text = " ".join(p.get("prompt") or " ".join(m["content"] for m in p["messages"]) for p in load_prompts())
    ids = tok(text)["input_ids"]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        start = rng.randrange(len(ids))
        out.append([ids[(start + i) % len(ids)] for i in range(length)])
    return out


def _prefix_ttft(built, engines: dict, rounds: int, sessions: int = 3, long_prompt: int = 1000) -> dict:
    from .agent import _empty_caches, _run, load_sessions

    pairs = load_sessions(2 * sessions)
    talks = [{"system": a["system"], "turns": a["turns"] + b["turns"]} for a, b in zip(pairs[::2], pairs[1::2])]
    firsts = {name: [] for name in engines}
    for r in range(rounds):
        for name, eng in (engines.items() if r % 2 == 0 else reversed(engines.items())):
            _empty_caches(eng)
            a = _run(eng, built.target.tokenizer, talks, "off", 1, 48)
            firsts[name] += [t for n, t in a["ttft"] if n >= long_prompt]
    return {name: statistics.median(v) if v else None for name, v in firsts.items()}


def paged_bench(blocks=(16, 64), rounds: int = 3, max_tokens: int = 64, limit: int = 8, requests: int = 64,
                mixed_tokens: int = 32, dtype: str = "auto", progress=print) -> dict:
    from actors.build import build_engine
    from actors.schema import KV_BLOCK

    from ..data import load_prompts

    built = build_engine("smollm2", [], dtype, max_batch=8, max_len=MIXED_LEN)
    tok = built.target.tokenizer
    from actors.text import encode_prompt

    chat = [encode_prompt(tok, **({"messages": p["messages"]} if "messages" in p else {"prompt": p["prompt"]}))
            for p in load_prompts()][:limit]
    decode = {"slotted": _engine(built, None, 8, 1024), **{f"block {b}": _engine(built, b, 8, 1024) for b in blocks}}
    tps = {B: {name: [] for name in decode} for B in (1, 8)}
    with torch.inference_mode():
        for eng in decode.values():  # first-call allocations, untimed
            _decode(eng, chat[:1], 1, 4)
        for r in range(rounds):
            for B in (1, 8):
                for name, eng in (decode.items() if r % 2 == 0 else reversed(decode.items())):
                    tps[B][name].append(_decode(eng, chat, B, max_tokens))
            progress(f"decode round {r + 1}/{rounds}")
        positions = built.engine.target.bytes_per_position()
        memory = MIXED_SLOTS * (MIXED_LEN + 17) * positions  # the slotted cache's bytes (KV_HEADROOM = 17)
        prompts = mixed_prompts(tok, requests)
        mixed = {}
        for name, block, slots in (("slotted", None, MIXED_SLOTS), ("paged", KV_BLOCK, MIXED_SLOTS * MIXED_SCALE)):
            eng = _engine(built, block, slots, MIXED_LEN, None if block is None else memory)
            mixed[name] = _mixed(eng, prompts, mixed_tokens)
            mixed[name]["kv_bytes"] = eng.kv_usage()["kv_bytes_reserved"]
            progress(f"mixed {name}: {mixed[name]['tokens_per_s']:.1f} tok/s, peak {mixed[name]['peak_running']}")
            del eng
        prefix = {"slotted": _engine(built, None, 8, MIXED_LEN), "paged": _engine(built, KV_BLOCK, 8, MIXED_LEN)}
        ttft = _prefix_ttft(built, prefix, rounds)
    ratio = {B: {name: statistics.median(a / b for a, b in zip(v, row["slotted"])) for name, v in row.items()}
             for B, row in tps.items()}
    return {"hardware": built.engine.info["hardware"], "dtype": built.dtype, "threads": torch.get_num_threads(),
            "rounds": rounds, "default_block": KV_BLOCK, "decode": {"max_tokens": max_tokens, "prompts": len(chat),
            "tokens_per_s": {B: {n: statistics.median(v) for n, v in row.items()} for B, row in tps.items()},
            "vs_slotted": ratio, "rounds": tps},
            "mixed": {"requests": requests, "max_tokens": mixed_tokens, "prompt_tokens": [len(p) for p in prompts],
                      "kv_memory_bytes": memory, "slots": {"slotted": MIXED_SLOTS, "paged": MIXED_SLOTS * MIXED_SCALE},
                      **mixed, "peak_ratio": mixed["paged"]["peak_running"] / mixed["slotted"]["peak_running"],
                      "throughput_ratio": mixed["paged"]["tokens_per_s"] / mixed["slotted"]["tokens_per_s"]},
            "prefix_ttft_s": {**ttft, "paged_over_slotted": ttft["paged"] / ttft["slotted"]
                              if ttft["paged"] and ttft["slotted"] else None}}


def render(rep: dict) -> str:
    hw = rep["hardware"]
    d, m, p = rep["decode"], rep["mixed"], rep["prefix_ttft_s"]
    lines = [f"specd bench --local --paged  ({hw.get('name')}, flags {' '.join(hw.get('flags', []))}, "
             f"{rep['threads']} threads, {rep['dtype']}, median of {rep['rounds']} rounds, interleaved)", "",
             f"decode, γ 0, {d['prompts']} prompts × {d['max_tokens']} tokens: tokens/s (÷ slotted, same round)"]
    for B, row in d["tokens_per_s"].items():
        lines.append(f"  batch {B}: " + ", ".join(f"{n} {v:.1f} ({d['vs_slotted'][B][n]:.3f}×)" for n, v in row.items()))
    lines += ["", f"mixed: {m['requests']} requests at once, prompts {min(m['prompt_tokens'])}-{max(m['prompt_tokens'])} "
              f"tokens (log-uniform, mean {statistics.mean(m['prompt_tokens']):.0f}), {m['max_tokens']} new each, "
              f"KV {m['kv_memory_bytes'] / 2**30:.2f} GiB for both"]
    for n in ("slotted", "paged"):
        r = m[n]
        lines.append(f"  {n:8s} {m['slots'][n]:3d} slots: {r['tokens_per_s']:.1f} tok/s, {r['seconds']:.1f} s, peak "
                     f"{r['peak_running']} running, {r['preemptions']} preemptions, TTFT p50 {r['ttft_p50_s']:.2f} s; "
                     f"prefill {r['prefill_share']:.0%} of the time, decode passes {r['verify_share']:.0%} "
                     f"({r['decode_passes']} of {r['rows_per_decode_pass']:.1f} rows on average)")
    lines.append(f"  paged ÷ slotted: peak running {m['peak_ratio']:.2f}×, throughput {m['throughput_ratio']:.2f}×")
    lines += ["", "prefix-cache TTFT, agent turns >= 1,000 prompt tokens: " + ", ".join(
        f"{n} {v * 1e3:.0f} ms" for n, v in p.items() if n != "paged_over_slotted" and v is not None)
        + (f" (paged ÷ slotted {p['paged_over_slotted']:.2f}×)" if p.get("paged_over_slotted") else "")]
    return "\n".join(lines)


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    d = rep["decode"]["vs_slotted"]
    names = list(d[1])
    for i, B in enumerate(d):
        a.bar([x + 0.4 * i for x in range(len(names))], [d[B][n] for n in names], width=0.4, label=f"batch {B}")
    a.set_xticks([x + 0.2 for x in range(len(names))], names)
    a.axhline(1.0, color="grey", lw=0.8)
    a.set_ylabel("decode tokens/s ÷ slotted")
    a.legend()
    m = rep["mixed"]
    b.bar(["slotted", "paged"], [m["slotted"]["peak_running"], m["paged"]["peak_running"]])
    b.set_ylabel(f"most requests running at once (equal KV, {m['requests']} requests)")
    fig.tight_layout()
    fig.savefig(path)


def main(args) -> int:
    rounds = args.rounds or 3
    rep = paged_bench(rounds=rounds, max_tokens=args.max_tokens or 64, limit=args.limit or 8, dtype=args.dtype)
    text = render(rep)
    print(text)
    write_report(rep, text, plot, args.json_path, "bench_paged")
    return 0
