"""`specd bench --local --agent`: suffix decoding against n-gram and speculation off, and the prefix
cache's TTFT, side by side in one run.

Sets (greedy): "agent" (specd/data/agent_sessions.jsonl: multi-turn coding sessions replayed turn by
turn, each turn re-sending the history with the model's own earlier answers), "repetitive"
(answers that repeat their input) and "chat" (the benchmark's chat prompts: where speculation must
not cost). Configurations: speculation off, and each draft under γ auto (the speculation policy),
interleaved per round in alternating order. Before each configuration's run the prefix cache is
emptied and a suffix draft's cache of past outputs starts empty, so every run sees the same state.
Per set, batch and configuration, the median over rounds of: tokens/s and its ratio to off in the
same round, acceptance α, tokens per target pass, and the policy's share of speculated steps.

TTFT: conversations of two agent sessions back to back (ten turns, so the later turns re-send a
history of over `long_prompt` tokens), at batch 1, speculation off, replayed with the prefix cache on
and off (interleaved per round); the first-token latency of every turn whose prompt holds at least
`long_prompt` tokens, median over turns and rounds, and the ratio off / on.
Writes JSON, a table, and a PNG.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from ..data import HERE, REPETITIVE, load_prompts

AGENT = HERE / "agent_sessions.jsonl"


def load_sessions(limit: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in AGENT.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def _empty_caches(eng) -> None:
    """Every cached prefix freed; every suffix draft's cache of past outputs emptied."""
    from actors.drafters.suffix import SuffixCache, SuffixDrafter

    while eng.prefix.slots:
        eng.free_slots.append(eng.prefix.evict())
    eng.free_slots.sort()
    for d in eng.drafters.values():
        if isinstance(d, SuffixDrafter):
            d.cache = SuffixCache(d.cache.max_requests, d.cache.max_bytes)


def _policy_steps(eng, draft: str) -> tuple[int, int]:
    st = (eng.policy.state()["drafters"].get(draft) if eng.policy is not None else None) or {}
    return st.get("steps", 0), st.get("speculated_steps", 0)


def _run(eng, tok, workload, draft: str, batch: int, max_tokens: int, gamma: int | str = "auto",
         tree: int | None = None) -> dict:
    """One configuration over one set: tokens, seconds, drafted/accepted, target passes, policy steps;
    and per request its first-token latency and prompt length (agent turns: one per turn)."""
    from actors.schema import Request, SamplingParams, SpeculationParams
    from actors.text import encode_prompt

    spec = (SpeculationParams(draft="none", gamma=0) if draft == "off" else
            SpeculationParams(draft=draft, gamma=gamma, tree=tree))
    acc = {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "passes": 0, "ttft": []}
    s0 = _policy_steps(eng, draft)
    for i in range(0, len(workload), batch):
        chunk = workload[i:i + batch]
        histories = [[{"role": "system", "content": w["system"]}] if "turns" in w else list(w["messages"])
                     for w in chunk]
        for turn in range(max(len(w["turns"]) if "turns" in w else 1 for w in chunk)):
            live = [b for b, w in enumerate(chunk) if "turns" not in w or turn < len(w["turns"])]
            for b in live:
                if "turns" in chunk[b]:
                    histories[b].append({"role": "user", "content": chunk[b]["turns"][turn]})
            reqs = [Request(f"{i + b}.{turn}", encode_prompt(tok, messages=histories[b]),
                            SamplingParams(max_tokens=max_tokens), spec) for b in live]
            keys = {eng.add_request(r): (b, r) for b, r in zip(live, reqs)}
            out: dict = {k: [] for k in keys}
            t0 = time.perf_counter()
            while any(not d or not d[-1].finished for d in out.values()):
                for k, d in eng.step().items():
                    if k in out:
                        if not out[k] and d.token_ids:
                            acc["ttft"].append((len(keys[k][1].prompt_ids), time.perf_counter() - t0))
                        out[k].append(d)
            acc["seconds"] += time.perf_counter() - t0
            for k, ds in out.items():
                b, _ = keys[k]
                last = ds[-1]
                acc["tokens"] += sum(len(d.token_ids) for d in ds)
                acc["drafted"] += last.stats.draft_tokens
                acc["accepted"] += last.stats.accepted_tokens
                acc["passes"] += last.stats.target_passes
                if "turns" in chunk[b]:
                    histories[b].append({"role": "assistant", "content": "".join(d.text for d in ds)})
    s1 = _policy_steps(eng, draft)
    acc["steps"], acc["speculated_steps"] = s1[0] - s0[0], s1[1] - s0[1]
    return acc


def agent_bench(model: str = "smollm2", drafts=("ngram", "suffix"), dtype: str = "auto", batches=(1, 8),
                max_tokens: int = 96, rounds: int = 3, sessions: int = 3, prompts: int = 6,
                long_prompt: int = 1000, speed: bool = True, ttft: bool = True, progress: bool = True) -> dict:
    """speed / ttft: run the draft comparison / the prefix cache's TTFT part."""
    import torch
    from tqdm import tqdm

    from actors.build import build_engine
    from actors.hardware import hardware

    built = build_engine(model, {d: d for d in drafts}, dtype, max_batch=max(batches), max_len=4096)
    eng, tok = built.engine, built.target.tokenizer
    sets = {"agent": load_sessions(max(sessions, max(batches))),
            "repetitive": load_prompts(REPETITIVE)[:prompts],
            "chat": [p for p in load_prompts() if p.get("kind") == "chat"][:prompts]}
    configs = ["off", *drafts]
    pairs = load_sessions(2 * sessions)
    long_talks = [{"system": a["system"], "turns": a["turns"] + b["turns"]} for a, b in zip(pairs[::2], pairs[1::2])]
    runs: dict = {}
    firsts: dict = {"on": [], "off": []}
    bar = tqdm(total=rounds * (speed * len(sets) * len(batches) * len(configs) + 2 * ttft), desc="agent bench",
               disable=not progress)
    with torch.inference_mode():
        for r in range(rounds):
            for name, work in sets.items() if speed else ():
                for batch in batches:
                    w = work[:sessions] if name == "agent" and batch == 1 else work
                    for cfg in (configs if r % 2 == 0 else configs[::-1]):
                        _empty_caches(eng)
                        runs.setdefault((name, batch, cfg), []).append(_run(eng, tok, w, cfg, batch, max_tokens))
                        bar.update(1)
            for on in ((True, False) if r % 2 == 0 else (False, True)) if ttft else ():  # TTFT of long later turns
                _empty_caches(eng)
                eng.prefix.on = on
                a = _run(eng, tok, long_talks, "off", 1, max_tokens)
                firsts["on" if on else "off"] += [t for n, t in a["ttft"] if n >= long_prompt]
                bar.update(1)
            eng.prefix.on = True
    bar.close()
    rows = []
    for (name, batch, cfg), rs in runs.items():
        base = runs[(name, batch, "off")]
        med = lambda f: statistics.median(f(x, b) for x, b in zip(rs, base))  # noqa: E731
        rows.append({"set": name, "batch": batch, "config": cfg,
                     "tokens_per_s": med(lambda x, b: x["tokens"] / x["seconds"]),
                     "vs_off": med(lambda x, b: (x["tokens"] / x["seconds"]) / (b["tokens"] / b["seconds"])),
                     "acceptance": med(lambda x, b: x["accepted"] / x["drafted"] if x["drafted"] else 0.0),
                     "tokens_per_pass": med(lambda x, b: x["tokens"] / x["passes"] if x["passes"] else 0.0),
                     "speculated_share": med(lambda x, b: x["speculated_steps"] / x["steps"] if x["steps"] else 0.0)})
    for row in rows:  # suffix against n-gram, same set and batch
        ng = next((x for x in rows if x["set"] == row["set"] and x["batch"] == row["batch"] and x["config"] == "ngram"),
                  None)
        row["vs_ngram"] = row["tokens_per_s"] / ng["tokens_per_s"] if ng else None
    t_on, t_off = (statistics.median(firsts[k]) if firsts[k] else None for k in ("on", "off"))
    return {"model": model, "dtype": eng.info.get("dtype"), "hardware": hardware("cpu"), "rounds": rounds,
            "max_tokens": max_tokens, "sessions": sessions, "prompts": prompts, "rows": rows,
            "ttft": {"long_prompt": long_prompt, "turns": len(firsts["on"]) // rounds, "on_s": t_on, "off_s": t_off,
                     "off_over_on": t_off / t_on if t_on and t_off else None}}


def render(rep: dict) -> str:
    hw = rep["hardware"]
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"suffix decoding and prefix caching, {rep['model']} ({rep['dtype']}), {hw.get('name')} "
             f"({', '.join(hw.get('flags', []))}), {hw.get('threads')} threads; greedy, up to {rep['max_tokens']} "
             f"tokens, median of {rep['rounds']} rounds, γ auto",
             f"{'set':<10} {'batch':>5} {'config':<7} {'tok/s':>7} {'×off':>6} {'×ngram':>7} {'α':>5} "
             f"{'tok/pass':>8} {'spec share':>10}"]
    for r in sorted(rep["rows"], key=lambda r: (r["set"], r["batch"], r["config"] != "off", r["config"])):
        lines.append(f"{r['set']:<10} {r['batch']:>5} {r['config']:<7} {r['tokens_per_s']:7.1f} {r['vs_off']:6.2f} "
                     f"{f(r['vs_ngram'], '7.2f')} {r['acceptance']:5.2f} {r['tokens_per_pass']:8.2f} "
                     f"{r['speculated_share']:10.0%}")
    t = rep["ttft"]
    lines.append(f"TTFT of agent turns with prompts >= {t['long_prompt']} tokens ({t['turns']} per round): prefix "
                 f"cache on {f(t['on_s'] and 1e3 * t['on_s'], '.0f')} ms, off {f(t['off_s'] and 1e3 * t['off_s'], '.0f')}"
                 f" ms: {f(t['off_over_on'], '.1f')}× lower")
    return "\n".join(lines)


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["set"], r["batch"]) for r in rep["rows"]})
    configs = sorted({r["config"] for r in rep["rows"]}, key=lambda c: (c != "off", c))
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / len(configs)
    for j, c in enumerate(configs):
        ys = [next((r["vs_off"] for r in rep["rows"] if (r["set"], r["batch"]) == k and r["config"] == c), 0)
              for k in keys]
        ax.bar([i + j * w for i in range(len(keys))], ys, w, label=c)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + w * (len(configs) - 1) / 2 for i in range(len(keys))], [f"{s}\nbatch {b}" for s, b in keys])
    ax.set_ylabel("tokens/s × speculation off")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(args) -> int:
    rep = agent_bench(args.model, tuple(args.draft or ("ngram", "suffix")), args.dtype,
                      tuple(int(b) for b in args.batch_sizes.split(",")),
                      args.max_tokens if args.max_tokens is not None else 96, args.rounds or 3)
    out = Path(args.json_path or "out/bench_agent.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1))
    text = render(rep)
    out.with_suffix(".txt").write_text(text)
    plot(rep, out.with_suffix(".png"))
    print(text)
    print(f"wrote {out} (.txt, .png)")
    return 0
