"""Pipelining: the target verifies one micro-batch while the drafts propose for the other.

Engine level (no Ray): an asynchronous drafter that answers from another thread, one call at
a time like a draft replica, stands in for RemoteDrafter. Greedy output with pipelining on is
token-identical to off and to Hugging Face `generate` of the target alone, with requests of
different lengths (micro-batches empty out unevenly and are rebalanced), local and no-draft
requests in the same batch, seeded sampling unchanged, aborts while a draft call is in
flight, and switching it off and on mid-run.

Cluster level (real Ray Serve, real gRPC over loopback, tiny models): a remote truncated
draft replica; `verifier.pipeline: true` in the config and `set_pipeline` on the Verifier
deployment through a Serve handle at run time; concurrent requests of different lengths give
the same tokens with pipelining on and off and as the target alone; cancelling a stream
mid-flight frees its KV on the verifier and on the draft replica.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import pytest
import torch

from actors.drafters import Drafter, DraftSeq, ModelDrafter, NgramDrafter, Proposal
from actors.engine import Request, SamplingParams, SpecEngine
from actors.llama import LlamaRunner

MAX_LEN = 160


def rand_tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


PROMPTS = [rand_tokens(7, 11), [42, 43], rand_tokens(20, 12), [10, 11, 12] * 4, rand_tokens(3, 13),
           rand_tokens(12, 14)]
MAX_TOKENS = [40, 9, 31, 40, 5, 22]  # different lengths: micro-batches empty out unevenly


class AsyncDrafter(Drafter):
    """A drafter on 'another machine': calls are answered by one worker thread, in order, as a
    draft replica does; `propose_async` returns at once with a function that waits."""

    def __init__(self, inner: Drafter, delay_s: float = 0.0):
        self.inner, self.delay_s = inner, delay_s
        self.name = inner.name
        self.pool = cf.ThreadPoolExecutor(1)
        self.lock = threading.Lock()  # the counters
        self.inner_lock = threading.Lock()  # the inner drafter's state (the worker vs release)
        self.in_flight = 0
        self.max_in_flight = 0
        self.flying: dict[int, int] = {}  # seq_id -> calls in flight for it
        self.calls = 0

    def propose_async(self, seqs: list[DraftSeq]):
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            for s in seqs:
                assert not self.flying.get(s.seq_id), "two calls in flight for one sequence"
                self.flying[s.seq_id] = 1

        def work() -> Proposal:
            try:
                if self.delay_s:
                    time.sleep(self.delay_s)
                with self.inner_lock:
                    return self.inner.propose(seqs)
            finally:
                with self.lock:
                    self.in_flight -= 1
                    self.calls += 1
        fut = self.pool.submit(work)

        def wait() -> Proposal:
            prop = fut.result()
            with self.lock:
                for s in seqs:
                    self.flying.pop(s.seq_id, None)
            return prop
        return wait

    def propose(self, seqs: list[DraftSeq]) -> Proposal:
        return self.propose_async(seqs)()

    def release(self, seq_id: int) -> None:
        # The engine must have waited for the sequence's call before releasing it (over the
        # network a release could overtake the call and the call would re-create the state).
        assert not self.flying.get(seq_id), f"released {seq_id} with a draft call in flight"
        with self.inner_lock:
            self.inner.release(seq_id)

    def num_active(self) -> int:
        return self.inner.num_active()

    def view_length(self, seq_id: int) -> int | None:
        return self.inner.view_length(seq_id)


def make_engine(tiny, pipeline: bool, max_batch: int = 6, delay_s: float = 0.0) -> SpecEngine:
    drafters = {
        "remote": AsyncDrafter(ModelDrafter.truncated(tiny.model, 2, max_batch=max_batch, max_len=MAX_LEN),
                               delay_s),
        "remote-full": AsyncDrafter(ModelDrafter.truncated(tiny.model, 4, max_batch=max_batch, max_len=MAX_LEN)),
        "ngram": NgramDrafter(),
        "local": ModelDrafter.truncated(tiny.model, 2, max_batch=max_batch, max_len=MAX_LEN),
    }
    return SpecEngine(LlamaRunner(tiny.model), drafters, max_batch=max_batch, max_len=MAX_LEN, pipeline=pipeline)


def requests(cfg, **params) -> list[Request]:
    return [Request(f"r{i}", p, SamplingParams(max_tokens=n, **params), d, g)
            for i, (p, n, (d, g)) in enumerate(zip(PROMPTS, MAX_TOKENS, cfg))]


def run(eng: SpecEngine, reqs: list[Request], stats: dict | None = None) -> dict[str, list[int]]:
    """Run to completion; returns each request's streamed tokens (checked against its final
    output); fills `stats` with each request's (drafts, draft tokens, accepted tokens)."""
    streamed: dict[str, list[int]] = {}
    for r in reqs:
        eng.add_request(r)
    while eng.has_work():
        for o in eng.step():
            streamed.setdefault(o.request_id, []).extend(o.token_ids)
    for r in reqs:
        seq = eng.finished.pop(r.request_id)
        assert seq.output == streamed[r.request_id]
        if stats is not None:
            stats[r.request_id] = (seq.stats.drafts, seq.stats.draft_tokens, seq.stats.accepted_tokens)
    return streamed


@pytest.fixture(scope="module")
def refs(tiny, hf_greedy):
    return [hf_greedy(tiny.model, p, n, eos=None) for p, n in zip(PROMPTS, MAX_TOKENS)]


ALL_REMOTE = [("remote", 3)] * 6
MIXED = [("remote", 3), ("ngram", 3), ("remote", 2), (None, 0), ("remote-full", 4), ("local", 2)]


@pytest.mark.parametrize("cfg", [ALL_REMOTE, MIXED], ids=["all-remote", "mixed"])
def test_pipelined_greedy_equals_plain_and_hf(tiny, refs, cfg):
    on, off = make_engine(tiny, True), make_engine(tiny, False)
    st_on, st_off = {}, {}
    got_on, got_off = run(on, requests(cfg), st_on), run(off, requests(cfg), st_off)
    for i in range(len(PROMPTS)):
        assert got_on[f"r{i}"] == got_off[f"r{i}"] == refs[i], f"r{i}"
    # Losslessness hides a draft handed to the wrong row; acceptance does not: each request
    # drafts from its own history only, so it drafts and accepts exactly as without pipelining.
    assert st_on == st_off
    bs_on, bs_off = on.batcher_stats, off.batcher_stats
    assert bs_on["pipelined_steps"] > 0 and bs_off["pipelined_steps"] == 0
    # two micro-batches: more target passes, each over fewer rows
    assert bs_on["target_passes"] > bs_off["target_passes"]
    assert on.drafters["remote"].max_in_flight == 2  # the other micro-batch's call overlapped a pass
    assert off.drafters["remote"].max_in_flight == 1
    for eng in (on, off):
        assert eng.kv_slots_in_use() == 0 and all(d.num_active() == 0 for d in eng.drafters.values())
        assert all(s.flight is None for s in eng.finished.values())
    st = on.stats
    assert st.draft_tokens > 0 and st.accepted_tokens > 0


def test_pipelined_sampling_with_seed_is_unchanged(tiny):
    cfg = [("remote", 3), ("remote", 2), ("ngram", 3), ("remote-full", 4), ("remote", 1), (None, 0)]
    got = [run(make_engine(tiny, on), requests(cfg, temperature=0.9, top_p=0.95, seed=7)) for on in (True, False)]
    assert got[0] == got[1]


def test_abort_with_a_draft_call_in_flight_frees_both_sides(tiny, refs):
    eng = make_engine(tiny, True, delay_s=0.01)
    drafter = eng.drafters["remote"]
    reqs = requests(ALL_REMOTE)
    for r in reqs:
        eng.add_request(r)
    for _ in range(3):
        eng.step()
    flying = [s for s in eng.active.values() if s.flight is not None and s.flight.drafts is None]
    assert flying, "no draft call in flight between steps"
    victim = flying[0]
    assert eng.abort(victim.req.request_id)
    assert victim.flight is None and victim.slot in eng.free_slots
    assert drafter.num_active() == len([s for s in eng.active.values() if s.req.draft == "remote"])
    streamed: dict[str, list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            streamed.setdefault(o.request_id, []).extend(o.token_ids)
    for i, r in enumerate(reqs):
        if r.request_id != victim.req.request_id:
            assert eng.finished[r.request_id].output == refs[i]
    assert eng.kv_slots_in_use() == 0 and drafter.num_active() == 0


def test_switching_pipelining_off_and_on_mid_run(tiny, refs):
    eng = make_engine(tiny, True)
    reqs = requests(MIXED)
    for r in reqs:
        eng.add_request(r)
    n = 0
    while eng.has_work():
        if n % 4 == 2:
            eng.set_pipeline(not eng.pipeline)
        eng.step()
        n += 1
    for i, r in enumerate(reqs):
        assert eng.finished[r.request_id].output == refs[i]
    assert eng.kv_slots_in_use() == 0 and all(d.num_active() == 0 for d in eng.drafters.values())


def test_off_with_flights_drains_then_runs_plain(tiny):
    eng = make_engine(tiny, True)
    for r in requests(ALL_REMOTE):
        eng.add_request(r)
    eng.step()
    eng.step()
    assert any(s.flight is not None for s in eng.active.values())
    eng.set_pipeline(False)
    eng.step()
    eng.step()
    assert all(s.flight is None for s in eng.active.values())
    before = eng.batcher_stats["pipelined_steps"]
    eng.step()
    assert eng.batcher_stats["pipelined_steps"] == before


# --------------------------------------------------------------------------- #
# The cluster: real Ray Serve, real gRPC, a remote draft replica
# --------------------------------------------------------------------------- #
DRAFT = "truncated:2"
C_PROMPTS = ["5 6 7 8 9", "11 12 13 14", "100 200 300", "42 43 44 45 46 47", "7 77 177", "300 301"]
C_MAX = [48, 12, 30, 64, 20, 40]
C_DRAFTS = [DRAFT, DRAFT, DRAFT, DRAFT, "ngram", "none"]
ADDRESS: list[str] = []


@pytest.fixture(scope="module")
def cluster():
    from cluster import serve as S
    from cluster.config import ClusterConfig
    from specd_client import SpecdClient

    cfg = ClusterConfig.model_validate({
        "model": "tiny", "dtype": "fp32", "max_len": 512, "grpc_port": 0, "http_port": 0,
        "router": {"max_queue": 32, "max_tokens": 256, "default_max_tokens": 16, "coalesce": False,
                   "default_draft": DRAFT},
        "verifier": {"max_batch": 8, "pipeline": True, "resources": {"custom": {"large_accel": 1}}},
        "drafts": [{"name": "ngram", "spec": "ngram"},
                   {"name": DRAFT, "spec": DRAFT, "max_batch": 16, "resources": {"custom": {"small_accel": 1}}}]})
    addr = S.start(cfg)
    ADDRESS.append(addr)
    client = SpecdClient(addr, timeout=120)
    S.wait_serving(client, timeout=90)
    yield client
    client.close()
    S.stop()


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
    import json

    from cluster.bench_cluster import pipeline_compare, render_pipeline

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
