"""Pipelining over real Ray Serve and real gRPC (tiny models): a remote truncated draft replica;
`verifier.pipeline: true` in the config and `set_pipeline` on the Verifier deployment through a
Serve handle at run time; concurrent requests of different lengths give the same tokens with
pipelining on and off and as the target alone; cancelling a stream mid-flight frees its KV on the
verifier and on the draft replica. (The engine-level tests: tests/unit/test_pipeline.py.)
The same cluster is what `specd bench --address` and `--pipeline-compare` measure in their tests.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import threading
import time

import pytest

from cluster.config import ClusterConfig
from specd.cli import main

# --------------------------------------------------------------------------- #
# The cluster: real Ray Serve, real gRPC, a remote draft replica
# --------------------------------------------------------------------------- #
DRAFT = "truncated:2"
OVERLAPPED, COLOCATED = "truncated:2-overlap", "truncated:2-colocated"
C_PROMPTS = ["5 6 7 8 9", "11 12 13 14", "100 200 300", "42 43 44 45 46 47", "7 77 177", "300 301"]
C_MAX = [48, 12, 30, 64, 20, 40]
C_DRAFTS = [DRAFT, DRAFT, DRAFT, DRAFT, "ngram", "none"]
ADDRESS: list[str] = []
CONFIG_PATH: list = []  # the cluster's config as a file (what `specd bench --config` reads)
BENCH_PROMPTS = ["5 6 7 8 9 5 6 7 8 9 5 6 7", "11 12 13 11 12 13 11 12"]


@pytest.fixture(scope="module")
def cluster(start_cluster, tmp_path_factory):
    cfg = {
        "model": "tiny", "dtype": "fp32", "max_len": 512, "grpc_port": 0, "http_port": 0,
        "router": {"max_queue": 32, "max_tokens": 256, "default_max_tokens": 16, "coalesce": False,
                   "default_draft": DRAFT},
        "verifier": {"max_batch": 8, "pipeline": True, "resources": {"custom": {"large_accel": 1}}},
        "drafts": [{"name": "ngram", "spec": "ngram"},
                   {"name": DRAFT, "spec": DRAFT, "placement": "remote", "overlap": False, "max_batch": 16,
                    "resources": {"custom": {"small_accel": 1}}},
                   # the other two ways `specd bench --overlap-compare` serves a model draft
                   {"name": OVERLAPPED, "spec": DRAFT, "placement": "remote", "overlap": True, "max_batch": 4,
                    "resources": {"custom": {"small_accel": 1}}},
                   {"name": COLOCATED, "spec": DRAFT, "placement": "colocated"}]}
    path = tmp_path_factory.mktemp("cluster") / "cluster.yaml"
    path.write_text(ClusterConfig.model_validate(cfg).dump())
    addr, client = start_cluster(cfg, timeout=90)
    ADDRESS.append(addr)
    CONFIG_PATH.append(path)
    return client


@pytest.fixture(scope="module")
def verifier(cluster):
    from ray import serve

    return serve.get_deployment_handle("Verifier", app_name="specd")


def _burst(client) -> list[list[int]]:
    """All C_PROMPTS at once, streamed; tokens per request."""
    def one(i):
        return [t for c in client.stream(prompt=C_PROMPTS[i], max_tokens=C_MAX[i], draft=C_DRAFTS[i], gamma=3)
                for t in c.token_ids]
    with cf.ThreadPoolExecutor(len(C_PROMPTS)) as ex:
        return list(ex.map(one, range(len(C_PROMPTS))))


def test_cluster_pipelined_greedy_same_on_off_and_target_alone(cluster, verifier, tiny, hf_greedy):
    refs = [hf_greedy(tiny.model, [int(t) for t in p.split()], n) for p, n in zip(C_PROMPTS, C_MAX)]
    st0 = verifier.stats.remote().result()
    assert st0["pipeline"] is True  # verifier.pipeline from the config
    on = _burst(cluster)
    st1 = verifier.stats.remote().result()
    assert on == refs
    assert st1["batcher"]["pipelined_steps"] > st0["batcher"]["pipelined_steps"]
    assert st1["remote_drafts"][DRAFT]["calls"] > st0["remote_drafts"][DRAFT]["calls"]

    assert verifier.set_pipeline.remote(False).result()["pipeline"] is False  # at run time, same cluster
    try:
        off = _burst(cluster)
        st2 = verifier.stats.remote().result()
        assert off == refs
        assert st2["batcher"]["pipelined_steps"] == st1["batcher"]["pipelined_steps"]
        assert st2["batcher"]["target_passes"] > st1["batcher"]["target_passes"]
    finally:
        assert verifier.set_pipeline.remote(True).result()["pipeline"] is True
    assert _burst(cluster) == refs


def test_cluster_cancel_mid_stream_with_pipelining_frees_kv_both_sides(cluster, verifier):
    assert verifier.stats.remote().result()["pipeline"] is True
    # Two long streams, so both micro-batches hold a sequence; cancel one mid-stream.
    other_out: list[int] = []

    def other():
        other_out.extend(t for c in cluster.stream(prompt="9 8 7 6", max_tokens=120, draft=DRAFT, gamma=2)
                         for t in c.token_ids)
    th = threading.Thread(target=other, daemon=True)
    th.start()
    it = cluster.stream(prompt="1 2 3 4 5", max_tokens=250, draft=DRAFT, gamma=3)
    first = next(it)
    assert first.token_ids and first.finish_reason is None
    it.close()  # client cancellation
    th.join(60)
    assert len(other_out) > 0
    end = time.time() + 20
    while True:
        reps = cluster.stats().replicas
        if reps and all(r.kv_slots_in_use == 0 for r in reps):
            break
        assert time.time() < end, f"KV still held: {reps}"
        time.sleep(0.2)
    assert {r.role for r in reps} == {"verifier", "draft"}
    st = verifier.stats.remote().result()
    assert st["active_sequences"] == 0 and st["kv_slots_in_use"] == 0


def test_bench_pipeline_compare_report(cluster, verifier, tmp_path):
    """`specd bench --pipeline-compare`'s measurement against this cluster: shape and sanity only."""
    from specd.bench.cluster import pipeline_compare, render_pipeline

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in C_PROMPTS[:3]))
    rep = pipeline_compare(ADDRESS[0], (2, 3), DRAFT, 3, 10, prompts, 3, rounds=2, progress=False,
                           match_niceness=False)
    assert [(r["concurrency"], r["pipeline"]) for r in rep["results"]] == [(2, False), (2, True), (3, False),
                                                                            (3, True)]
    for r in rep["results"]:
        assert r["rounds"] == 2 and r["tokens"] > 0 and r["tokens_per_s"] > 0
        b = r["batcher"]
        assert b["target_passes"] > 0 and b["draft_calls"] > 0 and b["draft_replica_busy_s"] > 0
        assert (b["pipelined_steps"] > 0) == r["pipeline"]
        assert 0 <= r["time_share"]["draft_wait"] <= r["time_share"]["draft_exposed"] <= 1
    assert set(rep["ratios"]) == {"c2", "c3"} and rep["greedy_agreement_on_vs_off"] == {"c2": 1.0, "c3": 1.0}
    assert set(rep["greedy_agreement_across_rounds"].values()) == {1.0}  # fp32
    assert "pipelining on/off tokens/s" in render_pipeline(rep)
    assert verifier.stats.remote().result()["pipeline"] is True  # the cluster's setting is restored


def test_bench_overlap_compare_report(cluster, tmp_path):
    """`specd bench --overlap-compare`'s measurement against this cluster (fp32): every configuration
    gives speculation-off's greedy tokens, only the overlapped draft answers rows from prepared
    blocks, and only the remote ones make draft calls. Shape and sanity, never timing thresholds."""
    from specd.bench.overlap import overlap_compare, overlap_config, render

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in BENCH_PROMPTS))
    names = {"overlapped": OVERLAPPED, "remote": DRAFT, "colocated": COLOCATED}
    rep = overlap_compare(ADDRESS[0], names, 3, 24, prompts, 2, rounds=1, progress=False, match_niceness=False)
    res = rep["results"]
    assert set(res) == {"overlapped", "remote", "colocated", "off"}
    assert rep["greedy_agreement_with_off"] == {"overlapped": 1.0, "remote": 1.0, "colocated": 1.0}
    assert res["overlapped"]["draft"]["prepared_rows"] > 0 and res["overlapped"]["draft"]["hit_rate"] > 0
    assert res["remote"]["draft"]["prepared_rows"] == 0 and res["remote"]["draft"]["calls"] > 0
    assert res["colocated"]["draft"]["calls"] == 0
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in res.values())
    assert "overlapped / non-overlapped remote" in render(rep)
    # what --serve starts: the config's remote draft three ways, one Verifier replica
    cfg, made = overlap_config(ClusterConfig.model_validate(
        {"model": "tiny", "drafts": [{"name": "t", "spec": DRAFT, "placement": "remote"}]}), "t")
    assert made == {"overlapped": "t", "remote": "t-sync", "colocated": "t-colocated"}
    assert [(d.name, d.remote, d.overlap) for d in cfg.drafts] == [("t", True, True), ("t-sync", True, False),
                                                                   ("t-colocated", False, True)]
    assert cfg.verifier.autoscaling.max_replicas == 1


def test_bench_address_report(cluster, tmp_path):
    """`specd bench --address` against this cluster: the report's shape and sane values, never
    timing thresholds: every point has tokens, positive throughput and ordered percentiles, α is
    a probability where something was drafted, the ratios are there, and at concurrency 1 the
    cluster's greedy tokens equal the in-process engine's."""
    addr, cfg_path = ADDRESS[0], CONFIG_PATH[0]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in BENCH_PROMPTS))
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--address", addr, "--config", str(cfg_path), "--prompts", str(prompts),
               "--draft", "ngram", "--gamma", "3",
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
    assert {"cluster-c1_spec_ge_0.98x_off", "cluster-c2_spec_ge_0.98x_off", "c1_off_cluster_ge_0.97x_inprocess",
            "c2_ge_0.8x_runner_ceiling", "c2_vs_serial_hf"} <= set(goals)
    assert goals["c2_vs_serial_hf"]["ratio"] == pytest.approx(
        max(r["tokens_per_s"] for r in rep["results"] if r["side"] == "cluster" and r["concurrency"] == 2)
        / next(r["tokens_per_s"] for r in rep["results"] if r["side"] == "hf"))
    # the same engine code on both sides, fp32, batch 1: identical greedy tokens, and speculation changes none
    assert rep["greedy_agreement_cluster_vs_inprocess_c1"] == {"spec": 1.0, "off": 1.0, "cluster spec vs cluster off": 1.0}


def test_bench_served_profile(cluster, tmp_path):
    """`specd bench --serve --profile`'s served profile (specd/bench/served.py) on this cluster:
    per point, the verifier loop's own accounting and each process's CPU per generated token.
    The batcher thread is told apart from the verifier's other threads (a profile that counted the
    whole replica as one, or read another process's thread, would not show both), every generated
    token is counted, and the engine's pass is part of its step."""
    from specd.bench import served
    from specd.bench.cluster import run

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in BENCH_PROMPTS))
    rep = run(ADDRESS[0], (1, 2), "ngram", 3, 12, prompts, 2, CONFIG_PATH[0], hf=False, progress=False,
              match_niceness=False, ceiling=False, profile=True)
    prof = rep["profile"]
    assert set(prof) == {"c1 spec", "c1 off", "c2 spec", "c2 off", "in-process c1 spec", "in-process c1 off"}
    for key in ("c1 spec", "c1 off", "c2 spec", "c2 off"):
        p = prof[key]
        got = next(r["tokens"] for r in rep["results"]
                   if r["side"] == "cluster" and f"c{r['concurrency']} {r['mode']}" == key)
        assert p["tokens"] == got > 0 and p["steps"] > 0
        loop = p["loop_ms_per_step"]
        assert all(v >= 0 for v in loop.values())
        assert 0 < loop["engine verify_s"] <= loop["step_s"] * 1.001
        assert p["deltas_per_step"] >= 1  # at least one stream message per step that ran a request
        cpu = p["cpu_ms_per_token"]
        assert cpu["verifier: batcher thread"] > 0 and cpu["verifier: other threads"] >= 0
        assert cpu["router"] > 0 and "Serve proxy" in cpu
    # /proc counts CPU in 10 ms ticks: one short window's other threads may stay under a tick, the run's do not
    assert sum(prof[k]["cpu_ms_per_token"]["verifier: other threads"] for k in ("c1 spec", "c1 off", "c2 spec", "c2 off")) > 0
    assert prof["in-process c1 off"]["steps"] > 0 and prof["in-process c1 off"]["loop_ms_per_step"]["engine verify_s"] > 0
    text = served.render(prof)
    assert "verifier: batcher thread" in text and "ms per engine step" in text
