"""`specd bench --serve --overlap-compare`: what overlapped remote drafting buys, on one cluster.

One Verifier replica serves the same model draft three ways, each its own entry in the config:

  NAME            remote, overlapped: after answering, the draft replica prepares the next block
                  for the likeliest verdicts while the target verifies (`overlap: true`)
  NAME-sync       remote, not overlapped: the same draft on its own replica, drafting only when asked
  NAME-colocated  the same draft inside the verifier replica, no hop

and "none" (speculation off). At concurrency 1, every prompt runs all four back to back, the order
reversed on every other prompt and round, at a fixed γ (default 4), greedy. Per configuration:
tokens/s, ITL, α; per remote one, from the Verifier's own accounting of the same requests: draft
calls, rows answered from a prepared block (the hit rate), time the replica spent drafting, and
the time per target pass the batcher waited for drafts (what overlap hides is the difference
between the two remote configurations).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from cluster import serve as S
from cluster.config import LOCAL_CONFIG, ClusterConfig
from cluster.serve import wait_serving

from ..data import load_prompts
from .records import cluster_request, match_ray_niceness, summarize, verifier_stats

OVERLAP_DRAFT = "truncated:4"


def overlap_config(cfg: ClusterConfig, draft: str) -> tuple[ClusterConfig, dict[str, str]]:
    """`cfg` with one Verifier replica and `draft` three ways (see the module docstring), each
    remote one on a single replica. Returns the config and {configuration: draft name}."""
    d = cfg.draft(draft)
    if not d.remote:
        raise ValueError(f"--overlap-compare needs a remote model draft; {draft!r} ({d.spec}) runs in the verifier")
    one = {"min_replicas": 1, "max_replicas": 1, "initial_replicas": None}
    data = cfg.model_dump(mode="json")
    data.update(grpc_port=0, http_port=0)
    data["verifier"]["pipeline"] = False
    data["verifier"]["autoscaling"].update(one)
    base = d.model_dump(mode="json")
    base["autoscaling"].update(one)
    names = {"overlapped": draft, "remote": f"{draft}-sync", "colocated": f"{draft}-colocated"}
    data["drafts"] = [{**base, "name": names["overlapped"], "overlap": True},
                      {**base, "name": names["remote"], "overlap": False},
                      {**base, "name": names["colocated"], "placement": "colocated"}]
    data["router"].update(default_draft=draft, coalesce=False)
    return ClusterConfig.model_validate(data), names


def _remote_delta(after: dict, before: dict, name: str) -> dict:
    ra, rb = after["remote_drafts"].get(name, {}), before["remote_drafts"].get(name, {})
    out = {k: ra.get(k, 0) - rb.get(k, 0) for k in ("calls", "replica_busy_s", "prepared_rows", "resyncs")}
    for k in ("target_passes", "rows_verified", "draft_s", "draft_wait_s", "verify_s"):
        out[k] = after["batcher"][k] - before["batcher"][k]
    return out


def overlap_compare(address: str, names: dict[str, str], gamma: int = 4, max_tokens: int = 48,
                    prompts_path=None, limit: int = 8, rounds: int = 2, progress: bool = True,
                    timeout: float = 600.0, match_niceness: bool = True, app_name: str = "specd") -> dict:
    import ray
    from ray import serve
    from tqdm import tqdm

    from actors.hardware import hardware
    from specd_client import SpecdClient

    niceness = match_ray_niceness(address) if match_niceness else os.nice(0)
    load_before = os.getloadavg()
    if not ray.is_initialized():
        ray.init(address="auto", log_to_driver=False)
    verifier = serve.get_deployment_handle("Verifier", app_name=app_name)
    prompts = load_prompts(prompts_path)[:limit]
    configs = [*names, "off"]
    draft_of = {**names, "off": "none"}
    client = SpecdClient(address, timeout=timeout, token=os.environ.get("SPECD_TOKEN"))
    records: dict[str, list[dict]] = {c: [] for c in configs}
    accounting: dict[str, dict] = {c: {} for c in names}
    try:
        wait_serving(client, timeout=120, poll=0.5)
        info = client.list_models()
        for c in configs:  # warm-up, untimed
            cluster_request(client, prompts[0], 8, draft_of[c], gamma)
        bar = tqdm(total=rounds * len(prompts) * len(configs), desc="bench --overlap-compare", unit="req",
                   disable=not progress)
        for rnd in range(rounds):
            for i, p in enumerate(prompts):
                for c in (configs if (i + rnd) % 2 == 0 else configs[::-1]):
                    before = verifier_stats(verifier)
                    records[c].append(cluster_request(client, p, max_tokens, draft_of[c], gamma))
                    if c in names:
                        after = verifier_stats(verifier)
                        for k, v in _remote_delta(after, before, draft_of[c]).items():
                            accounting[c][k] = accounting[c].get(k, 0) + v
                    bar.update(1)
        bar.close()
    finally:
        client.close()

    rows = {}
    for c in configs:
        s = summarize(records[c])
        # tokens/s over the summed request times, not first start to last end (requests ran in turns)
        wall = sum(r["end"] - r["start"] for r in records[c])
        s["tokens_per_s"] = s["tokens"] / wall if wall else 0.0
        s["seconds"] = wall
        a = accounting.get(c, {})
        if a:
            passes = a["target_passes"] or 1
            s["draft"] = {"calls": a["calls"], "prepared_rows": a["prepared_rows"],  # one row per call here
                          "hit_rate": a["prepared_rows"] / a["calls"] if a["calls"] else None,
                          "replica_ms_per_call": 1e3 * a["replica_busy_s"] / a["calls"] if a["calls"] else None,
                          "draft_ms_per_pass": 1e3 * a["draft_s"] / passes,
                          "draft_wait_ms_per_pass": 1e3 * a["draft_wait_s"] / passes,
                          "verify_ms_per_pass": 1e3 * a["verify_s"] / passes, "resyncs": a["resyncs"]}
        s.pop("acceptance_per_position", None)
        rows[c] = s
    tps = {c: rows[c]["tokens_per_s"] for c in configs}
    ratios = {"overlapped_vs_remote": tps["overlapped"] / tps["remote"],
              "overlapped_vs_colocated": tps["overlapped"] / tps["colocated"],
              **{f"{c}_vs_off": tps[c] / tps["off"] for c in names}}
    exposed = {c: rows[c]["draft"]["draft_ms_per_pass"] for c in ("overlapped", "remote")}
    ref = [r["token_ids"] for r in records["off"]]
    agree = {c: sum(r["token_ids"] == o for r, o in zip(records[c], ref)) / len(ref) for c in names}
    return {"mode": "overlap-compare", "address": address, "target": info.target, "draft": names["overlapped"],
            "names": names, "gamma": gamma, "max_tokens": max_tokens, "prompts": len(prompts), "rounds": rounds,
            "hardware": hardware(), "niceness": niceness, "cpu_count": os.cpu_count(),
            "loadavg_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
            "results": rows, "ratios": ratios,
            "draft_ms_hidden_per_pass": exposed["remote"] - exposed["overlapped"],
            "goal_overlapped_ge_1.2x_remote": {"ratio": ratios["overlapped_vs_remote"],
                                               "met": ratios["overlapped_vs_remote"] >= 1.2},
            "greedy_agreement_with_off": agree}


def render(report: dict) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    con = Console(record=True, width=170, file=io.StringIO())
    t = Table(title=f"specd bench --overlap-compare ({report['target']}, {report['draft']} γ={report['gamma']}, "
                    f"{report['prompts']} prompts × {report['rounds']} rounds, ≤{report['max_tokens']} new tokens, "
                    "greedy, concurrency 1, interleaved per prompt)")
    for col in ("configuration", "draft", "tokens", "tok/s", "ITL p50", "α", "mean acc. len", "draft calls",
                "hit rate", "replica ms/call", "draft ms/pass", "of it waiting", "verify ms/pass"):
        t.add_column(col, justify="left" if col in ("configuration", "draft") else "right")
    f = lambda v, fmt: "—" if v is None else format(v, fmt)  # noqa: E731
    for c, r in report["results"].items():
        d = r.get("draft", {})
        t.add_row(c, report["names"].get(c, "none"), str(r["tokens"]), f(r["tokens_per_s"], ".1f"),
                  f(r["itl_ms"]["p50"], ".1f"), f(r["acceptance_rate"], ".3f"), f(r["mean_accepted_length"], ".2f"),
                  f(d.get("calls"), "d"), f(d.get("hit_rate"), ".0%"), f(d.get("replica_ms_per_call"), ".1f"),
                  f(d.get("draft_ms_per_pass"), ".1f"), f(d.get("draft_wait_ms_per_pass"), ".1f"),
                  f(d.get("verify_ms_per_pass"), ".1f"))
    con.print(t)
    ra = report["ratios"]
    con.print(f"overlapped / non-overlapped remote: {ra['overlapped_vs_remote']:.2f}× tokens/s "
              f"(goal ≥ 1.2×: {'met' if report['goal_overlapped_ge_1.2x_remote']['met'] else 'MISSED'}); "
              f"overlapped / colocated: {ra['overlapped_vs_colocated']:.2f}×; vs speculation off: "
              + ", ".join(f"{c} {ra[f'{c}_vs_off']:.2f}×" for c in report["names"]))
    con.print(f"draft time per target pass the batcher no longer spends: {report['draft_ms_hidden_per_pass']:.1f} ms "
              "(remote minus overlapped); hit rate = rows answered from a block prepared during the last pass")
    con.print("greedy outputs identical to speculation off: "
              + ", ".join(f"{c} {v:.0%}" for c, v in report["greedy_agreement_with_off"].items())
              + " (bf16: a pass over more tokens may round a near-tie the other way; fp32 is exact, see tests)")
    con.print(f"hardware: {report['hardware']}; benchmark niceness {report['niceness']}, 1-min load "
              f"{report['loadavg_1m']['before']:.1f} before, {report['loadavg_1m']['after']:.1f} after")
    return con.export_text()


def main(args) -> int:
    """`specd bench --serve --overlap-compare [--draft NAME] [--gamma G]` (specd/cli.py)."""
    config_path = args.config or LOCAL_CONFIG
    draft = args.draft[0] if args.draft else OVERLAP_DRAFT
    cfg, names = overlap_config(ClusterConfig.load(config_path), draft)
    if not args.serve:
        raise SystemExit("--overlap-compare starts its own cluster (it needs the three configurations): use --serve")
    address = S.start(cfg)
    print(f"started a local cluster from {config_path} with {', '.join(names.values())} on grpc://{address}",
          flush=True)
    try:
        report = overlap_compare(address, names, args.gamma if args.gamma is not None else 4,
                                 args.max_tokens if args.max_tokens is not None else 48, args.prompts,
                                 args.limit if args.limit is not None else 8, args.rounds or 2,
                                 match_niceness=not args.no_match_niceness)
    finally:
        S.stop()
    text = render(report)
    print(text)
    out = Path(args.json_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    out.with_suffix(".txt").write_text(text)
    print(f"wrote {out}, {out.with_suffix('.txt')}")
    return 0
