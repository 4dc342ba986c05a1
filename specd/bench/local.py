"""`specd bench --local`: every figure a ratio measured side by side in one run.

Configurations, run interleaved per prompt chunk so machine noise hits all alike:
  hf                 Hugging Face `generate` (greedy), the plain baseline
  hf-assisted:SPEC   `generate(assistant_model=...)` with the same draft (batch 1 only: HF's limit)
  hf-prompt-lookup   `generate(prompt_lookup_num_tokens=...)`, HF's n-gram analogue (batch 1 only)
  engine             this engine with γ = 0
  engine+SPEC        this engine, speculative with drafter SPEC at a fixed γ
  engine+SPEC γ=auto       the same, γ chosen per step by the speculation policy (actors/policy.py)
Also: the cost of a verify pass over T tokens relative to one token, a profile of
one decode step, and how close a target pass comes to the memory-bandwidth floor.
"""
from __future__ import annotations

import sys
import time

import torch

from actors.build import build_engine, draft_meta
from actors.schema import Request, SamplingParams, SpecStats, SpeculationParams
from actors.text import encode_prompt

from ..data import load_prompts, mixed
from ..stats import percentile
from .peer import PeerFailed, make_peer


def hf_truncated(model, k: int):
    """A Hugging Face model made of the target's first k layers (for generate(assistant_model=...))."""
    import copy

    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = k
    draft = type(model)(cfg).to(next(model.parameters()).dtype)
    state = {n: t for n, t in model.state_dict().items()
             if not n.startswith("model.layers.") or int(n.split(".")[2]) < k}
    draft.load_state_dict(state, strict=False)
    draft.tie_weights()
    return draft.eval()


def _hf_generate(model, tok, ids: list[list[int]], max_new: int, eos: list[int], **kw) -> list[list[int]]:
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
    width = max(map(len, ids))
    x = torch.full((len(ids), width), pad, dtype=torch.long)
    att = torch.zeros_like(x)
    for b, row in enumerate(ids):  # left padding, as HF wants for batched generation
        x[b, width - len(row):] = torch.tensor(row)
        att[b, width - len(row):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=x, attention_mask=att, max_new_tokens=max_new, do_sample=False,
                             eos_token_id=eos, pad_token_id=pad, **kw)
    res = []
    for b in range(len(ids)):
        gen = out[b, width:].tolist()
        for i, t in enumerate(gen):
            if t in eos:
                gen = gen[:i + 1]
                break
        res.append(gen)
    return res


def _agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    """(length of the common prefix, length compared)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i, max(len(a), len(b))


def verify_costs(runner, ctx: int = 200, sizes=(1, 2, 3, 5, 8), reps: int = 15) -> dict:
    """Median time of one target pass over T tokens at context `ctx`, interleaved across T."""
    cache = runner.new_cache(1, ctx + max(sizes) + 1)
    g = torch.Generator().manual_seed(0)
    runner.forward(cache, [0], torch.randint(0, runner.vocab_size, (1, ctx), generator=g))
    times: dict[int, list[float]] = {t: [] for t in sizes}
    feeds = {t: torch.randint(0, runner.vocab_size, (1, t), generator=g) for t in sizes}
    for rep in range(reps + 2):
        for t in sizes:
            cache.truncate(0, ctx)
            t0 = time.perf_counter()
            runner.logits(runner.forward(cache, [0], feeds[t]))
            if rep >= 2:
                times[t].append(time.perf_counter() - t0)
    med = {t: sorted(v)[len(v) // 2] for t, v in times.items()}
    return {"context": ctx, "ms": {t: med[t] * 1e3 for t in sizes},
            "ratio_vs_1": {t: med[t] / med[sizes[0]] for t in sizes}}


def step_profile(built, prompt_ids: list[int], steps: int = 8) -> dict:
    """Profile γ=0 decode steps: where the time of one step goes, by op family."""
    from torch.profiler import ProfilerActivity, profile

    eng = built.engine
    key = eng.add_request(Request("profile", prompt_ids, SamplingParams(max_tokens=steps + 4, ignore_eos=True)))
    eng.step()  # prefill
    eng.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    eng.abort(key)
    families = {"matmul (linear, LM head)": ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul",
                                             "mkldnn::_linear_pointwise",  # prepacked weights (LlamaRunner.prepack)
                                             "aten::_weight_int4pack_mm",  # native weights (actors/native.py)
                                             "specd::block_matmul"),  # in the block kernel (norm folded in)
                "attention": ("aten::_scaled_dot_product", "aten::bmm", "aten::softmax", "specd::attention"),
                "KV cache write/read": ("aten::index_put", "aten::_index_put_impl_", "aten::index",
                                        "specd::rope_kv_write"),  # RoPE too, in the fused call
                "norms": ("aten::rms_norm", "aten::_fused_rms_norm", "specd::rms_norm")}
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    agg = {k: 0.0 for k in families}
    for e in prof.key_averages():
        for fam, prefixes in families.items():
            if any(e.key.startswith(p) for p in prefixes):
                agg[fam] += e.self_cpu_time_total
                break
    agg["other ops + python"] = total - sum(agg.values())
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    return {"ms_per_step": total / 1e3 / steps,
            "share": {k: v / total for k, v in agg.items()},
            "top_ops": [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls_per_step":
                         e.count / steps} for e in top]}


def bandwidth_floor(runner) -> dict:
    """Bytes a single-token pass must read / memory bandwidth: the runner's weights as it holds them
    (prepacked copies, native int4 blocks and their scales), the LM head once, not the embedding
    table (a pass reads one row of it) unless the LM head is that table."""
    from actors.build import tensor_bytes

    nbytes = tensor_bytes([runner.lm_head, runner.norm] + [v for w in runner.layers for v in vars(w).values()],
                           set())
    big = torch.ones(64 * 1024 * 1024, dtype=torch.float32)  # 256 MB, well beyond the caches
    for _ in range(2):
        big.sum()
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        big.sum()
        t.append(time.perf_counter() - t0)
    bw = big.numel() * 4 / min(t)
    return {"weight_bytes": nbytes, "bandwidth_GBps": bw / 1e9, "floor_ms": nbytes / bw * 1e3}


def run_local(model: str = "smollm2", drafts=("ngram", "truncated:4"), gamma: int = 4, dtype: str = "bf16",
              max_tokens: int = 64, batch_sizes=(1, 8), prompts_path=None, limit: int | None = None,
              hf_baselines: bool = True, progress: bool = True, adaptive: bool = True, device: str = "auto",
              trees: tuple[int, ...] = (), tree_depth: int = 6, quant: str = "none",
              draft_quant: str = "none", prepack: str = "auto", weights: str = "auto", peer: str | None = None,
              rounds: int = 1, exact: str = "auto") -> dict:
    """trees: node budgets at which every tree-capable draft also runs as a token tree (depth
    at most tree_depth); each is a configuration "engine+SPEC tree:N". quant, draft_quant: the
    target's and the drafts' int8 modes (`actors/quant.py`); prepack, weights: see `actors.build.build_engine`.
    peer: another runtime on the same GGUF (`peer.py`), one more configuration at batch 1.
    rounds: the whole interleaved pass repeated; tokens/s is the median of the rounds'."""
    from tqdm import tqdm

    prompts = mixed(load_prompts(prompts_path), limit)
    other = make_peer(peer, model, 4096, torch.get_num_threads()) if peer else None  # stops early without it
    built = build_engine(model, list(drafts), dtype, max_batch=max(batch_sizes), device=device, quant=quant,
                         draft_quant=draft_quant, prepack=prepack, weights=weights, exact=exact)
    eng, target = built.engine, built.target
    tok, hf = target.tokenizer, target.model
    ids = [encode_prompt(tok, prompt=p.get("prompt"), messages=p.get("messages")) for p in prompts]
    eos = sorted(target.eos_token_ids)

    assistants = {}
    if hf_baselines:
        for spec in drafts:
            if spec.startswith("truncated:"):
                assistants[spec] = hf_truncated(hf, int(spec.split(":")[1]))
            elif not spec.startswith("ngram") and spec != "none" and draft_meta(spec) is None:
                # (distilled checkpoints, EAGLE heads above all, have no HF assistant form)
                from actors.models import load_model
                assistants[spec] = load_model(spec, dtype).model

    configs = []  # (batch_size, name, kind, spec)
    for bs in batch_sizes:
        if other is not None and bs == 1:
            configs.append((bs, other.name, "peer", None))
        if hf_baselines:
            configs.append((bs, "hf", "hf", None))
            if bs == 1:
                configs += [(bs, f"hf-assisted:{s}", "hf-assist", s) for s in assistants]
                if any(s.startswith("ngram") for s in drafts):
                    configs.append((bs, "hf-prompt-lookup", "hf-lookup", None))
        configs.append((bs, "engine", "engine", None))
        configs += [(bs, f"engine+{s}", "engine", s) for s in drafts if s != "none"]
        configs += [(bs, f"engine+{s} tree:{n}", f"engine-tree:{n}", s) for s in drafts
                    if s != "none" and eng.drafters[s].tree_drafting for n in trees]
        if adaptive:
            configs += [(bs, f"engine+{s} γ=auto", "engine-adaptive", s) for s in drafts if s != "none"]

    rows = {(bs, name): {"batch": bs, "config": name, "tokens": 0, "seconds": 0.0, "stats": SpecStats(),
                         "agree": [0, 0], "exact": [0, 0], "identical": [0, 0], "rounds": []}
            for bs, name, _, _ in configs}
    reference: dict[int, list[int]] = {}  # prompt index -> HF greedy output at batch 1
    plain: dict[int, list[int]] = {}  # prompt index -> this engine's output without speculation, batch 1
    peer_failed = None  # why the peer's process failed, if it did: the bench goes on without it

    def drop_peer(e: PeerFailed) -> None:
        nonlocal peer_failed
        peer_failed = str(e)
        configs[:] = [c for c in configs if c[2] != "peer"]
        print(f"specd bench: {e}; going on without the peer", file=sys.stderr)

    # Warm up each path once (first-call allocations), untimed.
    for bs, name, kind, spec in list(configs):
        if bs == 1:
            try:
                _run_one(eng, hf, tok, kind, spec, [ids[0]], 8, eos, gamma, assistants, tree_depth, other)
            except PeerFailed as e:
                drop_peer(e)
    work = [(rnd, bs, list(range(i, min(i + bs, len(ids))))) for rnd in range(rounds) for bs in batch_sizes
            for i in range(0, len(ids), bs)]
    bar = tqdm(total=sum(len(idx) * sum(1 for c in configs if c[0] == bs) for _, bs, idx in work),
               desc="bench", unit="req", disable=not progress)
    for rnd, bs, idx in work:
        for cbs, name, kind, spec in list(configs):
            if cbs != bs:
                continue
            batch = [ids[i] for i in idx]
            t0 = time.perf_counter()
            try:
                outs, stats = _run_one(eng, hf, tok, kind, spec, batch, max_tokens, eos, gamma, assistants,
                                       tree_depth, other)
            except PeerFailed as e:
                drop_peer(e)
                continue
            dt = time.perf_counter() - t0
            r = rows[(bs, name)]
            r["seconds"] += dt
            r["tokens"] += sum(map(len, outs))
            if len(r["rounds"]) == rnd:
                r["rounds"].append([0, 0.0])
            r["rounds"][rnd][0] += sum(map(len, outs))
            r["rounds"][rnd][1] += dt
            if stats is not None:
                r["stats"].add(stats)
            for i, out in zip(idx, outs):
                if kind.startswith("engine"):  # exact passes: identical at every batch, with every draft
                    if bs == 1 and name == "engine":
                        plain.setdefault(i, out)
                    if i in plain:
                        r["identical"][0] += out == plain[i]
                        r["identical"][1] += 1
                if bs == 1 and name == "hf":
                    reference[i] = out
                elif i in reference:
                    same, n = _agreement(out, reference[i])
                    r["agree"][0] += same
                    r["agree"][1] += n
                    r["exact"][0] += out == reference[i]
                    r["exact"][1] += 1
            bar.update(len(idx))
    bar.close()
    if other is not None:
        other.close()

    results = []
    for (bs, name), r in rows.items():
        per_round = sorted(n / s for n, s in r["rounds"] if s)
        tps = per_round[len(per_round) // 2] if per_round else 0.0  # the median round (the only one by default)
        st: SpecStats = r["stats"]
        results.append({"batch": bs, "config": name, "tokens": r["tokens"], "seconds": r["seconds"],
                        "tokens_per_s": tps, "tokens_per_s_rounds": per_round, "acceptance_rate": st.acceptance_rate if st.draft_tokens else None,
                        "mean_accepted_length": st.mean_accepted_length if st.drafts else None,
                        "acceptance_per_position": st.per_position(),
                        "tokens_per_target_pass": r["tokens"] / st.target_passes if st.target_passes else None,
                        "nodes_per_pass": st.draft_tokens / st.drafts if st.drafts else None,
                        "agreement_with_hf": r["agree"][0] / r["agree"][1] if r["agree"][1] else None,
                        "identical_to_engine_gamma0": r["identical"][0] / r["identical"][1] if r["identical"][1]
                        else None,
                        "exact_match_with_hf": r["exact"][0] / r["exact"][1] if r["exact"][1] else None})
    for res in results:
        same = {x["config"]: x["tokens_per_s"] for x in results if x["batch"] == res["batch"]}
        res["speedup_vs_hf"] = res["tokens_per_s"] / same["hf"] if same.get("hf") else None
        res["speedup_vs_engine_gamma0"] = res["tokens_per_s"] / same["engine"] if same.get("engine") else None
        anchor = next((v for k, v in same.items() if k.startswith("hf-assisted") or k == "hf-prompt-lookup"), None)
        res["speedup_vs_hf_anchor"] = res["tokens_per_s"] / anchor if anchor else None
        peer_tps = next((x["tokens_per_s"] for x in results if x["batch"] == 1 and other and x["config"] == other.name),
                        None)  # batch 1: what a peer without batching serves
        res["speedup_vs_peer"] = res["tokens_per_s"] / peer_tps if peer_tps else None

    prof = step_profile(built, ids[0])
    report = {"model": model, "dtype": built.dtype, "dtype_reason": built.dtype_reason, "quant": quant,
              "draft_quant": draft_quant, "prepacked": eng.info.get("prepacked"), "weights": eng.info.get("weights"),
              "exact": eng.info.get("exact"),
              "hardware": eng.info.get("hardware"), "gamma": gamma, "max_tokens": max_tokens,
              "prompts": len(ids), "rounds": rounds, "threads": torch.get_num_threads(), "results": results,
              "peer": None if other is None else {"name": other.name, "version": other.version,
                                                  "failed": peer_failed},
              "verify_cost": verify_costs(eng.target), "decode_step_profile": prof,
              "bandwidth": bandwidth_floor(eng.target)}
    report["bandwidth"]["engine_step_ms"] = report["verify_cost"]["ms"][1]
    report["bandwidth"]["engine_vs_floor"] = report["verify_cost"]["ms"][1] / report["bandwidth"]["floor_ms"]
    return report


def _run_one(eng, hf, tok, kind, spec, batch, max_tokens, eos, gamma, assistants, tree_depth=6, peer=None):
    if kind == "peer":
        return [peer.generate(p, max_tokens, eos) for p in batch], None
    if kind == "hf":
        return _hf_generate(hf, tok, batch, max_tokens, eos), None
    if kind == "hf-assist":
        return _hf_generate(hf, tok, batch, max_tokens, eos, assistant_model=assistants[spec]), None
    if kind == "hf-lookup":
        return _hf_generate(hf, tok, batch, max_tokens, eos, prompt_lookup_num_tokens=gamma), None
    tree = int(kind.split(":")[1]) if kind.startswith("engine-tree:") else None
    g = ("auto" if kind == "engine-adaptive" else tree_depth if tree else gamma) if spec else 0
    reqs = [Request(f"b{i}", p, SamplingParams(max_tokens=max_tokens),
                    SpeculationParams(draft=spec or "none", gamma=g, tree=tree)) for i, p in enumerate(batch)]
    done = eng.generate(reqs)
    stats = SpecStats()
    for c in done:
        stats.add(c.stats)
    return [c.token_ids for c in done], stats


def head_of_line(model: str = "smollm2", dtype: str = "bf16", long_tokens: int = 1500, streams: int = 4,
                 chunks=(None, 256), rounds: int = 2) -> dict:
    """Inter-token latency of `streams` running greedy streams while a `long_tokens` prompt is
    admitted, per prefill chunk budget (None: the whole prompt in one step, as before chunked
    prefill), interleaved over `rounds`. A stream token's latency is the wall time of the step
    that committed it divided by the tokens it committed there."""
    built = build_engine(model, [], dtype, max_batch=streams + 1, max_len=long_tokens + 128)
    eng, tok = built.engine, built.target.tokenizer
    short = [encode_prompt(tok, prompt=p.get("prompt"), messages=p.get("messages")) for p in load_prompts()[:streams]]
    filler = encode_prompt(tok, prompt=" ".join(p.get("prompt") or p["messages"][-1]["content"] for p in load_prompts()))
    long_ids = (filler * (long_tokens // len(filler) + 1))[:long_tokens]
    itl: dict[str, list[float]] = {str(c): [] for c in chunks}
    steps: dict[str, int] = {str(c): 0 for c in chunks}
    for _ in range(rounds):
        for c in chunks:
            eng.prefill_chunk = c or long_tokens
            keys = [eng.add_request(Request(f"s{i}", p, SamplingParams(max_tokens=120, ignore_eos=True)))
                    for i, p in enumerate(short)]
            for _ in range(3):
                eng.step()  # all streams decoding
            big = eng.add_request(Request("long", long_ids, SamplingParams(max_tokens=4)))
            while True:
                t0 = time.perf_counter()
                out = eng.step()
                dt = time.perf_counter() - t0
                steps[str(c)] += 1
                for k in keys:
                    if k in out and out[k].token_ids:
                        itl[str(c)] += [dt / len(out[k].token_ids)] * len(out[k].token_ids)
                if big in out:
                    break
            for k in keys + [big]:
                eng.abort(k)
    eng.prefill_chunk = 512

    def ms(xs, q):
        p = percentile(xs, q)
        return None if p is None else p * 1e3
    return {"long_prompt_tokens": long_tokens, "streams": streams, "rounds": rounds,
            "by_chunk": {c: {"itl_p50_ms": ms(v, 50), "itl_p99_ms": ms(v, 99), "steps_to_admit":
                             steps[c] / rounds} for c, v in itl.items()}}


def render(report: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    con = Console(record=True, width=160)
    t = Table(title=f"specd bench --local  ({report['model']}, {report['dtype']}, γ={report['gamma']}, "
                    f"{report['prompts']} prompts, ≤{report['max_tokens']} new tokens, greedy"
                    + (f", median of {report['rounds']} rounds" if report.get("rounds", 1) > 1 else "") + ")")
    peer = report.get("peer")
    cols = ["batch", "config", "tok/s", "× hf", "× hf anchor", "× engine γ=0"] + ([f"× {peer['name']}"] if peer else [])
    for col in cols + ["α", "tokens/pass", "nodes/pass", "accepted per depth", "agree w/ hf", "exact"]:
        t.add_column(col, justify="right" if col not in ("config", "accepted per depth") else "left")
    f = lambda v, fmt: "—" if v is None else format(v, fmt)  # noqa: E731
    for r in sorted(report["results"], key=lambda r: (r["batch"], r["config"])):
        t.add_row(str(r["batch"]), r["config"], f(r["tokens_per_s"], ".1f"), f(r["speedup_vs_hf"], ".2f"),
                  f(r.get("speedup_vs_hf_anchor"), ".2f"), f(r["speedup_vs_engine_gamma0"], ".2f"),
                  *([f(r.get("speedup_vs_peer"), ".2f")] if peer else []),
                  f(r["acceptance_rate"], ".3f"), f(r.get("tokens_per_target_pass"), ".2f"),
                  f(r.get("nodes_per_pass"), ".1f"),
                  " ".join(f"{a:.2f}" for a in r["acceptance_per_position"]) or "—",
                  f(r["agreement_with_hf"], ".3f"), f(r.get("identical_to_engine_gamma0"), ".0%"))
    con.print(t)
    ex = report.get("exact") or {}
    con.print(f"exact: the share of outputs identical, token for token, to this engine's without speculation at "
              f"batch 1; the target's passes are {'row-invariant' if ex.get('exact') else 'NOT row-invariant'} "
              f"({ex.get('why', '?')})")
    con.print(f"hardware: {report.get('hardware')}; dtype {report['dtype']} ({report.get('dtype_reason', '')}); "
              f"weights {report.get('weights')}; "
              "× hf anchor: against HF generate(assistant_model=...) or prompt lookup at batch 1")
    if peer:
        con.print(f"× {peer['name']}: against {peer['name']} ({peer['version']}) at batch 1 on the same GGUF and "
                  "prompt tokens, interleaved")
        if peer.get("failed"):
            con.print(f"{peer['name']} FAILED and was left out: {peer['failed']}")
    vc = report["verify_cost"]
    con.print("verify pass over T tokens vs 1 token (context %d): " % vc["context"]
              + ", ".join(f"T={k}: {v:.2f}× ({vc['ms'][k]:.1f} ms)" for k, v in vc["ratio_vs_1"].items()))
    bw = report["bandwidth"]
    con.print(f"bandwidth floor: {bw['weight_bytes'] / 1e6:.0f} MB of weights at {bw['bandwidth_GBps']:.1f} GB/s "
              f"= {bw['floor_ms']:.1f} ms; engine single-token pass {bw['engine_step_ms']:.1f} ms "
              f"({bw['engine_vs_floor']:.2f}× the floor)")
    pr = report["decode_step_profile"]
    con.print(f"one γ=0 decode step ({pr['ms_per_step']:.1f} ms under the profiler): "
              + ", ".join(f"{k} {v:.0%}" for k, v in pr["share"].items()))
    return con.export_text()


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in report["results"]})
    trees = [r for r in report["results"] if " tree:" in r["config"]]
    fig, axes = plt.subplots(1 + bool(trees), len(batches), figsize=(6 * len(batches), 4 + 4 * bool(trees)),
                             squeeze=False)
    for ax, bs in zip(axes[0], batches):
        rs = sorted((r for r in report["results"] if r["batch"] == bs), key=lambda r: r["config"])
        ax.barh([r["config"] for r in rs], [r["tokens_per_s"] for r in rs],
                color=["#999" if r["config"].startswith("hf") else "#2a7" for r in rs])
        ax.set_title(f"batch {bs}: tokens/s (greedy)")
        ax.set_xlabel("tokens/s")
    if trees:  # tokens per pass and tokens/s against the node budget (a chain counts γ nodes)
        for ax, bs in zip(axes[1], batches):
            for spec in sorted({r["config"].split(" ")[0] for r in trees}):
                pts = [(report["gamma"], r) for r in report["results"] if r["batch"] == bs and r["config"] == spec]
                pts += sorted((int(r["config"].split("tree:")[1]), r) for r in trees
                              if r["batch"] == bs and r["config"].startswith(spec + " tree:"))
                if not pts:
                    continue
                xs = [n for n, _ in pts]
                ax.plot(xs, [r["tokens_per_s"] for _, r in pts], marker="o", label=f"{spec} tok/s")
                ax2 = ax.twinx()
                ax2.plot(xs, [r["tokens_per_target_pass"] or 1 for _, r in pts], "--", marker="s",
                         label=f"{spec} tokens/pass")
                ax2.set_ylabel("tokens per target pass")
            ax.set_xlabel("draft nodes per pass (chain = γ, then tree budgets)")
            ax.set_ylabel("tokens/s")
            ax.set_title(f"batch {bs}: chain vs trees")
            ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
