"""`specd tune`: measure this machine, predict the best γ (and tree budget) per batch size, check it.

    specd tune [--model smollm2] [--draft ngram --draft default] [--batches 1,4,8] [--out out/tune]

For each draft, on the hardware at hand (`hardware.hardware()`: GPU name, or CPU model and flags):
  1. measure  the target's pass cost t(B, T) over batch × tokens per row (`calibrate.measure`), the
              draft's cost per drafted position s_B at each batch size (`calibrate.draft_step_seconds`,
              what the profile gives the policy), and, from greedy generation on the calibration
              prompts (chat and code from `specd/data/prompts.jsonl`) at γ = AUTO_MAX_GAMMA and at
              each tree budget, at every batch size: what each row drafted (k) and accepted (a) at
              every verify step, and the seconds each step spent drafting;
  2. predict  tokens/s for every γ and tree budget at every batch size B, Leviathan's formula extended
              to acceptance that varies by position (a_j: P(draft j accepted | drafts < j were)):
                  E(γ)       = 1 + Σ_{k=1..γ} Π_{j≤k} a_j = 1 + E[min(a, γ)]    tokens per row and pass
                  tokens/s   = B · E(γ) / (E[t(B, 1 + W)] + d(γ))
              W = max over the B rows of min(k, γ): rows are padded to the widest, and a drafter may
              propose fewer than γ (n-gram: none without a match); rows drawn independently, so
              P(W ≤ w) = P(min(k, γ) ≤ w)^B. d(γ): the drafting the calibration steps spent at
              batch B, per drafted position × γ for a chain (the widest row's draft is how many
              draft steps ran), per step for a tree budget (the tree's depth and width are the
              drafter's; 1.5 × depth chain steps, the policy's charge until it measures a tree,
              overcharged them: tree 4 at batch 1 predicted 26 tokens/s, measured 37). With a_j = α for every j, E(γ) is
              Leviathan's (1 - α^(γ+1)) / (1 - α). An engine step costs more than its pass and
              its drafting (logits to host, acceptance, per-row bookkeeping, a drafter's
              catch-up on accepted tokens): o(B, W) is fitted by non-negative least squares to
              what the calibration runs' steps (plain decoding and each drafting run, at every
              batch size) cost beyond t(B, 1 + W) + d, as o0 + o1·B + o2·[drafting] + o3·B·W, and
              added to every step's time.
  3. check    the prediction against a short empirical sweep: real greedy generation at every γ and
              tree budget, on the same prompts, interleaved prompt chunk by prompt chunk, timing the
              full-batch decode steps (prefill costs the same at every γ; the prediction is of the
              steady state), each chunk's rate the best of --rounds runs (other load on the
              machine only slows a run down; the pass-cost grid keeps its least time too, and is
              made monotone in rows and tokens);
              measured tokens/s at the predicted best against the sweep's best, and the sweep's range
              (a flat curve shows as a narrow one);
  4. store    a profile per draft (`actors/tune_profile.py`), keyed by the hardware fingerprint, model,
              draft, dtype and quant mode, in the profile store (the engine and the cluster's
              verifiers use it under `gamma: auto` where it matches) and in --out beside tune.json,
              tune.txt (the tables) and tune.png (tokens/s against γ per batch size, predicted and
              measured).

Does not know: serving. It drives the in-process engine with fixed γ only.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.calibrate import PassCost, draft_step_seconds, grid, measure
from actors.hardware import hardware, hardware_line
from actors.policy import PRIOR_ACCEPT, TREE_BUDGETS, TREE_DEPTH
from actors.schema import AUTO_MAX_GAMMA, Request, SamplingParams, SpeculationParams
from actors.tune_profile import QUANT_NONE, TuneProfile, profile_key, save, store_path

GAMMAS = (0, 1, 2, 3, 4, 6)  # the sweep's defaults: small enough for ~20 min on a 2-core CPU
BUDGETS = (4, 8)

# ------------------------------------------------------------------------------------- prediction


@dataclass
class DraftRecord:
    """Per row and verify step of a calibration run: tokens drafted (a tree: its nodes) and
    accepted (a tree: the accepted path's length)."""
    drafted: list[int]
    accepted: list[int]

    def accepted_at(self, n: int) -> list[float]:
        """P(the first k drafts accepted) for k = 1..n: Π_{j≤k} a_j."""
        m = max(1, len(self.accepted))
        return [sum(a >= k for a in self.accepted) / m for k in range(1, n + 1)]

    def conditional(self, n: int) -> list[float]:
        """a_j = P(draft j accepted | drafted, and drafts < j accepted), j = 1..n: what the
        speculation policy estimates live (positions never reached: its cautious prior)."""
        out = []
        for j in range(1, n + 1):
            reached = sum(k >= j and a >= j - 1 for k, a in zip(self.drafted, self.accepted))
            out.append(sum(a >= j for a in self.accepted) / reached if reached else PRIOR_ACCEPT)
        return out

    def mean_accepted(self) -> float:
        """Accepted tokens (a tree: path length) per verify step that drafted (the policy's tree estimate)."""
        got = [a for k, a in zip(self.drafted, self.accepted) if k]
        return sum(got) / len(got) if got else 0.0

    def expected_tokens(self, gamma: int) -> float:
        """E(γ) = 1 + Σ_{k=1..γ} Π_{j≤k} a_j: tokens per row and pass (accepted drafts + one)."""
        return 1.0 + sum(self.accepted_at(gamma))

    def width_pmf(self, rows: int, gamma: int) -> list[float]:
        """P(W = w), w = 0..γ, W = max over `rows` independent rows of min(k, γ): a step's widest draft."""
        m = max(1, len(self.drafted))
        cdf = [sum(min(k, gamma) <= w for k in self.drafted) / m for w in range(gamma + 1)]
        cdf[-1] = 1.0  # no samples: every row drafts γ
        return [cdf[w] ** rows - (cdf[w - 1] ** rows if w else 0.0) for w in range(gamma + 1)]

    def expected_pass_s(self, cost: PassCost, rows: int, gamma: int) -> float:
        """E[t(rows, 1 + W)] (rows are padded to the widest)."""
        return sum(p * cost(rows, 1 + w) for w, p in enumerate(self.width_pmf(rows, gamma)))

    def expected_width(self, rows: int, gamma: int) -> float:
        """E[W]: the widest draft of a step, on average."""
        return sum(w * p for w, p in enumerate(self.width_pmf(rows, gamma)))


@dataclass
class StepOverhead:
    """What an engine step costs beyond its target pass and its drafting, in seconds, fitted to
    the calibration runs' steps (see the module docstring): o0 + o1·B + o2·drafting + o3·B·W."""
    coef: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    steps: int = 0  # steps the fit saw

    def __call__(self, rows: int, width: float, drafting: bool) -> float:
        o0, o1, o2, o3 = self.coef
        return max(0.0, o0 + o1 * rows + o2 * drafting + o3 * rows * width)

    @classmethod
    def fit(cls, samples: list[tuple[int, int, bool, float]]) -> "StepOverhead":
        """samples: (rows, widest draft W, drafting, seconds beyond pass and drafting) per step.
        Non-negative least squares (scipy's `nnls`): each term is a cost, and unconstrained, a
        negative per-row term fitted at one batch size turns into a large constant at another."""
        from scipy.optimize import nnls

        if len(samples) < 5:
            return cls()
        x = [[1.0, b, float(d), b * w] for b, w, d, _ in samples]
        coef, _ = nnls(x, [s for *_, s in samples])
        return cls(tuple(float(c) for c in coef), len(samples))


def predict_tps(cost: PassCost, rec: DraftRecord | None, rows: int, gamma: int, draft_s: float,
                overhead: StepOverhead | None = None) -> float:
    """Tokens/s of `rows` rows drafting up to γ tokens (or tree nodes) each, `draft_s` seconds of
    drafting per step: rows · E(γ) / (E[t(rows, 1 + W)] + draft_s + o(rows, E[W])). γ = 0 (rec None):
    plain decoding."""
    o = overhead or StepOverhead()
    if rec is None or gamma == 0:
        return rows / (cost(rows, 1) + o(rows, 0, False))
    return rows * rec.expected_tokens(gamma) / (rec.expected_pass_s(cost, rows, gamma) + draft_s
                                               + o(rows, rec.expected_width(rows, gamma), True))


# ------------------------------------------------------------------------------------ measurement


def config_name(gamma: int, tree: int) -> str:
    return f"tree:{tree}" if tree else f"γ={gamma}"


@dataclass
class Run:
    """One `run_logged` generation: tokens generated, each row's (drafted, accepted) per verify
    step, and the tokens and seconds of its full-batch decode steps (every row past its prefill,
    none finished yet: the steady state a prediction describes)."""
    tokens: int
    record: DraftRecord
    decode_tokens: int = 0
    decode_s: float = 0.0


def run_logged(eng, reqs: list[Request], steps: list | None = None) -> Run:
    """Generate to completion, logging every verify step (see `Run`). steps, when given, gets
    (rows, widest draft, seconds, of which drafting) of every step once all rows decode."""
    keys = {eng.add_request(r) for r in reqs}
    started: set[int] = set()  # rows that have produced a token (their prefill is done)
    last: dict[int, tuple[int, int, int]] = {}  # key -> (passes, drafted, accepted) so far
    run = Run(0, DraftRecord([], []))
    while keys:
        decoding = len(started) == len(reqs)
        full = decoding and len(keys) == len(reqs)
        t0, d0 = time.perf_counter(), eng.batcher.draft_s
        out = eng.step()
        dt, ds = time.perf_counter() - t0, eng.batcher.draft_s - d0
        stats = {k: eng.active[k].stats for k in keys if k in eng.active}
        for k, d in out.items():
            run.tokens += len(d.token_ids)
            run.decode_tokens += full * len(d.token_ids)
            started.add(k)
            if d.finished and k in keys:
                stats[k] = d.stats
                keys.discard(k)
        run.decode_s += full * dt
        widest, rows = 0, 0
        for k, st in stats.items():
            now = (st.target_passes, st.draft_tokens, st.accepted_tokens)
            prev = last.get(k, (0, 0, 0))
            if now[0] > prev[0]:  # one verify step of this row
                run.record.drafted.append(now[1] - prev[1])
                run.record.accepted.append(now[2] - prev[2])
                widest, rows = max(widest, now[1] - prev[1]), rows + 1
            last[k] = now
        if steps is not None and decoding and rows:
            steps.append((rows, widest, dt, ds))
    return run


def requests(prompts: list[list[int]], draft: str, gamma: int, tree: int, max_tokens: int) -> list[Request]:
    return [Request(f"tune-{i}", p, SamplingParams(max_tokens=max_tokens),
                    SpeculationParams(draft=draft if gamma else "none", gamma=gamma, tree=tree or None))
            for i, p in enumerate(prompts)]


def calibration_prompts(tokenizer, path: str | None, limit: int) -> list[list[int]]:
    """Half chat, half code from the committed prompt set; from a user's file, its first `limit`
    prompts taken in turn from each "kind" it names (a file without kinds: its first `limit`). A
    model without a tokenizer (the tiny test model): random ids and repeating patterns, half each."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        chat = [torch.randint(3, 512, (12,), generator=g).tolist() for _ in range(limit)]
        code = [[10 + i, 11 + i, 12 + i, 13 + i] * 4 for i in range(limit)]
    else:
        from actors.text import encode_prompt

        from .data import load_prompts, mixed

        return [encode_prompt(tokenizer, prompt=r.get("prompt"), messages=r.get("messages"))
                for r in mixed(load_prompts(path), limit)]
    return [p for pair in zip(chat, code) for p in pair][:limit]


def sweep(eng, prompts: list[list[int]], configs: list[tuple[str, int, int]], batches: list[int],
          max_tokens: int, rounds: int, bar) -> dict:
    """Measured decode tokens/s per (batch, draft, γ, tree): the configs (draft, γ, tree) run
    interleaved, chunk by chunk of `batch` prompts, in an order rotated per chunk and round. A
    chunk counts its full-batch decode steps only (`Run`): prefill costs the same at every γ, and
    the prediction is of the steady state. Each chunk's rate is the best of its `rounds` runs (the
    machine's other load only ever slows a run down, as in the pass-cost grid), and a
    configuration's tokens/s is its tokens over the sum of its chunks' seconds at those rates."""
    tokens: dict[tuple, int] = {}
    secs: dict[tuple, float] = {}
    for d, g, n in configs:  # warm-up: first-call allocations, untimed
        eng.generate(requests(prompts[:1], d, g, n, 4))
    for r in range(rounds):
        for bs in batches:
            for c, i in enumerate(range(0, len(prompts), bs)):
                k = (c + r) % len(configs)
                for d, g, n in configs[k:] + configs[:k]:
                    chunk = prompts[i:i + bs]
                    run = run_logged(eng, requests(chunk, d, g, n, max_tokens))
                    key = (bs, d, g, n, i)
                    if run.decode_s > 0 and (key not in tokens or
                                             run.decode_tokens / run.decode_s > tokens[key] / secs[key]):
                        tokens[key], secs[key] = run.decode_tokens, run.decode_s
                    bar.update(len(chunk))
    tps: dict[tuple, list[float]] = {}
    for key, t in tokens.items():
        tot = tps.setdefault(key[:4], [0, 0.0])
        tot[0] += t
        tot[1] += secs[key]
    return {key: t / s for key, (t, s) in tps.items()}


def monotone(cost: PassCost) -> PassCost:
    """The grid with every point lowered to the least cost measured at as many rows and tokens or
    more: a pass over more rows or tokens never costs less, and a grid point measured above a
    wider one was slowed down by the machine's other load."""
    pts = cost.points
    return PassCost({(b, t): min(s for (b2, t2), s in pts.items() if b2 >= b and t2 >= t) for b, t in pts},
                    cost.dtype, cost.meta)


def tune(model: str = "smollm2", drafts: tuple[str, ...] = ("ngram",), dtype: str = "auto", device: str = "auto",
         batches: tuple[int, ...] = (1, 4, 8), gammas: tuple[int, ...] = GAMMAS,
         tree_budgets: tuple[int, ...] = BUDGETS, prompts_path: str | None = None, limit: int = 8,
         max_tokens: int = 32, reps: int = 3, rounds: int = 2, out: str | Path = "out/tune", store: bool = True,
         progress: bool = True) -> dict:
    """The whole study (see the module docstring); returns the report (tune.json) and writes the
    profiles. `store`: also file each profile in the profile store, where engines find it."""
    from tqdm import tqdm

    from actors.build import build_engine

    t_start = time.perf_counter()
    if not gammas or min(gammas) < 0 or max(gammas) > AUTO_MAX_GAMMA:
        raise ValueError(f"gammas must lie in [0, {AUTO_MAX_GAMMA}] (the most the policy proposes), got {gammas}")
    batches = sorted(set(batches))
    built = build_engine(model, {d: d for d in drafts}, dtype, max_batch=max(batches), max_len=1024, device=device)
    eng = built.engine
    hw = hardware(eng.device)
    prompts = calibration_prompts(built.target.tokenizer, prompts_path, limit)
    if len(prompts) < max(batches):
        raise ValueError(f"{len(prompts)} prompts cannot fill a batch of {max(batches)}: raise --limit")
    gammas = sorted(set(gammas) | {0})
    trees = {d: [n for n in sorted(set(tree_budgets)) if eng.drafters[d].tree_drafting] for d in drafts}

    # 1. measure: the pass-cost grid, each draft's step cost, and its acceptance per position
    widths = sorted(set(range(1, max(gammas) + 2)) | {n + 1 for ns in trees.values() for n in ns})
    cap = max(batches) * max(widths)  # every point of the grid measured, none extrapolated
    grid_bar = tqdm(desc="pass cost grid", unit=" pass", disable=not progress,
                    total=reps * len(grid(max(batches), tuple(widths), cap)))
    with torch.inference_mode():
        cost = monotone(measure(eng.target, max(batches), reps, tokens=tuple(widths), cap=cap,
                                progress=lambda: grid_bar.update(1)))
    grid_bar.close()
    cal_bar = tqdm(desc="acceptance", unit=" req", disable=not progress,  # every batch size counts a share
                   total=len(prompts) * (1 + sum(1 + len(trees[d]) for d in drafts)),
                   bar_format="{l_bar}{bar}| {n:.0f}/{total_fmt} [{elapsed}<{remaining}]")
    plain_steps: list = []  # (rows, widest, seconds, drafting) of plain decoding steps, for the overhead fit
    for bs in batches:  # every batch size: what the overhead costs per row
        for i in range(0, len(prompts), bs):
            chunk = prompts[i:i + bs]
            run_logged(eng, requests(chunk, drafts[0], 0, 0, max_tokens), plain_steps)
            cal_bar.update(len(chunk) / len(batches))
    measured: dict[str, dict] = {}
    for d in drafts:
        drafter = eng.drafters[d]
        ctx = prompts[0]
        with torch.inference_mode():
            step_s = {bs: draft_step_seconds(drafter, ctx, eng.target, reps=5, rows=bs) for bs in batches}
        recs: dict[int, DraftRecord] = {}
        samples = [(b, w, False, s - cost(b, 1)) for b, w, s, _ in plain_steps]
        # drafting seconds as the engine's steps spent them, per batch size: per drafted position
        # for the chain (its widest draft is how many draft steps ran), per step for a tree budget
        drafting: dict[int, dict[int, float]] = {}
        for n in [0] + trees[d]:  # 0: the chain at the policy's longest γ
            rec = DraftRecord([], [])
            drafting[n] = {}
            for bs in batches:  # every batch size: the overhead fit sees drafting steps at each
                steps: list = []
                for i in range(0, len(prompts), bs):
                    chunk = prompts[i:i + bs]
                    rec_i = run_logged(eng, requests(chunk, d, TREE_DEPTH if n else AUTO_MAX_GAMMA, n, max_tokens),
                                       steps).record
                    if bs == max(batches):  # acceptance from one pass over the prompts; all steps feed the fit
                        rec.drafted += rec_i.drafted
                        rec.accepted += rec_i.accepted
                    cal_bar.update(len(chunk) / len(batches))
                spent = sum(ds for *_, ds in steps)
                drafting[n][bs] = spent / max(1, len(steps) if n else sum(w for _, w, _, _ in steps))
                samples += [(b, w, True, s - cost(b, 1 + w) - ds) for b, w, s, ds in steps]
            recs[n] = rec
        measured[d] = {"step_s": step_s, "drafting": drafting, "records": recs, "overhead": StepOverhead.fit(samples)}
    cal_bar.close()

    # 2. predict
    configs = [(drafts[0], 0, 0)] + [(d, g, 0) for d in drafts for g in gammas if g] + \
              [(d, TREE_DEPTH, n) for d in drafts for n in trees[d]]
    predicted = {}
    for bs in batches:
        for d, g, n in configs:
            m = measured[d]
            draft_s = m["drafting"][n][bs] * (1 if n else g)
            predicted[bs, d, g, n] = predict_tps(cost, m["records"][n] if g else None, bs, n or g, draft_s,
                                                 m["overhead"])

    # 3. check: the empirical sweep
    bar = tqdm(desc="sweep", unit=" req", total=rounds * len(prompts) * len(configs) * len(batches),
               disable=not progress)
    meas = sweep(eng, prompts, configs, batches, max_tokens, rounds, bar)
    bar.close()

    # 4. report and store
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"model": built.target.name, "dtype": built.dtype, "dtype_reason": built.dtype_reason,
              "quant": QUANT_NONE, "hardware": hw, "hardware_line": hardware_line(hw), "batches": batches,
              "gammas": gammas, "prompts": len(prompts), "max_tokens": max_tokens, "rounds": rounds,
              "pass_cost": cost.to_json(),
              "drafts": {}}
    for d in drafts:
        m = measured[d]
        mine = [(g, n) for dd, g, n in configs if dd == d or g == 0]
        rows, by_batch = [], {}
        for bs in batches:
            key = lambda g, n: (bs, d if g else drafts[0], g, n)  # noqa: E731  (γ=0 is shared by every draft)
            pred = {config_name(g, n): predicted[key(g, n)] for g, n in mine}
            got = {config_name(g, n): meas[key(g, n)] for g, n in mine}
            rows += [{"batch": bs, "config": c, "predicted_tokens_per_s": pred[c], "measured_tokens_per_s": got[c]}
                     for c in pred]
            best_pred, best_meas = max(pred, key=pred.get), max(got, key=got.get)
            by_batch[bs] = {"predicted_best": best_pred, "measured_at_predicted": got[best_pred],
                            "best_measured": best_meas, "best_measured_tokens_per_s": got[best_meas],
                            "ratio": got[best_pred] / got[best_meas],
                            "sweep_range": [min(got.values()), max(got.values())]}
        chain = m["records"][0]
        key = profile_key(hw, built.target.name, d, built.dtype)
        b1 = min(batches)  # a tree's drafting per row, at the smallest batch (as the prior's chain step)
        prof = TuneProfile(key, cost, chain.conditional(AUTO_MAX_GAMMA), m["step_s"],
                           {n: m["records"][n].mean_accepted() for n in trees[d]},
                           {n: m["drafting"][n][b1] / b1 for n in trees[d]}, time.time(),
                           {"rows": rows, "by_batch": by_batch, "prompts": len(prompts), "max_tokens": max_tokens})
        paths = [str(save(prof, out / f"profile-{_slug(d)}.json"))]
        if store:
            paths.append(str(save(prof, store_path(key))))
        o = m["overhead"]
        report["drafts"][d] = {"accept": prof.accept, "accepted_at": chain.accepted_at(AUTO_MAX_GAMMA),
                               "verify_steps": len(chain.accepted), "step_s": m["step_s"], "tree": prof.tree,
                               "drafting_s": m["drafting"],
                               "step_overhead": {"coef": list(o.coef), "steps": o.steps,
                                                 "ms": {bs: {"plain": 1e3 * o(bs, 0, False),
                                                             "drafting_w4": 1e3 * o(bs, 4, True)}
                                                        for bs in batches}},
                               "rows": rows, "by_batch": by_batch, "profiles": paths}
    report["wall_s"] = time.perf_counter() - t_start
    (out / "tune.json").write_text(json.dumps(report, indent=2))
    (out / "tune.txt").write_text(render(report))
    plot(report, out / "tune.png")
    return report


def _slug(spec: str) -> str:
    return spec.strip("/").replace("/", "_").replace(":", "-") or "draft"


# ------------------------------------------------------------------------------------- presenting


def render(report: dict) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    con = Console(record=True, width=170, file=io.StringIO())  # recorded, not printed
    con.print(f"specd tune: {report['model']} ({report['dtype']}, quant {report['quant']}) on "
              f"{report['hardware_line']}; {report['prompts']} prompts, <= {report['max_tokens']} new tokens, "
              f"greedy, the faster of {report['rounds']} rounds per prompt chunk; {report.get('wall_s', 0):.0f} s")
    t = Table(title="predicted best against the empirical sweep (decode tokens/s: full-batch steps, no prefill)")
    for col in ("draft", "batch", "predicted best", "measured at it", "sweep best", "measured best", "ratio",
                "sweep range (min–max)", "spread"):
        t.add_column(col, justify="left" if col in ("draft", "predicted best", "sweep best") else "right")
    for d, v in report["drafts"].items():
        for bs, b in v["by_batch"].items():
            lo, hi = b["sweep_range"]
            t.add_row(d, str(bs), b["predicted_best"], f"{b['measured_at_predicted']:.1f}", b["best_measured"],
                      f"{b['best_measured_tokens_per_s']:.1f}", f"{b['ratio']:.2f}", f"{lo:.1f}–{hi:.1f}",
                      f"{hi / lo - 1:.0%}")
    con.print(t)
    for d, v in report["drafts"].items():
        configs = list(dict.fromkeys(r["config"] for r in v["rows"]))
        t = Table(title=f"{d}: tokens/s predicted / measured")
        t.add_column("batch", justify="right")
        for c in configs:
            t.add_column(c, justify="right")
        for bs in v["by_batch"]:
            cells = {r["config"]: r for r in v["rows"] if r["batch"] == bs}
            t.add_row(str(bs), *(f"{cells[c]['predicted_tokens_per_s']:.0f} / {cells[c]['measured_tokens_per_s']:.0f}"
                                 for c in configs))
        con.print(t)
        con.print(f"{d}: acceptance per position (conditional) "
                  + " ".join(f"{a:.2f}" for a in v["accept"]) + f" over {v['verify_steps']} verify steps; "
                  + "draft ms per position by batch " + ", ".join(f"{b}: {s * 1e3:.2f}" for b, s in v["step_s"].items())
                  + ("; tree accepted path " + ", ".join(f"{n}: {x:.2f}" for n, x in v["tree"].items())
                     if v["tree"] else ""))
        if "step_overhead" in v:
            con.print(f"{d}: engine step overhead beyond pass + drafting (fitted over "
                      f"{v['step_overhead']['steps']} steps), ms plain / drafting at W=4: "
                      + ", ".join(f"B={b} {x['plain']:.1f} / {x['drafting_w4']:.1f}"
                                  for b, x in v["step_overhead"]["ms"].items()))
        if "drafting_s" in v:  # JSON keys are strings once read back
            con.print(f"{d}: drafting in the engine's steps, ms by batch: "
                      + "; ".join(f"{'chain, per position' if int(n) == 0 else f'tree:{n}, per step'} "
                                  + ", ".join(f"B={b} {x * 1e3:.1f}" for b, x in by_bs.items())
                                  for n, by_bs in v["drafting_s"].items()))
        con.print(f"{d}: profiles {', '.join(v['profiles'])}")
    return con.export_text()


def plot(report: dict, path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = report["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, bs in zip(axes[0], batches):
        for i, (d, v) in enumerate(report["drafts"].items()):
            rows = [r for r in v["rows"] if r["batch"] == bs]
            xs = list(range(len(rows)))
            color = f"C{i}"
            ax.plot(xs, [r["measured_tokens_per_s"] for r in rows], "o-", color=color, label=f"{d} measured")
            ax.plot(xs, [r["predicted_tokens_per_s"] for r in rows], "s--", color=color, alpha=0.6,
                    label=f"{d} predicted")
            ax.set_xticks(xs, [r["config"].replace("γ=", "") for r in rows], fontsize=8)
        ax.set_title(f"batch {bs}")
        ax.set_xlabel("γ (then tree node budgets)")
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize=7)
    fig.suptitle(f"specd tune: {report['model']} ({report['dtype']}), {report['hardware_line']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ CLI


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="measure pass costs and acceptance here, predict the best γ per batch size, "
                                    "check it with a sweep, and store a profile that gamma 'auto' uses")
    p.set_defaults(func=run)
    p.add_argument("--model", default="smollm2", help="target: 'smollm2' (embedded), 'tiny', or a HF model dir")
    p.add_argument("--draft", action="append", default=None,
                   help="draft to tune (repeatable; default: ngram and the shipped default draft)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto: the dtype the engine would choose at load (the largest batch)")
    p.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda or cuda:N")
    p.add_argument("--batches", default="1,4,8", help="batch sizes to predict and sweep")
    p.add_argument("--gammas", default=",".join(map(str, GAMMAS)),
                   help=f"draft lengths to sweep (at most {AUTO_MAX_GAMMA})")
    p.add_argument("--tree-budgets", default=",".join(map(str, BUDGETS)),
                   help="token-tree node budgets, for drafts that draft trees (the policy also weighs "
                        f"{','.join(map(str, TREE_BUDGETS))}; empty: chains only)")
    p.add_argument("--prompts", default=None, help="calibration prompts, JSONL (default: specd/data/prompts.jsonl)")
    p.add_argument("--limit", type=int, default=8, help="prompts (half chat, half code); at least the largest batch")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt")
    p.add_argument("--reps", type=int, default=3, help="timings per pass-cost grid point (the least is kept)")
    p.add_argument("--rounds", type=int, default=2, help="sweep rounds (per prompt chunk the fastest is kept)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (a profile matches engines with the same count; default: torch's)")
    p.add_argument("--out", default="out/tune")
    p.add_argument("--no-store", action="store_true", help="write the profiles to --out only, not the profile store")


def run(args) -> int:
    from actors.build import draft_meta

    if args.threads:
        torch.set_num_threads(args.threads)
    ints = lambda s: tuple(int(x) for x in s.split(",") if x.strip())  # noqa: E731
    drafts = tuple(args.draft or (["ngram"] + (["default"] if args.model == "smollm2" and draft_meta("default")
                                               else [])))
    report = tune(args.model, drafts, args.dtype, args.device, ints(args.batches), ints(args.gammas),
                  ints(args.tree_budgets), args.prompts, args.limit, args.max_tokens, args.reps, args.rounds,
                  args.out, store=not args.no_store)
    print(render(report))
    print(f"wrote {Path(args.out) / 'tune.json'}, tune.txt, tune.png and the profiles")
    return 0
