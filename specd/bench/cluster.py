"""`specd bench --address HOST:PORT`: a running cluster, driven through the SDK, against the
in-process engine and serial Hugging Face `generate` on the same prompts, in one run.

Measured, greedy, on the committed prompt set (or --prompts):
  cluster      at each concurrency (default 1, 4, 16), speculation on (a draft the cluster
               serves; default: its default draft) and off (draft "none")
  in-process   this engine (actors.build.build_engine) at concurrency 1, both modes
  hf           serial Hugging Face `generate` of the target (specd.bench.local._hf_generate)
Per point: tokens/s (all tokens / wall time of the point), TTFT, inter-token latency
(p50/p99; a chunk of k tokens that arrived dt after the previous one counts as k gaps of dt/k),
the gap between stream chunks, α and mean accepted length (from each response's speculation
stats) and how many responses were coalesced.
Ratios from the same run: per-token overhead of the cluster against the in-process engine at
concurrency 1, cluster throughput at each concurrency against serial HF, speculation on/off.

Interleaving, so machine noise hits every side alike: at concurrency 1 each prompt runs
cluster-spec, in-process-spec, cluster-off, in-process-off, hf back to back (the order reversed
on every other prompt); higher concurrencies alternate on/off per round.
Every request at one concurrency level has a distinct prompt, so nothing coalesces unless
--prompts has fewer lines than the concurrency (the report counts coalesced responses).
The in-process engine runs with the verifier's torch thread count (from the cluster config),
HF with every core: the baseline gets the whole machine.

`--profile` (with `--serve`) adds where a served token's time goes (`specd.bench.served`): the
verifier loop's own accounting per step beside the in-process engine's, and every local process's
CPU per generated token.

`--pipeline-compare` (see `pipeline_compare`) measures what pipelining buys instead: one cluster,
one remote model draft, the Verifier switched on and off through a Serve handle between
interleaved rounds on the same prompts, with the batcher's own accounting of where time went.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time
import uuid
from pathlib import Path

from cluster import serve as S
from cluster.config import LOCAL_CONFIG, ClusterConfig
from cluster.serve import wait_serving

from ..data import PROMPTS, load_prompts
from ..stats import median
from .local import _hf_generate
from .records import cluster_request, match_ray_niceness, record, summarize, verifier_stats


# ---------------------------------------------------------------------------------- the three sides
def cluster_point(client, prompts: list[dict], concurrency: int, max_tokens: int, draft: str, gamma: int,
                  bar=None) -> tuple[list[dict], float]:
    """All `prompts` through the cluster with `concurrency` requests in flight."""
    def one(p):
        r = cluster_request(client, p, max_tokens, draft, gamma)
        if bar is not None:
            bar.update(1)
        return r
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        recs = list(ex.map(one, prompts))
    return recs, time.perf_counter() - t0


class InProcess:
    """The same target (and drafts) in this process, one request at a time (`specd bench --address`,
    and `specd demo`'s cluster ÷ in-process column)."""

    def __init__(self, model: str, drafts: dict[str, str], dtype: str, max_len: int, **build):
        """drafts: the cluster's name for each draft -> what it is (see actors/build.py); build: more
        `build_engine` keywords (the cluster config's device, weights, ...)."""
        from actors.build import build_engine

        self.built = build_engine(model, drafts, dtype, max_batch=1, max_len=max_len, **build)
        self.tok = self.built.target.tokenizer
        self.eos = sorted(self.built.target.eos_token_ids)

    def encode(self, p: dict) -> list[int]:
        from actors.text import encode_prompt

        if self.tok is None:  # tiny test models: prompts are space-separated token ids (as the router reads them)
            return [int(t) for t in p["prompt"].split()]
        return encode_prompt(self.tok, prompt=p.get("prompt"), messages=p.get("messages"))

    def request(self, ids: list[int], max_tokens: int, draft: str | None, gamma: int) -> dict:
        from actors.schema import Completion, Request, SamplingParams, SpeculationParams

        eng = self.built.engine
        req = Request(uuid.uuid4().hex, ids, SamplingParams(max_tokens=max_tokens),
                      SpeculationParams(draft=draft or "none", gamma=gamma if draft else 0))
        arrivals, deltas = [], []
        t0 = time.perf_counter()
        key = eng.add_request(req)
        while eng.has_work():
            d = eng.step().get(key)
            if d is not None:
                arrivals.append((time.perf_counter(), len(d.token_ids)))
                deltas.append(d)
        done = Completion.join(deltas)
        return record(t0, arrivals, done.token_ids, done.stats.to_dict(), False)

    def hf(self, ids: list[int], max_tokens: int, threads: int | None) -> dict:
        import torch

        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            t0 = time.perf_counter()
            out = _hf_generate(self.built.target.model, self.tok, [ids], max_tokens, self.eos)[0]
            t1 = time.perf_counter()
        finally:
            torch.set_num_threads(before)
        return {"start": t0, "end": t1, "ttft": None, "itl": [], "gaps": [], "tokens": len(out),
                "token_ids": out, "stats": {}, "coalesced": False}


# ---------------------------------------------------------------------------------- the run
def _policy_steps(client) -> dict[str, tuple[int, int]]:
    """Per draft, summed over verifier replicas: (steps under the policy, steps speculated)."""
    out: dict[str, list[int]] = {}
    for r in client.stats().replicas:
        for d, st in r.policy.items():
            acc = out.setdefault(d, [0, 0])
            acc[0] += st["steps"]
            acc[1] += st["speculated_steps"]
    return {d: (a, b) for d, (a, b) in out.items()}


def runner_ceiling(runner, threads: int, rows: int = 16, reps: int = 3) -> dict:
    """tokens/s of the target's runner alone decoding `rows` rows of one token each (no engine, no
    cluster): the most a replica with `threads` threads could deliver at that batch. runner: the
    engine's own (its weights and fused kernels as the verifier builds them)."""
    import torch

    from actors.calibrate import measure

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            cost = measure(runner, rows, reps=reps)
    finally:
        torch.set_num_threads(before)
    return {"rows": rows, "threads": threads, "pass_ms": cost(rows, 1) * 1e3, "tokens_per_s": rows / cost(rows, 1)}


def run(address: str, concurrency=(1, 4, 16), draft: str | None = None, gamma: int | str | None = None,
        max_tokens: int = 64, prompts_path=None, limit: int | None = 16, config_path=None,
        inprocess: bool = True, hf: bool = True, rounds: int = 1, progress: bool = True,
        timeout: float = 600.0, match_niceness: bool = True, ceiling: bool = True, profile: bool = False) -> dict:
    """Speculation on against off at every concurrency, `rounds` interleaved rounds (each over
    all prompts; the order of on and off alternates). At concurrency 1 each prompt also runs
    on the in-process engine (in the dtype the verifier chose) and serial HF generate.
    profile: also the served profile (`specd.bench.served`; a local cluster this process reaches
    through Ray), under the report's "profile"."""
    import torch
    from tqdm import tqdm

    from actors.hardware import hardware
    from specd_client import SpecdClient

    cfg = ClusterConfig.load(config_path or LOCAL_CONFIG)  # threads and draft specs of the cluster
    niceness = match_ray_niceness(address) if match_niceness else os.nice(0)
    load_before = os.getloadavg()
    prompts = load_prompts(prompts_path)[:limit]
    conc = sorted(set(int(c) for c in concurrency))
    client = SpecdClient(address, timeout=timeout, token=os.environ.get("SPECD_TOKEN"))
    try:
        wait_serving(client, timeout=120, poll=0.5)
        info = client.list_models()
        names = [d.name for d in info.drafts]
        draft = draft or info.default_draft or (names[0] if names else "none")
        if draft != "none" and draft not in names:
            raise ValueError(f"--draft {draft!r}: the cluster serves {names}")
        sent_gamma = gamma  # None: the draft's default (auto in the shipped configs)
        default = next((d.default_gamma for d in info.drafts if d.name == draft), "auto")
        local_gamma = gamma if gamma is not None else default
        spec = cfg.draft(draft).spec if draft in [d.name for d in cfg.drafts] else draft
        modes = [("spec", draft)] + ([("off", "none")] if draft != "none" else [])
        verifiers = [r for r in client.stats().replicas if r.role == "verifier"]
        dtype = verifiers[0].dtype if verifiers and verifiers[0].dtype else cfg.dtype
        threads_engine = cfg.verifier.torch_threads
        threads_hf = torch.get_num_threads()

        local = None
        if inprocess or hf or ceiling:
            local = InProcess(info.target, {draft: spec} if draft != "none" else {}, dtype, cfg.max_len)
            local_ids = [local.encode(p) for p in prompts]
            torch.set_num_threads(threads_engine)

        n_req = rounds * sum(len(prompts) * len(modes) for c in conc)
        if 1 in conc:
            n_req += rounds * len(prompts) * (len(modes) * inprocess + hf)
        bar = tqdm(total=n_req, desc="bench --address", unit="req", disable=not progress)

        # warm-up, untimed: first calls allocate (cluster replicas, this process's engine, HF)
        for _, d in modes:
            cluster_request(client, prompts[0], 8, d, sent_gamma)
            if inprocess:
                local.request(local_ids[0], 8, d if d != "none" else None, local_gamma)
        if hf:
            local.hf(local_ids[0], 8, threads_hf)
        # Every prompt once through the cluster, untimed: the verifier's prefix cache then holds what it
        # can of them for whichever mode runs first (else the second mode of a point would find the
        # first's prompts cached and prefill nothing: at c16, 0.02 against 0.10 prompt tokens
        # prefilled per generated token, and a 0.91x "speculation on / off" that was only the order).
        if any(c > 1 for c in conc):
            cluster_point(client, prompts, max(conc), max_tokens, "none", 0)

        points: dict[tuple, dict] = {}  # (side, concurrency, mode, round) -> {"records", "wall"}
        policy_steps: dict[tuple, list[int]] = {}  # (concurrency, mode) -> [steps, speculated]

        def add(key, recs, wall=None):
            pt = points.setdefault(key, {"records": [], "wall": 0.0})
            pt["records"] += recs
            pt["wall"] += wall if wall is not None else sum(r["end"] - r["start"] for r in recs)

        prof = None
        if profile:
            from ray import serve

            from .served import ServedProfile
            prof = ServedProfile(serve.get_deployment_handle("Verifier", app_name=cfg.app_name), cfg.app_name)
        local_acc: dict[str, list] = {}  # mode -> [in-process BatcherStats totals, tokens] (profile)

        def inprocess(mode, fn):
            if prof is None:
                return fn()
            before = local.built.engine.batcher.to_dict()
            rec = fn()
            after = local.built.engine.batcher.to_dict()
            acc = local_acc.setdefault(mode, [{}, 0])
            for k, v in after.items():
                acc[0][k] = acc[0].get(k, 0) + v - before[k]
            acc[1] += rec["tokens"]
            return rec

        def counted(c, mode, fn):
            if prof is not None:
                inner = fn
                fn = lambda: prof.around(f"c{c} {mode}", inner)  # noqa: E731
            before = _policy_steps(client).get(draft, (0, 0))
            out = fn()
            after = _policy_steps(client).get(draft, (0, 0))
            acc = policy_steps.setdefault((c, mode), [0, 0])
            acc[0] += after[0] - before[0]
            acc[1] += after[1] - before[1]
            return out

        for rnd in range(rounds):
            if 1 in conc:  # interleaved per prompt: cluster vs in-process vs hf, spec vs off
                for i, p in enumerate(prompts):
                    steps = []
                    for mode, d in modes:
                        steps.append((("cluster", 1, mode, rnd),
                                      lambda d=d: cluster_request(client, p, max_tokens, d, sent_gamma)))
                        if inprocess:
                            steps.append((("in-process", 1, mode, rnd), lambda d=d: local.request(
                                local_ids[i], max_tokens, d if d != "none" else None, local_gamma)))
                    if hf:
                        steps.append((("hf", 1, "off", rnd), lambda: local.hf(local_ids[i], max_tokens, threads_hf)))
                    for key, fn in (steps if (i + rnd) % 2 == 0 else steps[::-1]):
                        rec = (counted(1, key[2], fn) if key[0] == "cluster" else
                               inprocess(key[2], fn) if key[0] == "in-process" else fn())
                        add(key, [rec])
                        bar.update(1)
            for c in conc:
                if c == 1:
                    continue
                for mode, d in (modes if rnd % 2 == 0 else modes[::-1]):
                    recs, wall = counted(c, mode, lambda d=d: cluster_point(client, prompts, c, max_tokens, d,
                                                                            sent_gamma, bar))
                    add(("cluster", c, mode, rnd), recs, wall)
        bar.close()
        stats = client.stats()
    finally:
        client.close()

    merged: dict[tuple, dict] = {}
    for (side, c, mode, _), pt in points.items():
        m = merged.setdefault((side, c, mode), {"records": [], "wall": 0.0})
        m["records"] += pt["records"]
        m["wall"] += pt["wall"]
    results = []
    for (side, c, mode), pt in merged.items():
        row = {"side": side, "concurrency": c, "mode": mode,
               "draft": "none" if mode == "off" else draft, **summarize(pt["records"], pt["wall"])}
        if side == "cluster" and (c, mode) in policy_steps:
            n, on = policy_steps[c, mode]
            row["policy_steps"], row["speculated_share"] = n, on / n if n else None
        results.append(row)
    get = {(r["side"], r["concurrency"], r["mode"]): r for r in results}

    def tps(key):
        pt = points.get(key)
        return summarize(pt["records"], pt["wall"])["tokens_per_s"] if pt else None

    # greedy sanity: the cluster's tokens against the in-process engine's, prompt by prompt
    agree = {}
    for mode, _ in modes:
        a = [r["token_ids"] for k, pt in sorted(points.items()) if k[:3] == ("cluster", 1, mode)
             for r in pt["records"]]
        b = [r["token_ids"] for k, pt in sorted(points.items()) if k[:3] == ("in-process", 1, mode)
             for r in pt["records"]]
        if a and b:
            agree[mode] = sum(x == y for x, y in zip(a, b)) / len(a)
    on, off = ([r["token_ids"] for k, pt in sorted(points.items()) if k[:3] == ("cluster", 1, m) for r in pt["records"]]
               for m in ("spec", "off"))
    if on and off:  # exact passes: speculation through the cluster changes no greedy token
        agree["cluster spec vs cluster off"] = sum(x == y for x, y in zip(on, off)) / len(on)

    ratios: dict = {"cluster_vs_inprocess_c1": {}, "vs_hf_serial": {}, "spec_vs_off": {}, "spec_vs_off_rounds": {}}
    for mode, _ in modes:
        cl, ip = get.get(("cluster", 1, mode)), get.get(("in-process", 1, mode))
        if cl and ip and cl["tokens_per_s"] and ip["tokens_per_s"]:
            ratios["cluster_vs_inprocess_c1"][mode] = {
                "tokens_per_s_ratio": cl["tokens_per_s"] / ip["tokens_per_s"],
                "per_token_overhead": ip["tokens_per_s"] / cl["tokens_per_s"],  # cluster s/token over in-process
                "loss": 1 - cl["tokens_per_s"] / ip["tokens_per_s"]}
    h = get.get(("hf", 1, "off"))
    for r in results:
        if h and h["tokens_per_s"] and r["side"] == "cluster":
            ratios["vs_hf_serial"][f"c{r['concurrency']}-{r['mode']}"] = r["tokens_per_s"] / h["tokens_per_s"]
        if r["mode"] == "spec":
            off = get.get((r["side"], r["concurrency"], "off"))
            if off and off["tokens_per_s"]:
                ratios["spec_vs_off"][f"{r['side']}-c{r['concurrency']}"] = r["tokens_per_s"] / off["tokens_per_s"]
                per = [tps((r["side"], r["concurrency"], "spec", k)) / tps((r["side"], r["concurrency"], "off", k))
                       for k in range(rounds)]
                ratios["spec_vs_off_rounds"][f"{r['side']}-c{r['concurrency']}"] = {
                    "median": median(per), "min": min(per), "max": max(per), "rounds": per}
    goals = {}
    for key, v in ratios["spec_vs_off_rounds"].items():
        if key.startswith("cluster"):
            goals[f"{key}_spec_ge_0.98x_off"] = {"median": v["median"], "met": v["median"] >= 0.98}
    c1 = ratios["cluster_vs_inprocess_c1"]
    if "off" in c1:
        goals["c1_off_cluster_ge_0.97x_inprocess"] = {"ratio": c1["off"]["tokens_per_s_ratio"],
                                                     "met": c1["off"]["tokens_per_s_ratio"] >= 0.97}
    top = max(conc)
    best = max((get[k]["tokens_per_s"] for k in get if k[0] == "cluster" and k[1] == top), default=None)
    ceil = None
    if ceiling and local is not None and best is not None:
        ceil = runner_ceiling(local.built.engine.target, threads_engine, rows=top)
        goals[f"c{top}_ge_0.8x_runner_ceiling"] = {"ratio": best / ceil["tokens_per_s"],
                                                   "met": best / ceil["tokens_per_s"] >= 0.8}
    if h and best is not None and h["tokens_per_s"]:
        goals[f"c{top}_vs_serial_hf"] = {"ratio": best / h["tokens_per_s"]}

    served = None
    if prof is not None:
        from .served import inprocess_profile
        tokens = {f"c{r['concurrency']} {r['mode']}": r["tokens"] for r in results if r["side"] == "cluster"}
        served = prof.report(tokens)
        for mode, (acc, n) in local_acc.items():
            served[f"in-process c1 {mode}"] = inprocess_profile(acc, n)
    for r in results:  # token ids stay out of the JSON
        r.pop("token_ids", None)
    ver = [r for r in stats.replicas if r.role == "verifier"]
    return {"address": address, "target": info.target, "dtype": dtype,
            "dtype_reason": ver[0].dtype_reason if ver else "", "hardware": hardware(),
            "cluster_hardware": ver[0].hardware if ver else "", "draft": draft, "draft_spec": spec,
            "gamma": "auto" if sent_gamma is None and default == "auto" else local_gamma, "max_tokens": max_tokens,
            "prompts": len(prompts), "prompt_file": str(prompts_path or PROMPTS), "concurrency": conc,
            "rounds": rounds, "threads": {"in_process": threads_engine, "hf": threads_hf}, "niceness": niceness,
            "loadavg_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
            "policy": {r.replica_id: r.policy for r in ver}, "runner_ceiling": ceil,
            "results": sorted(results, key=lambda r: (r["side"] != "cluster", r["concurrency"], r["side"],
                                                      r["mode"])),
            "ratios": ratios, "goals": goals, "greedy_agreement_cluster_vs_inprocess_c1": agree, "profile": served}


# ---------------------------------------------------------------------------------- pipelining
PIPELINE_DRAFT = "truncated:4"
BATCHER_KEYS = ("target_passes", "rows_verified", "pipelined_steps", "verify_s", "prefill_s", "draft_s",
                "draft_wait_s", "draft_flight_s")


def pipeline_config(cfg, draft: str):
    """The cluster `pipeline_compare` starts: `cfg` with one Verifier replica (so a Serve-handle
    toggle reaches the only one), pipelining off to start, and only `draft`, on one replica."""

    d = cfg.draft(draft)
    if not d.remote:
        raise ValueError(f"--pipeline-compare needs a remote model draft; {draft!r} ({d.spec}) runs in the verifier")
    one = {"min_replicas": 1, "max_replicas": 1, "initial_replicas": None}
    data = cfg.model_dump(mode="json")
    data.update(grpc_port=0, http_port=0)
    data["verifier"]["pipeline"] = False
    data["verifier"]["autoscaling"].update(one)
    dd = d.model_dump(mode="json")
    dd["autoscaling"].update(one)
    data["drafts"] = [dd]
    data["router"].update(default_draft=draft, coalesce=False, max_queue=max(64, data["router"]["max_queue"]))
    return ClusterConfig.model_validate(data)


def _delta(after: dict, before: dict, draft: str) -> dict:
    b = {k: after["batcher"][k] - before["batcher"][k] for k in BATCHER_KEYS}
    ra, rb = after["remote_drafts"].get(draft, {}), before["remote_drafts"].get(draft, {})
    for k in ("calls", "replica_busy_s", "replica_queued_s", "resyncs"):
        b[f"draft_{k}"] = ra.get(k, 0) - rb.get(k, 0)
    return b


def pipeline_compare(address: str, concurrency=(4, 8), draft: str = PIPELINE_DRAFT, gamma: int | None = None,
                     max_tokens: int = 48, prompts_path=None, limit: int | None = 8, rounds: int = 3,
                     progress: bool = True, timeout: float = 600.0, match_niceness: bool = True,
                     app_name: str = "specd") -> dict:
    """Pipelining on against off, on one running cluster whose Verifier has a single replica.

    For each round and concurrency the same prompts run once with pipelining on and once off
    (`set_pipeline` on the Verifier through a Serve handle; the order flips every time, so drift
    in machine load hits both alike). Per mode and concurrency: tokens/s (all tokens / summed
    wall time), per-round tokens/s, TTFT, p50/p99 inter-token latency, α, and, from the
    verifier's batcher accounting over the same wall time: target passes and rows per pass, time
    in target passes, drafting the batcher waited for, and the draft replica's busy time. This
    process must reach the cluster's Ray (it does when it started the cluster)."""
    import ray
    from ray import serve
    from tqdm import tqdm

    from specd_client import SpecdClient

    niceness = match_ray_niceness(address) if match_niceness else os.nice(0)
    load_before = os.getloadavg()
    if not ray.is_initialized():
        ray.init(address="auto", log_to_driver=False)
    verifier = serve.get_deployment_handle("Verifier", app_name=app_name)
    prompts = load_prompts(prompts_path)[:limit]
    conc = sorted(set(int(c) for c in concurrency))
    client = SpecdClient(address, timeout=timeout, token=os.environ.get("SPECD_TOKEN"))
    try:
        wait_serving(client, timeout=120, poll=0.5)
        info = client.list_models()
        if draft not in [d.name for d in info.drafts]:
            raise ValueError(f"draft {draft!r}: the cluster serves {[d.name for d in info.drafts]}")
        if gamma is None:
            gamma = next(d.default_gamma for d in info.drafts if d.name == draft)
        initial = verifier_stats(verifier)["pipeline"]
        bar = tqdm(total=2 * rounds * len(conc) * len(prompts), desc="bench --pipeline-compare", unit="req",
                   disable=not progress)
        for on in (True, False):  # warm-up, untimed: both paths, the widest burst
            verifier.set_pipeline.remote(on).result(timeout_s=60)
            cluster_point(client, prompts[:max(conc)], max(conc), 8, draft, gamma)
        points: dict[tuple, dict] = {}
        outputs: dict[tuple, list] = {}
        i = 0
        for rnd in range(rounds):
            for c in conc:
                for on in ((True, False) if i % 2 == 0 else (False, True)):
                    st = verifier.set_pipeline.remote(on).result(timeout_s=60)
                    assert st["pipeline"] is on and st["active_sequences"] == 0
                    recs, wall = cluster_point(client, prompts, c, max_tokens, draft, gamma, bar)
                    after = verifier_stats(verifier)
                    if after["replica_id"] != st["replica_id"]:
                        raise RuntimeError("the Verifier has more than one replica: the toggle reached only one")
                    pt = points.setdefault((c, on), {"records": [], "wall": 0.0, "round_tps": [], "batcher": {}})
                    pt["records"] += recs
                    pt["wall"] += wall
                    pt["round_tps"].append(sum(r["tokens"] for r in recs) / wall)
                    for k, v in _delta(after, st, draft).items():
                        pt["batcher"][k] = pt["batcher"].get(k, 0) + v
                    outputs.setdefault((c, on), []).append([r["token_ids"] for r in recs])
                i += 1
        bar.close()
        verifier.set_pipeline.remote(initial).result(timeout_s=60)
    finally:
        client.close()

    results = []
    for (c, on), pt in sorted(points.items()):
        b = pt["batcher"]
        wall = pt["wall"]
        row = {"concurrency": c, "pipeline": on, "rounds": len(pt["round_tps"]),
               **summarize(pt["records"], wall), "round_tokens_per_s": pt["round_tps"], "batcher": b,
               "time_share": {  # of the point's wall time, in the verifier's batcher thread / on the draft
                   "target_verify": b["verify_s"] / wall, "target_prefill": b["prefill_s"] / wall,
                   "draft_exposed": b["draft_s"] / wall, "draft_wait": b["draft_wait_s"] / wall,
                   "draft_replica_busy": b["draft_replica_busy_s"] / wall,
                   "batcher_other": max(0.0, 1 - (b["verify_s"] + b["prefill_s"] + b["draft_s"]) / wall)},
               "rows_per_pass": b["rows_verified"] / b["target_passes"] if b["target_passes"] else None,
               "verify_ms_per_pass": 1e3 * b["verify_s"] / b["target_passes"] if b["target_passes"] else None,
               "draft_ms_per_call": (1e3 * b["draft_replica_busy_s"] / b["draft_calls"]
                                     if b["draft_calls"] else None),
               # drafting the replica did that the batcher did not wait for: hidden behind target passes
               "draft_hidden_s": max(0.0, b["draft_replica_busy_s"] - b["draft_wait_s"])}
        results.append(row)
    get = {(r["concurrency"], r["pipeline"]): r for r in results}
    ratios = {}
    for c in conc:
        on, off = get.get((c, True)), get.get((c, False))
        if on and off and off["tokens_per_s"]:
            ratios[f"c{c}"] = {
                "tokens_per_s_on_over_off": on["tokens_per_s"] / off["tokens_per_s"],
                "itl_p50_on_over_off": (on["itl_ms"]["p50"] / off["itl_ms"]["p50"]
                                        if on["itl_ms"]["p50"] and off["itl_ms"]["p50"] else None),
                "per_round_tokens_per_s_on_over_off": [a / b for a, b in zip(on["round_tokens_per_s"],
                                                                             off["round_tokens_per_s"])]}
    agree, agree_within = {}, {}
    for c in conc:
        a, b = outputs.get((c, True), []), outputs.get((c, False), [])
        pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
        if pairs:
            agree[f"c{c}"] = sum(x == y for x, y in pairs) / len(pairs)
        # the noise floor: the same mode in different rounds (in bf16 a row's numerics depend on
        # what else is in its target pass, and continuous batching never batches alike twice)
        for on in (True, False):
            rs = outputs.get((c, on), [])
            pairs = [(x, y) for ra, rb in zip(rs, rs[1:]) for x, y in zip(ra, rb)]
            if pairs:
                agree_within[f"c{c}-{'on' if on else 'off'}"] = sum(x == y for x, y in pairs) / len(pairs)
    for r in results:
        r.pop("token_ids", None)
    return {"mode": "pipeline-compare", "address": address, "target": info.target, "draft": draft, "gamma": gamma,
            "max_tokens": max_tokens, "prompts": len(prompts), "prompt_file": str(prompts_path or PROMPTS),
            "concurrency": conc, "rounds": rounds, "niceness": niceness, "cpu_count": os.cpu_count(),
            "loadavg_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
            "results": results, "ratios": ratios, "greedy_agreement_on_vs_off": agree,
            "greedy_agreement_across_rounds": agree_within}


def render_pipeline(report: dict) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    con = Console(record=True, width=210, file=io.StringIO())
    t = Table(title=f"specd bench --pipeline-compare {report['address']}  ({report['target']}, draft "
                    f"{report['draft']} γ={report['gamma']} on its own replica, {report['prompts']} prompts, "
                    f"≤{report['max_tokens']} new tokens, greedy, {report['rounds']} interleaved rounds)")
    for col in ("conc", "pipeline", "tokens", "tok/s", "tok/s per round", "TTFT p50", "ITL p50", "ITL p99",
                "α", "passes", "rows/pass", "ms/pass", "verify", "draft exposed", "of it waiting",
                "draft replica busy", "draft ms/call"):
        t.add_column(col, justify="left" if col == "pipeline" else "right")
    f = lambda v, fmt: "—" if v is None else format(v, fmt)  # noqa: E731
    for r in report["results"]:
        sh = r["time_share"]
        t.add_row(str(r["concurrency"]), "on" if r["pipeline"] else "off", str(r["tokens"]),
                  f(r["tokens_per_s"], ".1f"), "/".join(f"{x:.1f}" for x in r["round_tokens_per_s"]),
                  f(r["ttft_ms"]["p50"], ".0f"), f(r["itl_ms"]["p50"], ".1f"), f(r["itl_ms"]["p99"], ".1f"),
                  f(r["acceptance_rate"], ".3f"), str(int(r["batcher"]["target_passes"])),
                  f(r["rows_per_pass"], ".2f"), f(r["verify_ms_per_pass"], ".1f"),
                  f"{sh['target_verify']:.0%}", f"{sh['draft_exposed']:.0%}", f"{sh['draft_wait']:.0%}",
                  f"{sh['draft_replica_busy']:.0%}", f(r["draft_ms_per_call"], ".1f"))
    con.print(t)
    con.print("latencies in ms; shares are of the point's wall time: verify = target passes (+ accept, commit) in "
              "the verifier's batcher; draft exposed = drafting the batcher did or waited for; of it waiting = "
              "blocked on the draft replica's answers; draft replica busy = time the replica spent proposing")
    for k, v in report["ratios"].items():
        itl = v["itl_p50_on_over_off"]
        con.print(f"concurrency {k[1:]}: pipelining on/off tokens/s {v['tokens_per_s_on_over_off']:.3f}× "
                  f"(per round {', '.join(f'{x:.2f}' for x in v['per_round_tokens_per_s_on_over_off'])}), "
                  f"ITL p50 {'—' if itl is None else format(itl, '.3f')}×")
    if report["greedy_agreement_on_vs_off"]:
        con.print("greedy outputs identical with pipelining on and off: "
                  + ", ".join(f"{k} {v:.0%}" for k, v in report["greedy_agreement_on_vs_off"].items())
                  + ("; same mode, consecutive rounds: " + ", ".join(
                      f"{k} {v:.0%}" for k, v in report["greedy_agreement_across_rounds"].items())
                     if report.get("greedy_agreement_across_rounds") else "")
                  + " (bf16 numerics depend on the batch a row shares a pass with; fp32 is exact, see tests)")
    con.print(f"{report['cpu_count']} CPUs; benchmark process niceness {report['niceness']}, 1-min load average "
              f"{report['loadavg_1m']['before']:.1f} before, {report['loadavg_1m']['after']:.1f} after")
    return con.export_text()


# ---------------------------------------------------------------------------------- output
def render(report: dict) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    con = Console(record=True, width=150, file=io.StringIO())  # printed once, by the caller
    t = Table(title=f"specd bench --address {report['address']}  ({report['target']}, {report['dtype']}, "
                    f"draft {report['draft']} γ={report['gamma']}, {report['prompts']} prompts, "
                    f"≤{report['max_tokens']} new tokens, greedy)")
    for col in ("side", "conc", "mode", "req", "tokens", "tok/s", "TTFT p50", "TTFT p99", "ITL p50",
                "ITL p99", "α", "mean acc. len", "speculated", "coalesced"):
        t.add_column(col, justify="left" if col in ("side", "mode") else "right")
    f = lambda v, fmt: "—" if v is None else format(v, fmt)  # noqa: E731
    for r in report["results"]:
        t.add_row(r["side"], str(r["concurrency"]), r["mode"] if r["mode"] == "off" else f"{r['draft']}",
                  str(r["requests"]), str(r["tokens"]), f(r["tokens_per_s"], ".1f"),
                  f(r["ttft_ms"]["p50"], ".0f"), f(r["ttft_ms"]["p99"], ".0f"), f(r["itl_ms"]["p50"], ".1f"),
                  f(r["itl_ms"]["p99"], ".1f"), f(r["acceptance_rate"], ".3f"), f(r["mean_accepted_length"], ".2f"),
                  f(r.get("speculated_share") if r["mode"] == "spec" else None, ".0%"), str(r["coalesced"]))
    con.print(t)
    con.print(f"hardware: {report.get('cluster_hardware') or report['hardware']}; target dtype {report['dtype']} "
              f"({report.get('dtype_reason', '')})")
    if report.get("runner_ceiling"):
        c = report["runner_ceiling"]
        con.print(f"runner alone, {c['rows']} rows x 1 token, {c['threads']} thread(s): {c['pass_ms']:.0f} ms per pass "
                  f"= {c['tokens_per_s']:.1f} tok/s")
    for k, v in report["ratios"].get("spec_vs_off_rounds", {}).items():
        con.print(f"speculation on / off, {k}: median {v['median']:.2f}× over {len(v['rounds'])} rounds "
                  f"(min {v['min']:.2f}, max {v['max']:.2f})")
    con.print("latencies in ms; ITL: a chunk of k tokens arriving dt after the previous counts as k gaps of dt/k")
    ra = report["ratios"]
    for mode, v in ra["cluster_vs_inprocess_c1"].items():
        con.print(f"concurrency 1, {mode}: cluster {v['tokens_per_s_ratio']:.2f}× the in-process engine's tokens/s "
                  f"(per-token overhead {v['per_token_overhead']:.2f}×, loss {v['loss']:+.1%})")
    if ra["vs_hf_serial"]:
        con.print("cluster vs serial HF generate: "
                  + ", ".join(f"{k} {v:.2f}×" for k, v in ra["vs_hf_serial"].items()))
    for k, v in report["goals"].items():
        con.print(f"goal {k}: {v}")
    con.print(f"benchmark process niceness {report['niceness']}, 1-min load average "
              f"{report['loadavg_1m']['before']:.1f} before, {report['loadavg_1m']['after']:.1f} after")
    if report["greedy_agreement_cluster_vs_inprocess_c1"]:
        con.print("greedy outputs identical at concurrency 1 (cluster against the in-process engine per mode, and "
                  "the cluster's speculative against its own speculation-off outputs): "
                  + ", ".join(f"{k} {v:.0%}" for k, v in report["greedy_agreement_cluster_vs_inprocess_c1"].items()))
    return con.export_text()


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = report["results"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = {"spec": "#2a7", "off": "#36c"}
    for mode in ("spec", "off"):
        cl = sorted((r for r in rs if r["side"] == "cluster" and r["mode"] == mode), key=lambda r: r["concurrency"])
        if not cl:
            continue
        label = f"cluster, {report['draft']}" if mode == "spec" else "cluster, no draft"
        xs = [r["concurrency"] for r in cl]
        a1.plot(xs, [r["tokens_per_s"] for r in cl], "o-", color=colors[mode], label=label)
        a2.plot(xs, [r["ttft_ms"]["p50"] for r in cl], "o-", color=colors[mode], label=f"TTFT p50, {mode}")
        a2.plot(xs, [r["itl_ms"]["p50"] for r in cl], "s--", color=colors[mode], label=f"ITL p50, {mode}")
        a2.plot(xs, [r["itl_ms"]["p99"] for r in cl], "^:", color=colors[mode], label=f"ITL p99, {mode}")
        ip = [r for r in rs if r["side"] == "in-process" and r["mode"] == mode]
        if ip:
            a1.plot([1], [ip[0]["tokens_per_s"]], "D", color=colors[mode], mfc="none", ms=9,
                    label=f"in-process engine, {mode}")
    h = [r for r in rs if r["side"] == "hf"]
    if h:
        a1.axhline(h[0]["tokens_per_s"], color="#999", ls="--", label="serial HF generate")
        a1.axhline(5 * h[0]["tokens_per_s"], color="#c66", ls=":", label="5× serial HF")
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["concurrency"], [str(c) for c in report["concurrency"]])
        ax.set_xlabel("concurrent requests")
        ax.legend(fontsize=7)
    a1.set_ylabel("tokens/s (all requests)")
    a1.set_ylim(bottom=0)
    a1.set_title("throughput")
    a2.set_yscale("log")
    a2.set_ylabel("ms")
    a2.set_title("latency")
    fig.suptitle(f"specd cluster at {report['address']}: {report['target']} ({report['dtype']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    """`specd bench --address HOST:PORT` or `specd bench --serve [--config FILE]` (specd/cli.py)."""
    if getattr(args, "pipeline_compare", False):
        return main_pipeline(args)
    started = False
    address = args.address
    config_path = args.config or LOCAL_CONFIG
    args.concurrency = args.concurrency or "1,4,16"
    args.rounds = args.rounds or 1
    args.max_tokens = 64 if args.max_tokens is None else args.max_tokens
    if args.serve:
        address = S.start(ClusterConfig.load(config_path).model_copy(update={"grpc_port": 0, "http_port": 0}))
        started = True
        print(f"started a local cluster from {config_path} on grpc://{address}", flush=True)
    try:
        draft = args.draft[0] if args.draft else None
        report = run(address, tuple(int(x) for x in args.concurrency.split(",")), draft, args.gamma,
                     args.max_tokens, args.prompts, args.limit if args.limit is not None else 16, config_path,
                     inprocess=not args.no_inprocess, hf=not args.no_hf, rounds=args.rounds,
                     match_niceness=not args.no_match_niceness, profile=args.profile)
    finally:
        if started:
            S.stop()
    text = render(report)
    if report.get("profile"):
        from .served import render as render_profile
        text += render_profile(report["profile"])
    print(text)
    out = Path(args.json_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    out.with_suffix(".txt").write_text(text)
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(report, args.plot)
    print(f"wrote {out}, {out.with_suffix('.txt')}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def main_pipeline(args) -> int:
    """`specd bench --serve --pipeline-compare`: start a local cluster from --config (one Verifier
    replica, the remote draft on one replica), pipelining on against off, write JSON + table."""
    config_path = args.config or LOCAL_CONFIG
    draft = args.draft[0] if args.draft else PIPELINE_DRAFT
    started = False
    address = args.address
    if args.serve:
        cfg = pipeline_config(ClusterConfig.load(config_path), draft)
        address = S.start(cfg)
        started = True
        print(f"started a local cluster from {config_path} (one Verifier replica, {draft} on one Draft replica) "
              f"on grpc://{address}", flush=True)
    try:
        report = pipeline_compare(address, tuple(int(x) for x in (args.concurrency or "4,8").split(",")), draft,
                                  args.gamma, args.max_tokens if args.max_tokens is not None else 48, args.prompts,
                                  args.limit if args.limit is not None else 8, args.rounds or 3,
                                  match_niceness=not args.no_match_niceness)
        report["config"] = str(config_path)
    finally:
        if started:
            S.stop()
    text = render_pipeline(report)
    print(text)
    out = Path(args.json_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    out.with_suffix(".txt").write_text(text)
    print(f"wrote {out} and {out.with_suffix('.txt')}")
    return 0
