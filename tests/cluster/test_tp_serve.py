"""A verifier replica that is a tensor-parallel group, served: `verifier.tensor_parallel_size: 2` over a real
local Ray Serve (the replica is rank 0, rank 1 a Ray actor in the replica's placement group), a model
directory (a tiny Qwen3 with the demo model's tokenizer; the demo model itself was served so by hand, see
the README) through gRPC and HTTP; and a rank killed mid-stream (SIGKILL of its process) takes the
replica down, Serve restarts the group, and the router resumes the stream on it: every token arrives,
the same as an undisturbed run's, and the client sees no error."""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import requests

from cluster import serve as S
from cluster.config import ClusterConfig
from helpers import save_tiny_qwen3

PROMPT = "Count from 1 to 100, separated by commas: 1, 2, 3,"


@pytest.fixture(scope="module")
def client(start_cluster, tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-qwen3")
    save_tiny_qwen3(model)
    cfg = ClusterConfig.model_validate({
        "model": str(model), "dtype": "fp32", "weights": "dense", "max_len": 512, "grpc_port": 0, "http_port": 0,
        "router": {"max_tokens": 120, "default_max_tokens": 16, "default_draft": "ngram"},
        "verifier": {"max_batch": 4, "tensor_parallel_size": 2, "resources": {"custom": {"large_accel": 1}}},
        "drafts": [{"name": "ngram", "spec": "ngram"}]})
    return start_cluster(cfg, timeout=180, client_timeout=300)[1]


def ranks() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith("ray::Rank")]


def test_a_tensor_parallel_verifier_serves_grpc_and_http(client):
    rep, = [r for r in client.stats().replicas if r.role == "verifier"]
    assert "tensor-parallel rank 0 of 2" in rep.dtype_reason and len(ranks()) == 1
    a = client.generate(prompt=PROMPT, max_tokens=24, draft="none")
    b = client.generate(prompt=PROMPT, max_tokens=24, draft="ngram", gamma=4)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24  # speculation changes nothing
    r = requests.post(f"http://{S.http_address()}/v1/completions",
                      json={"model": client.list_models().target, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == a.text


def test_a_rank_killed_mid_stream_loses_no_token(client):
    want = client.generate(prompt=PROMPT, max_tokens=120, draft="none").token_ids
    before = client.stats().failovers_total
    got, first = [], threading.Event()

    def stream():
        for chunk in client.stream(prompt=PROMPT, max_tokens=120, draft="none"):
            got.extend(chunk.token_ids)
            first.set()

    th = threading.Thread(target=stream)
    th.start()
    assert first.wait(120)
    victim, = ranks()
    os.kill(victim.pid, signal.SIGKILL)
    th.join(300)
    assert not th.is_alive() and got == want  # every token, none repeated, as undisturbed
    assert client.stats().failovers_total > before  # the stream really moved to the restarted group
    deadline = time.monotonic() + 60
    while not [p for p in ranks() if p.pid != victim.pid] and time.monotonic() < deadline:
        time.sleep(1)
    assert [p for p in ranks() if p.pid != victim.pid]  # Serve restarted the group
