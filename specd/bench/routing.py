"""`specd bench --serve --routing`: prefix-aware routing (`cluster.routing.PrefixRouter`) against
Serve's power-of-two choices, through a local cluster with two verifier replicas.

The agent-like sessions (specd/data/agent_sessions.jsonl) are replayed at each concurrency c: c
sessions at once, each turn by turn through the SDK, every turn re-sending the history with the
model's earlier answers. Both routings run in every round, in alternating order, each on a fresh
cluster (so no cache carries over). Per routing and concurrency, the median over rounds of: the
prefix cache's hit rate over both replicas (prompt tokens found / looked up, from GetStats), TTFT
p50 and p99 over all turns, and tokens/s (all tokens / wall time). Writes JSON and a table.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import statistics
import time
from pathlib import Path

ROUTINGS = ("prefix", "power_of_two")


def _config(base, routing: str, draft: str):
    v = base.verifier.model_copy(update={"routing": routing, "max_batch": 8, "torch_threads": 1,
                                         "autoscaling": base.verifier.autoscaling.model_copy(
                                             update={"min_replicas": 2, "max_replicas": 2})})
    drafts = [d for d in base.drafts if d.name == draft] or [type(base.drafts[0])(name=draft, spec=draft)]
    return base.model_copy(update={"grpc_port": 0, "http_port": 0, "verifier": v, "drafts": drafts,
                                   "router": base.router.model_copy(update={"default_draft": draft})})


def _replay(client, session: dict, max_tokens: int) -> list[dict]:
    history = [{"role": "system", "content": session["system"]}]
    out = []
    for turn in session["turns"]:
        history.append({"role": "user", "content": turn})
        t0 = time.perf_counter()
        first, text, tokens = None, [], 0
        for chunk in client.stream(messages=history, max_tokens=max_tokens):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
            text.append(chunk.text)
            tokens += len(chunk.token_ids)
        out.append({"ttft": first, "tokens": tokens})
        history.append({"role": "assistant", "content": "".join(text)})
    return out


def _prefix_totals(client) -> tuple[int, int]:
    reps = [r for r in client.stats().replicas if r.role == "verifier"]
    return sum(r.prefix_cache_queries for r in reps), sum(r.prefix_cache_hits for r in reps)


def routing_bench(config_path: str, concurrency=(4, 16), rounds: int = 3, max_tokens: int = 64,
                  draft: str = "suffix", progress: bool = True) -> dict:
    from tqdm import tqdm

    from actors.hardware import hardware
    from cluster import serve as S
    from cluster.config import ClusterConfig
    from cluster.serve import wait_serving
    from specd_client import SpecdClient

    from .agent import load_sessions

    sessions = load_sessions()
    base = ClusterConfig.load(config_path)
    runs: dict = {}
    bar = tqdm(total=rounds * len(ROUTINGS) * len(concurrency), desc="routing bench", disable=not progress)
    for r in range(rounds):
        for routing in (ROUTINGS if r % 2 == 0 else ROUTINGS[::-1]):
            address = S.start(_config(base, routing, draft))
            try:
                with SpecdClient(address, timeout=600) as client:
                    wait_serving(client, timeout=300)
                    for c in concurrency:
                        q0, h0 = _prefix_totals(client)
                        t0 = time.perf_counter()
                        with cf.ThreadPoolExecutor(c) as ex:
                            turns = [t for s in ex.map(lambda s: _replay(client, s, max_tokens), sessions[:c])
                                     for t in s]
                        wall = time.perf_counter() - t0
                        q1, h1 = _prefix_totals(client)
                        ttft = sorted(t["ttft"] for t in turns if t["ttft"] is not None)
                        runs.setdefault((routing, c), []).append({
                            "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
                            "ttft_p50": ttft[len(ttft) // 2], "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
                            "tokens_per_s": sum(t["tokens"] for t in turns) / wall})
                        bar.update(1)
            finally:
                S.stop()
    bar.close()
    rows = [{"routing": routing, "concurrency": c,
             **{k: statistics.median(x[k] for x in rs) for k in ("hit_rate", "ttft_p50", "ttft_p99", "tokens_per_s")}}
            for (routing, c), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
    return {"config": str(config_path), "draft": draft, "hardware": hardware("cpu"), "rounds": rounds,
            "max_tokens": max_tokens, "rows": rows}


def render(rep: dict) -> str:
    hw = rep["hardware"]
    lines = [f"routing over two verifier replicas ({rep['config']}, draft {rep['draft']}), {hw.get('name')} "
             f"({', '.join(hw.get('flags', []))}); agent sessions, up to {rep['max_tokens']} tokens per turn, "
             f"median of {rep['rounds']} rounds",
             f"{'conc':>4} {'routing':<13} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s':>7}"]
    for r in rep["rows"]:
        lines.append(f"{r['concurrency']:>4} {r['routing']:<13} {r['hit_rate']:8.0%} {1e3 * r['ttft_p50']:7.0f}ms "
                     f"{1e3 * r['ttft_p99']:7.0f}ms {r['tokens_per_s']:7.1f}")
    return "\n".join(lines)


def main(args) -> int:
    from cluster.config import LOCAL_CONFIG

    rep = routing_bench(args.config or LOCAL_CONFIG, tuple(int(x) for x in (args.concurrency or "4,16").split(",")),
                        args.rounds or 3, args.max_tokens if args.max_tokens is not None else 64,
                        (args.draft or ["suffix"])[0])
    text = render(rep)
    print(text)
    out = Path(args.json_path or "out/bench_routing.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1))
    out.with_suffix(".txt").write_text(text)
    print(f"wrote {out} (.txt)")
    return 0
