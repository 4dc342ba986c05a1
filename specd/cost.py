"""`specd cost`: $/1M tokens, J/token, replicas and latency of serving a load, from a measured bench.

    specd cost out/bench.json --rps 20 --tokens 200 [--accelerators FILE] [--pools H100:L4,...]

What it reads (the kind is recognised from the JSON's keys, `detect_kind`):
  local      `specd bench --local`: results[] rows {batch, config, tokens_per_s, mean_accepted_length}
             and report["hardware"]["name"]. Off = config "engine" (γ=0); on = an "engine+DRAFT"
             config (default: the fastest at each batch; `--spec` names one).
  cluster    `specd bench --address/--serve`: results[] rows {side, concurrency, mode, tokens_per_s,
             ttft_ms, itl_ms, ...} (side "cluster" by default), report["cluster_hardware"].
             Off = mode "off", on = mode "spec" (with the cluster's draft, wherever it was placed).
  gpu-check  `make gpu-check`: report["device_name"], shapes[].speed rows {batch, engine_off_tok_s,
             p{p}_gamma_{auto|4}_tok_s, ...} (first shape unless `--shape`; on = p0.7 γ=auto by
             default: the drafts there are oracles with planted acceptance p).
Each batch (or concurrency) level of the input is one operating point: a replica serving at that
level delivers the measured tokens/s at the measured latency.

The accelerator table (`specd/data/accelerators.yaml`, or `--accelerators FILE`) gives per kind:
price per hour, power draw, and bandwidth and bf16 compute relative to H100. None of it is measured.

Arithmetic (per option, accelerator and level; load = rps x tokens tokens/s):
  replicas     = ceil(load / tokens/s per replica)
  $/1M tokens  = sum over pools(replicas x $/h) / (load x 3600) x 1e6
  J/token      = sum over pools(replicas x W) / load
The provisioned replicas are paid for whole (the ceiling), so a load just above a multiple of one
replica's throughput costs a whole replica more.

Scaling to an accelerator other than the one measured (the "scaled-from-X" rows):
  A decode pass over n tokens (batch x tokens per row: 1 with speculation off, γ+1 on; γ=auto
  counted as 4) reads all weights once and does ~2 x params x n FLOPs, so with bf16 weights its
  arithmetic intensity is about n FLOP/byte. Below `--ridge-tokens` (default 128; H100's roofline
  ridge is 989 TFLOPS / 3.35 TB/s = 295, and passes leave the bandwidth floor earlier in practice)
  the pass is taken as bandwidth-bound and tokens/s scales by rel_bandwidth(dst) / rel_bandwidth(src);
  at or above it, compute-bound, by rel_bf16_compute(dst) / rel_bf16_compute(src). Inter-token
  latency scales by the inverse of the same factor; TTFT (prefill: compute-bound) by the compute
  ratio. A run that was compute-bound where it was measured (a CPU without native bf16) but is
  scaled by bandwidth is only an order-of-magnitude guide: measure on the target kind.

Drafts on a small-accelerator pool (the "modelled-from-X" rows; target on V, drafts on D):
  s = the share of a co-located speculative step spent drafting (`--draft-share`, default 0.2:
  an assumption, none of the bench JSONs records it; about γ=4 draft steps at 6% of a target pass).
  verifier tokens/s = co-located tokens/s on V / (1 - s)   (the verifier only verifies; the draft of
                      one micro-batch overlaps the verification of another, verifier.pipeline)
  draft replicas    = ceil(load x s / (co-located tokens/s on D))   (the draft's work, on D, at the
                      same level as measured: a draft replica batching the sequences of several
                      verifiers together would need fewer)
  ITL               = ITL on V x (1 - s) + ITL on D x s + hop / mean accepted length
                      (a sequence still waits for its own draft: verify, draft and one hop per step;
                      `--hop-ms`, default 1 ms, assumed)
Measured (straight from the input, on its own accelerator), scaled and modelled rows are told
apart in the "basis" column, the JSON and the plot (filled markers: measured only).

Outputs: a table (printed and written as text), a JSON and a PNG of $/1M tokens against latency
(inter-token p50 where the input measured it, else the mean a batch gives: level / tokens/s).
This module does not measure anything, and knows nothing of the engine: only the JSONs.
"""
from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

ACCELERATORS = Path(__file__).parent / "data" / "accelerators.yaml"
AUTO_GAMMA = 4  # γ=auto counts as this many draft tokens per row when choosing the scaling regime

OFF, COLOCATED, POOL = "spec off", "spec co-located", "spec, draft pool"
OPTIONS = (OFF, COLOCATED, POOL)
_REGIME = {"bandwidth": "bw", "compute": "compute"}


# ---------------------------------------------------------------------------------- inputs
@dataclass
class Accelerator:
    key: str
    label: str
    usd_per_hour: float
    power_w: float
    rel_bandwidth: float  # vs H100
    rel_bf16_compute: float  # vs H100
    source: str
    match: list[str] = field(default_factory=list)

    def matches(self, name: str) -> bool:
        return any(re.search(p, name, re.IGNORECASE) for p in self.match)


def load_accelerators(path: str | Path | None = None) -> dict[str, Accelerator]:
    """The accelerator table: key -> Accelerator. Every entry must name its source."""
    import yaml

    path = Path(path or ACCELERATORS)
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path}: expected a mapping of accelerator name -> fields")
    table = {}
    for key, d in data.items():
        missing = [f for f in ("usd_per_hour", "power_w", "rel_bandwidth", "rel_bf16_compute", "source")
                   if f not in (d or {})]
        if missing:
            raise ValueError(f"{path}: accelerator {key!r} lacks {', '.join(missing)}")
        for f in ("usd_per_hour", "power_w", "rel_bandwidth", "rel_bf16_compute"):
            if not float(d[f]) > 0:
                raise ValueError(f"{path}: accelerator {key!r}: {f} must be > 0, got {d[f]!r}")
        table[str(key)] = Accelerator(str(key), d.get("label", str(key)), float(d["usd_per_hour"]),
                                      float(d["power_w"]), float(d["rel_bandwidth"]),
                                      float(d["rel_bf16_compute"]), str(d["source"]).strip(),
                                      [str(m) for m in d.get("match", [])])
    return table


@dataclass
class Point:
    """One measured operating point: one replica of the measured hardware at `level`."""
    level: int  # batch (local, gpu-check) or concurrency (cluster)
    option: str  # OFF or COLOCATED
    config: str  # the input's name for it
    tokens_per_s: float
    itl_ms: float  # inter-token latency of one sequence
    itl_basis: str  # "p50" (measured percentile) or "mean" (derived: level / tokens_per_s)
    ttft_ms: float | None = None  # p50 where measured
    mean_accepted_length: float | None = None
    gamma: int | None = None  # None: auto / unknown

    def tokens_per_pass(self) -> int:
        """Tokens one target pass processes at this point (batch x tokens per row)."""
        per_row = 1 if self.option == OFF else (self.gamma if self.gamma is not None else AUTO_GAMMA) + 1
        return self.level * per_row


@dataclass
class Measured:
    kind: str
    hardware: str
    level_name: str  # "batch" or "concurrency"
    points: list[Point]
    notes: list[str] = field(default_factory=list)


def detect_kind(report: dict) -> str:
    """'local', 'cluster' or 'gpu-check', from the JSON's keys."""
    if not isinstance(report, dict):
        raise ValueError("the input is not a JSON object")  # noqa: TRY004 (the CLI reports ValueErrors)
    if "device_name" in report and isinstance(report.get("shapes"), list):
        return "gpu-check"
    rows = report.get("results")
    if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
        if all({"side", "concurrency", "mode", "tokens_per_s"} <= r.keys() for r in rows):
            return "cluster"
        if all({"batch", "config", "tokens_per_s"} <= r.keys() for r in rows):
            return "local"
    raise ValueError("not a bench JSON this reads: expected `specd bench --local` (results[] with batch, config, "
                     "tokens_per_s), `specd bench --address` (results[] with side, concurrency, mode, tokens_per_s) "
                     f"or `make gpu-check` (device_name, shapes[]); got keys {sorted(report)[:12]}")


def _gamma_of(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _pick(cands: dict[str, float], spec: str | None, what: str) -> str:
    """The speculative config to use among `cands` (name -> tokens/s): `spec`, or the fastest."""
    if spec in (None, "best"):
        return max(cands, key=cands.get)
    for name in (spec, f"engine+{spec}"):
        if name in cands:
            return name
    raise ValueError(f"--spec {spec!r}: {what} has {sorted(cands)}")


def extract(report: dict, spec: str | None = None, shape: str | None = None, side: str = "cluster") -> Measured:
    """The measured operating points of a bench JSON of any of the three kinds."""
    kind = detect_kind(report)
    return {"local": _extract_local, "cluster": _extract_cluster, "gpu-check": _extract_gpu_check}[kind](
        report, spec=spec, shape=shape, side=side)


def _hw_name(hw) -> str:
    if isinstance(hw, dict):
        return str(hw.get("name") or "")
    return str(hw or "")


def _extract_local(report: dict, spec, **_) -> Measured:
    by_batch: dict[int, dict[str, dict]] = {}
    for r in report["results"]:
        by_batch.setdefault(int(r["batch"]), {})[r["config"]] = r
    points, notes = [], []
    for b, rows in sorted(by_batch.items()):
        off = rows.get("engine")
        cands = {n: r["tokens_per_s"] for n, r in rows.items() if n.startswith("engine+") and r["tokens_per_s"] > 0}
        if off and off["tokens_per_s"] > 0:
            points.append(Point(b, OFF, "engine (γ=0)", off["tokens_per_s"], b / off["tokens_per_s"] * 1e3, "mean"))
        if cands:
            name = _pick(cands, spec, f"batch {b}")
            r = rows[name]
            points.append(Point(b, COLOCATED, name, r["tokens_per_s"], b / r["tokens_per_s"] * 1e3, "mean",
                                mean_accepted_length=r.get("mean_accepted_length"),
                                gamma=None if "auto" in name else _gamma_of(report.get("gamma"))))
    notes.append("latency: the local bench records no percentiles; ITL is the mean a batch gives "
                  "(batch / tokens/s, prefill included)")
    return Measured("local", _hw_name(report.get("hardware")), "batch", points, notes)


def _extract_cluster(report: dict, spec, side="cluster", **_) -> Measured:
    rows = [r for r in report["results"] if r["side"] == side]
    if not rows:
        sides = sorted({r["side"] for r in report["results"]})
        raise ValueError(f"--side {side!r}: the cluster bench has sides {sides}")
    points = []
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["mode"] != "off")):
        if r["mode"] not in ("off", "spec") or not r["tokens_per_s"] > 0:
            continue
        c = int(r["concurrency"])
        p50 = (r.get("itl_ms") or {}).get("p50")
        itl, basis = (p50, "p50") if p50 is not None else (c / r["tokens_per_s"] * 1e3, "mean")
        opt = OFF if r["mode"] == "off" else COLOCATED
        points.append(Point(c, opt, f"{side} {r['mode']} ({r.get('draft', '')})", r["tokens_per_s"], itl, basis,
                            ttft_ms=(r.get("ttft_ms") or {}).get("p50"),
                            mean_accepted_length=r.get("mean_accepted_length") if opt == COLOCATED else None,
                            gamma=_gamma_of(report.get("gamma")) if opt == COLOCATED else None))
    hw = report.get("cluster_hardware") or _hw_name(report.get("hardware"))
    notes = [(f"cluster bench: one 'replica' is the whole measured cluster ({side} side); spec = draft "
              f"{report.get('draft')!r} as deployed (if it ran on a remote draft replica, its hop is in the figure)")]
    return Measured("cluster", _hw_name(hw), "concurrency", points, notes)


def _extract_gpu_check(report: dict, spec, shape=None, **_) -> Measured:
    shapes = {s["shape"]: s for s in report["shapes"]}
    if not shapes:
        raise ValueError("the gpu-check JSON has no shapes")
    if shape is None:
        shape = next(iter(shapes))
    if shape not in shapes:
        raise ValueError(f"--shape {shape!r}: the gpu-check JSON has {sorted(shapes)}")
    points = []
    for row in shapes[shape]["speed"]:
        b = int(row["batch"])
        if row.get("engine_off_tok_s", 0) > 0:
            tps = row["engine_off_tok_s"]
            points.append(Point(b, OFF, "engine off", tps, b / tps * 1e3, "mean"))
        cands = {k[:-len("_tok_s")]: v for k, v in row.items()
                 if re.fullmatch(r"p[\d.]+_gamma_\w+_tok_s", k) and v > 0}
        if cands:
            name = _pick(cands, spec if spec is not None else ("p0.7_gamma_auto" if "p0.7_gamma_auto" in cands
                                                              else "best"), f"gpu-check batch {b}")
            g = name.rsplit("_gamma_", 1)[1]
            points.append(Point(b, COLOCATED, f"oracle {name}", cands[name], b / cands[name] * 1e3, "mean",
                                mean_accepted_length=row.get(f"{name}_mean_accepted_length"), gamma=_gamma_of(g)))
    notes = [f"gpu-check shape {shape} (random weights; drafts are oracles with planted acceptance p)",
             "latency: gpu-check records no percentiles; ITL is the mean a batch gives (batch / tokens/s)"]
    return Measured("gpu-check", str(report["device_name"]), "batch", points, notes)


def match_accelerator(hardware: str, table: dict[str, Accelerator]) -> str:
    """The table key whose `match` patterns recognise `hardware`."""
    hits = [k for k, a in table.items() if a.matches(hardware)]
    if len(hits) != 1:
        raise ValueError(f"the input ran on {hardware!r}, which " + (
            f"matches several accelerators {hits}" if hits else "matches no accelerator in the table")
            + "; name it with --measured-on KEY")
    return hits[0]


# ---------------------------------------------------------------------------------- arithmetic
def replicas_needed(load_tps: float, per_replica_tps: float) -> int:
    """ceil(load / per replica): replicas are provisioned whole."""
    if not per_replica_tps > 0:
        raise ValueError(f"per-replica tokens/s must be > 0, got {per_replica_tps}")
    return math.ceil(round(load_tps / per_replica_tps, 9))  # round: 300/60*... float dust is not a replica


def usd_per_million_tokens(usd_per_hour: float, load_tps: float) -> float:
    """$/1M tokens of provisioned capacity costing `usd_per_hour` that serves `load_tps` tokens/s."""
    return usd_per_hour / (load_tps * 3600) * 1e6


def joules_per_token(watts: float, load_tps: float) -> float:
    return watts / load_tps


def speed_ratio(src: Accelerator, dst: Accelerator, tokens_per_pass: int, ridge_tokens: float) -> tuple[float, str]:
    """How much faster `dst` runs a pass over `tokens_per_pass` tokens than `src` (the rule in the
    module docstring): the bandwidth ratio below the ridge, the bf16 compute ratio at or above it."""
    if tokens_per_pass < ridge_tokens:
        return dst.rel_bandwidth / src.rel_bandwidth, "bandwidth"
    return dst.rel_bf16_compute / src.rel_bf16_compute, "compute"


@dataclass
class Load:
    rps: float
    tokens: float  # mean tokens per request

    @property
    def tokens_per_s(self) -> float:
        return self.rps * self.tokens


def _request_ms(ttft_ms: float | None, itl_ms: float, tokens: float) -> float:
    """Latency of one request of `tokens` tokens: TTFT + (tokens - 1) x ITL where TTFT was
    measured, else tokens x ITL (prefill not counted beyond one inter-token gap)."""
    return ttft_ms + (tokens - 1) * itl_ms if ttft_ms is not None else tokens * itl_ms


def _row(point: Point, option: str, accel: str, target: Accelerator, draft: Accelerator | None, basis: str,
         scaling: str, tps: float, n_target: int, n_draft: int, itl: float, ttft: float | None,
         load: Load) -> dict:
    usd_h = n_target * target.usd_per_hour + (n_draft * draft.usd_per_hour if draft else 0.0)
    watts = n_target * target.power_w + (n_draft * draft.power_w if draft else 0.0)
    return {"level": point.level, "option": option, "accelerator": accel, "target_accel": target.key,
            "draft_accel": draft.key if draft else None, "config": point.config, "basis": basis,
            "measured": basis == "measured", "scaling": scaling, "tokens_per_s_per_replica": tps,
            "replicas": {"target": n_target, "draft": n_draft}, "replicas_total": n_target + n_draft,
            "usd_per_hour": usd_h, "usd_per_1m_tokens": usd_per_million_tokens(usd_h, load.tokens_per_s),
            "joules_per_token": joules_per_token(watts, load.tokens_per_s), "itl_ms": itl,
            "itl_basis": point.itl_basis if basis == "measured" else f"{point.itl_basis}, {basis}",
            "ttft_ms": ttft, "request_ms": _request_ms(ttft, itl, load.tokens),
            "mean_accepted_length": point.mean_accepted_length}


def cost_rows(measured: Measured, table: dict[str, Accelerator], measured_on: str, load: Load,
              accels: list[str] | None = None, pools: list[tuple[str, str]] | None = None,
              draft_share: float = 0.2, hop_ms: float = 1.0, ridge_tokens: float = 128) -> list[dict]:
    """Every option x accelerator (or pool pair) x measured level, as table rows (see the module
    docstring for the arithmetic and the scaling rule)."""
    if not load.tokens_per_s > 0:
        raise ValueError(f"the load must be > 0 tokens/s (--rps {load.rps} x --tokens {load.tokens})")
    if not 0 <= draft_share < 1:
        raise ValueError(f"--draft-share must be in [0, 1), got {draft_share}")
    src = table[measured_on]
    accels = list(table) if accels is None else accels
    pools = default_pools(table) if pools is None else pools
    for k in list(accels) + [k for pair in pools for k in pair]:
        if k not in table:
            raise ValueError(f"accelerator {k!r} is not in the table ({', '.join(table)})")
    rows = []
    for p in measured.points:
        for key in accels:
            dst = table[key]
            if key == measured_on:
                f, basis, scaling, fc = 1.0, "measured", "", 1.0
            else:
                f, regime = speed_ratio(src, dst, p.tokens_per_pass(), ridge_tokens)
                fc = dst.rel_bf16_compute / src.rel_bf16_compute
                basis, scaling = f"scaled-from-{measured_on}", f"{_REGIME[regime]} x{f:.3g}"
            tps = p.tokens_per_s * f
            rows.append(_row(p, p.option, key, dst, None, basis, scaling, tps, replicas_needed(load.tokens_per_s, tps),
                             0, p.itl_ms / f, None if p.ttft_ms is None else p.ttft_ms / fc, load))
        if p.option != COLOCATED:
            continue
        for v_key, d_key in pools:
            v, d = table[v_key], table[d_key]
            fv, rv = speed_ratio(src, v, p.tokens_per_pass(), ridge_tokens)
            fd, rd = speed_ratio(src, d, p.level, ridge_tokens)  # the draft: one token per row per step
            tps_v = p.tokens_per_s * fv / (1 - draft_share)
            n_v = replicas_needed(load.tokens_per_s, tps_v)
            n_d = replicas_needed(load.tokens_per_s, p.tokens_per_s * fd / draft_share) if draft_share > 0 else 0
            itl = p.itl_ms / fv * (1 - draft_share) + p.itl_ms / fd * draft_share + hop_ms / (
                p.mean_accepted_length or 1.0)
            fc = v.rel_bf16_compute / src.rel_bf16_compute
            rows.append(_row(p, POOL, f"{v_key}+{d_key}", v, d, f"modelled-from-{measured_on}",
                             f"V {_REGIME[rv]} x{fv:.3g}, D {_REGIME[rd]} x{fd:.3g}", tps_v,
                             n_v, n_d, itl, None if p.ttft_ms is None else p.ttft_ms / fc, load))
    return rows


def default_pools(table: dict[str, Accelerator], draft: str = "L4") -> list[tuple[str, str]]:
    """(verifier, draft) pairs: every kind with more bandwidth than `draft`, drafting on `draft`."""
    if draft not in table:
        return []
    return [(k, draft) for k, a in table.items() if a.rel_bandwidth > table[draft].rel_bandwidth]


def analyse(report: dict, table: dict[str, Accelerator], load: Load, measured_on: str | None = None,
            spec: str | None = None, shape: str | None = None, side: str = "cluster",
            accels: list[str] | None = None, pools: list[tuple[str, str]] | None = None,
            levels: list[int] | None = None, draft_share: float = 0.2, hop_ms: float = 1.0,
            ridge_tokens: float = 128, source: str = "") -> dict:
    """The whole result (what the JSON holds) from a parsed bench JSON."""
    m = extract(report, spec=spec, shape=shape, side=side)
    if levels:
        m.points = [p for p in m.points if p.level in levels]
    if not m.points:
        raise ValueError("no usable operating points in the input" + (f" at {m.level_name} {levels}" if levels else ""))
    measured_on = measured_on or match_accelerator(m.hardware, table)
    if measured_on not in table:
        raise ValueError(f"--measured-on {measured_on!r} is not in the table ({', '.join(table)})")
    rows = cost_rows(m, table, measured_on, load, accels, pools, draft_share, hop_ms, ridge_tokens)
    notes = list(m.notes)
    if any(p.option == COLOCATED and p.config.split("+", 1)[-1].startswith("ngram") for p in m.points):
        notes.append("an n-gram draft is nearly free and runs in the verifier: the draft-pool rows model a model draft")
    notes.append("prices, power and relative speeds come from the accelerator table, whose entries are "
                 "datasheet peaks and estimated prices (see each source); power is taken at its listed draw")
    return {"input": {"path": source, "kind": m.kind, "hardware": m.hardware, "measured_on": measured_on,
                      "level": m.level_name, "dtype": report.get("dtype")},
            "load": {"rps": load.rps, "tokens_per_request": load.tokens, "tokens_per_s": load.tokens_per_s},
            "assumptions": {"draft_share": draft_share, "hop_ms": hop_ms, "ridge_tokens": ridge_tokens,
                            "auto_gamma_as": AUTO_GAMMA,
                            "scaling": "tokens/s x rel_bandwidth ratio when batch x tokens per row < ridge_tokens, "
                                       "else x rel_bf16_compute ratio; ITL / the same factor; TTFT / the compute ratio",
                            "draft_pool": "verifier tokens/s = co-located / (1 - s); draft replicas = ceil(load x s / "
                                          "co-located tokens/s on the draft kind); ITL = ITL_V (1 - s) + ITL_D s + hop "
                                          "/ mean accepted length"},
            "points": [asdict(p) for p in m.points],
            "accelerators": {k: asdict(a) for k, a in table.items()},
            "rows": rows, "notes": notes}


# ---------------------------------------------------------------------------------- presentation
def _fmt(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "—"
    if v == 0:
        return "0"
    return f"{v:.{digits}g}" if abs(v) < 10 ** digits else f"{v:,.0f}"


def render(result: dict) -> str:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    inp, load = result["input"], result["load"]
    import io

    con = Console(record=True, width=220, file=io.StringIO())
    t = Table(title=f"specd cost — {inp['kind']} bench measured on {inp['hardware']!r} (= {inp['measured_on']}); "
                    f"load {load['rps']:g} req/s x {load['tokens_per_request']:g} tokens "
                    f"= {load['tokens_per_s']:g} tok/s")
    itl_is = {"p50"} == {r["itl_basis"].split(",")[0] for r in result["rows"]}
    cols = ((inp["level"], "right"), ("option", "left"), ("accelerator", "left"), ("config", "left"),
            ("basis", "left"), ("tok/s/replica", "right"), ("replicas t+d", "right"), ("$/h", "right"),
            ("$/1M tok", "right"), ("J/tok", "right"), ("ITL ms " + ("p50" if itl_is else "mean"), "right"),
            (f"request ms ({load['tokens_per_request']:g} tok)", "right"), ("scaling", "left"))
    for col, justify in cols:
        t.add_column(col, justify=justify, no_wrap=True)
    order = {o: i for i, o in enumerate(OPTIONS)}
    rows = sorted(result["rows"], key=lambda r: (r["level"], order[r["option"]], not r["measured"],
                                                r["usd_per_1m_tokens"]))
    last = None
    for r in rows:
        if last is not None and r["level"] != last:
            t.add_section()
        last = r["level"]
        rep = r["replicas"]
        t.add_row(str(r["level"]), r["option"], escape(r["accelerator"]), escape(r["config"]),
                  r["basis"] if r["measured"] else f"[dim]{escape(r['basis'])}[/dim]",
                  _fmt(r["tokens_per_s_per_replica"]), f"{rep['target']}+{rep['draft']}", _fmt(r["usd_per_hour"]),
                  _fmt(r["usd_per_1m_tokens"]), _fmt(r["joules_per_token"]), _fmt(r["itl_ms"]),
                  _fmt(r["request_ms"]), escape(r["scaling"]))
    con.print(t)
    a = result["assumptions"]
    con.print(f"scaling: {a['scaling']} (ridge {a['ridge_tokens']:g} tokens per pass; γ=auto counted as "
              f"{a['auto_gamma_as']})")
    con.print(f"draft pool (assumed s = {a['draft_share']:g}, hop {a['hop_ms']:g} ms): {a['draft_pool']}")
    for n in result["notes"]:
        con.print(f"note: {n}")
    return con.export_text()


def plot(result: dict, path: str | Path) -> None:
    """$/1M tokens against inter-token latency: one line per option and accelerator through its
    levels; filled markers are measured, hollow ones scaled or modelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = {OFF: "o", COLOCATED: "s", POOL: "^"}
    styles = {OFF: ":", COLOCATED: "-", POOL: "--"}
    accels = sorted({r["accelerator"] for r in result["rows"]})
    colour = {a: plt.get_cmap("tab10")(i % 10) for i, a in enumerate(accels)}
    fig, ax = plt.subplots(figsize=(11, 6.5))
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in result["rows"]:
        groups.setdefault((r["option"], r["accelerator"]), []).append(r)
    for (opt, acc), rs in sorted(groups.items()):
        rs.sort(key=lambda r: r["level"])
        xs, ys = [r["itl_ms"] for r in rs], [r["usd_per_1m_tokens"] for r in rs]
        ax.plot(xs, ys, styles[opt], color=colour[acc], alpha=0.5, linewidth=1)
        for r, x, y in zip(rs, xs, ys):
            ax.scatter([x], [y], marker=markers[opt], s=50, edgecolors=[colour[acc]],
                       facecolors=[colour[acc]] if r["measured"] else "none", linewidths=1.5, zorder=3)
            ax.annotate(str(r["level"]), (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7,
                        color=colour[acc])
    ax.set_xscale("log")
    ax.set_yscale("log")
    inp, load = result["input"], result["load"]
    ax.set_xlabel("inter-token latency, ms (p50 where measured, else mean = level / tokens/s)")
    ax.set_ylabel("$ per 1M tokens (provisioned replicas, whole)")
    ax.set_title(f"specd cost: {inp['kind']} bench on {inp['measured_on']}, load {load['tokens_per_s']:g} tok/s "
                 f"(labels: {inp['level']})", fontsize=10)
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color="k", marker=markers[o], linestyle=styles[o], label=o) for o in OPTIONS
               if any(r["option"] == o for r in result["rows"])]
    handles += [Line2D([], [], color=colour[a], marker="o", linestyle="", label=a) for a in accels]
    handles += [Line2D([], [], color="k", marker="o", linestyle="", label="measured"),
                Line2D([], [], color="k", marker="o", markerfacecolor="none", linestyle="",
                       label="scaled / modelled")]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------- command line
def _csv(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def _pools(value: str) -> list[tuple[str, str]]:
    out = []
    for item in _csv(value):
        v, sep, d = item.partition(":")
        if not sep or not v or not d:
            raise argparse.ArgumentTypeError(f"a pool is VERIFIER:DRAFT (e.g. H100:L4), got {item!r}")
        out.append((v, d))
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("cost", help="$/1M tokens, J/token, replicas and latency for a load, from a bench JSON",
                       description=__doc__.split("\n\n")[0])
    p.set_defaults(func=run)
    p.add_argument("input", help="a `specd bench --local`, `specd bench --address/--serve` or `make gpu-check` JSON")
    p.add_argument("--rps", type=float, default=10.0, help="target load: requests per second (default %(default)s)")
    p.add_argument("--tokens", type=float, default=200.0,
                   help="target load: mean generated tokens per request (default %(default)s)")
    p.add_argument("--accelerators", default=None, help=f"accelerator table YAML (default {ACCELERATORS})")
    p.add_argument("--measured-on", default=None,
                   help="table key of the hardware the input ran on (default: matched from its hardware name)")
    p.add_argument("--accels", type=_csv, default=None, help="comma list of table keys to cost (default: all)")
    p.add_argument("--pools", type=_pools, default=None,
                   help="VERIFIER:DRAFT pairs for drafts on a small-accelerator pool (default: every kind with more "
                        "bandwidth than L4, drafting on L4)")
    p.add_argument("--levels", type=lambda v: [int(x) for x in _csv(v)], default=None,
                   help="only these batch sizes / concurrencies of the input (default: all)")
    p.add_argument("--spec", default=None,
                   help="speculative config: local: an engine+DRAFT config (default: the fastest per batch); "
                        "gpu-check: e.g. p0.9_gamma_4 (default p0.7_gamma_auto)")
    p.add_argument("--shape", default=None, help="gpu-check: which model shape (default: the first)")
    p.add_argument("--side", default="cluster",
                   help="cluster bench: which side's rows: cluster (default) or in-process")
    p.add_argument("--draft-share", type=float, default=0.2,
                   help="assumed share of a co-located speculative step spent drafting "
                        "(draft-pool model; default %(default)s)")
    p.add_argument("--hop-ms", type=float, default=1.0,
                   help="assumed verifier<->draft-pool hop per step, ms (default %(default)s)")
    p.add_argument("--ridge-tokens", type=float, default=128,
                   help="tokens per pass at which scaling switches from the bandwidth to the compute ratio "
                        "(default %(default)s)")
    p.add_argument("--json", dest="json_path", default="out/cost.json",
                   help="write the JSON here (default %(default)s)")
    p.add_argument("--text", default="out/cost.txt", help="write the table here (default %(default)s)")
    p.add_argument("--plot", default="out/cost.png", help="write the PNG here (default %(default)s)")


def run(args) -> int:
    path = Path(args.input)
    report = json.loads(path.read_text())
    table = load_accelerators(args.accelerators)
    result = analyse(report, table, Load(args.rps, args.tokens), measured_on=args.measured_on, spec=args.spec,
                     shape=args.shape, side=args.side, accels=args.accels, pools=args.pools, levels=args.levels,
                     draft_share=args.draft_share, hop_ms=args.hop_ms, ridge_tokens=args.ridge_tokens,
                     source=str(path))
    text = render(result)
    print(text, end="")
    for out in (args.json_path, args.text, args.plot):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    Path(args.text).write_text(text)
    plot(result, args.plot)
    print(f"wrote {args.json_path}, {args.text}, {args.plot}")
    return 0
