"""`specd quant`: what int8 weights do to speed and to the output, on the hardware at hand.

    specd quant [--model smollm2] [--draft default] [--qat-draft DIR] [--limit 8] [--out out/quant]

Three parts, in one process, every timing interleaved with its comparisons:
  1. kernels   the target's pass cost t(B, T) for B rows of T new tokens (`calibrate.measure`)
               with fp32 and bf16 weights, plain (F.linear: MKL for fp32, oneDNN reordering
               the weight in every call for bf16) and prepacked (`LlamaRunner.prepack`), and
               bf16 + each int8 mode of `actors/quant.py`, and for a GGUF-born target its
               native 4-bit weights (`actors/native.py`, "bf16+native"): what a multi-token pass costs
               against a one-token pass (the price of verifying γ drafts), and what each weight
               format costs per decode step;
  2. drafts    one draft step (`calibrate.draft_step_seconds`) of the draft in bf16, int8
               (weight-only, post-training) and, when given, a QAT head (`specd distill --qat`);
  3. the table rows: the target in bf16 (plain and prepacked), native and each int8 mode; per row γ=0 (the target alone)
               and each draft at a fixed γ, greedy at batch 1 on the calibration prompts (half
               chat, half code), prompt by prompt round-robin over every configuration:
                 tokens/s and its ratio to bf16 γ=0; α = accepted / drafted; tokens per pass;
                 agreement with the bf16 target's own greedy output (share of outputs identical,
                 and the mean share of each output before the first differing token);
                 mean NLL of the output tokens under the bf16 (unquantized) target.
               A quantized draft leaves the output unchanged (the target verifies every token);
               a quantized target changes it, and the agreement and NLL columns say by how much.
               The embedded target is itself dequantized from a Q4_1 GGUF, so its weights lie
               near a coarse grid already: int8 error on it understates what a natively trained
               bf16 model would show.
Writes quant.json, quant.txt (the tables and the verdict on "quantization accelerates both draft
and target") and quant.png (pass cost against tokens per pass, per weight format).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from actors.calibrate import draft_step_seconds, measure
from actors.hardware import hardware, hardware_line
from actors.schema import QUANT_MODES, Request, SamplingParams, SpeculationParams

TOKENS = (1, 2, 3, 5, 9, 16)  # tokens per row in the kernel study: 1 + γ for γ = 0, 1, 2, 4, 8, 15
BATCH = 8  # rows in the kernel study's grid (1..BATCH)
DRAFT_INT8 = "int8-weight"  # the post-training int8 draft (weight-only: a batch-1 draft is bound by its weights)


def add_parser(sub) -> None:
    p = sub.add_parser("quant", help="int8 target and draft (torchao): pass costs, draft cost, tokens/s, α, "
                                     "agreement with and NLL under the unquantized target")
    p.set_defaults(func=run)
    p.add_argument("--model", default="smollm2", help="target: 'smollm2' (embedded), 'tiny', or a HF model dir")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="the unquantized target's dtype")
    p.add_argument("--draft", default="default", help="the draft to quantize post-training (default: the shipped head)")
    p.add_argument("--qat-draft", default=None,
                   help="a head trained with `specd distill --qat` (default: out/drafts/smollm2-eagle3-qat if present)")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--modes", default=",".join(m for m in QUANT_MODES if m != "none"),
                   help="the target's int8 modes to compare with the unquantized target")
    p.add_argument("--prompts", default=None, help="JSONL (default: specd/data/prompts.jsonl, half chat, half code)")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="timings per pass-cost point (the least is kept)")
    p.add_argument("--out", default="out/quant")


def run(args) -> int:
    qat = args.qat_draft
    if qat is None and Path("out/drafts/smollm2-eagle3-qat/specd_draft.json").exists() and args.model == "smollm2":
        qat = "out/drafts/smollm2-eagle3-qat"
    rep = study(args.model, args.dtype, args.draft, qat, args.gamma, tuple(m for m in args.modes.split(",") if m),
                args.prompts, args.limit, args.max_tokens, args.reps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = render(rep)
    (out / "quant.json").write_text(json.dumps(rep, indent=2))
    (out / "quant.txt").write_text(text + "\n")
    plot(rep, out / "quant.png")
    print(text)
    print(f"\nwrote {out / 'quant.json'}, {out / 'quant.txt'}, {out / 'quant.png'}")
    return 0


def study(model: str = "smollm2", dtype: str = "bf16", draft: str = "default", qat_draft: str | None = None,
          gamma: int = 4, modes: tuple[str, ...] = ("int8-weight", "int8-dynamic", "mixed"),
          prompts_path: str | None = None, limit: int = 8, max_tokens: int = 64, reps: int = 3,
          progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from actors import cpu, native
    from actors.build import draft_mode, make_drafter, ready_drafter, with_exact, with_prepack
    from actors.engine import SpecEngine
    from actors.llama import PACKABLE, LlamaRunner
    from actors.models import gguf_source, load_model
    from actors.quant import _torchao, check_mode, quantize_runner
    from actors.sequence import common_prefix

    from .tune import calibration_prompts

    for m in modes:
        check_mode(m)
        if m == "none":
            raise ValueError("--modes lists int8 modes; the unquantized target is always the reference")
    _torchao()  # imported quietly before transformers imports it loudly
    target = load_model(model, dtype)
    prompts = calibration_prompts(target.tokenizer, prompts_path, limit)
    max_len = max(map(len, prompts)) + max_tokens + 64
    ref_runner = LlamaRunner(target.model)  # plain weights: the reference for agreement and NLL
    # weight formats: plain and prepacked (`LlamaRunner.prepack`, where this CPU runs that layout:
    # actors/cpu.py), then each int8 mode (prepacked where it leaves dense weights of a dtype that
    # packs by default: mixed's attention in bf16)
    models = {"fp32": load_model(model, "fp32").model} if dtype != "fp32" else {}  # fp32: AVX2 CPUs may prefer it
    models[dtype] = target.model
    formats = {}
    for name, m in models.items():
        formats[name] = LlamaRunner(m) if name != dtype else ref_runner
        if cpu.available(PACKABLE[m.dtype]):
            formats[f"{name}+prepacked"] = with_prepack(LlamaRunner(m), "on")
    gguf = gguf_source(model)
    if gguf is not None and native.runs_here():  # the GGUF's own blocks (actors/native.py)
        if "bf16" not in models:
            models["bf16"] = load_model(model, "bf16").model
        formats["bf16+native"] = native.apply(LlamaRunner(models["bf16"]), gguf)
    # passes as the engine runs them: row-invariant where that is cheap (`build.with_exact`), so that a draft never
    # changes a target's output and "identical" compares weight formats alone
    formats = {name: with_exact(r) for name, r in formats.items()}
    formats.update({f"{dtype}+{m}": with_prepack(quantize_runner(LlamaRunner(target.model), m)) for m in modes})

    # 1. kernels: every format's pass-cost grid, the formats interleaved rep by rep
    bar = tqdm(total=reps * len(formats), desc="pass costs", disable=not progress)
    costs = {}
    for _ in range(reps):
        for name, runner in formats.items():
            with torch.inference_mode():
                pc = measure(runner, BATCH, reps=1, tokens=TOKENS)
            costs[name] = pc if name not in costs else type(pc)(
                {k: min(v, costs[name].points[k]) for k, v in pc.points.items()}, pc.dtype)
            bar.update(1)
    bar.close()

    # 2. drafts: unquantized, post-training int8, QAT int8; one step each, interleaved
    draft_kinds = {dtype: (draft, "none"), "int8": (draft, DRAFT_INT8)}
    if qat_draft:
        draft_kinds["qat-int8"] = (qat_draft, draft_mode(qat_draft))
    ctx = prompts[0][:64]
    def drafter(spec: str, mode: str):  # as an engine builds it
        return ready_drafter(make_drafter(spec, target, 1, max_len), spec, mode)
    probe = {k: drafter(spec, m) for k, (spec, m) in draft_kinds.items()}
    step = {k: [] for k in probe}
    for _ in range(3):
        for k, d in probe.items():
            step[k].append(draft_step_seconds(d, ctx, ref_runner))
    draft_step = {k: min(v) for k, v in step.items()}

    # 3. the table: one engine per target format, each draft kind in it, prompts round-robin
    engines = {}
    for tname in [t for t in [dtype, f"{dtype}+prepacked", "bf16+native"] + [f"{dtype}+{m}" for m in modes]
                  if t in formats]:
        runner = formats[tname]
        drafters = {k: drafter(spec, m) for k, (spec, m) in draft_kinds.items()}
        engines[tname] = SpecEngine(runner, drafters, tokenizer=target.tokenizer, eos_token_ids=target.eos_token_ids,
                                    max_batch=1, max_len=max_len, pass_cost=costs[tname])
    configs = [(t, d) for t in engines for d in (None, *draft_kinds)]
    rows = {c: {"target": c[0], "draft": c[1] or "none", "seconds": 0.0, "tokens": 0, "drafted": 0, "accepted": 0,
                "passes": 0, "outputs": []} for c in configs}
    for t, d in configs:  # warm-up, untimed
        _generate(engines[t], prompts[0], d, gamma, 8)
    bar = tqdm(total=len(prompts) * len(configs), desc="quant table", unit="gen", disable=not progress)
    for p in prompts:
        for c in configs:
            t0 = time.perf_counter()
            out, st = _generate(engines[c[0]], p, c[1], gamma, max_tokens)
            r = rows[c]
            r["seconds"] += time.perf_counter() - t0
            r["tokens"] += len(out)
            r["drafted"] += st.draft_tokens
            r["accepted"] += st.accepted_tokens
            r["passes"] += st.target_passes
            r["outputs"].append(out)
            bar.update(1)
    bar.close()

    reference = rows[(dtype, None)]["outputs"]
    table = []
    for c in configs:
        r = rows[c]
        outs = r.pop("outputs")
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["alpha"] = r["accepted"] / r["drafted"] if r["drafted"] else None
        r["tokens_per_pass"] = r["tokens"] / r["passes"] if r["passes"] else None
        r["identical_share"] = sum(o == ref for o, ref in zip(outs, reference)) / len(outs)
        r["prefix_agreement"] = sum(common_prefix(o, ref) / max(len(ref), 1)
                                    for o, ref in zip(outs, reference)) / len(outs)
        r["nll"] = _mean_nll(ref_runner, prompts, outs)
        table.append(r)
    base = rows[(dtype, None)]["tokens_per_s"]
    for r in table:
        r["x_bf16_plain"] = r["tokens_per_s"] / base
    return {"model": target.name, "dtype": dtype, "hardware": hardware("cpu"), "threads": torch.get_num_threads(),
            "gamma": gamma, "prompts": len(prompts), "max_tokens": max_tokens, "draft": draft, "qat_draft": qat_draft,
            "draft_int8_mode": DRAFT_INT8,
            "pass_cost": {n: pc.to_json() for n, pc in costs.items()}, "draft_step_s": draft_step, "table": table}


def _generate(eng, prompt: list[int], draft: str | None, gamma: int, max_tokens: int):
    [done] = eng.generate([Request("q", prompt, SamplingParams(max_tokens=max_tokens),
                                   SpeculationParams(draft=draft or "none", gamma=gamma if draft else 0))])
    return done.token_ids, done.stats


@torch.inference_mode()
def _mean_nll(runner, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """Mean negative log-likelihood per output token under `runner` (the unquantized target)."""
    total, count = 0.0, 0
    for p, out in zip(prompts, outputs):
        if not out:
            continue
        ids = torch.tensor([p + out])
        h = runner.forward(runner.new_cache(1, ids.shape[1] + 1), [0], ids)[0, len(p) - 1:-1]
        logp = torch.log_softmax(runner.logits(h).float(), -1)
        total -= logp.gather(1, torch.tensor(out)[:, None]).sum().item()
        count += len(out)
    return total / max(count, 1)


def _ms(pc: dict, b: int, t: int) -> float | None:
    for bb, tt, s in pc["points"]:
        if (bb, tt) == (b, t):
            return s * 1e3
    return None


def render(rep: dict) -> str:
    hw = rep["hardware"]
    dt = rep["dtype"]
    lines = [f"specd quant: {rep['model']} on {hardware_line(hw)}; "
             f"{rep['prompts']} prompts x {rep['max_tokens']} tokens, greedy, batch 1, "
             f"γ={rep['gamma']}", "",
             "1. Pass cost, ms (1 row; T new tokens), and T tokens against one",
             f"{'weights':22}" + "".join(f"{'T=' + str(t):>9}" for t in TOKENS) + f"{'T=9/T=1':>9}{'8 rows':>9}"]
    for name, pc in rep["pass_cost"].items():
        ms = [_ms(pc, 1, t) for t in TOKENS]
        r8 = _ms(pc, BATCH, 1)
        lines.append(f"{name:22}" + "".join(f"{x:9.1f}" if x is not None else f"{'-':>9}" for x in ms)
                     + f"{ms[TOKENS.index(9)] / ms[0]:9.2f}" + (f"{r8:9.1f}" if r8 is not None else ""))
    lines += ["", "2. One draft step, ms: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in rep["draft_step_s"].items())
              + f" (int8 = {rep['draft_int8_mode']}, post-training"
              + (f"; qat-int8 = {rep['qat_draft']}" if rep.get("qat_draft") else "; no QAT head given") + ")", "",
              f"3. End to end (tokens/s ratio to the {dt} target alone, same run)",
              f"{'target':22}{'draft':>10}{'tok/s':>8}{'x':>7}{'α':>7}{'tok/pass':>9}{'identical':>10}"
              f"{'prefix':>8}{'NLL':>7}"]
    for r in rep["table"]:
        f = lambda v, fmt: format(v, fmt) if v is not None else "-"  # noqa: E731
        lines.append(f"{r['target']:22}{r['draft']:>10}{r['tokens_per_s']:8.1f}{r['x_bf16_plain']:7.2f}"
                     f"{f(r['alpha'], '.3f'):>7}{f(r['tokens_per_pass'], '.2f'):>9}{r['identical_share']:10.2f}"
                     f"{r['prefix_agreement']:8.2f}{r['nll']:7.3f}")
    lines += ["", "identical: share of outputs equal to the unquantized target's greedy output; prefix: mean share "
              "before the first differing token; NLL: per output token under the unquantized target.",
              "A quantized draft cannot change the output (the target verifies); a quantized target does. The embedded "
              "target was dequantized from a Q4_1 GGUF, so int8 error on it understates a native bf16 model's.",
              "", "Verdict on 'quantization accelerates both draft and target':"] + verdict(rep)
    return "\n".join(lines)


def verdict(rep: dict) -> list[str]:
    """Each int8 target against the unquantized one as it runs by default (prepacked where that
    exists), prepacking against plain weights, each int8 draft against the unquantized draft."""
    dt = rep["dtype"]
    plain = {r["target"]: r["tokens_per_s"] for r in rep["table"] if r["draft"] == "none"}
    pc = rep["pass_cost"]
    base = f"{dt}+prepacked" if f"{dt}+prepacked" in plain else dt
    out = []
    for name, tps in plain.items():
        ref = dt if name == base else base
        if name == dt:
            continue
        step = _ms(pc[name], 1, 1) / _ms(pc[ref], 1, 1)
        out.append(f"  target {name}: decode step {step:.2f}x the {ref} one, tokens/s {tps / plain[ref]:.2f}x -> "
                   + ("faster" if tps > plain[ref] * 1.02 else "slower" if tps < plain[ref] * 0.98 else "no change"))
    ds = rep["draft_step_s"]
    for k in ds:
        if k != dt:
            out.append(f"  draft {k}: step {ds[k] / ds[dt]:.2f}x the {dt} draft's -> "
                       + ("faster" if ds[k] < ds[dt] * 0.98 else "slower" if ds[k] > ds[dt] * 1.02 else "no change"))
    return out


def plot(rep: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, pc in rep["pass_cost"].items():
        ms = [_ms(pc, 1, t) for t in TOKENS]
        a.plot(TOKENS, ms, marker="o", label=name)
    a.set_xlabel("tokens in the pass (1 row)")
    a.set_ylabel("ms per target pass")
    a.set_title(f"pass cost by weight format ({hardware_line(rep['hardware'])})", fontsize=9)
    a.legend(fontsize=8)
    for r in rep["table"]:
        b.scatter(r["nll"], r["tokens_per_s"], marker="o" if r["draft"] == "none" else "^")
        b.annotate(f"{r['target'].split('+')[-1]} / {r['draft']}", (r["nll"], r["tokens_per_s"]), fontsize=7)
    b.set_xlabel("NLL of the output under the unquantized target")
    b.set_ylabel("tokens/s (batch 1)")
    b.set_title("speed against output quality", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
