"""`specd bench --address` against a real tiny-model cluster (Ray Serve gRPC over loopback).

Checks the report's shape and that its values are sane, never timing thresholds: every
point has tokens, positive throughput and ordered percentiles, α is a probability where
something was drafted, the ratios are there, and at concurrency 1 the cluster's greedy
tokens equal the in-process engine's.
"""
from __future__ import annotations

import json
import os

import pytest

from cluster.config import ClusterConfig
from specd.cli import main

PROMPTS = ["5 6 7 8 9 5 6 7 8 9 5 6 7", "11 12 13 11 12 13 11 12"]  # tiny model: prompts are token ids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, start_cluster):
    cfg = ClusterConfig.model_validate({
        "model": "tiny", "dtype": "fp32", "max_len": 128, "grpc_port": 0, "http_port": 0,
        "router": {"max_tokens": 32, "default_max_tokens": 8, "default_draft": "ngram"},
        "verifier": {"max_batch": 4, "resources": {"custom": {"large_accel": 1}}},
        "drafts": [{"name": "ngram", "spec": "ngram", "default_gamma": 3}]})
    path = tmp_path_factory.mktemp("bench") / "cluster.yaml"
    path.write_text(cfg.dump())
    addr, _ = start_cluster(cfg, timeout=60)
    return addr, path


def test_bench_address_report(cluster, tmp_path):
    addr, cfg_path = cluster
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--address", addr, "--config", str(cfg_path), "--prompts", str(prompts),
               "--concurrency", "1,2", "--max-tokens", "12", "--json", str(out), "--plot", str(png),
               "--no-match-niceness"])  # the default would renice the whole test session
    assert rc == 0
    rep = json.loads(out.read_text())
    assert png.stat().st_size > 1000 and out.with_suffix(".txt").read_text().strip()

    assert rep["target"] == "tiny" and rep["draft"] == "ngram" and rep["gamma"] == 3
    assert rep["concurrency"] == [1, 2] and rep["prompts"] == 2 and rep["niceness"] == os.nice(0)
    points = {(r["side"], r["concurrency"], r["mode"]) for r in rep["results"]}
    assert points == {("cluster", 1, "spec"), ("cluster", 1, "off"), ("cluster", 2, "spec"), ("cluster", 2, "off"),
                      ("in-process", 1, "spec"), ("in-process", 1, "off"), ("hf", 1, "off")}
    for r in rep["results"]:
        assert r["requests"] == 2 and 2 <= r["tokens"] <= 24
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0
        assert r["coalesced"] == 0
        if r["side"] != "hf":
            t, itl = r["ttft_ms"], r["itl_ms"]
            assert 0 < t["p50"] <= t["p99"] and t["mean"] > 0
            assert itl["p50"] is None or 0 <= itl["p50"] <= itl["p99"]
        if r["mode"] == "off":
            assert r["acceptance_rate"] is None and r["mean_accepted_length"] is None
        elif r["acceptance_rate"] is not None:
            assert 0 <= r["acceptance_rate"] <= 1 and 1 <= r["mean_accepted_length"] <= 1 + rep["gamma"]
            assert all(0 <= a <= 1 for a in r["acceptance_per_position"])

    ra = rep["ratios"]
    assert set(ra["cluster_vs_inprocess_c1"]) == {"spec", "off"}
    for v in ra["cluster_vs_inprocess_c1"].values():
        assert v["tokens_per_s_ratio"] > 0
        assert v["per_token_overhead"] == pytest.approx(1 / v["tokens_per_s_ratio"])
    assert set(ra["vs_hf_serial"]) == {"c1-spec", "c1-off", "c2-spec", "c2-off"}
    assert all(v > 0 for v in ra["vs_hf_serial"].values())
    assert set(ra["spec_vs_off"]) == {"cluster-c1", "cluster-c2", "in-process-c1"}
    goals = rep["goals"]
    assert {"cluster-c1_spec_ge_0.98x_off", "cluster-c2_spec_ge_0.98x_off", "c1_off_cluster_ge_0.95x_inprocess",
            "c2_ge_0.7x_runner_ceiling", "c2_vs_serial_hf"} <= set(goals)
    assert goals["c2_vs_serial_hf"]["ratio"] == pytest.approx(
        max(r["tokens_per_s"] for r in rep["results"] if r["side"] == "cluster" and r["concurrency"] == 2)
        / next(r["tokens_per_s"] for r in rep["results"] if r["side"] == "hf"))
    # the same engine code on both sides, fp32, batch 1: identical greedy tokens
    assert rep["greedy_agreement_cluster_vs_inprocess_c1"] == {"spec": 1.0, "off": 1.0}
