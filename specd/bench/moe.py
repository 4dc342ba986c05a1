"""`specd bench --local --moe`: a tiny mixture-of-experts target beside its dense twin.

The twins (random weights, saved once under the specd cache as Hugging Face directories, so the
engine loads them as it loads a user's model): a Qwen3-MoE of 16 experts, 2 per token, and a Qwen3
whose MLP is as wide as those 2 experts together, with the same attention, embeddings and depth.
A token costs both the same arithmetic; a pass over many rows reads more experts than one row does.

  curve   the target pass over B rows × T tokens (B 1 and 8, T 1-16) against one token, interleaved
          across both models, median of --rounds; for the MoE the distinct experts a layer ran
  policy  the engine on both at batch 1 and 8 (n-gram and a truncated self-draft at fixed γ 4 and
          γ auto, and γ 0), interleaved per round: tokens/s, each ÷ γ 0 (median of the rounds)

The policy reads each target's own calibrated pass costs (`actors/calibrate.py`: it times the
runner at every batch and width it may choose, so the MoE's experts-per-pass growth is measured,
not assumed). Writes out/bench_moe.{json,txt,png}.
"""
from __future__ import annotations

import time
import uuid
from pathlib import Path

import torch

from actors.schema import Request, SamplingParams, SpeculationParams

from .records import write_report

SHAPE = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             head_dim=32, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False)
EXPERTS, TOP_K, EXPERT_WIDTH = 16, 2, 256
WIDTHS, BATCHES = tuple(range(1, 17)), (1, 8)
CONFIGS = {"γ0": ("none", 0), "ngram γ4": ("ngram", 4), "ngram auto": ("ngram", "auto"),
           "truncated:2 γ4": ("truncated:2", 4), "truncated:2 auto": ("truncated:2", "auto")}
VERSION = 1  # of the twins' recipe: a changed recipe writes new directories


def twins(seed: int = 0) -> dict[str, Path]:
    """{"moe": dir, "dense": dir}: the twins, built and saved on first use."""
    import transformers as T

    from actors.models import cache_dir

    root = cache_dir() / f"bench-moe-v{VERSION}-seed{seed}"
    specs = {"moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                     dict(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_WIDTH,
                          norm_topk_prob=True, intermediate_size=TOP_K * EXPERT_WIDTH)),
             "dense": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(intermediate_size=TOP_K * EXPERT_WIDTH))}
    out = {}
    for name, (cfg_cls, model_cls, kw) in specs.items():
        path = root / f"tiny-{name}"
        if not (path / "config.json").exists():
            torch.manual_seed(seed)
            model = model_cls(cfg_cls(**SHAPE, **kw))
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() >= 2:  # scaled so greedy choices are not near-ties, as the tiny test models
                        p.normal_(0.0, 0.06)
            model.save_pretrained(path)
        out[name] = path
    return out


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts with a repeated span (something for n-gram to find) and a random tail."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        span = torch.randint(3, SHAPE["vocab_size"], (8 + i % 8,), generator=g).tolist()
        out.append(span * 2 + torch.randint(3, SHAPE["vocab_size"], (4 + i % 5,), generator=g).tolist())
    return out


def _pass_ms(runner, B: int, T: int, cache, ctx: int, feeds) -> tuple[float, float | None]:
    """One timed verify pass (B rows × T tokens after `ctx` cached ones, logits for all), and the
    mean number of experts a sparse layer ran (None for a dense model)."""
    for s in range(B):
        cache.truncate(s, ctx)
    t0 = time.perf_counter()
    runner.logits(runner.forward(cache, list(range(B)), feeds[(B, T)]))
    dt = time.perf_counter() - t0
    sparse = [w.moe.active for w in runner.layers if w.moe is not None]
    return dt * 1e3, (sum(sparse) / len(sparse) if sparse else None)


def curves(runners: dict, rounds: int, ctx: int = 96, progress=print) -> dict:
    """{model: {B: {T: (median ms, experts)}}}, interleaved across models, batches and widths."""
    g = torch.Generator().manual_seed(1)
    V = SHAPE["vocab_size"]
    caches, feeds = {}, {(B, T): torch.randint(0, V, (B, T), generator=g) for B in BATCHES for T in WIDTHS}
    for name, r in runners.items():
        caches[name] = r.new_cache(max(BATCHES), ctx + max(WIDTHS) + 1)
        for s in range(max(BATCHES)):
            r.forward(caches[name], [s], torch.randint(0, V, (1, ctx), generator=g))
    times = {name: {B: {T: [] for T in WIDTHS} for B in BATCHES} for name in runners}
    experts = {name: {B: {} for B in BATCHES} for name in runners}
    for rnd in range(rounds + 1):  # the first round warms every shape, untimed
        for B in BATCHES:
            for T in WIDTHS:
                for name, r in runners.items():
                    ms, ex = _pass_ms(r, B, T, caches[name], ctx, feeds)
                    if rnd:
                        times[name][B][T].append(ms)
                        experts[name][B][T] = ex
        progress(f"curve round {rnd}/{rounds}")
    return {name: {B: {T: (sorted(v)[len(v) // 2], experts[name][B][T]) for T, v in row.items()}
                   for B, row in per.items()} for name, per in times.items()}


def _generate(engine, prompts, draft: str, gamma, max_tokens: int) -> int:
    reqs = [Request(uuid.uuid4().hex, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    SpeculationParams(draft=draft, gamma=gamma)) for p in prompts]
    return sum(len(c.token_ids) for c in engine.generate(reqs))


def policy(engines: dict, prompts, rounds: int, max_tokens: int, progress=print) -> dict:
    """{model: {B: {config: tokens/s per round}}}, interleaved per round across models and configs."""
    out = {name: {B: {c: [] for c in CONFIGS} for B in BATCHES} for name in engines}
    for name, eng in engines.items():  # first-call allocations and kernels, untimed
        for draft, gamma in CONFIGS.values():
            _generate(eng, prompts[:1], draft, gamma, 8)
    for rnd in range(rounds):
        for B in BATCHES:
            for c, (draft, gamma) in CONFIGS.items():
                for name, eng in engines.items():
                    n, t0 = 0, time.perf_counter()
                    for i in range(0, len(prompts), B):
                        n += _generate(eng, prompts[i:i + B], draft, gamma, max_tokens)
                    out[name][B][c].append(n / (time.perf_counter() - t0))
        progress(f"policy round {rnd + 1}/{rounds}")
    return out


def main(args) -> int:
    from actors.build import build_engine

    rounds = args.rounds or 3
    max_tokens = args.max_tokens or 48
    paths = twins()
    built = {name: build_engine(str(path), ["ngram", "truncated:2"], args.dtype, max_batch=max(BATCHES), max_len=512,
                                device=args.device, exact=args.exact) for name, path in paths.items()}
    for name, b in built.items():
        print(f"[specd bench --moe] {name}: {b.dtype_reason}; {b.engine.info['exact']['why']}")
    runners = {name: b.engine.target for name, b in built.items()}
    curve = curves(runners, rounds)
    tps = policy({name: b.engine for name, b in built.items()}, _prompts(args.limit or 16), rounds, max_tokens)
    med = {name: {B: {c: sorted(v)[len(v) // 2] for c, v in row.items()} for B, row in per.items()}
           for name, per in tps.items()}
    report = {"models": {name: str(p) for name, p in paths.items()}, "shape": SHAPE,
              "experts": {"total": EXPERTS, "per_token": TOP_K, "width": EXPERT_WIDTH},
              "dtype": {name: b.dtype_reason for name, b in built.items()},
              "hardware": built["moe"].engine.info["hardware"], "threads": torch.get_num_threads(), "rounds": rounds,
              "max_tokens": max_tokens, "prompts": args.limit or 16,
              "curve_ms": {n: {B: {T: ms for T, (ms, _) in row.items()} for B, row in per.items()}
                           for n, per in curve.items()},
              "experts_per_layer": {B: {T: ex for T, (_, ex) in row.items()} for B, row in curve["moe"].items()},
              "tokens_per_s": med, "tokens_per_s_rounds": tps,
              "vs_gamma0": {n: {B: {c: v / row["γ0"] for c, v in row.items()} for B, row in per.items()}
                            for n, per in med.items()},
              "policy": {n: b.engine.policy.state() if b.engine.policy is not None else None
                               for n, b in built.items()}}
    text = render(report)
    print(text)
    write_report(report, text, plot, args.json_path, "bench_moe")
    return 0


def render(rep: dict) -> str:
    hw = rep["hardware"]
    lines = [f"specd bench --local --moe: Qwen3-MoE ({rep['experts']['total']} experts, {rep['experts']['per_token']} "
             f"per token) against its dense twin; {rep['threads']} threads; {hw}",
             "verify pass ÷ one token (B rows × T tokens); MoE: experts run per sparse layer"]
    head = f"{'T':>3} " + " ".join(f"{'dense B' + str(B):>10} {'moe B' + str(B):>9} {'experts':>7}" for B in BATCHES)
    lines.append(head)
    c = rep["curve_ms"]
    for T in WIDTHS:
        cells = []
        for B in BATCHES:
            d, m = c["dense"][B][T] / c["dense"][1][1], c["moe"][B][T] / c["moe"][1][1]
            cells.append(f"{d:>10.2f} {m:>9.2f} {rep['experts_per_layer'][B][T]:>7.1f}")
        lines.append(f"{T:>3} " + " ".join(cells))
    lines.append(f"one token: dense {c['dense'][1][1]:.2f} ms, moe {c['moe'][1][1]:.2f} ms")
    lines.append(f"tokens/s (median of {rep['rounds']} rounds) and ÷ γ0")
    lines.append(f"{'config':<18} " + " ".join(f"{n + ' B' + str(B):>22}" for n in ("dense", "moe") for B in BATCHES))
    for cfg in CONFIGS:
        lines.append(f"{cfg:<18} " + " ".join(
            f"{rep['tokens_per_s'][n][B][cfg]:>14.1f} ({rep['vs_gamma0'][n][B][cfg]:.2f}×)"
            for n in ("dense", "moe") for B in BATCHES))
    return "\n".join(lines)


def plot(rep: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    c = rep["curve_ms"]
    for n, style in (("dense", "--"), ("moe", "-")):
        for B in BATCHES:
            a.plot(WIDTHS, [c[n][B][T] / c[n][1][1] for T in WIDTHS], style, label=f"{n}, {B} rows")
    a.set_xlabel("tokens per row (T)")
    a.set_ylabel("pass time ÷ one token")
    a.legend()
    x = range(len(CONFIGS))
    for i, (n, B) in enumerate((n, B) for n in ("dense", "moe") for B in BATCHES):
        b.bar([j + 0.2 * i - 0.3 for j in x], [rep["vs_gamma0"][n][B][cfg] for cfg in CONFIGS], 0.2,
              label=f"{n} B{B}")
    b.axhline(1.0, color="grey", lw=0.8)
    b.set_xticks(list(x), list(CONFIGS), rotation=20, fontsize=8)
    b.set_ylabel("tokens/s ÷ γ 0")
    b.legend(fontsize=8)
    fig.suptitle("tiny MoE against its dense twin", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
