"""`specd cost` on fixed, hand-made bench JSONs: the arithmetic exactly, measured rows apart from
scaled and modelled ones, the three input kinds recognised, and the files written.

The fixtures are shaped like real bench JSONs (specd/bench/local.py `run_local`, specd/bench/cluster.py
`run`, specd/gpu_check.py) but small, and use their own accelerator table, so editing the shipped
table changes no expected number here. The load 4 req/s x 73 tokens = 292 tok/s is chosen so that
replicas needed are not whole (292 / 40 = 7.3): a missing ceiling, a floor or a round all fail.
"""
from __future__ import annotations

import argparse
import json
import math

import pytest

from specd import cost as C

TABLE_YAML = """
cpu:
  label: test cpu
  match: ['AMD EPYC']
  usd_per_hour: 0.10
  power_w: 10
  rel_bandwidth: 0.01
  rel_bf16_compute: 0.001
  source: test fixture
BIG:
  match: ['BIGGPU']
  usd_per_hour: 2.0
  power_w: 500
  rel_bandwidth: 1.0
  rel_bf16_compute: 1.0
  source: test fixture
SMALL:
  match: ['SMALLGPU']
  usd_per_hour: 0.5
  power_w: 70
  rel_bandwidth: 0.1
  rel_bf16_compute: 0.2
  source: test fixture
"""


def _local_row(batch, config, tps, mal=None):
    return {"batch": batch, "config": config, "tokens": 640, "seconds": 640 / tps, "tokens_per_s": tps,
            "acceptance_rate": None if mal is None else 0.3, "mean_accepted_length": mal,
            "acceptance_per_position": [], "agreement_with_hf": 1.0, "exact_match_with_hf": 1.0,
            "speedup_vs_hf": None, "speedup_vs_engine_gamma0": None}


LOCAL = {"model": "smollm2", "dtype": "bf16", "dtype_reason": "fixture", "gamma": 4, "max_tokens": 64, "prompts": 4,
         "threads": 2, "hardware": {"device": "cpu", "name": "AMD EPYC", "flags": ["avx2", "fma"], "cores": 2},
         "results": [_local_row(1, "hf", 30.0), _local_row(1, "engine", 40.0),
                     _local_row(1, "engine+ngram", 45.0, 1.5), _local_row(1, "engine+truncated:4", 50.0, 2.0),
                     _local_row(1, "engine+truncated:4 γ=auto", 48.0, 1.8),
                     _local_row(8, "hf", 150.0), _local_row(8, "engine", 160.0),
                     _local_row(8, "engine+ngram", 200.0, 1.6), _local_row(8, "engine+truncated:4", 190.0, 1.9)],
         "verify_cost": {}, "decode_step_profile": {}, "bandwidth": {}}


def _cluster_row(side, c, mode, tps, itl_p50, ttft_p50, mal=None):
    return {"side": side, "concurrency": c, "mode": mode, "draft": "none" if mode == "off" else "eagle",
            "requests": 16, "tokens": 1024, "seconds": 1024 / tps, "tokens_per_s": tps,
            "ttft_ms": {"mean": ttft_p50, "p50": ttft_p50, "p99": ttft_p50 and ttft_p50 * 2},
            "itl_ms": {"p50": itl_p50, "p99": itl_p50 and itl_p50 * 2}, "chunk_gap_ms": {"p50": None, "p99": None},
            "acceptance_rate": None, "mean_accepted_length": mal, "acceptance_per_position": [], "coalesced": 0}


CLUSTER = {"address": "127.0.0.1:9000", "target": "smollm2", "dtype": "bf16", "dtype_reason": "",
           "hardware": {"device": "cpu", "name": "AMD EPYC"},
           "cluster_hardware": "AMD EPYC (avx2, fma), 2 cores, 1 thread, torch 2.13.0", "draft": "eagle",
           "draft_spec": "default", "gamma": "auto", "max_tokens": 64, "prompts": 16, "concurrency": [1, 4],
           "results": [_cluster_row("cluster", 1, "spec", 20.0, 45.0, 120.0, 1.6),
                       _cluster_row("cluster", 1, "off", 18.0, 55.0, 110.0),
                       _cluster_row("cluster", 4, "spec", 50.0, 70.0, 300.0, 1.5),
                       _cluster_row("cluster", 4, "off", 48.0, 80.0, 290.0),
                       _cluster_row("in-process", 1, "spec", 22.0, 40.0, 100.0, 1.6),
                       _cluster_row("hf", 1, "off", 19.0, None, None)],
           "ratios": {}, "goals": {}}

GPU = {"device": "cuda", "device_name": "NVIDIA H200", "torch": "2.13.0", "hardware": {"name": "NVIDIA H200"},
       "sizes": {}, "wall_s": 100.0,
       "shapes": [{"shape": "smollm2-135m", "greedy_equal_hf": {}, "pass_ms": {"1x1": 2.0}, "floor_ms": 0.1,
                   "speed": [{"batch": 1, "hf_tok_s": 100.0, "engine_off_tok_s": 150.0,
                              "p0.7_gamma_auto_tok_s": 250.0, "p0.7_gamma_auto_mean_accepted_length": 2.5,
                              "p0.7_gamma_4_tok_s": 260.0, "p0.7_gamma_4_mean_accepted_length": 2.6},
                             {"batch": 16, "hf_tok_s": 1500.0, "engine_off_tok_s": 2000.0,
                              "p0.7_gamma_auto_tok_s": 2400.0, "p0.7_gamma_auto_mean_accepted_length": 2.2,
                              "p0.7_gamma_4_tok_s": 2300.0, "p0.7_gamma_4_mean_accepted_length": 2.6}]}]}

LOAD = C.Load(rps=4, tokens=73)  # 292 tok/s


@pytest.fixture()
def table(tmp_path):
    p = tmp_path / "acc.yaml"
    p.write_text(TABLE_YAML)
    return C.load_accelerators(p)


def _find(rows, level, option, accel):
    hits = [r for r in rows if r["level"] == level and r["option"] == option and r["accelerator"] == accel]
    assert len(hits) == 1, (level, option, accel, hits)
    return hits[0]


def test_detects_each_kind():
    assert C.detect_kind(LOCAL) == "local"
    assert C.detect_kind(CLUSTER) == "cluster"
    assert C.detect_kind(GPU) == "gpu-check"
    with pytest.raises(ValueError, match="not a bench JSON"):
        C.detect_kind({"long_prompt_tokens": 1500, "by_chunk": {}})  # out/bench_hol.json: another report


def test_extracts_operating_points():
    m = C.extract(LOCAL)
    assert (m.kind, m.hardware, m.level_name) == ("local", "AMD EPYC", "batch")
    got = {(p.level, p.option): (p.config, p.tokens_per_s) for p in m.points}
    assert got == {(1, C.OFF): ("engine (γ=0)", 40.0), (1, C.COLOCATED): ("engine+truncated:4", 50.0),
                   (8, C.OFF): ("engine (γ=0)", 160.0), (8, C.COLOCATED): ("engine+ngram", 200.0)}
    assert [p.config for p in C.extract(LOCAL, spec="ngram").points if p.option == C.COLOCATED] == \
        ["engine+ngram", "engine+ngram"]
    m = C.extract(CLUSTER)
    assert m.hardware.startswith("AMD EPYC") and m.level_name == "concurrency"
    assert sorted((p.level, p.option, p.tokens_per_s) for p in m.points) == \
        [(1, C.COLOCATED, 20.0), (1, C.OFF, 18.0), (4, C.COLOCATED, 50.0), (4, C.OFF, 48.0)]  # cluster side only
    m = C.extract(GPU)
    assert m.hardware == "NVIDIA H200"
    spec = [p for p in m.points if p.option == C.COLOCATED]
    # the default is the middling oracle acceptance with γ auto, not the fastest config
    assert [(p.config, p.tokens_per_s, p.gamma) for p in spec] == [("oracle p0.7_gamma_auto", 250.0, None),
                                                                   ("oracle p0.7_gamma_auto", 2400.0, None)]


def test_arithmetic_measured_local(table):
    res = C.analyse(LOCAL, table, LOAD, draft_share=0.25, hop_ms=1.0, pools=[("BIG", "SMALL")])
    assert res["input"]["measured_on"] == "cpu" and res["load"]["tokens_per_s"] == 292
    r = _find(res["rows"], 1, C.OFF, "cpu")
    assert r["basis"] == "measured" and r["measured"]
    assert r["replicas"] == {"target": 8, "draft": 0}  # ceil(292 / 40) = ceil(7.3)
    assert r["usd_per_hour"] == pytest.approx(8 * 0.10)
    assert r["usd_per_1m_tokens"] == pytest.approx(8 * 0.10 / (292 * 3600) * 1e6)
    assert r["joules_per_token"] == pytest.approx(8 * 10 / 292)
    assert r["itl_ms"] == pytest.approx(1 / 40 * 1e3) and r["itl_basis"] == "mean"
    assert r["request_ms"] == pytest.approx(73 * 25.0)  # no TTFT measured: tokens x ITL
    r = _find(res["rows"], 1, C.COLOCATED, "cpu")
    assert r["config"] == "engine+truncated:4" and r["replicas"]["target"] == 6  # ceil(5.84)
    assert r["usd_per_1m_tokens"] == pytest.approx(6 * 0.10 / (292 * 3600) * 1e6)
    r = _find(res["rows"], 8, C.OFF, "cpu")
    assert r["replicas"]["target"] == 2  # ceil(1.825)
    assert r["itl_ms"] == pytest.approx(8 / 160 * 1e3)


def test_scaling_rule(table):
    # batch 1: a pass over 1 (off) or 5 (γ=4) tokens is below the ridge: the bandwidth ratio, 1.0 / 0.01
    res = C.analyse(LOCAL, table, LOAD, pools=[])
    r = _find(res["rows"], 1, C.OFF, "BIG")
    assert r["basis"] == "scaled-from-cpu" and not r["measured"] and r["scaling"].startswith("bw")
    assert r["tokens_per_s_per_replica"] == pytest.approx(40 * 100)
    assert r["replicas"]["target"] == 1
    assert r["usd_per_1m_tokens"] == pytest.approx(2.0 / (292 * 3600) * 1e6)
    assert r["joules_per_token"] == pytest.approx(500 / 292)
    assert r["itl_ms"] == pytest.approx(25.0 / 100)
    r = _find(res["rows"], 1, C.COLOCATED, "SMALL")
    assert r["tokens_per_s_per_replica"] == pytest.approx(50 * 10)
    # batch 8 with γ=4: 8 x 5 = 40 tokens per pass. Ridge 128: bandwidth; ridge 32: compute (1.0 / 0.001)
    r = _find(res["rows"], 8, C.COLOCATED, "BIG")
    assert r["tokens_per_s_per_replica"] == pytest.approx(200 * 100)
    res = C.analyse(LOCAL, table, LOAD, pools=[], ridge_tokens=32)
    r = _find(res["rows"], 8, C.COLOCATED, "BIG")
    assert r["scaling"].startswith("compute") and r["tokens_per_s_per_replica"] == pytest.approx(200 * 1000)
    r = _find(res["rows"], 8, C.OFF, "BIG")  # 8 tokens per pass: still below 32
    assert r["scaling"].startswith("bw") and r["tokens_per_s_per_replica"] == pytest.approx(160 * 100)
    # γ=auto counts as 4: 8 x 5 = 40 >= 32 as well
    assert C.Point(8, C.COLOCATED, "x", 1.0, 1.0, "mean", gamma=None).tokens_per_pass() == 40
    assert C.speed_ratio(table["BIG"], table["SMALL"], 1, 128) == (pytest.approx(0.1), "bandwidth")
    assert C.speed_ratio(table["BIG"], table["SMALL"], 128, 128) == (pytest.approx(0.2), "compute")


def test_draft_pool_model(table):
    load = C.Load(rps=100, tokens=73)  # 7300 tok/s
    res = C.analyse(LOCAL, table, load, draft_share=0.25, hop_ms=1.0, pools=[("BIG", "SMALL")], levels=[1])
    r = _find(res["rows"], 1, C.POOL, "BIG+SMALL")
    # co-located on cpu 50 tok/s, L = 2.0, ITL 20 ms; BIG is x100 (bandwidth), SMALL x10
    assert r["tokens_per_s_per_replica"] == pytest.approx(50 * 100 / 0.75)
    assert r["replicas"] == {"target": 2, "draft": 4}  # ceil(7300 / 6666.7); ceil(7300 x 0.25 / (50 x 10))
    assert r["usd_per_hour"] == pytest.approx(2 * 2.0 + 4 * 0.5)
    assert r["usd_per_1m_tokens"] == pytest.approx((2 * 2.0 + 4 * 0.5) / (7300 * 3600) * 1e6)
    assert r["joules_per_token"] == pytest.approx((2 * 500 + 4 * 70) / 7300)
    assert r["itl_ms"] == pytest.approx(20 / 100 * 0.75 + 20 / 10 * 0.25 + 1.0 / 2.0)
    assert r["basis"] == "modelled-from-cpu" and not r["measured"]
    # no pool row for speculation off; none when the draft share is 0 costs a draft replica
    assert not [x for x in res["rows"] if x["option"] == C.POOL and x["config"].startswith("engine (")]
    res = C.analyse(LOCAL, table, load, draft_share=0.0, pools=[("BIG", "SMALL")], levels=[1])
    assert _find(res["rows"], 1, C.POOL, "BIG+SMALL")["replicas"]["draft"] == 0


def test_measured_and_scaled_rows_apart(table):
    res = C.analyse(LOCAL, table, LOAD, pools=[("BIG", "SMALL")])
    assert len(res["rows"]) == 2 * 2 * 3 + 2  # levels x (off, co-located) x accelerators + one pool row per level
    for r in res["rows"]:
        on_measured = r["accelerator"] == "cpu" and r["option"] != C.POOL
        assert r["measured"] is on_measured
        assert r["basis"] == ("measured" if on_measured else
                              "modelled-from-cpu" if r["option"] == C.POOL else "scaled-from-cpu")
    # told where it ran: now BIG holds the measured figures and cpu the scaled ones
    res = C.analyse(LOCAL, table, LOAD, measured_on="BIG", pools=[])
    r = _find(res["rows"], 1, C.OFF, "BIG")
    assert r["measured"] and r["tokens_per_s_per_replica"] == 40.0
    assert _find(res["rows"], 1, C.OFF, "cpu")["basis"] == "scaled-from-BIG"


def test_cluster_latency_is_measured_p50(table):
    res = C.analyse(CLUSTER, table, LOAD, pools=[])
    r = _find(res["rows"], 1, C.OFF, "cpu")
    assert r["measured"] and r["itl_ms"] == 55.0 and r["itl_basis"] == "p50" and r["ttft_ms"] == 110.0
    assert r["replicas"]["target"] == math.ceil(292 / 18)  # 17
    r = _find(res["rows"], 1, C.COLOCATED, "cpu")
    assert r["request_ms"] == pytest.approx(120.0 + 72 * 45.0)  # TTFT + (tokens - 1) x ITL
    r = _find(res["rows"], 1, C.OFF, "BIG")
    assert r["itl_ms"] == pytest.approx(55.0 / 100) and r["ttft_ms"] == pytest.approx(110.0 / 1000)
    assert r["itl_basis"] == "p50, scaled-from-cpu"
    assert {r["level"] for r in res["rows"]} == {1, 4}


def test_gpu_check_on_the_shipped_table():
    table = C.load_accelerators()
    assert {"H200", "H100", "A100", "L4", "cpu"} <= set(table)
    for a in table.values():
        assert a.source and "estimate" in a.source.lower()  # every price is an estimate, and says so
    assert C.match_accelerator("NVIDIA H100 80GB HBM3", table) == "H100"
    assert C.match_accelerator("NVIDIA L4", table) == "L4"
    assert C.match_accelerator("AMD EPYC (avx2, fma), 2 cores", table) == "cpu"
    with pytest.raises(ValueError, match="--measured-on"):
        C.match_accelerator("NVIDIA L40S", table)
    res = C.analyse(GPU, table, LOAD)
    assert res["input"]["measured_on"] == "H200"
    r = _find(res["rows"], 16, C.OFF, "H200")
    assert r["measured"] and r["replicas"]["target"] == 1
    assert r["usd_per_1m_tokens"] == pytest.approx(table["H200"].usd_per_hour / (292 * 3600) * 1e6)
    assert _find(res["rows"], 1, C.POOL, "H100+L4")["basis"] == "modelled-from-H200"
    assert not _find(res["rows"], 1, C.OFF, "H100")["measured"]


def test_cli_writes_table_json_and_png(tmp_path, table, capsys):
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(LOCAL))
    acc = tmp_path / "acc.yaml"
    acc.write_text(TABLE_YAML)
    ap = argparse.ArgumentParser()
    C.add_parser(ap.add_subparsers(dest="cmd"))
    out = tmp_path / "o"
    args = ap.parse_args(["cost", str(src), "--rps", "4", "--tokens", "73", "--accelerators", str(acc),
                          "--pools", "BIG:SMALL", "--json", str(out / "c.json"), "--text", str(out / "c.txt"),
                          "--plot", str(out / "c.png")])
    assert C.run(args) == 0
    res = json.loads((out / "c.json").read_text())
    assert res["input"]["kind"] == "local" and res["rows"]
    assert _find(res["rows"], 1, C.OFF, "cpu")["replicas"]["target"] == 8
    assert (out / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "c.txt").read_text()
    assert "measured" in text and "scaled-from-cpu" in text and "modelled-from-cpu" in text
    assert "scaled-from-cpu" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ap.parse_args(["cost", str(src), "--pools", "BIG"])


def test_errors_name_the_problem(table):
    with pytest.raises(ValueError, match="load must be > 0"):
        C.analyse(LOCAL, table, C.Load(0, 73))
    with pytest.raises(ValueError, match="not in the table"):
        C.analyse(LOCAL, table, LOAD, accels=["H100"])
    with pytest.raises(ValueError, match="--spec"):
        C.analyse(LOCAL, table, LOAD, spec="eagle")
    with pytest.raises(ValueError, match="--measured-on"):
        C.analyse({**LOCAL, "hardware": {"name": "Intel Xeon"}}, table, LOAD)
