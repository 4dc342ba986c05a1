"""`specd distill`: train a draft for a target and report what it buys (the training library is
specd/train/distill.py; this is the command around it).

  specd distill --kind eagle3 --init-from eagle --minutes 60 --patience 3 ...   the shipped default (README)
  specd distill --kind eagle --objective fkl --steps 300 --out out/drafts/eagle    the single-layer head
  specd distill --kind truncated:4 --head-vocab 8192 --objective ntp ...
  specd distill --kind eagle --domain code ...          a domain draft (code prompts only)
  specd distill --data my.jsonl ...                     a user's prompts ("prompt"/"messages"/"ids") or texts ("text")
  specd distill --model path/to/qwen3 ...               any family the fast runner serves (llama, mistral, qwen2, qwen3)

Writes the checkpoint (loadable with --draft PATH), report.json, report.txt and
alpha.png (held-out acceptance per draft position, before and after) into --out.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub) -> None:
    from actors.schema import QUANT_MODES
    from specd.train.distill import KINDS, OBJECTIVES, DistillConfig

    d = DistillConfig()
    p = sub.add_parser("distill", help="train a draft model from the target (KL / NTP distillation)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.set_defaults(func=run)
    p.add_argument("--model", default="smollm2",
                   help="target: 'smollm2' (embedded), 'tiny', or a HF model dir of any family the runner serves")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="the target's dtype (as served)")
    p.add_argument("--kind", default=d.kind, help=f"draft kind: {' | '.join(KINDS)}")
    p.add_argument("--objective", default=d.objective, choices=OBJECTIVES,
                   help="forward KL, reverse KL, total variation, or next-token cross-entropy")
    p.add_argument("--temperature", type=float, default=d.temperature, help="softmax temperature of the soft targets")
    p.add_argument("--head-vocab", type=int, default=d.head_vocab,
                   help="keep the draft's LM head to the N most frequent tokens (0: full vocabulary)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--max-seq-len", type=int, default=d.max_len, help="training sequence cut")
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps, help="eagle: drafting steps unrolled in training")
    p.add_argument("--reg-weight", type=float, default=d.reg_weight, help="eagle: feature regression weight")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="held-out α every N steps (0: end only)")
    p.add_argument("--patience", type=int, default=d.patience,
                   help="stop once held-out α has not risen in N evaluations (0: never); the best is kept")
    p.add_argument("--minutes", type=float, default=d.minutes,
                   help="training time budget (0: none); the LR schedule ends with steps or minutes, whichever first")
    p.add_argument("--eagle-init", default="last", choices=["last", "random"],
                   help="eagle: start the head's layer from the target's last layer, or at random")
    p.add_argument("--small-layers", type=int, default=2, help="small: decoder layers")
    p.add_argument("--small-hidden", type=int, default=192, help="small: hidden size")
    p.add_argument("--data", default=None, help="JSONL of prompts/texts (default: specd/data/distill_prompts.jsonl)")
    p.add_argument("--heldout", default=None, help="JSONL of held-out prompts (default: specd/data/prompts.jsonl)")
    p.add_argument("--domain", default=None, help="train only on corpus rows of this domain (e.g. code)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N corpus rows")
    p.add_argument("--max-new", type=int, default=128, help="tokens the target generates per prompt")
    p.add_argument("--samples", type=int, default=2,
                   help="sampled continuations per prompt (T=0.8) beside the greedy one, in the teacher data")
    p.add_argument("--data-only", action="store_true", help="build (and cache) the teacher data, then stop")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--qat", default="none", choices=QUANT_MODES,
                   help="quantization-aware training: fake-quantize the trainable linears as this int8 mode "
                        "(torchao); the checkpoint then serves in that mode")
    p.add_argument("--init-from", default=None,
                   help="start from this EAGLE checkpoint ('default': the shipped head), e.g. a QAT fine-tune")
    p.add_argument("--out", default="out/drafts/draft", help="checkpoint + report directory")
    p.add_argument("--compare", nargs="+", default=None, metavar="DIR",
                   help="only print a table of these runs' reports (α ± bootstrap SE, paired differences)")


def run(args) -> int:
    from specd.train.distill import DistillConfig, render
    from specd.train.distill import run as distill

    from .data import DISTILL_CORPUS, PROMPTS

    if args.compare:
        print(compare(args.compare))
        return 0
    heads = 3 if args.small_hidden % 3 == 0 else 4
    cfg = DistillConfig(kind=args.kind, objective=args.objective, temperature=args.temperature,
                        head_vocab=args.head_vocab, steps=args.steps, batch=args.batch, lr=args.lr,
                        max_len=args.max_seq_len, ttt_steps=args.ttt_steps, reg_weight=args.reg_weight,
                        eval_every=args.eval_every, seed=args.seed, qat=args.qat, init_from=args.init_from,
                        patience=args.patience, minutes=args.minutes,
                        small={"num_hidden_layers": args.small_layers, "hidden_size": args.small_hidden,
                               "intermediate_size": args.small_hidden * 8 // 3, "num_attention_heads": heads,
                               "num_key_value_heads": 1, "eagle_init": args.eagle_init})
    report = distill(args.data or DISTILL_CORPUS, args.heldout or PROMPTS, args.model, args.out,
                     domain=args.domain, cfg=cfg, max_new=args.max_new, dtype=args.dtype, limit=args.limit,
                     samples=args.samples, data_only=args.data_only)
    if args.data_only:
        print(json.dumps(report, indent=1))
        return 0
    text = render(report)
    out = Path(args.out)
    (out / "report.txt").write_text(text + "\n")
    plot(report, out / "alpha.png")
    print(text)
    print(f"\ncheckpoint: {out}  (use --draft {out}); report: {out / 'report.json'}")
    return 0


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = report.get("checkpoints") or []
    fig, axes = plt.subplots(1, 2 if curve else 1, figsize=(11 if curve else 6, 3.5), squeeze=False)
    ax = axes[0][0]
    for key, style in (("before", "--"), ("after", "-")):
        a = report[key]["all"]["alpha_per_position"]
        ax.plot(range(1, len(a) + 1), a, style, marker="o", label=f"{key} (α={report[key]['all']['alpha']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("held-out acceptance (greedy)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{report['kind']} draft, {report['objective']}, {report.get('steps_run', report['config']['steps'])}"
                 " steps")
    ax.legend()
    if curve:  # the training curve: held-out α at each evaluation
        ax = axes[0][1]
        ax.plot([0] + [c["step"] for c in curve], [report["before"]["all"]["alpha"]] + [c["alpha"] for c in curve],
                marker="o", label="α (Leviathan, γ=4)")
        ax.plot([0] + [c["step"] for c in curve],
                [report["before"]["all"]["alpha_per_position"][0]] + [c["alpha_1"] for c in curve],
                marker="s", label="first position")
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out acceptance")
        ax.set_title(f"stopped: {report.get('stopped', '')}"[:60])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(paths: list[str]) -> str:
    """A side-by-side table of several distill reports (for the claims in the README): held-out
    α after training with its bootstrap standard error over the held-out prompts, and, where the
    reports hold per-prompt runs, α(first) − α(each other) with the error of that paired difference."""
    from specd.train.distill import bootstrap_alpha

    rows = [json.loads((Path(p) / "report.json").read_text()) for p in paths]
    doms = sorted({d for r in rows for d in r["after"] if d != "all"})
    head = f"{'draft':34}{'kind':8}{'obj':6}{'steps':>6}{'α before':>10}{'α after':>9}{'± SE':>7}" + \
        "".join(f"{'α ' + d:>10}" for d in doms) + f"{'c':>7}{'pred.':>7}"
    lines = [head]
    runs = [r["after"]["all"].get("runs_per_sequence") for r in rows]
    for i, (p, r) in enumerate(zip(paths, rows)):
        se = bootstrap_alpha(runs[i])["se"][0] if runs[i] else float("nan")
        steps = r.get("kept_step", r["config"]["steps"])
        lines.append(f"{Path(p).name:34}{r['kind']:8}{r['objective']:6}{steps:>6}"
                     f"{r['before']['all']['alpha']:>10.3f}{r['after']['all']['alpha']:>9.3f}{se:>7.3f}" +
                     "".join(f"{r['after'].get(d, {}).get('alpha', float('nan')):>10.3f}" for d in doms) +
                     f"{r['c']:>7.3f}{r['predicted_speedup'][str(r['best_gamma'])]:>7.2f}")
    for p, r in zip(paths[1:], runs[1:]):
        if runs[0] and r and len(r) == len(runs[0]):
            b = bootstrap_alpha(runs[0], r)
            lines.append(f"α({Path(paths[0]).name}) − α({Path(p).name}) = {b['diff']:+.3f} ± {b['diff_se']:.3f} "
                         f"(paired bootstrap over {len(r)} held-out prompts)")
    return "\n".join(lines)
