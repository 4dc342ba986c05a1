"""`specd lab`: the seed's claims about speculative decoding, measured on your own target and drafts.

    specd lab [--model smollm2] [--out out/lab]      under 20 min on 2 CPU cores (--limit, --max-tokens size it)
    specd lab --quick                                 the tiny model, under a minute (run by make test)

One bounded study; every claim gets a table, a figure where a curve says more, a verdict computed
from the numbers (never written in advance) and the command that reproduces it:

  best γ depends on α and c       tokens/s against γ per draft, with Leviathan's prediction from the
                                  measured α and c, and the prediction from the measured pass-cost curve
  acceptance falls with entropy   acceptance by target-entropy quintile and by context (sentence start,
                                  after punctuation, word start, inside a word); the entropy gate's effect
  a threshold trades length       the confidence-threshold sweep at batch 1 and 4: candidate length, α,
  for acceptance                  tokens per pass, tokens/s, and where the optimum lies
  a poor draft hurts batching     throughput against batch for oracle drafts of acceptance p, against none
  lossy rules trade deviation     speedup against deviation (TV per position, NLL under the target,
  for speed                       agreement with the lossless output at the same seed): a Pareto plot
  draft "auto"                    a mixed chat+code workload: each draft alone, auto, and an oracle that
                                  knows each prompt's domain
  distillation                    KL vs NTP, same-family vs generic, domain: from `specd distill` reports

Writes report.md, lab.json and PNG figures into --out.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from actors.acceptance import entropy, process
from actors.drafters.base import Drafter, DraftSeq, Proposal
from actors.schema import Request, SamplingParams, SpecStats, SpeculationParams
from actors.sequence import common_prefix

from .stats import leviathan_alpha

# --------------------------------------------------------------------------------- observers


class DeviationLog:
    """A step observer (`SpecEngine.observer`): per position a lossy rule decided, (request key,
    position, TV). Exact: an accepted draft x is emitted with probability 1 where the target has
    p(x), so TV(emitted, p) = 1 - p(x); the token after the accepted prefix is drawn from p: TV 0."""

    def __init__(self):
        self.log: list[tuple[int, int, float]] = []

    def verified(self, batch, logits, verdicts) -> None:
        for b, (r, v) in enumerate(zip(batch.rows, verdicts)):
            if r.rule != "lossy":
                continue
            a = len(v.path)
            p = process(logits[b, :a][None], [r.seq])[0] if a else None  # [a, V]
            for j in range(a + 1):
                tv = 1.0 - float(p[j, r.drafts[j]]) if j < a else 0.0
                self.log.append((r.seq.key, len(r.seq.tokens) + j, tv))


class EntropyLog:
    """A step observer: per drafted chain position, (the target's entropy there, accepted,
    the position's context: `context`)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.log: list[tuple[float, bool, str]] = []

    def verified(self, batch, logits, verdicts) -> None:
        idx = [b for b, r in enumerate(batch.rows) if r.drafts and r.parents is None and r.seq.beam is None]
        if not idx:
            return
        for b, ent in zip(idx, entropy(logits[idx]).tolist()):  # [Bd, G+1]
            r, a = batch.rows[b], len(verdicts[b].path)
            prev = [r.seq.tokens[-1]] + r.drafts  # (not committed yet: the last token is the root)
            for j in range(len(r.drafts)):
                self.log.append((ent[j], j < a, context(self.tokenizer, prev[j], r.drafts[j])))


def context(tokenizer, prev: int, tok: int) -> str:
    """Where a drafted token stands: after a sentence end, after other punctuation, inside a
    word (no leading space), or at a word start."""
    if tokenizer is None:
        return "word start"
    p, t = tokenizer.decode([prev]), tokenizer.decode([tok])
    if p.rstrip(" ").endswith((".", "!", "?", "\n")) or p.endswith("\n"):
        return "sentence start"
    if p.rstrip(" ").endswith((",", ";", ":", ")", "(", '"', "'")):
        return "after punctuation"
    return "inside word" if t[:1].isalnum() and p[-1:].isalnum() else "word start"


# --------------------------------------------------------------------------------- measurement


class FixedToken(Drafter):
    """Proposes the same token every step (a deterministic one-token draft)."""
    name = "fixed"

    def __init__(self, token: int):
        self.token = token

    def propose(self, seqs: list[DraftSeq]) -> Proposal:
        return Proposal(tokens=torch.full((len(seqs), 1), self.token, dtype=torch.long), num_draft=[1] * len(seqs))

    def release(self, seq_id: int) -> None:
        pass


def first_token_tv(target, ctx: list[int], rank: int, rule: str, n: int = 3000, seed0: int = 70_000) -> dict:
    """The deviation of `rule` at one context, measured both ways: ctx + [t1] (t1 the target's
    likeliest first token), a draft proposing the token of rank `rank` there. Returns t1, the
    target's distribution p there, the TV the engine accounted at that position (DeviationLog: exact
    per position, how `specd lab` measures deviation on a large vocabulary), and the histogram
    of what the engine emitted there over the seeded runs whose first token was t1."""
    from actors.engine import SpecEngine
    from actors.llama import LlamaRunner

    with torch.inference_mode():
        p1 = torch.softmax(target.model(torch.tensor([ctx])).logits[0, -1].double(), -1)
        t1 = int(p1.argmax())
        p = torch.softmax(target.model(torch.tensor([ctx + [t1]])).logits[0, -1].double(), -1)
    d = int(p.argsort(descending=True)[rank])
    eng = SpecEngine(LlamaRunner(target.model), {"fixed": FixedToken(d)}, eos_token_ids=set(), max_batch=512,
                     max_len=16)
    eng.observer = dev = DeviationLog()
    reqs = [Request(f"r{i}", ctx, SamplingParams(max_tokens=3, temperature=1.0, seed=seed0 + i),  # room for a draft
                    SpeculationParams("fixed", 1, acceptance=rule)) for i in range(n)]
    k0 = eng.add_request(reqs[0])  # keys are handed out in order: request i has key k0 + i
    eng.abort(k0)
    done = eng.generate(reqs)
    at_t1 = {k0 + 1 + i for i, c in enumerate(done) if c.token_ids[0] == t1}
    second = [c.token_ids[1] for c in done if c.token_ids[0] == t1]
    tv = [v for k, pos, v in dev.log if pos == len(ctx) + 1 and k in at_t1]
    hist = torch.bincount(torch.tensor(second), minlength=len(p))
    return {"t1": t1, "draft": d, "p": p, "hist": hist, "tv_accounted": sum(tv) / max(1, len(tv)),
            "runs": len(second)}


def leviathan(alpha: float, gamma: int, c: float) -> float:
    """Expected speedup at i.i.d. acceptance alpha, draft length gamma, draft/target cost c."""
    tokens = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + 1)


class Lab:
    def __init__(self, model: str, drafts: list[str], prompts: list[list[int]], max_tokens: int, dtype: str,
                 quick: bool, progress: bool = True):
        from actors.build import build_engine

        self.quick, self.max_tokens, self.prompts = quick, max_tokens, prompts
        self.built = build_engine(model, {d: d for d in drafts}, dtype, max_batch=8, max_len=1024)
        self.eng = self.built.engine
        self.drafts = drafts
        from tqdm import tqdm

        self.bar = tqdm(desc="specd lab", unit=" tok", disable=not progress)  # every token the study generates

    def run(self, draft: str | None, gamma, prompts: list[list[int]] | None = None, batch: int = 1, **spec) -> dict:
        """Generate every prompt (greedy unless spec says otherwise), `batch` at a time; totals."""
        prompts = prompts if prompts is not None else self.prompts
        sampling = spec.pop("sampling", {})
        total, t0, stats, outs = 0, time.perf_counter(), SpecStats(), []
        for i in range(0, len(prompts), batch):
            reqs = [Request(f"l{i + j}", p, SamplingParams(max_tokens=self.max_tokens, **sampling),
                            SpeculationParams(draft=draft or "none", gamma=gamma if draft else 0, **spec))
                    for j, p in enumerate(prompts[i:i + batch])]
            for c in self.eng.generate(reqs):
                total += len(c.token_ids)
                stats.add(c.stats)
                outs.append(c.token_ids)
                self.bar.update(len(c.token_ids))
        secs = time.perf_counter() - t0
        return {"tokens": total, "seconds": secs, "tokens_per_s": total / secs, "outputs": outs,
                "acceptance_rate": stats.acceptance_rate, "draft_tokens": stats.draft_tokens,
                "tokens_per_pass": total / max(1, stats.target_passes + len(prompts)),
                "candidate_length": stats.draft_tokens / stats.drafts if stats.drafts else 0.0,
                "per_position": stats.per_position()}

    # ---- claims ------------------------------------------------------------------------------
    def gamma_sweep(self) -> dict:
        from actors.calibrate import draft_step_seconds

        gammas = [0, 1, 2, 4, 6] if self.quick else [0, 1, 2, 3, 4, 6, 8]
        base = self.run(None, 0)
        cost = self.eng.pass_cost
        out = {"gammas": gammas, "drafts": {}}
        for d in self.drafts:
            rows = {g: (base if g == 0 else self.run(d, g)) for g in gammas}
            g_fit = max(g for g in gammas if g)
            alpha = leviathan_alpha(rows[g_fit]["tokens_per_pass"], g_fit)
            ctx = self.prompts[0] + rows[g_fit]["outputs"][0][:8]
            with torch.inference_mode():
                step = draft_step_seconds(self.eng.drafters[d], ctx[:max(2, len(ctx))], self.eng.target, reps=5)
            c = step / cost(1, 1)
            meas = {g: rows[g]["tokens_per_s"] / base["tokens_per_s"] for g in gammas}
            lev = {g: leviathan(alpha, g, c) for g in gammas}
            curve = {g: ((1 - alpha ** (g + 1)) / (1 - alpha) if alpha < 1 else g + 1) * cost(1, 1)
                     / (cost(1, g + 1) + g * step) for g in gammas}
            out["drafts"][d] = {"alpha": alpha, "c": c, "measured_speedup": meas, "leviathan": lev,
                                "with_pass_cost_curve": curve, "best_measured": max(meas, key=meas.get),
                                "best_leviathan": max(lev, key=lev.get), "best_curve": max(curve, key=curve.get)}
        ds = out["drafts"]
        differ = len({v["best_measured"] for v in ds.values()}) > 1 or len({round(v["alpha"], 2) for v in ds.values()}) > 1
        agree = sum(v["best_measured"] == v["best_curve"] for v in ds.values())
        best = ", ".join(f"{d} γ={v['best_measured']}" for d, v in ds.items())
        alphas = ", ".join(f"{d} {v['alpha']:.2f}" for d, v in ds.items())
        cs = ", ".join(f"{d} {v['c']:.3f}" for d, v in ds.items())
        out["verdict"] = (f"best γ per draft (measured): {best}; α {alphas}, c {cs}. "
                          + ("CONFIRMED: the best γ differs with α and c" if differ else
                             "NOT shown: one γ is best for every draft here")
                          + f"; the pass-cost-curve prediction picks the measured best for {agree}/{len(ds)} drafts, "
                            "Leviathan's (which assumes a free verify pass) for "
                          + f"{sum(v['best_measured'] == v['best_leviathan'] for v in ds.values())}/{len(ds)}")
        return out

    def entropy_split(self, draft: str) -> dict:
        self.eng.observer = obs = EntropyLog(self.eng.tokenizer)
        self.run(draft, 4)
        log, self.eng.observer = obs.log, None
        if not log:
            return {"verdict": "no drafted positions", "bins": []}
        ents = sorted(e for e, _, _ in log)
        edges = [ents[int(len(ents) * q / 5)] for q in range(1, 5)]
        bins = []
        for i in range(5):
            lo = edges[i - 1] if i else -1.0
            hi = edges[i] if i < 4 else float("inf")
            sel = [a for e, a, _ in log if lo < e <= hi]
            bins.append({"entropy_from": lo, "entropy_to": hi, "positions": len(sel),
                         "acceptance": sum(sel) / len(sel) if sel else None})
        ctx = {}
        for _, a, c in log:
            ctx.setdefault(c, []).append(a)
        by_ctx = {c: {"positions": len(v), "acceptance": sum(v) / len(v)} for c, v in ctx.items()}
        acc = [b["acceptance"] for b in bins if b["acceptance"] is not None]
        falls = len(acc) >= 2 and acc[-1] < acc[0]
        gates = {}
        base = self.run(draft, "auto")
        for g in ([1.0, 3.0] if self.quick else [1.5, 2.5, 4.0]):
            r = self.run(draft, "auto", entropy_gate=g)
            gates[g] = {"tokens_per_s": r["tokens_per_s"], "vs_no_gate": r["tokens_per_s"] / base["tokens_per_s"],
                        "draft_tokens": r["draft_tokens"]}
        return {"draft": draft, "positions": len(log), "bins": bins, "by_context": by_ctx, "gate": gates,
                "verdict": (f"acceptance {acc[0]:.2f} in the lowest-entropy fifth vs {acc[-1]:.2f} in the highest: "
                            + ("CONFIRMED, acceptance falls in high-entropy regions" if falls else "REFUTED here")
                            + "; by context: " + ", ".join(f"{c} {v['acceptance']:.2f}" for c, v in by_ctx.items())
                            + "; entropy gate (γ auto): " + ", ".join(f"{g} nats {v['vs_no_gate']:.2f}x"
                                                                        for g, v in gates.items()))}

    def threshold_sweep(self, draft: str) -> dict:
        taus = [0.0, 0.3, 0.6] if self.quick else [0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9]
        out = {"draft": draft, "taus": taus, "batches": {}}
        for bs in (1, 4):
            base = self.run(None, 0, batch=bs)
            rows = {}
            for tau in taus:
                r = self.run(draft, 6, batch=bs, threshold=tau)
                rows[tau] = {k: r[k] for k in ("candidate_length", "acceptance_rate", "tokens_per_pass", "tokens_per_s")}
                rows[tau]["vs_no_draft"] = r["tokens_per_s"] / base["tokens_per_s"]
            best = max(rows, key=lambda t: rows[t]["tokens_per_s"])
            out["batches"][bs] = {"rows": rows, "best_tau": best}
        b1, b4 = out["batches"][1]["best_tau"], out["batches"][4]["best_tau"]
        r1 = out["batches"][1]["rows"]
        trades = r1[taus[-1]]["candidate_length"] < r1[0.0]["candidate_length"] and \
            r1[taus[-1]]["acceptance_rate"] >= r1[0.0]["acceptance_rate"]
        out["verdict"] = ((f"CONFIRMED: τ {taus[-1]} cuts the candidate length {r1[0.0]['candidate_length']:.1f} -> "
                           f"{r1[taus[-1]]['candidate_length']:.1f} and raises α {r1[0.0]['acceptance_rate']:.2f} -> "
                           f"{r1[taus[-1]]['acceptance_rate']:.2f}" if trades else "NOT shown: the threshold did not "
                           "trade length for acceptance here")
                          + f"; the best τ is {b1} at batch 1 and {b4} at batch 4")
        return out

    def poor_draft_batching(self) -> dict:
        from actors.drafters.oracle import OracleDrafter

        base_outs = self.run(None, 0)["outputs"]
        refs = {tuple(p): o + [0] * 64 for p, o in zip(self.prompts, base_outs)}
        ps = [0.2, 0.8] if self.quick else [0.2, 0.5, 0.8]
        batches = [1, 4] if self.quick else [1, 4, 8]
        V = self.eng.target.vocab_size
        out = {"ps": ps, "batches": batches, "rows": {}}
        for p in ps:
            self.eng.register_drafter(f"oracle{p}", OracleDrafter(refs, p, V, seed=int(p * 100)))
        for bs in batches:
            off = self.run(None, 0, batch=bs)["tokens_per_s"]
            out["rows"][bs] = {"off": off}
            for p in ps:
                out["rows"][bs][p] = self.run(f"oracle{p}", 4, batch=bs)["tokens_per_s"] / off
        for p in ps:
            self.eng.register_drafter(f"oracle{p}", None)
        lo, hi = batches[0], batches[-1]
        hurt = [p for p in ps if out["rows"][hi][p] < out["rows"][lo][p]]
        out["verdict"] = ("speculation on / off at a fixed γ=4: " + "; ".join(
            f"p={p}: " + ", ".join(f"batch {b} {out['rows'][b][p]:.2f}x" for b in batches) for p in ps)
            + (". CONFIRMED: a draft's gain shrinks with batch" + (f" (p={hurt[0]} falls below 1.0x)" if any(
                out["rows"][hi][p] < 1 for p in hurt) else "") if hurt else ". NOT shown here"))
        return out

    def lossy_pareto(self, draft: str) -> dict:
        rules = ["lossless", "topk:5", "typical:0.3"] if self.quick else \
            ["lossless", "topk:2", "topk:5", "topk:20", "typical:0.1", "typical:0.3", "typical:0.5"]
        sampling = {"temperature": 1.0, "seed": 5}
        ref = self.run(draft, 4, sampling=dict(sampling), acceptance="lossless")
        rows = {}
        for rule in rules:
            r = ref if rule == "lossless" else self.run(draft, 4, sampling=dict(sampling), acceptance=rule)
            agree = [common_prefix(a, b) / max(1, max(len(a), len(b))) for a, b in zip(r["outputs"], ref["outputs"])]
            rows[rule] = {"tokens_per_s": r["tokens_per_s"], "speedup_vs_lossless": r["tokens_per_s"] / ref["tokens_per_s"],
                          "nll": self._nll(r["outputs"]), "agreement_with_lossless": sum(agree) / len(agree),
                          "acceptance_rate": r["acceptance_rate"]}
        base_nll = rows["lossless"]["nll"]
        for r in rows.values():
            r["nll_increase"] = r["nll"] - base_nll
        lossy = {k: v for k, v in rows.items() if k != "lossless"}
        faster = [k for k, v in lossy.items() if v["speedup_vs_lossless"] > 1.0]
        return {"draft": draft, "rows": rows,
                "verdict": ("lossy rules vs lossless (same seeds): " + "; ".join(
                    f"{k}: {v['speedup_vs_lossless']:.2f}x, NLL {v['nll_increase']:+.3f} nats/token, agreement "
                    f"{v['agreement_with_lossless']:.0%}" for k, v in lossy.items())
                    + (". CONFIRMED: speed bought with a measured deviation" if faster else
                       ". REFUTED here: no lossy rule was faster")),
                "tv_note": "TV is exact on a small vocabulary (tests/unit/test_controls.py); on the embedded model "
                           "the deviation is shown as NLL under the target and agreement with the lossless output"}

    def _nll(self, outputs: list[list[int]]) -> float:
        """Mean negative log-likelihood (nats/token) of the outputs under the target at temperature 1."""
        model, tot, n = self.built.target.model, 0.0, 0
        with torch.inference_mode():
            for p, o in zip(self.prompts, outputs):
                if not o:
                    continue
                ids = torch.tensor([p + o])
                logp = torch.log_softmax(model(ids).logits[0, len(p) - 1:-1].float(), -1)
                tot -= float(logp.gather(1, torch.tensor(o)[:, None]).sum())
                n += len(o)
        return tot / max(1, n)

    def draft_auto(self, domains: dict[str, list[list[int]]]) -> dict:
        rows, per_domain = {}, {}
        for d in self.drafts:
            per_domain[d] = {dom: self.run(d, "auto", prompts=ps) for dom, ps in domains.items()}
            rows[d] = _combine(per_domain[d].values())
        auto = {dom: self.run("auto", "auto", prompts=ps) for dom, ps in domains.items()}
        rows["auto"] = _combine(auto.values())
        oracle = {dom: max((per_domain[d][dom] for d in self.drafts), key=lambda r: r["tokens_per_s"])
                  for dom in domains}
        rows["oracle by domain"] = _combine(oracle.values())
        best_single = max(self.drafts, key=lambda d: rows[d]["tokens_per_s"])
        return {"rows": {k: {"tokens_per_s": v["tokens_per_s"]} for k, v in rows.items()},
                "verdict": f"mixed workload tokens/s: best single draft {best_single} {rows[best_single]['tokens_per_s']:.1f}, "
                           f"auto {rows['auto']['tokens_per_s']:.1f}, oracle by domain "
                           f"{rows['oracle by domain']['tokens_per_s']:.1f}"}


def _combine(runs) -> dict:
    runs = list(runs)
    return {"tokens_per_s": sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)}


def distill_reports(root: Path) -> dict:
    """The claims `specd distill` measured (specd/claims.sh writes out/claims/*/report.json), where present."""
    rows = {}
    for rep in sorted(root.glob("*/report.json")):
        r = json.loads(rep.read_text())
        rows[rep.parent.name] = {"kind": r["kind"], "objective": r["objective"], "steps": r["config"]["steps"],
                                 "alpha_after": r["after"]["all"]["alpha"], "domain": r.get("domain")}
    if not rows:
        return {"rows": {}, "verdict": f"no distill reports under {root}: run `sh specd/claims.sh 100` first"}
    v = []
    for a, b, what in (("eagle-fkl", "eagle-ntp", "KL vs NTP (eagle)"), ("truncated4-fkl", "truncated4-ntp",
                                                                         "KL vs NTP (truncated:4)"),
                       ("truncated4-fkl", "small-fkl", "same-family vs generic")):
        if a in rows and b in rows:
            v.append(f"{what}: {rows[a]['alpha_after']:.3f} vs {rows[b]['alpha_after']:.3f}")
    return {"rows": rows, "verdict": "; ".join(v) or "reports present but not the claim pairs"}


# --------------------------------------------------------------------------------- the command
def add_parser(sub) -> None:
    p = sub.add_parser("lab", help="measure the seed's claims on your target and drafts (report.md + figures)")
    p.set_defaults(func=run)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--draft", action="append", default=None, help="drafts to study (default: ngram, default, "
                                                                  "truncated:4; --quick: ngram, truncated:2)")
    p.add_argument("--quick", action="store_true", help="the tiny random model, small sizes: under a minute")
    p.add_argument("--limit", type=int, default=None, help="prompts per study (default 8; --quick 4)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 32 (--quick 24)")
    p.add_argument("--out", default="out/lab")


def run(args) -> int:
    from actors.build import draft_meta
    from actors.text import encode_prompt

    from .data import PROMPTS, load_prompts

    t0 = time.perf_counter()
    quick = args.quick
    model = "tiny" if quick else args.model
    drafts = args.draft or (["ngram", "truncated:2"] if quick else
                            ["ngram"] + (["default"] if draft_meta("default") else []) + ["truncated:4"])
    limit = args.limit or (4 if quick else 8)
    max_tokens = args.max_tokens or (24 if quick else 32)
    if quick:
        g = torch.Generator().manual_seed(0)
        chat = [torch.randint(3, 512, (12,), generator=g).tolist() for _ in range(limit)]
        code = [[10, 11, 12, 13, 14] * 3 for _ in range(limit // 2)] + [[40, 41, 42] * 4 for _ in range(limit // 2)]
        prompts = chat
        lab = Lab(model, drafts, prompts, max_tokens, "fp32", quick)
    else:
        rows = load_prompts(PROMPTS)
        lab = Lab(model, drafts, [], max_tokens, args.dtype, quick)
        tok = lab.built.target.tokenizer
        enc = [(r.get("kind", "chat"), encode_prompt(tok, prompt=r.get("prompt"), messages=r.get("messages")))
               for r in rows]
        chat = [i for k, i in enc if k == "chat"][:limit]
        code = [i for k, i in enc if k == "code"][:limit]
        lab.prompts = prompts = (chat[:limit // 2] + code[:limit - limit // 2])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    main = drafts[1] if len(drafts) > 1 else drafts[0]

    def section(claim, fn, *a):
        t = time.perf_counter()
        res = fn(*a)
        res["seconds"] = time.perf_counter() - t
        print(f"[specd lab {time.perf_counter() - t0:5.0f} s] {claim}: {res['verdict']}", flush=True)
        return res

    cmd = (f"specd lab{' --quick' if quick else ''}" + (f" --limit {args.limit}" if args.limit else "")
           + (f" --max-tokens {args.max_tokens}" if args.max_tokens else "")
           + (f" --dtype {args.dtype}" if args.dtype != "auto" else "")
           + "".join(f" --draft {d}" for d in args.draft or []) + f" --out {args.out}")
    res = {"model": model, "dtype": lab.built.dtype, "hardware": lab.eng.info.get("hardware"), "drafts": drafts,
           "prompts": len(prompts), "max_tokens": max_tokens}
    res["gamma"] = section("the best γ depends on α and c", lab.gamma_sweep)
    res["entropy"] = section("acceptance falls in high-entropy regions", lab.entropy_split, main)
    res["threshold"] = section("a confidence threshold trades candidate length for acceptance", lab.threshold_sweep,
                               main)
    res["batching"] = section("a poor draft hurts batching", lab.poor_draft_batching)
    res["lossy"] = section("lossy rules trade deviation for speed", lab.lossy_pareto, main)
    res["draft_auto"] = section('draft "auto" on a mixed chat and code workload', lab.draft_auto,
                                {"chat": chat[:max(2, limit // 2)], "code": code[:max(2, limit // 2)]})
    res["distill"] = section("distillation", distill_reports, Path("out/claims"))
    res["wall_s"] = time.perf_counter() - t0
    (out / "lab.json").write_text(json.dumps(res, indent=2, default=str))
    figures = _plots(res, out)
    (out / "report.md").write_text(_report(res, cmd, figures))
    print(f"[specd lab] {res['wall_s']:.0f} s; wrote {out / 'report.md'}, {out / 'lab.json'} and {len(figures)} figures")
    return 0


CLAIMS = [("gamma", "The best γ depends on α and c"), ("entropy", "Acceptance falls in high-entropy regions"),
          ("threshold", "A confidence threshold trades candidate length for acceptance"),
          ("batching", "A poor draft hurts batching"), ("lossy", "Lossy rules trade deviation for speed"),
          ("draft_auto", 'Draft "auto" picks the right draft'), ("distill", "Distillation")]


def _report(res: dict, cmd: str, figures: dict) -> str:
    lines = [f"# specd lab: {res['model']} ({res['dtype']})", "",
             f"Hardware: {res['hardware']}. Drafts: {', '.join(res['drafts'])}; {res['prompts']} prompts, "
             f"<= {res['max_tokens']} new tokens; {res['wall_s']:.0f} s. Reproduce: `{cmd}`.", ""]
    for key, title in CLAIMS:
        r = res[key]
        lines += [f"## {title}", "", f"**Verdict:** {r['verdict']}", ""]
        if key in figures:
            lines += [f"![{title}]({figures[key]})", ""]
        lines += ["```json", json.dumps({k: v for k, v in r.items() if k != "verdict"}, indent=1, default=str)[:3000],
                  "```", ""]
    return "\n".join(lines)


def _plots(res: dict, out: Path) -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = {}
    fig, ax = plt.subplots(figsize=(6, 4))
    for d, v in res["gamma"]["drafts"].items():
        gs = res["gamma"]["gammas"]
        ax.plot(gs, [v["measured_speedup"][g] for g in gs], marker="o", label=f"{d} measured")
        ax.plot(gs, [v["leviathan"][g] for g in gs], "--", label=f"{d} Leviathan α={v['alpha']:.2f} c={v['c']:.2f}")
        ax.plot(gs, [v["with_pass_cost_curve"][g] for g in gs], ":", label=f"{d} pass-cost curve")
    ax.set_xlabel("γ")
    ax.set_ylabel("speedup over γ=0")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "gamma.png", dpi=100)
    figs["gamma"] = "gamma.png"
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    bins = [b for b in res["entropy"]["bins"] if b["acceptance"] is not None]
    ax.bar(range(len(bins)), [b["acceptance"] for b in bins])
    ax.set_xticks(range(len(bins)), [f"{b['entropy_from']:.1f}-{b['entropy_to']:.1f}" for b in bins], fontsize=7)
    ax.set_xlabel("target entropy at the position (nats, quintiles)")
    ax.set_ylabel("acceptance")
    fig.tight_layout()
    fig.savefig(out / "entropy.png", dpi=100)
    figs["entropy"] = "entropy.png"
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for bs, v in res["threshold"]["batches"].items():
        taus = list(v["rows"])
        axes[0].plot(taus, [v["rows"][t]["tokens_per_s"] for t in taus], marker="o", label=f"batch {bs}")
        axes[1].plot([v["rows"][t]["candidate_length"] for t in taus], [v["rows"][t]["acceptance_rate"] for t in taus],
                     marker="o", label=f"batch {bs}")
    axes[0].set_xlabel("τ")
    axes[0].set_ylabel("tokens/s")
    axes[1].set_xlabel("candidate length")
    axes[1].set_ylabel("α")
    for a in axes:
        a.legend()
    fig.tight_layout()
    fig.savefig(out / "threshold.png", dpi=100)
    figs["threshold"] = "threshold.png"
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    b = res["batching"]
    for p in b["ps"]:
        ax.plot(b["batches"], [b["rows"][bs][p] for bs in b["batches"]], marker="o", label=f"oracle p={p}")
    ax.axhline(1.0, color="#999")
    ax.set_xlabel("batch")
    ax.set_ylabel("tokens/s, speculation on / off (γ=4)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "batching.png", dpi=100)
    figs["batching"] = "batching.png"
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for k, v in res["lossy"]["rows"].items():
        ax.scatter(max(v["nll_increase"], 0.0), v["speedup_vs_lossless"])
        ax.annotate(k, (max(v["nll_increase"], 0.0), v["speedup_vs_lossless"]), fontsize=8)
    ax.set_xlabel("deviation: NLL increase under the target (nats/token)")
    ax.set_ylabel("speedup over lossless")
    fig.tight_layout()
    fig.savefig(out / "lossy.png", dpi=100)
    figs["lossy"] = "lossy.png"
    plt.close(fig)
    return figs
