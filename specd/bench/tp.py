"""`specd bench --local --tp N`: the target split over N processes (`actors.tp`, gloo, ranks 1..N-1 as
Ray actors of a local cluster) against one process, on this machine's cores.

The embedded model in fp32 (dense weights, exact passes as `exact: auto` chooses), a pass of B rows × 1
token after 200 cached positions, B 1 and 8, median of --rounds × 20 passes, interleaved: one process at
N threads (the cores the group uses), one process at 1 thread, and the group at 1 thread per rank. Per
group pass: the seconds rank 0 spends in collectives (the two all-reduces per layer, the logits'
all-gather, the pass's announcement to the other ranks) and their share of the pass: what a cost model
needs to predict the GPU case, where the math shrinks N-fold and NCCL's collectives replace gloo's.
On a CPU it does not pay: N processes share the cores one process would use. Writes
out/bench_tp.{json,txt,png}.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .records import write_report

CONTEXT, PASSES, BATCHES = 200, 20, (1, 8)


def _passes(runner, cache, B: int, feed) -> float:
    """Median seconds of PASSES decode passes of B rows (each row rolled back after)."""
    times = []
    for _ in range(PASSES):
        t = time.perf_counter()
        runner.logits(runner.forward(cache, list(range(B)), feed[:B]))
        times.append(time.perf_counter() - t)
        for s in range(B):
            cache.truncate(s, CONTEXT)
    return statistics.median(times)


def tp_bench(world: int = 2, rounds: int = 3, model: str = "smollm2", progress=print) -> dict:
    import ray
    import torch.distributed as dist

    from actors import tp
    from actors.build import with_exact
    from actors.hardware import hardware
    from actors.llama import LlamaRunner
    from actors.models import load_model
    from cluster.tp import shard_of, start_ranks

    threads = torch.get_num_threads()
    hf = load_model(model, "fp32").model
    single = with_exact(LlamaRunner(hf), "auto")
    ray.init(num_cpus=world, include_dashboard=False, log_to_driver=False)
    address, _, refs = start_ranks(model, "fp32", world, exact="auto", threads=1)
    group = tp.init(0, world, address)
    try:
        torch.set_num_threads(1)
        sharded = shard_of(model, "fp32", group)
        g = torch.Generator().manual_seed(0)
        V = single.vocab_size
        feed = torch.randint(0, V, (max(BATCHES), 1), generator=g)
        caches = {}
        for name, r in (("one", single), ("tp", sharded)):
            caches[name] = r.new_cache(max(BATCHES), CONTEXT + 8)
            for s in range(max(BATCHES)):
                r.forward(caches[name], [s], torch.randint(0, V, (1, CONTEXT), generator=g))
        configs = {f"1 process, {threads} threads": ("one", threads), "1 process, 1 thread": ("one", 1),
                   f"{world} processes, 1 thread each": ("tp", 1)}
        ms = {B: {c: [] for c in configs} for B in BATCHES}
        comm = {B: [] for B in BATCHES}
        for rnd in range(rounds + 1):  # the first round warms every shape, untimed
            for B in BATCHES:
                for c, (name, n) in (configs.items() if rnd % 2 == 0 else reversed(configs.items())):
                    torch.set_num_threads(n)
                    r = single if name == "one" else sharded
                    c0 = group.comm_s
                    sec = _passes(r, caches[name], B, feed)
                    if rnd:
                        ms[B][c].append(sec * 1e3)
                        if name == "tp":
                            comm[B].append((group.comm_s - c0) / PASSES / sec)
            progress(f"round {rnd}/{rounds}")
        calls = group.calls
    finally:
        tp.stop(sharded)
        ray.get(refs)
        dist.destroy_process_group()
        ray.shutdown()
        torch.set_num_threads(threads)
    med = {B: {c: statistics.median(v) for c, v in row.items()} for B, row in ms.items()}
    return {"model": model, "dtype": "fp32", "world": world, "hardware": hardware("cpu"), "rounds": rounds,
            "context": CONTEXT, "passes_per_round": PASSES, "pass_ms": med, "pass_ms_rounds": ms,
            "comm_share": {B: statistics.median(v) for B, v in comm.items()},
            "collectives_per_pass": 2 * single.num_layers + 1, "collective_calls": calls,
            "exact": {"one": single.exact_why, "tp": sharded.exact_why}}


def render(rep: dict) -> str:
    hw = rep["hardware"]
    lines = [f"specd bench --local --tp {rep['world']}  ({rep['model']} fp32, {hw.get('name')}, flags "
             f"{' '.join(hw.get('flags', []))}; pass of B rows × 1 token after {rep['context']} positions, median of "
             f"{rep['rounds']} rounds × {rep['passes_per_round']} passes, interleaved)", ""]
    names = list(next(iter(rep["pass_ms"].values())))
    lines.append("| batch | " + " | ".join(names) + " | collectives' share of the group's pass |")
    lines.append("|---|" + "---|" * (len(names) + 1))
    for B, row in rep["pass_ms"].items():
        lines.append(f"| {B} | " + " | ".join(f"{row[n]:.1f} ms" for n in names) + f" | {rep['comm_share'][B]:.0%} |")
    lines.append(f"\n{rep['collectives_per_pass']} collectives per pass (2 all-reduces per layer, the logits' "
                 "all-gather), plus one announcement from rank 0")
    return "\n".join(lines)


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(next(iter(rep["pass_ms"].values())))
    for i, n in enumerate(names):
        ax.bar([x + 0.25 * i for x in range(len(rep["pass_ms"]))], [row[n] for row in rep["pass_ms"].values()],
               width=0.25, label=n)
    ax.set_xticks([x + 0.25 for x in range(len(rep["pass_ms"]))], [f"batch {B}" for B in rep["pass_ms"]])
    ax.set_ylabel("ms per decode pass")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(args) -> int:
    rep = tp_bench(world=args.tp, rounds=args.rounds or 3)
    text = render(rep)
    print(text)
    write_report(rep, text, plot, args.json_path, "bench_tp")
    return 0
