"""Placement on a multi-node Ray cluster (ray.cluster_utils.Cluster, real raylets on one machine).

One node carries the small-accelerator resource, one the large. Draft replicas must land only
on the first, verifiers only on the second, and a request must still flow through both. Two
replicas of each: GetStats and GetLoad must report every one, and Abort must reach a stream on
whichever verifier replica holds it. The cluster requires a bearer token (auth.tokens_file).
"""
import time

import pytest
import ray
from ray import serve

from cluster import serve as S
from cluster.config import ClusterConfig
from specd_client import SpecdClient


TOKEN = "s3cret-token-for-tests-7f1c"
# greedy continuations of the tiny model that meet no EOS within 600 tokens (as in test_autoscaling)
LONG_PROMPTS = ["5 6 7 8 9", "11 12 13 14", "100 200 300", "42 43 44 45"]


@pytest.fixture(scope="module")
def nodes(start_cluster, tmp_path_factory):
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    small = c.add_node(num_cpus=2, resources={"small_accel": 2})
    large = c.add_node(num_cpus=2, resources={"large_accel": 2})
    ray.init(address=c.address)
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text("# accepted bearer tokens\nanother-token\n" + TOKEN + "\n")
    cfg = ClusterConfig.model_validate({
        "auth": {"tokens_file": str(tokens)},
        "model": "tiny", "dtype": "fp32", "grpc_port": 0, "http_port": 0,
        "router": {"max_tokens": 900, "default_max_tokens": 8, "default_draft": "truncated:2"},
        "max_len": 1000,
        "verifier": {"max_batch": 2, "resources": {"custom": {"large_accel": 1}},
                     "autoscaling": {"min_replicas": 2, "max_replicas": 2}},
        "drafts": [{"name": "truncated:2", "spec": "truncated:2", "placement": "remote", "default_gamma": 2,
                    "max_batch": 4,  # room for every sequence of both verifiers on either replica
                    "resources": {"custom": {"small_accel": 1}},
                    "autoscaling": {"min_replicas": 2, "max_replicas": 2}}]})
    addr, _ = start_cluster(cfg, address=c.address)
    yield addr, small.node_id, large.node_id
    S.stop()  # Serve and the driver first, then the raylets under them
    c.shutdown()


def test_drafts_on_small_pool_verifier_on_large_pool(nodes):
    addr, small, large = nodes
    with SpecdClient(addr, timeout=60, token=TOKEN) as client:
        r = client.generate(prompt="5 6 7 8 9", max_tokens=8)  # tiny model: prompts are token ids
        assert len(r.token_ids) == 8 and r.spec_stats["draft_tokens"] > 0
    v = serve.get_deployment_handle("Verifier", app_name="specd").stats.remote().result()
    assert v["node_id"] == large
    draft = serve.get_deployment_handle("Draft-truncated-2", app_name="specd")
    seen = {draft.stats.remote().result()["replica_id"]: draft.stats.remote().result()["node_id"]
            for _ in range(8)}
    assert set(seen.values()) == {small}


def test_pinned_routing_keeps_each_sequence_on_its_draft_replica(nodes):
    """cluster/routing.py's PinnedRouter: with two draft replicas and several sequences drafting
    concurrently, every call after a sequence's first lands on the replica holding its draft
    KV, so no sequence is ever re-synced, and both replicas serve. (Serve's default router,
    power of two choices, sends about half the calls elsewhere: resyncs > 0.)"""
    import concurrent.futures as cf

    addr, _, _ = nodes
    verifier = serve.get_deployment_handle("Verifier", app_name="specd")

    def verifier_totals() -> dict:  # over both verifier replicas (idle: their counters stand still)
        seen = {}
        for _ in range(16):
            st = verifier.stats.remote().result()
            seen[st["replica_id"]] = st["remote_drafts"]["truncated:2"]
        assert len(seen) == 2
        return {k: sum(s[k] for s in seen.values()) for k in ("calls", "resyncs")}
    before = verifier_totals()
    prompts = [f"{5 + i} {6 + i} {7 + i} {8 + i}" for i in range(4)]
    with SpecdClient(addr, timeout=120, token=TOKEN) as client:
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            out = list(ex.map(lambda p: client.generate(prompt=p, max_tokens=16, draft="truncated:2", gamma=2),
                              prompts))
    assert all(len(r.token_ids) == 16 and r.spec_stats["draft_tokens"] > 0 for r in out)
    after = verifier_totals()
    assert after["calls"] - before["calls"] >= 8
    assert after["resyncs"] == before["resyncs"]  # no call went to a replica without the sequence's state
    draft = serve.get_deployment_handle("Draft-truncated-2", app_name="specd")
    calls = {}
    for _ in range(12):
        st = draft.stats.remote().result()
        calls[st["replica_id"]] = st["calls"]
    assert len(calls) == 2 and all(n > 0 for n in calls.values())


def test_stats_load_and_abort_reach_every_verifier_replica(nodes):
    """GetStats and GetLoad list both verifier replicas (and GetStats both draft replicas), each
    once; with streams running on both verifier replicas, one Abort ends every one of them."""
    import threading

    addr, _, _ = nodes
    with SpecdClient(addr, timeout=120, token=TOKEN) as client:
        st = client.stats()
        roles = sorted(r.role for r in st.replicas)
        assert roles == ["draft", "draft", "verifier", "verifier"]
        assert len({r.replica_id for r in st.replicas}) == 4
        assert len(client.load()) == 2

        ids, chunks, threads = [], {}, []

        def run(rid, prompt):  # distinct prompts (identical ones would coalesce into one generation)
            chunks[rid] = list(client.stream(prompt=prompt, max_tokens=600, draft="truncated:2", gamma=2,
                                             request_id=rid))
        for i, prompt in enumerate(LONG_PROMPTS):  # 2 slots per replica: spread until both run one
            rid = f"long-{i}"
            ids.append(rid)
            threads.append(threading.Thread(target=run, args=(rid, prompt), daemon=True))
            threads[-1].start()
            time.sleep(0.3)
            running = sorted(x.running for x in client.load())
            if running[0] >= 1:
                break
        assert sorted(x.running for x in client.load())[0] >= 1, "the streams never ran on both replicas"
        aborted = client.abort(ids)
        for t in threads:
            t.join(60)
        assert sorted(aborted) == sorted(ids)
        assert all(chunks[rid][-1].finish_reason == "abort" for rid in ids)
        end = time.time() + 20  # the verifiers free the slots at their next step boundary
        while any(x.running or x.kv_slots_in_use for x in client.load()) and time.time() < end:
            time.sleep(0.1)
        assert all(x.running == 0 and x.kv_slots_in_use == 0 for x in client.load())

        # A stream another router replica holds is aborted on the verifiers (here: their own call)
        t = threading.Thread(target=run, args=("via-verifier", LONG_PROMPTS[0]), daemon=True)
        t.start()
        verifier = serve.get_deployment_handle("Verifier", app_name="specd")
        found = []
        for _ in range(40):
            found = verifier.abort_ids.remote(["via-verifier"]).result()
            if found:
                break
            time.sleep(0.05)
        t.join(60)
        assert found == ["via-verifier"] and chunks["via-verifier"][-1].finish_reason == "abort"


def test_bearer_token_is_required_and_never_logged(nodes):
    """With auth configured every RPC but the health check needs `authorization: Bearer <token>`:
    none or a wrong one is UNAUTHENTICATED (the SDK's Unauthenticated), and no log file of the
    Ray session contains the token."""
    from pathlib import Path

    from specd_client import Unauthenticated

    addr, _, _ = nodes
    for token in (None, "wrong", TOKEN[:-1]):
        with SpecdClient(addr, timeout=30, token=token) as bad:
            assert bad.health() == "SERVING"
            for call in (lambda: bad.generate(prompt="5 6 7", max_tokens=2), bad.stats, bad.list_models, bad.load,
                         lambda: bad.abort("x"), lambda: list(bad.stream(prompt="5 6 7", max_tokens=2))):
                with pytest.raises(Unauthenticated, match="bearer token"):
                    call()
    with SpecdClient(addr, timeout=30, metadata=[("authorization", f"Basic {TOKEN}")]) as basic:
        with pytest.raises(Unauthenticated):
            basic.generate(prompt="5 6 7", max_tokens=2)
    with SpecdClient(addr, timeout=30, token=TOKEN) as good:
        assert len(good.generate(prompt="5 6 7", max_tokens=2).token_ids) == 2
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    leaked = [p for p in logs.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert not leaked, leaked
