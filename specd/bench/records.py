"""What every cluster benchmark shares: one streamed request's record (arrivals, TTFT, inter-token
gaps, speculation stats), their summary per point, matching Ray's worker niceness, and the
verifier's own accounting through a Serve handle. Used by `bench/cluster.py` and `bench/overlap.py`.
"""
from __future__ import annotations

import os
import time
import uuid

from ..stats import percentile


def record(t_send: float, arrivals: list[tuple[float, int]], token_ids: list[int], stats: dict | None,
            coalesced: bool) -> dict:
    """One request: arrivals = [(time, tokens in that chunk)]."""
    arrivals = [(t, n) for t, n in arrivals if n > 0]
    itl, gaps = [], []
    for (t0, _), (t1, n) in zip(arrivals, arrivals[1:]):
        gaps.append(t1 - t0)
        itl += [(t1 - t0) / n] * n
    return {"start": t_send, "end": arrivals[-1][0] if arrivals else t_send,
            "ttft": arrivals[0][0] - t_send if arrivals else None, "itl": itl, "gaps": gaps,
            "tokens": len(token_ids), "token_ids": token_ids, "stats": stats or {}, "coalesced": coalesced}


def summarize(records: list[dict], wall: float | None = None) -> dict:
    """Aggregate request records of one point. wall: the point's wall time (else first start to
    last end)."""
    tokens = sum(r["tokens"] for r in records)
    if wall is None:
        wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    ttft = [r["ttft"] for r in records if r["ttft"] is not None]
    itl = [x for r in records for x in r["itl"]]
    gaps = [x for r in records for x in r["gaps"]]
    st = [r["stats"] for r in records]
    drafted = sum(s.get("draft_tokens", 0) for s in st)
    accepted = sum(s.get("accepted_tokens", 0) for s in st)
    drafts = sum(s.get("drafts", 0) for s in st)
    # per position: each request's ratios weighted by its drafting steps (exact for a fixed γ)
    width = max((len(s.get("acceptance_per_position", [])) for s in st), default=0)
    per_pos = []
    for j in range(width):
        w = [(s.get("drafts", 0), s["acceptance_per_position"][j]) for s in st
             if len(s.get("acceptance_per_position", [])) > j]
        tot = sum(x for x, _ in w)
        per_pos.append(sum(x * a for x, a in w) / tot if tot else 0.0)
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    return {"requests": len(records), "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "ttft_ms": {"mean": ms(sum(ttft) / len(ttft)) if ttft else None, "p50": ms(percentile(ttft, 50)),
                        "p99": ms(percentile(ttft, 99))},
            "itl_ms": {"p50": ms(percentile(itl, 50)), "p99": ms(percentile(itl, 99))},
            "chunk_gap_ms": {"p50": ms(percentile(gaps, 50)), "p99": ms(percentile(gaps, 99))},
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None,
            "acceptance_per_position": per_pos,
            "coalesced": sum(r["coalesced"] for r in records)}


def prompt_kwargs(p: dict) -> dict:
    return {"prompt": p["prompt"]} if "prompt" in p else {"messages": p["messages"]}


def cluster_request(client, p: dict, max_tokens: int, draft: str, gamma: int) -> dict:
    arrivals, ids, stats, coalesced = [], [], None, False
    t0 = time.perf_counter()
    for chunk in client.stream(**prompt_kwargs(p), max_tokens=max_tokens, temperature=0.0, draft=draft,
                               gamma=gamma if draft != "none" else 0, request_id=uuid.uuid4().hex):
        arrivals.append((time.perf_counter(), len(chunk.token_ids)))
        ids += chunk.token_ids
        coalesced = coalesced or chunk.coalesced
        if chunk.spec_stats is not None:
            stats = chunk.spec_stats
    return record(t0, arrivals, ids, stats, coalesced)


def match_ray_niceness(address: str) -> int:
    """Ray starts its workers, the Serve replicas among them, at niceness RAY_worker_niceness
    (15). On a machine shared with other work that alone would starve the cluster against an
    in-process engine at niceness 0, so for a cluster on this machine the benchmark process
    (client, in-process engine, HF) runs at the replicas' niceness too. Returns the niceness."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        return os.nice(0)
    want = int(os.environ.get("RAY_worker_niceness", 15))
    now = os.nice(0)
    return os.nice(want - now) if want > now else now


def verifier_stats(handle) -> dict:
    return handle.stats.remote().result(timeout_s=60)


def write_report(report: dict, text: str, plot, json_path: str | None, name: str) -> None:
    """A bench's report as JSON, its table as text beside it, and its PNG (plot(report, path)): at
    --json, or out/<name>.json (a bare `bench.json` default, shared by every bench, takes the name)."""
    import json
    from pathlib import Path

    out = Path(json_path or f"out/{name}.json")
    if out.name == "bench.json":
        out = out.with_name(f"{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    out.with_suffix(".txt").write_text(text + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_suffix('.txt')}, {out.with_suffix('.png')}")
