"""`specd soak`: a bounded soak of the cluster under mixed load, cancellations and deadlines.

    specd soak [--minutes 10] [--concurrency 16] [--config FILE | --address HOST:PORT] [--out out/soak]

Starts a local cluster from --config (default `cluster/configs/local.yaml`, the embedded model), or
loads one already running at --address (then RSS is read only for replicas on this machine), and
keeps --concurrency SDK streams in flight until the time is up. Each request draws, from a seeded
generator: a prompt (the committed chat, code and repetitive prompts), max_tokens, greedy or seeded
sampling, sometimes a stop string or beam search, a draft (every draft the server lists, and none)
with γ auto or fixed, sometimes a confidence threshold; and what the soak does to it:
  cancel    (--cancel-share)   after a few chunks, half close the stream (the server sees CANCELLED)
                               and half call Abort with the request id (the stream ends "abort");
  deadline  (--deadline-share) a gRPC deadline shorter than the request needs (DEADLINE_EXCEEDED).
The client does not retry (retries=0), so every status the server answers is counted as it came.

Reports, in --out as soak.json, soak.txt and soak.png:
  - requests by outcome: OK, the statuses the soak provoked (CANCELLED, DEADLINE_EXCEEDED, and
    RESOURCE_EXHAUSTED, which admission answers under overload), and anything else, which fails it;
  - per --window seconds: requests finished, p50/p99 end-to-end latency and time to first token of
    the OK ones, tokens/s;
  - every Serve replica's RSS over time (pids from Serve's controller, RSS from psutil), and its
    growth in MB/min over the last --slope-minutes (least squares; a replica started later counts
    from a minute after its first sample);
  - KV slots in use at the end (verifiers' target and draft KV, and every draft replica's), after
    the last request finished and a short grace for aborts to land.
Verdict: pass when no unprovoked status occurred, every replica grew by less than --max-slope
MB/min, and no KV slot is in use at the end. Exit status 1 otherwise.
"""
from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from .stats import percentile, slope

STOPS = ("\n\n", ".", "```")
RUN_TIMEOUT_S = 300.0  # a request the soak does not cut short: past this it hangs, and counts against it


@dataclass
class Outcome:
    """One soak request: when it started and ended (seconds since the soak began), how it ended,
    time to first token, tokens received, and what it asked for."""
    start: float
    end: float
    status: str  # "OK" or a gRPC status name
    finish_reason: str | None
    ttft: float | None
    tokens: int
    draft: str
    action: str  # "run" | "close" | "abort" | "deadline"


def provoked(o: Outcome) -> bool:
    """OK, or a status the soak itself provoked: CANCELLED when it closed the stream,
    DEADLINE_EXCEEDED when it set a short deadline, RESOURCE_EXHAUSTED (admission) anywhere."""
    return (o.status in ("OK", "RESOURCE_EXHAUSTED") or (o.status, o.action) in
            {("CANCELLED", "close"), ("DEADLINE_EXCEEDED", "deadline")})


def _request(rng: random.Random, prompts: list[dict], drafts: list[str], max_tokens: int,
             max_beams: int) -> dict:
    """Keyword arguments of `SpecdClient.stream` for one mixed request."""
    p = rng.choice(prompts)
    kw: dict = {"prompt": p["prompt"]} if "prompt" in p else {"messages": p["messages"]}
    kw["max_tokens"] = rng.randint(8, max_tokens)
    draft = rng.choice(drafts)
    kw["draft"] = draft
    kw["gamma"] = 0 if draft == "none" else rng.choice(["auto", "auto", 2, 4])
    if max_beams > 1 and rng.random() < 0.05:
        kw.update(num_beams=2, temperature=0.0, max_tokens=min(kw["max_tokens"], 32))
        return kw
    if rng.random() < 0.5:
        kw.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(2 ** 31))
    if rng.random() < 0.2:
        kw["stop"] = rng.choice(STOPS)
    if draft != "none" and rng.random() < 0.2:
        kw["threshold"] = rng.choice([0.2, 0.5])
    return kw


def _one(client, kw: dict, action: str, rng: random.Random, t0: float) -> Outcome:
    from specd_client.errors import SpecdError

    rid = uuid.uuid4().hex
    start = time.perf_counter()
    timeout = rng.uniform(0.05, 1.5) if action == "deadline" else RUN_TIMEOUT_S
    cut = rng.randint(1, 4)  # chunks before a cancellation
    status, finish, ttft, tokens, chunks = "OK", None, None, 0, 0
    stream = client.stream(**kw, request_id=rid, timeout=timeout)
    try:
        for chunk in stream:
            chunks += 1
            tokens += len(chunk.token_ids)
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - start
            finish = chunk.finish_reason or finish
            if chunks == cut and not chunk.final:
                if action == "close":
                    status = "CANCELLED"  # the server sees the RPC cancelled
                    break
                if action == "abort":
                    client.abort(rid)  # the stream goes on to a final chunk with finish_reason "abort"
    except SpecdError as e:
        status = e.code.name
    finally:
        stream.close()
    return Outcome(start - t0, time.perf_counter() - t0, status, finish, ttft, tokens, kw["draft"], action)


def _serve_replicas() -> dict[str, tuple[int, str]]:
    """replica id → (pid, node ip) of every running Serve replica, from Serve's controller."""
    from ray.serve.context import _get_global_client

    out = {}
    details = _get_global_client().get_serve_details()
    for app in details.get("applications", {}).values():
        for dep_name, dep in app.get("deployments", {}).items():
            for r in dep.get("replicas", []):
                if r.get("pid") and r.get("state") == "RUNNING":
                    out[f"{dep_name}#{r['replica_id'][-6:]}"] = (r["pid"], r.get("node_ip", ""))
    return out


def _memory_mb(pid: int) -> tuple[float, float] | None:
    """(RSS, private) MB of a process. Private = RSS less its file-backed and shared pages (its
    libraries, Ray's object store mappings): the memory the process allocated itself."""
    import psutil

    try:
        m = psutil.Process(pid).memory_info()
    except psutil.Error:
        return None
    return m.rss / 2 ** 20, (m.rss - getattr(m, "shared", 0)) / 2 ** 20


def _kv_in_use(client) -> dict[str, int]:
    """KV slots in use now: per verifier replica its target's and its drafts', per draft replica its own."""
    out = {}
    for r in client.stats().replicas:
        out[f"{r.role}:{r.replica_id}"] = r.kv_slots_in_use
    for r in client.load():
        out[f"verifier-drafts:{r.replica_id}"] = r.draft_kv_slots_in_use
    return out


def slope_mb_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) points, in MB per minute (None under 3 points)."""
    per_s = slope(points)
    return None if per_s is None else 60.0 * per_s


def _fit(pts: list[tuple[float, float]], since: float) -> tuple[float | None, float | None]:
    """(first second fitted, MB/min) over the samples from `since`; a replica whose first sample
    came later (started by the autoscaler) is fitted from a minute after it, past its warm-up."""
    settle_from = since if pts[0][0] < 10.0 else max(since, pts[0][0] + 60.0)
    settled = [(t, v) for t, v in pts if t >= settle_from]
    return (settled[0][0] if settled else None), slope_mb_per_min(settled)


def summarize(outcomes: list[Outcome], rss: dict[str, list[tuple[float, float]]], kv_end: dict[str, int],
              duration: float, window: float, slope_minutes: float, max_slope: float,
              private: dict[str, list[tuple[float, float]]] | None = None) -> dict:
    """The report. rss / private: per replica, (second, MB) samples; the memory check fits RSS,
    and the private fit says whether growth is the process's own allocations."""
    statuses = Counter(o.status for o in outcomes)
    unprovoked = dict(Counter(f"{o.status} ({o.action})" for o in outcomes if not provoked(o)))
    windows = []
    for w in range(int(duration // window) + (duration % window > 1)):
        lo, hi = w * window, (w + 1) * window
        done = [o for o in outcomes if lo <= o.end < hi]
        ok = [o for o in done if o.status == "OK" and o.finish_reason != "abort"]
        windows.append({"start_s": lo, "finished": len(done), "ok": len(ok),
                        "p50_s": percentile([o.end - o.start for o in ok], 50),
                        "p99_s": percentile([o.end - o.start for o in ok], 99),
                        "ttft_p50_s": percentile([o.ttft for o in ok if o.ttft is not None], 50),
                        "tokens_per_s": sum(o.tokens for o in done) / max(min(hi, duration) - lo, 1e-9)})
    since = duration - 60.0 * slope_minutes
    private = rss if private is None else private
    replicas = {}
    for name, pts in rss.items():
        mine = private.get(name) or pts
        from_s, rss_slope = _fit(pts, since)
        replicas[name] = {"first_s": pts[0][0], "rss_first_mb": pts[0][1], "rss_last_mb": pts[-1][1],
                          "rss_max_mb": max(v for _, v in pts), "private_first_mb": mine[0][1],
                          "private_last_mb": mine[-1][1], "slope_from_s": from_s,
                          "rss_slope_mb_per_min": rss_slope, "private_slope_mb_per_min": _fit(mine, since)[1]}
    slopes = [r["rss_slope_mb_per_min"] for r in replicas.values() if r["rss_slope_mb_per_min"] is not None]
    kv_total = sum(kv_end.values())
    checks = {"statuses": not unprovoked, "memory": bool(slopes) and max(slopes) < max_slope, "kv_end": kv_total == 0}
    return {"duration_s": duration, "requests": len(outcomes), "statuses": dict(statuses),
            "finish_reasons": dict(Counter(o.finish_reason for o in outcomes if o.status == "OK")),
            "actions": dict(Counter(o.action for o in outcomes)), "unprovoked": unprovoked,
            "tokens": sum(o.tokens for o in outcomes), "windows": windows, "replicas": replicas,
            "kv_in_use_end": kv_end, "checks": checks, "pass": all(checks.values()),
            "max_slope_mb_per_min": max_slope, "slope_minutes": slope_minutes}


def soak(address: str, minutes: float, concurrency: int, prompts: list[dict], out: str, *, seed: int = 0,
         cancel_share: float = 0.1, deadline_share: float = 0.1, max_tokens: int = 96, window: float = 60.0,
         sample_s: float = 5.0, slope_minutes: float = 8.0, max_slope: float = 2.0, progress: bool = True,
         token: str | None = None) -> dict:
    import ray
    from tqdm import tqdm

    from actors.hardware import hardware, hardware_line
    from specd_client import SpecdClient

    client = SpecdClient(address, retries=0, token=token)
    info = client.list_models()
    drafts = list(dict.fromkeys(["none", *[d.name for d in info.drafts]]))
    duration = 60.0 * minutes
    t0 = time.perf_counter()
    stop_at = t0 + duration
    outcomes: list[Outcome] = []
    rss: dict[str, list[tuple[float, float]]] = {}
    private: dict[str, list[tuple[float, float]]] = {}
    lock = threading.Lock()
    done = threading.Event()
    bar = tqdm(total=int(duration), desc="soak", unit="s", disable=not progress,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s {postfix}")

    def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.perf_counter() < stop_at:
            kw = _request(rng, prompts, drafts, min(max_tokens, info.max_tokens), info.max_beams)
            u = rng.random()
            action = ("close" if rng.random() < 0.5 else "abort") if u < cancel_share else \
                "deadline" if u < cancel_share + deadline_share else "run"
            o = _one(client, kw, action, rng, t0)
            with lock:
                outcomes.append(o)

    here = ("", "127.0.0.1", ray.util.get_node_ip_address())  # replicas on this machine

    def sampler() -> None:
        while not done.is_set():
            now = time.perf_counter() - t0
            try:
                for name, (pid, ip) in _serve_replicas().items():
                    mb = _memory_mb(pid) if ip in here else None  # a pid on another machine is not ours
                    if mb is not None:
                        rss.setdefault(name, []).append((now, mb[0]))
                        private.setdefault(name, []).append((now, mb[1]))
            except Exception as e:  # the controller busy or restarting: skip this sample
                print(f"[soak] RSS sample at {now:.0f} s failed: {e!r}", flush=True)
            with lock:
                n = len(outcomes)
                bad = sum(not provoked(o) for o in outcomes)
            bar.n = min(int(now), int(duration))
            bar.set_postfix_str(f"{n} requests, {bad} unprovoked errors")
            bar.refresh()
            done.wait(sample_s)

    s = threading.Thread(target=sampler, daemon=True)
    s.start()
    workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    # Aborts and cancellations land asynchronously: give the batchers a moment, then read KV.
    kv_end: dict[str, int] = {}
    for _ in range(20):
        kv_end = _kv_in_use(client)
        if not any(kv_end.values()):
            break
        time.sleep(1.0)
    done.set()
    s.join()
    bar.close()
    client.close()
    report = summarize(outcomes, rss, kv_end, elapsed, window, slope_minutes, max_slope, private)
    report.update(address=address, concurrency=concurrency, minutes=minutes, seed=seed, cancel_share=cancel_share,
                  deadline_share=deadline_share, hardware=hardware_line(hardware()), drafts=drafts,
                  rss_samples=rss, private_samples=private)
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "soak.json").write_text(json.dumps(report | {"outcomes": [asdict(o) for o in outcomes]}, indent=1))
    (path / "soak.txt").write_text(render(report))
    plot(report, str(path / "soak.png"))
    return report


def _fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def render(report: dict) -> str:
    lines = [f"specd soak: {report['minutes']:g} min at concurrency {report['concurrency']} on {report['address']}",
             f"hardware: {report['hardware']}", f"drafts: {', '.join(report['drafts'])}",
             f"requests {report['requests']}, tokens {report['tokens']}, actions {report['actions']}",
             f"statuses {report['statuses']}, finish reasons (OK) {report['finish_reasons']}",
             f"unprovoked statuses: {report['unprovoked'] or 'none'}", "",
             "| window | finished | OK | p50 ms | p99 ms | TTFT p50 ms | tokens/s |", "|---|---|---|---|---|---|---|"]
    for w in report["windows"]:
        lines.append(f"| {w['start_s'] / 60:.1f} min | {w['finished']} | {w['ok']} | {_fmt_ms(w['p50_s'])} | "
                     f"{_fmt_ms(w['p99_s'])} | {_fmt_ms(w['ttft_p50_s'])} | {w['tokens_per_s']:.1f} |")
    sl = lambda x: "-" if x is None else f"{x:+.2f}"  # noqa: E731
    lines += ["", f"| replica | first sample | RSS first → last MB | private first → last MB | RSS MB/min | "
                  f"private MB/min (last {report['slope_minutes']:g} min) |", "|---|---|---|---|---|---|"]
    for name, r in sorted(report["replicas"].items()):
        lines.append(f"| {name} | {r['first_s']:.0f} s | {r['rss_first_mb']:.0f} → {r['rss_last_mb']:.0f} | "
                     f"{r['private_first_mb']:.0f} → {r['private_last_mb']:.0f} | {sl(r['rss_slope_mb_per_min'])} | "
                     f"{sl(r['private_slope_mb_per_min'])} |")
    lines += ["", f"KV slots in use at the end: {report['kv_in_use_end']}",
              f"checks: {report['checks']} (RSS growth < {report['max_slope_mb_per_min']:g} MB/min)",
              f"verdict: {'PASS' if report['pass'] else 'FAIL'}"]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    ws = report["windows"]
    mins = [w["start_s"] / 60 for w in ws]
    for key, label in (("p50_s", "p50"), ("p99_s", "p99"), ("ttft_p50_s", "TTFT p50")):
        a1.plot(mins, [None if w[key] is None else 1000 * w[key] for w in ws], marker="o", label=label)
    a1.set_xlabel("minute")
    a1.set_ylabel("ms (OK requests)")
    a1.set_title("latency per window")
    a1.legend()
    for i, (name, pts) in enumerate(sorted(report["rss_samples"].items())):
        color = f"C{i}"
        a2.plot([t / 60 for t, _ in pts], [v for _, v in pts], color=color, label=f"{name} RSS")
        mine = report["private_samples"].get(name, [])
        a2.plot([t / 60 for t, _ in mine], [v for _, v in mine], color=color, linestyle="--", label="private")
    a2.set_xlabel("minute")
    a2.set_ylabel("MB")
    a2.set_title("memory per Serve replica (dashed: private, RSS less file-backed and shared)")
    a2.legend(fontsize=7)
    fig.suptitle(f"specd soak: {report['concurrency']} streams, {report['requests']} requests, "
                 f"{'PASS' if report['pass'] else 'FAIL'}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="a bounded soak: mixed load with cancellations and deadlines; statuses, "
                                    "latency and every replica's RSS over time, KV at the end")
    p.set_defaults(func=run)
    p.add_argument("--config", default=None, help="start a local cluster from this config (default: local.yaml)")
    p.add_argument("--address", default=None, help="HOST:PORT of a running cluster instead (joins its Ray for RSS)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompts", default=None, help="JSONL prompts (default: the committed and repetitive sets)")
    p.add_argument("--max-tokens", type=int, default=96, help="the most new tokens a request asks for")
    p.add_argument("--cancel-share", type=float, default=0.1, help="share of requests cancelled mid-stream")
    p.add_argument("--deadline-share", type=float, default=0.1, help="share of requests with a short deadline")
    p.add_argument("--window", type=float, default=60.0, help="seconds per latency window")
    p.add_argument("--slope-minutes", type=float, default=8.0, help="RSS growth is fitted over the last N minutes")
    p.add_argument("--max-slope", type=float, default=2.0, help="RSS growth that fails the soak, MB/min")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/soak")


def run(args) -> int:
    import os

    from cluster import serve as S
    from cluster.config import LOCAL_CONFIG, ClusterConfig

    from .data import PROMPTS, REPETITIVE, load_prompts

    prompts = load_prompts(args.prompts) if args.prompts else load_prompts(PROMPTS) + load_prompts(REPETITIVE)
    started = args.address is None
    if started:
        cfg = ClusterConfig.load(args.config or LOCAL_CONFIG).model_copy(update={"grpc_port": 0, "http_port": 0})
        address = S.start(cfg)
        print(f"[specd soak] started a local cluster from {args.config or LOCAL_CONFIG} on grpc://{address}",
              flush=True)
    else:
        import ray
        ray.init(address="auto", log_to_driver=False)
        address = args.address
    try:
        from specd_client import SpecdClient
        with SpecdClient(address, token=os.environ.get("SPECD_TOKEN")) as c:
            S.wait_serving(c, timeout=300)
        report = soak(address, args.minutes, args.concurrency, prompts, args.out, seed=args.seed,
                      cancel_share=args.cancel_share, deadline_share=args.deadline_share, max_tokens=args.max_tokens,
                      window=args.window, slope_minutes=args.slope_minutes, max_slope=args.max_slope,
                      token=os.environ.get("SPECD_TOKEN"))
    finally:
        if started:
            S.stop()
    print(render(report))
    print(f"wrote {Path(args.out) / 'soak.json'}, soak.txt and soak.png")
    return 0 if report["pass"] else 1
