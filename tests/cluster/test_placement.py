"""Placement on a multi-node Ray cluster (ray.cluster_utils.Cluster, real raylets on one machine).

One node carries the small-accelerator resource, one the large. Draft replicas must land only
on the first, verifiers only on the second, and a request must still flow through both.
"""
import pytest
import ray
from ray import serve

from cluster import serve as S
from cluster.config import ClusterConfig
from specd_client import SpecdClient


@pytest.fixture(scope="module")
def nodes(start_cluster):
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    small = c.add_node(num_cpus=2, resources={"small_accel": 2})
    large = c.add_node(num_cpus=2, resources={"large_accel": 2})
    ray.init(address=c.address)
    cfg = ClusterConfig.model_validate({
        "model": "tiny", "dtype": "fp32", "max_len": 128, "grpc_port": 0, "http_port": 0,
        "router": {"max_tokens": 16, "default_max_tokens": 8, "default_draft": "truncated:2"},
        "verifier": {"max_batch": 2, "resources": {"custom": {"large_accel": 1}}},
        "drafts": [{"name": "truncated:2", "spec": "truncated:2", "placement": "remote", "default_gamma": 2,
                    "max_batch": 2,
                    "resources": {"custom": {"small_accel": 1}},
                    "autoscaling": {"min_replicas": 2, "max_replicas": 2}}]})
    addr, _ = start_cluster(cfg, address=c.address)
    yield addr, small.node_id, large.node_id
    S.stop()  # Serve and the driver first, then the raylets under them
    c.shutdown()


def test_drafts_on_small_pool_verifier_on_large_pool(nodes):
    addr, small, large = nodes
    with SpecdClient(addr, timeout=60) as client:
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
    before = verifier.stats.remote().result()["remote_drafts"]["truncated:2"]
    prompts = [f"{5 + i} {6 + i} {7 + i} {8 + i}" for i in range(4)]
    with SpecdClient(addr, timeout=120) as client:
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            out = list(ex.map(lambda p: client.generate(prompt=p, max_tokens=16, draft="truncated:2", gamma=2),
                              prompts))
    assert all(len(r.token_ids) == 16 and r.spec_stats["draft_tokens"] > 0 for r in out)
    after = verifier.stats.remote().result()["remote_drafts"]["truncated:2"]
    assert after["calls"] - before["calls"] >= 8
    assert after["resyncs"] == before["resyncs"]  # no call went to a replica without the sequence's state
    draft = serve.get_deployment_handle("Draft-truncated-2", app_name="specd")
    calls = {}
    for _ in range(12):
        st = draft.stats.remote().result()
        calls[st["replica_id"]] = st["calls"]
    assert len(calls) == 2 and all(n > 0 for n in calls.values())
