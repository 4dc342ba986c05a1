"""`make gpu-check`: the engine on a GPU, measured in one prepared run.

    python3 -m specd.gpu_check [--device cuda|cuda:N|cpu] [--out out]

Runs with whatever Python holds PyTorch on the GPU machine: it imports only `actors/` (the data
plane: torch, transformers) and the standard library — never Ray, pydantic or the cluster
config — and builds what it needs without a network:
  * models: seeded random-weight llama models with SmolLM2-135M's exact shape and a 1B-class
    shape (16 layers, hidden 2048); random weights run at the same speed as trained ones;
  * drafts: an *oracle* drafter that proposes the target's own next greedy token with
    probability p and a wrong token otherwise (random weights give no meaningful acceptance),
    for p in {0.5, 0.7, 0.9}.
It measures, per shape:
  1. greedy output of the engine (γ=0 and with the oracle draft) identical to HF `generate`
     on the device, in fp32 (TF32 off); then in bf16 with exact passes, a width-5 pass's rows
     bitwise equal to single-token passes and speculative output identical to γ=0's;
  2. the bf16 pass-cost curve over batch {1, 8, 32} x tokens per row {1, 2, 4, 8, 16};
  3. tokens/s against HF `generate` at batch 1 and 16, speculation off and on for each p,
     through the speculation policy (γ auto) and at a fixed γ=4;
  4. the single-token pass against the weight-bandwidth floor (weight bytes over the bandwidth
     of a device-to-device copy measured in the same run).
It writes out/gpu_check.json and out/gpu_check.png (the GPU's name in both) and prints a table.
Without a GPU it says so and exits 2. `--device cpu` is the dry run: the same script end to end
on the small shape with small sizes, proving it will not fail on an import or a shape.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from actors.calibrate import measure
from actors.drafters.oracle import OracleDrafter
from actors.engine import SpecEngine
from actors.hardware import hardware
from actors.llama import LlamaRunner
from actors.schema import Request, SamplingParams, SpeculationParams

SHAPES = {  # llama configs; vocabularies as the real models'
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
}
FULL = dict(batches=(1, 8, 32), tokens=(1, 2, 4, 8, 16), ps=(0.5, 0.7, 0.9), new=128, prompt=64, speed_batches=(1, 16),
            equiv_new=32, shapes=tuple(SHAPES))
DRY = dict(batches=(1, 4), tokens=(1, 2, 4), ps=(0.7,), new=16, prompt=32, speed_batches=(1, 4), equiv_new=12,
           shapes=("smollm2-135m",))


def build(shape: str, dtype: torch.dtype, device: str, seed: int = 0):
    """A seeded random llama of the given shape. Linear weights ~ N(0, 1/fan_in) and embeddings
    ~ N(0, 1): logits spread widely, so greedy choices are not near-ties between kernels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, max_position_embeddings=4096, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[1] ** -0.5)
    return model.to(dtype).eval()


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate(model, prompts: list[list[int]], new: int) -> tuple[list[list[int]], float]:
    ids = torch.tensor(prompts, device=model.device)  # equal lengths: no padding
    sync(model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    sync(model.device)
    return out[:, ids.shape[1]:].tolist(), time.perf_counter() - t0


def engine_generate(eng: SpecEngine, prompts: list[list[int]], new: int, draft: str | None, gamma) -> tuple:
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=new, ignore_eos=True),
                    SpeculationParams(draft=draft or "none", gamma=gamma if draft else 0)) for i, p in enumerate(prompts)]
    sync(eng.device)
    t0 = time.perf_counter()
    done = eng.generate(reqs)
    sync(eng.device)
    return [c.token_ids for c in done], time.perf_counter() - t0, done


def bandwidth(device, gb: float = 1.0) -> float:
    """GB/s of a device-to-device copy, counting bytes read and written."""
    n = int(gb * 1e9 / 4)
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    for _ in range(2):
        b.copy_(a)
    sync(device)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best / 1e9


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def check_shape(shape: str, device: str, sizes: dict, log) -> dict:
    vocab = SHAPES[shape]["vocab_size"]
    rng = random.Random(1)
    res: dict = {"shape": shape}

    # 1. greedy equivalence, fp32, TF32 off
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = build(shape, torch.float32, device)
    prompts = [[rng.randrange(3, vocab) for _ in range(sizes["prompt"])] for _ in range(2)]
    ref, _ = hf_generate(model, prompts, sizes["equiv_new"])
    refs = {tuple(p): r for p, r in zip(prompts, ref)}
    runner = LlamaRunner(model)
    cost = measure(runner, 2, reps=1)
    eng = SpecEngine(runner, {"oracle": OracleDrafter(refs, 0.7, vocab)}, max_batch=2, max_len=512, pass_cost=cost)
    plain, _, _ = engine_generate(eng, prompts, sizes["equiv_new"], None, 0)
    spec, _, done = engine_generate(eng, prompts, sizes["equiv_new"], "oracle", 4)
    res["greedy_equal_hf"] = {"plain": plain == ref, "oracle_gamma4": spec == ref,
                              "accepted_tokens": sum(c.stats.accepted_tokens for c in done)}
    log(f"{shape}: greedy (fp32) engine == HF generate: plain {plain == ref}, speculative {spec == ref}")
    del eng, runner, model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()

    # 1b. exact passes in bf16 (`LlamaRunner.make_exact`: on a GPU, one SDPA call per query row and each
    # linear's probed row plan): a width-5 pass's rows against 5 single-token passes, bitwise, and greedy
    # output with the oracle draft against speculation off
    model = build(shape, torch.bfloat16, device)
    runner = LlamaRunner(model).make_exact()
    seq = torch.tensor([prompts[0][:sizes["prompt"]] + ref[0][:5]], device=device)
    n = seq.shape[1]
    with torch.inference_mode():
        c1, c2 = runner.new_cache(1, n + 1), runner.new_cache(1, n + 1)
        single = torch.cat([runner.logits(runner.forward(c1, [0], seq[:, t:t + 1]))[0] for t in range(n)])
        runner.forward(c2, [0], seq[:, :n - 5])
        wide = runner.logits(runner.forward(c2, [0], seq[:, n - 5:]))[0]
    eng = SpecEngine(runner, {"oracle": OracleDrafter(refs, 0.7, vocab)}, max_batch=2, max_len=512, pass_cost=cost)
    plain, _, _ = engine_generate(eng, prompts, sizes["equiv_new"], None, 0)
    spec, _, _ = engine_generate(eng, prompts, sizes["equiv_new"], "oracle", 4)
    res["exact_bf16"] = {"rows_bitwise": bool(torch.equal(wide, single[n - 5:])), "speculative_identical": plain == spec,
                         "plans": sorted({p.label() for p in runner.plans.values()})}
    log(f"{shape}: exact bf16: width-5 rows == single-token passes {res['exact_bf16']['rows_bitwise']}, "
        f"speculative == plain {plain == spec}, linear plans {res['exact_bf16']['plans']}")
    del eng, runner, model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()

    # 2. the bf16 pass-cost curve
    model = build(shape, torch.bfloat16, device)
    runner = LlamaRunner(model)
    B = max(sizes["batches"])
    cache = runner.new_cache(B, sizes["prompt"] + max(sizes["tokens"]) + 1)
    with torch.inference_mode():
        runner.forward(cache, list(range(B)), torch.randint(3, vocab, (B, sizes["prompt"]), device=device))
        curve = {}
        for b in sizes["batches"]:
            for t in sizes["tokens"]:
                feed = torch.randint(3, vocab, (b, t), device=device)
                times = []
                for rep in range(4):
                    for s in range(b):
                        cache.truncate(s, sizes["prompt"])
                    sync(device)
                    t0 = time.perf_counter()
                    runner.logits(runner.forward(cache, list(range(b)), feed))
                    sync(device)
                    if rep:
                        times.append(time.perf_counter() - t0)
                curve[f"{b}x{t}"] = min(times) * 1e3
    res["pass_ms"] = curve
    one = curve[f"1x{sizes['tokens'][0]}"]
    res["pass_ratio_vs_1_token"] = {k: v / curve[f"{k.split('x')[0]}x1"] for k, v in curve.items()}
    log(f"{shape}: bf16 pass ms " + ", ".join(f"{k}: {v:.2f}" for k, v in curve.items()))

    # 4. the floor
    bw = bandwidth(device)
    wb = weight_bytes(model)
    res["bandwidth_GBps"], res["weight_bytes"] = bw, wb
    res["floor_ms"] = wb / (bw / 2 * 1e9) * 1e3  # a pass reads the weights once: read bandwidth = copy / 2
    res["pass_vs_floor"] = one / res["floor_ms"]

    # 3. tokens/s: HF vs engine off vs speculation (policy and fixed γ), batch 1 and 16
    speed = []
    cost = measure(runner, max(sizes["speed_batches"]), reps=1)
    for bs in sizes["speed_batches"]:
        prompts = [[rng.randrange(3, vocab) for _ in range(sizes["prompt"])] for _ in range(bs)]
        hf_out, hf_s = hf_generate(model, prompts, sizes["new"])
        refs = {tuple(p): r for p, r in zip(prompts, hf_out)}
        drafters = {f"p{p}": OracleDrafter(refs, p, vocab, seed=int(p * 100)) for p in sizes["ps"]}
        eng = SpecEngine(runner, drafters, max_batch=bs, max_len=sizes["prompt"] + sizes["new"] + 64, pass_cost=cost)
        engine_generate(eng, prompts, 8, None, 0)  # warm-up
        n = bs * sizes["new"]
        row = {"batch": bs, "hf_tok_s": n / hf_s}
        _, off_s, _ = engine_generate(eng, prompts, sizes["new"], None, 0)
        row["engine_off_tok_s"] = n / off_s
        for p in sizes["ps"]:
            for gamma in ("auto", 4):
                _, s, done = engine_generate(eng, prompts, sizes["new"], f"p{p}", gamma)
                st = done[0].stats
                for c in done[1:]:
                    st.add(c.stats)
                row[f"p{p}_gamma_{gamma}_tok_s"] = n / s
                row[f"p{p}_gamma_{gamma}_mean_accepted_length"] = st.mean_accepted_length
        speed.append(row)
        log(f"{shape} batch {bs}: HF {row['hf_tok_s']:.0f} tok/s, engine off {row['engine_off_tok_s']:.0f}, "
            + ", ".join(f"p{p} auto {row[f'p{p}_gamma_auto_tok_s']:.0f} / γ4 {row[f'p{p}_gamma_4_tok_s']:.0f}"
                        for p in sizes["ps"]))
    res["speed"] = speed
    return res


def render(report: dict) -> str:
    lines = [f"specd gpu-check on {report['device_name']} ({report['device']}), torch {report['torch']}"]
    for r in report["shapes"]:
        lines.append(f"\n{r['shape']}: greedy == HF {r['greedy_equal_hf']}; exact bf16 {r['exact_bf16']}; "
                     f"single-token bf16 pass "
                     f"{r['pass_ms'][next(iter(r['pass_ms']))]:.2f} ms vs floor {r['floor_ms']:.2f} ms "
                     f"({r['pass_vs_floor']:.1f}x; copy bandwidth {r['bandwidth_GBps']:.0f} GB/s)")
        lines.append("pass cost vs one token: " + ", ".join(f"{k} {v:.2f}x" for k, v in r["pass_ratio_vs_1_token"].items()))
        keys = [k for k in r["speed"][0] if k.endswith("tok_s")]
        lines.append(f"{'batch':>6} " + " ".join(f"{k.replace('_tok_s', ''):>16}" for k in keys))
        for row in r["speed"]:
            lines.append(f"{row['batch']:>6} " + " ".join(f"{row[k]:>16.1f}" for k in keys))
    return "\n".join(lines)


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = report["shapes"]
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 8), squeeze=False)
    for i, r in enumerate(shapes):
        ax = axes[0][i]
        by_b: dict[str, list] = {}
        for k, v in r["pass_ms"].items():
            b, t = k.split("x")
            by_b.setdefault(b, []).append((int(t), v))
        for b, pts in by_b.items():
            ax.plot([t for t, _ in pts], [v for _, v in pts], marker="o", label=f"batch {b}")
        ax.set_title(f"{r['shape']}: bf16 pass cost ({report['device_name']})")
        ax.set_xlabel("tokens per row")
        ax.set_ylabel("ms")
        ax.legend()
        ax = axes[1][i]
        for row in r["speed"]:
            keys = [k for k in row if k.endswith("tok_s")]
            ax.barh([f"b{row['batch']} {k.replace('_tok_s', '')}" for k in keys], [row[k] for k in keys])
        ax.set_xlabel("tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the dry run: small shape, small sizes)")
    ap.add_argument("--out", default="out")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, cuda available: False). "
              "Run it on a GPU machine, or `make gpu-check DEVICE=cpu` for the dry run.", file=sys.stderr)
        return 2
    sizes = DRY if device.type == "cpu" else FULL
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[gpu-check {time.perf_counter() - t0:6.1f} s] {msg}", flush=True)

    hw = hardware(device)
    log(f"device {device}: {hw['name']}")
    report = {"device": str(device), "device_name": hw["name"], "torch": torch.__version__, "hardware": hw,
              "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()}, "shapes": []}
    for shape in sizes["shapes"]:
        report["shapes"].append(check_shape(shape, str(device), sizes, log))
    report["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    text = render(report)
    (out / "gpu_check.txt").write_text(text + "\n")
    print(text)
    png = plot(report, out / "gpu_check.png")
    log(f"wrote {out / 'gpu_check.json'}" + (f" and {out / 'gpu_check.png'}" if png else " (no matplotlib: no PNG)"))
    ok = all(all(v for k, v in r["greedy_equal_hf"].items() if k != "accepted_tokens")
             and r["exact_bf16"]["rows_bitwise"] and r["exact_bf16"]["speculative_identical"] for r in report["shapes"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
