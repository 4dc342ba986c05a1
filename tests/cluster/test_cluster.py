"""The cluster end to end: a real local Ray, Ray Serve's gRPC proxy over loopback, the SDK.

One cluster for the module: the embedded SmolLM2 target in fp32 on a verifier replica
(`large_accel` pool), the 4-layer self-draft on its own Draft replica (`small_accel`),
n-gram inside the verifier. Nothing is mocked.
"""
from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import ray
import torch

from actors.text import encode_prompt
from cluster.config import ClusterConfig
from helpers import chat_ids
from specd_client.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted

MAX_LEN = 256
QUESTION = [{"role": "user", "content": "Name two planets and one fact about each."}]


@pytest.fixture(scope="module")
def cluster(start_cluster):
    cfg = ClusterConfig.model_validate({
        "model": "smollm2", "dtype": "fp32", "max_len": MAX_LEN, "grpc_port": 0, "http_port": 0,
        "router": {"max_queue": 3, "max_tokens": 128, "default_max_tokens": 16, "default_draft": "ngram"},
        "verifier": {"max_batch": 4, "resources": {"custom": {"large_accel": 1}}},
        "drafts": [{"name": "ngram", "spec": "ngram"},
                   {"name": "truncated:4", "spec": "truncated:4", "placement": "remote", "max_batch": 4,
                    "resources": {"custom": {"small_accel": 1}}},
                   # the shipped EAGLE head on its own replica: target hidden states cross over
                   {"name": "eagle", "spec": "default", "placement": "remote", "max_batch": 4,
                    "resources": {"custom": {"small_accel": 1}}}]})
    return start_cluster(cfg, timeout=60)[1]


@pytest.fixture(scope="module")
def hf_ref(smollm2):
    ids = chat_ids(smollm2.tokenizer, QUESTION[0]["content"])
    out = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                 eos_token_id=sorted(smollm2.eos_token_ids), pad_token_id=0)
    return out[0, len(ids):].tolist()


def verifier_stats(client) -> dict:
    return {r.role: r for r in client.stats().replicas}


def wait_kv_free(client, timeout=20.0):
    end = time.time() + timeout
    while time.time() < end:
        reps = client.stats().replicas
        if reps and all(r.kv_slots_in_use == 0 for r in reps):
            return reps
        time.sleep(0.2)
    raise AssertionError(f"KV still held: {client.stats().replicas}")


@pytest.mark.parametrize("draft", ["none", "ngram", "truncated:4", "eagle"])
def test_greedy_over_grpc_equals_hf_generate(cluster, hf_ref, draft):
    r = cluster.generate(messages=QUESTION, max_tokens=32, draft=draft, gamma=4)
    assert r.token_ids == hf_ref
    chunks = list(cluster.stream(messages=QUESTION, max_tokens=32, draft=draft, gamma=3))
    assert [t for c in chunks for t in c.token_ids] == hf_ref
    assert "".join(c.text for c in chunks) == r.text and r.text
    assert chunks[-1].finish_reason == r.finish_reason and all(c.finish_reason is None for c in chunks[:-1])
    if draft in ("truncated:4", "eagle"):
        assert r.spec_stats["draft_tokens"] > 0  # drafts really came from the Draft replica
    if draft == "eagle":
        assert r.spec_stats["accepted_tokens"] > 0  # the head read real target features


BAD = [
    (dict(prompt=""), "prompt must not be empty"),
    (dict(prompt="word " * (MAX_LEN + 10)), "context of 256 tokens"),
    (dict(prompt="hi", max_tokens=0), "sampling.max_tokens must be in [1, 128]"),
    (dict(prompt="hi", max_tokens=129), "sampling.max_tokens must be in [1, 128]"),
    (dict(prompt="hi", temperature=-0.5), "sampling.temperature must be 0 (greedy) or in [0.001, 1000.0]"),
    (dict(prompt="hi", top_p=0.0), "sampling.top_p must be in [1e-06, 1]"),
    (dict(prompt="hi", top_p=1.5), "sampling.top_p must be in [1e-06, 1]"),
    (dict(prompt="hi", draft="nope"), "speculation.draft 'nope' is unknown"),
    (dict(prompt="hi", draft="ngram", gamma=17), "speculation.gamma must be in [0, 16]"),
    (dict(prompt="hi", draft="ngram", gamma=-1), "speculation.gamma must be in [0, 16]"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role must be one of"),
    (dict(messages=[]), "messages must not be empty"),
    (dict(prompt="hi", num_beams=5), "sampling.num_beams must be in [1, 4]"),  # the verifier's max_batch
    (dict(prompt="hi", num_beams=2, temperature=0.7), "beam search: sampling.temperature must be 0"),
]


@pytest.mark.parametrize("kw,msg", BAD, ids=[m.split(" must")[0][:30] for _, m in BAD])
def test_bad_input_is_invalid_argument_and_server_keeps_serving(cluster, kw, msg):
    with pytest.raises(InvalidArgument) as ei:
        cluster.generate(**kw)
    assert msg in ei.value.details
    with pytest.raises(InvalidArgument):
        list(cluster.stream(**kw))
    assert cluster.generate(prompt="The sky is", max_tokens=3).finish_reason == "length"


def test_beam_search_over_grpc_equals_hf_beam_search(cluster, smollm2):
    """A beam request (B=2, n-gram drafts) through the SDK returns HF's best hypothesis, while an
    ordinary request shares the verifier's batch; its KV (all B beams' slots) is freed after."""
    ids = chat_ids(smollm2.tokenizer, QUESTION[0]["content"])
    with torch.inference_mode():
        out = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=12, num_beams=2, do_sample=False,
                                     eos_token_id=sorted(smollm2.eos_token_ids), pad_token_id=0)
    ref = out[0, len(ids):].tolist()
    with cf.ThreadPoolExecutor(2) as ex:
        beam = ex.submit(cluster.generate, messages=QUESTION, max_tokens=12, num_beams=2, draft="ngram", gamma=3)
        plain = ex.submit(cluster.generate, prompt="The sky is", max_tokens=8)
        r, p = beam.result(timeout=120), plain.result(timeout=120)
    assert r.token_ids == ref and r.text == smollm2.tokenizer.decode(ref, skip_special_tokens=True)
    assert p.finish_reason == "length" and len(p.token_ids) == 8
    wait_kv_free(cluster)


def test_coalescing_identical_requests_share_one_generation(cluster, hf_ref):
    before = cluster.stats()
    n = 3
    with cf.ThreadPoolExecutor(n) as ex:
        results = list(ex.map(lambda _: cluster.generate(messages=QUESTION, max_tokens=32, draft="truncated:4",
                                                         gamma=4), range(n)))
    after = cluster.stats()
    assert all(r.token_ids == hf_ref for r in results)
    assert sum(r.coalesced for r in results) == after.coalesced_total - before.coalesced_total
    assert after.coalesced_total - before.coalesced_total >= 1  # at least one caller joined another's run
    # one generation's worth of tokens per coalesced group, not n
    assert after.tokens_total - before.tokens_total == (n - sum(r.coalesced for r in results)) * len(hf_ref)


def test_same_request_id_twice_in_flight_both_complete(cluster, smollm2, hf_greedy):
    """Regression (defect: the verifier keyed streams by the client's request id; the second
    request overwrote the first's subscriber and aborted it, the first hung to its deadline and
    the second got INTERNAL). Two concurrent requests with one id and different prompts, through
    the SDK: both complete with their own greedy output, each echoing the id."""
    prompts = ["The capital of France is", "Water boils at"]
    refs = [hf_greedy(smollm2.model, encode_prompt(smollm2.tokenizer, prompt=p), 16) for p in prompts]
    with cf.ThreadPoolExecutor(2) as ex:
        got = list(ex.map(lambda p: cluster.generate(prompt=p, max_tokens=16, request_id="same-id", draft="ngram",
                                                     timeout=60), prompts))
    assert [r.token_ids for r in got] == refs
    assert all(r.request_id == "same-id" and r.finish_reason in ("length", "stop") for r in got)
    wait_kv_free(cluster)


def test_cancelled_stream_frees_kv_on_verifier_and_draft(cluster):
    it = cluster.stream(prompt="Count from one to one hundred:", max_tokens=128, draft="truncated:4", gamma=2)
    first = next(it)
    assert first.token_ids
    reps = verifier_stats(cluster)
    assert reps["verifier"].kv_slots_in_use == 1
    it.close()  # client cancellation
    reps = wait_kv_free(cluster)
    assert {r.role for r in reps} == {"verifier", "draft"}


def test_abort_rpc_ends_the_stream_with_abort_and_frees_kv(cluster):
    """Abort(request_ids) ends the named stream (finish reason "abort", usage counting what was
    streamed), frees its KV on the verifier and its draft, ignores unknown ids, and GetLoad sees
    the running sequence before and none after."""
    it = cluster.stream(prompt="Count from one to one hundred:", max_tokens=128, draft="truncated:4", gamma=2,
                        request_id="abort-me")
    got = list(next(it).token_ids)
    load = cluster.load()
    assert len(load) == 1 and load[0].running == 1 and load[0].kv_slots_in_use == 1
    assert load[0].kv_slots_total == 4 and 0 <= load[0].recent_acceptance <= 1
    assert cluster.abort(["abort-me", "never-sent"]) == ["abort-me"]
    chunks = list(it)
    got += [t for c in chunks for t in c.token_ids]
    assert chunks[-1].finish_reason == "abort" and chunks[-1].usage.completion_tokens == len(got) < 128
    wait_kv_free(cluster)
    assert cluster.load()[0].running == 0 and cluster.abort("abort-me") == []


def test_token_ids_input_and_the_matched_stop_string(cluster, smollm2):
    """Token ids are an input beside text and messages (checked against the vocabulary), and the
    final message names the stop string that ended the generation."""
    ids = encode_prompt(smollm2.tokenizer, prompt="The capital of France is")
    by_text = cluster.generate(prompt="The capital of France is", max_tokens=12)
    assert cluster.generate(token_ids=ids, max_tokens=12).token_ids == by_text.token_ids
    with pytest.raises(InvalidArgument, match="token_ids.ids must not be empty"):
        cluster.generate(token_ids=[])
    with pytest.raises(InvalidArgument, match="49152"):  # the vocabulary size, named as the limit
        cluster.generate(token_ids=[1, 10**6])
    word = by_text.text.split()[2]
    r = cluster.generate(prompt="The capital of France is", max_tokens=12, stop=["@@never@@", word])
    assert r.finish_reason == "stop" and r.stop_string == word and word not in r.text
    chunks = list(cluster.stream(prompt="The capital of France is", max_tokens=12, stop=[word]))
    assert chunks[-1].stop_string == word and all(c.stop_string == "" for c in chunks[:-1])
    assert cluster.generate(prompt="The capital of France is", max_tokens=3).stop_string == ""


def test_health_per_service(cluster):
    from specd_client import NotFound

    assert cluster.health() == "SERVING" and cluster.health("specd.v1.SpecDecode") == "SERVING"
    with pytest.raises(NotFound):
        cluster.health("specd.v1.Nope")


def test_stats_carry_the_cpu_paths_and_the_layout_each_verifier_chose(cluster):
    """GetStats: each verifier's probes of the optional CPU fast paths (`actors/cpu.py`), the
    weight layout it chose with its dtype (fp32 here: prepacked only where that layout runs), and
    whether its passes are exact (the default: yes, naming the attention path and the row plans)."""
    v = next(r for r in cluster.stats().replicas if r.role == "verifier")
    assert set(v.cpu_paths) == {"bf16", "prepack-bf16", "prepack-fp32", "int4pack", "block-kernel", "attn-kernel"}
    assert v.exact and v.exact_reason.startswith("exact (auto)") and "linears" in v.exact_reason
    assert v.dtype == "fp32" and v.dtype_reason.startswith("fp32+prepacked" if v.prepacked else "fp32")
    assert v.prepacked <= (v.cpu_paths["prepack-fp32"] == "ok")


def test_deadline_stops_the_sequence_and_frees_kv(cluster):
    t0 = time.time()
    with pytest.raises(DeadlineExceeded):
        r = cluster.generate(prompt="Count from one to one hundred: one, two,", max_tokens=128,
                             draft="truncated:4", timeout=0.5)
        print("finished in", time.time() - t0, r.finish_reason, len(r.token_ids))
    wait_kv_free(cluster)
    assert cluster.generate(prompt="The sky is", max_tokens=3).token_ids


def test_overload_is_resource_exhausted_and_others_complete(cluster):
    """max_queue = 3: a burst of 8 distinct requests gets RESOURCE_EXHAUSTED for the excess,
    and every admitted request still completes in full."""
    def one(i):
        try:
            return cluster.generate(prompt=f"Story number {i}: once upon a time", max_tokens=24, draft="none")
        except ResourceExhausted as e:
            return e
    with cf.ThreadPoolExecutor(8) as ex:
        out = list(ex.map(one, range(8)))
    rejected = [o for o in out if isinstance(o, ResourceExhausted)]
    done = [o for o in out if not isinstance(o, ResourceExhausted)]
    assert rejected and done
    assert all("router.max_queue = 3" in e.details for e in rejected)
    assert all(len(r.token_ids) == 24 for r in done)


def test_lost_draft_replicas_are_resynced_and_output_identical(cluster, hf_ref):
    """Kill both Draft replicas while a stream drafts on each: the verifier re-sends each
    sequence's committed tokens (and, for the feature head, every committed token's target
    hidden state) to a fresh replica, and both greedy outputs stay identical."""
    streams = {draft: cluster.stream(messages=QUESTION, max_tokens=32, draft=draft, gamma=2)
               for draft in ("truncated:4", "eagle")}
    got = {draft: list(next(it).token_ids) for draft, it in streams.items()}  # both under way
    for actor in ("Draft-truncated-4", "Draft-eagle"):
        name = next(a for a in ray.util.list_named_actors(all_namespaces=True) if actor in a["name"])
        ray.kill(ray.get_actor(name["name"], namespace=name["namespace"]), no_restart=True)

    def rest(draft):
        return got[draft] + [t for chunk in streams[draft] for t in chunk.token_ids]
    with cf.ThreadPoolExecutor(2) as ex:  # both streams read at once (the verifier batches them)
        out = dict(zip(streams, ex.map(rest, streams)))
    assert out == {"truncated:4": hf_ref, "eagle": hf_ref}
