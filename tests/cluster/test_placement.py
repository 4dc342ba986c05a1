"""Placement on a multi-node Ray cluster (ray.cluster_utils.Cluster, real raylets on one machine).

One node carries the small-accelerator resource, one the large. Draft replicas must land only
on the first, verifiers only on the second, and a request must still flow through both. Two
replicas of each: GetStats and GetLoad must report every one, and Abort must reach a stream on
whichever verifier replica holds it. The cluster requires a bearer token (auth.tokens_file).

The same cluster serves the OpenAI-compatible HTTP API (through the official `openai` client)
and exports Prometheus metrics on every node's metrics port (flushed every second here); a
second application on it (`specd-chat`, the embedded chat model) serves chat completions.
"""
import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pydantic
import pytest
import ray
import torch
from ray import serve

from cluster import serve as S
from cluster.app import build_app
from cluster.config import REPLICA_ENV, ClusterConfig
from specd_client import SpecdClient

TOKEN = "s3cret-token-for-tests-7f1c"
# greedy continuations of the tiny model that meet no EOS within 600 tokens (as in test_autoscaling)
LONG_PROMPTS = ["5 6 7 8 9", "11 12 13 14", "100 200 300", "42 43 44 45"]
DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "grafana-dashboard.json"


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text("# accepted bearer tokens\nanother-token\n" + TOKEN + "\n")
    return tokens


@pytest.fixture(scope="module")
def nodes(start_cluster, tokens_file):
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "_system_config": {"metrics_report_interval_ms": 1000}})  # metrics flushed every second
    small = c.add_node(num_cpus=2, resources={"small_accel": 2})
    large = c.add_node(num_cpus=2, resources={"large_accel": 2})
    ray.init(address=c.address)
    cfg = ClusterConfig.model_validate({
        "auth": {"tokens_file": str(tokens_file)},
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
    # the replica's process runs with the config's environment (by default, the malloc tuning and kernel-cache bounds)
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{v['pid']}/environ").read_text().split("\0") if "=" in kv)
    assert {k: env.get(k) for k in REPLICA_ENV} == REPLICA_ENV
    draft = serve.get_deployment_handle("Draft-truncated-2", app_name="specd")
    seen = {draft.stats.remote().result()["replica_id"]: draft.stats.remote().result()["node_id"]
            for _ in range(8)}
    assert set(seen.values()) == {small}
    # a draft replica's process too
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{draft.stats.remote().result()['pid']}/environ").read_text()
               .split("\0") if "=" in kv)
    assert {k: env.get(k) for k in REPLICA_ENV} == REPLICA_ENV


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


def test_prefix_routing_keeps_a_conversation_on_one_replica(nodes):
    """cluster/routing.py's PrefixRouter: the turns of a conversation (each prompt extends the last
    one with its answer) all go to one verifier replica, whose prefix cache serves them. (Serve's
    default choice would spread six turns over both replicas with probability 31/32.)"""
    addr, _, _ = nodes
    with SpecdClient(addr, timeout=60, token=TOKEN) as client:
        def per_replica() -> dict:
            return {r.replica_id: (r.prefix_cache_requests, r.prefix_cache_hits)
                    for r in client.stats().replicas if r.role == "verifier"}
        before = per_replica()
        prompt = " ".join(str(i) for i in range(40, 80))
        for turn in range(6):
            r = client.generate(prompt=prompt, max_tokens=8, gamma=0)
            prompt += " " + " ".join(map(str, r.token_ids)) + f" {turn + 3} {turn + 4}"
        after = per_replica()
    served = {k: after[k][0] - before[k][0] for k in after}
    assert sorted(served.values()) == [0, 6], served
    home = max(served, key=served.get)
    assert after[home][1] - before[home][1] >= 5 * 40  # each later turn reused at least the first 40 tokens


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
        # Serve picks the less loaded of two random replicas, by queue lengths it may have cached:
        # several streams can land on one replica before the other gets one, so keep adding
        # (distinct prompts: identical ones would coalesce) until both run one.
        for i in range(12):
            rid, prompt = f"long-{i}", f"{LONG_PROMPTS[i % len(LONG_PROMPTS)]} {300 + i}"
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
        # each replica by its id (cluster/routing.PinnedRouter): an unpinned call would go to the
        # idle replica, whose queue is shorter, not to the one running the stream
        replicas = [x.replica_id for x in client.load()]
        found, end = [], time.time() + 30  # until the stream has reached a verifier (slow on a loaded machine)
        while not found and time.time() < end:
            found = [i for r in replicas for i in verifier.options(session_id=r).abort_ids.remote(
                ["via-verifier"]).result()]
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


# ---- the OpenAI-compatible HTTP API ------------------------------------------------------------
def openai_client(token: str = TOKEN, prefix: str = "") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{S.http_address()}{prefix}/v1", api_key=token, max_retries=0, timeout=120)


SPEC = {"draft": "truncated:2", "gamma": 2, "return_token_ids": True}


def test_openai_completions_equal_the_grpc_path(nodes):
    """Completions through the `openai` client, streamed and not, give the tokens the SDK's gRPC
    call gives (greedy), the finish reason, usage and vLLM-shaped speculation metrics."""
    addr, _, _ = nodes
    oa = openai_client()
    assert [m.id for m in oa.models.list().data] == ["tiny"]
    with SpecdClient(addr, timeout=60, token=TOKEN) as client:
        ref = client.generate(prompt="7 8 9 10", max_tokens=12, draft="truncated:2", gamma=2)
    r = oa.completions.create(model="tiny", prompt="7 8 9 10", max_tokens=12, temperature=0, extra_body=SPEC)
    choice = r.choices[0]
    assert choice.token_ids == ref.token_ids and choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (4, 12)
    m = r.spec_decode_metrics
    assert (m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"]) == (
        ref.spec_stats["drafts"], ref.spec_stats["draft_tokens"], ref.spec_stats["accepted_tokens"])
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    assert m["draft_acceptance_rate"] == pytest.approx(m["num_accepted_tokens"] / m["num_draft_tokens"])
    assert m["acceptance_rate_per_pos"] == pytest.approx(ref.spec_stats["acceptance_per_position"])
    chunks = list(oa.completions.create(model="tiny", prompt=[7, 8, 9, 10], max_tokens=12, temperature=0, stream=True,
                                        extra_body=SPEC))
    assert [t for c in chunks for t in c.choices[0].token_ids] == ref.token_ids
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].spec_decode_metrics == m


def test_openai_logprobs_equal_a_plain_forward(nodes):
    """logprobs through the real cluster (remote draft, speculation on): each token's equals the
    target's log-softmax from a plain fp32 forward of prompt + output, and so do its alternatives."""
    from actors.models import load_model

    oa = openai_client()
    r = oa.completions.create(model="tiny", prompt="7 8 9 10 7 8 9 10", max_tokens=12, temperature=0, logprobs=2,
                              extra_body=SPEC)
    out, lp = r.choices[0].token_ids, r.choices[0].logprobs
    assert r.spec_decode_metrics["num_draft_tokens"] > 0
    model = load_model("tiny").model
    with torch.inference_mode():
        ids = [7, 8, 9, 10, 7, 8, 9, 10] + out
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, 7:-1].float(), -1)  # [12, V]
    assert lp.tokens == [f"token_id:{t}" for t in out]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), ref.gather(-1, torch.tensor(out)[:, None])[:, 0],
                               atol=1e-4, rtol=0)
    for j, top in enumerate(lp.top_logprobs):
        want = ref[j].topk(2)
        assert set(top) == {f"token_id:{t}" for t in want.indices.tolist()}
        torch.testing.assert_close(torch.tensor(sorted(top.values(), reverse=True)), want.values, atol=1e-4, rtol=0)


def test_openai_n_choices_reproduce_with_a_seed(nodes):
    """n = 2 sampled choices from the real engine (speculation on): the same seeded request gives
    the same two choices again, and the two differ from each other (seed and seed + 1)."""
    oa = openai_client()

    def ask():
        r = oa.completions.create(model="tiny", prompt="7 8 9 10", max_tokens=10, temperature=1.0, seed=11, n=2,
                                  extra_body=SPEC)
        return [c.token_ids for c in sorted(r.choices, key=lambda c: c.index)]
    first = ask()
    assert ask() == first and first[0] != first[1] and all(len(t) == 10 for t in first)


def test_openai_errors_have_openai_shape(nodes):
    """400 names the field and the limit (the router's own validation), a field the server cannot
    honour is refused by name while an unknown one is accepted, a wrong bearer token is 401, an
    unknown model 404."""
    oa = openai_client()
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model="tiny", prompt="5 6", max_tokens=5000)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "max_tokens" and "[1, 900]" in err["message"]
    assert err["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model="tiny", prompt="5 6", extra_body={"gamma": 17})
    assert e.value.body["param"] == "gamma" and "[0, 16]" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # a field the server cannot honour: refused by name
        oa.completions.create(model="tiny", prompt="5 6", extra_body={"tools": [{"type": "function"}]})
    assert e.value.body["param"] == "tools"
    # an unknown field is accepted (and named in the router's log), as vLLM does
    assert oa.completions.create(model="tiny", prompt="5 6", max_tokens=2, extra_body={"frobnicate": 1}).choices
    for token in ("wrong", TOKEN[:-1]):
        with pytest.raises(openai.AuthenticationError) as e:
            openai_client(token).completions.create(model="tiny", prompt="5 6", max_tokens=2)
        assert set(e.value.body) == {"message", "type", "param", "code"} and "bearer token" in e.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        openai_client("wrong").models.list()
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="gpt-4", prompt="5 6", max_tokens=2)


def test_an_http_client_that_disconnects_mid_stream_frees_its_kv(nodes):
    """Three streamed completions, each closed after two chunks: the router cancels their
    generations (none runs to its end) and within seconds no verifier replica holds target or
    draft KV for them."""
    addr, _, _ = nodes
    oa = openai_client()
    with SpecdClient(addr, timeout=60, token=TOKEN) as client:
        before = client.stats().tokens_total  # tokens of generations that ran to their end
    for prompt in LONG_PROMPTS[:3]:
        stream = oa.completions.create(model="tiny", prompt=prompt, max_tokens=800, stream=True,
                                       extra_body={"draft": "truncated:2", "gamma": 2})
        chunks = iter(stream)
        next(chunks), next(chunks)
        stream.close()  # the client goes away mid-generation
    with SpecdClient(addr, timeout=60, token=TOKEN) as client:
        end = time.time() + 30
        while True:
            load = client.load()
            used = [(r.kv_slots_in_use, r.draft_kv_slots_in_use, r.running) for r in load]
            if all(u == (0, 0, 0) for u in used) or time.time() > end:
                break
            time.sleep(0.2)
        assert len(load) == 2 and all(u == (0, 0, 0) for u in used), used
        assert client.stats().tokens_total == before  # cancelled, not run to their 800 tokens and then freed


def test_a_coalesced_stream_outlives_the_caller_that_started_it(nodes):
    """B joins A's generation (coalescing); A disconnects; B still gets the whole greedy output.
    (Regression: the generation's verifier call ran in A's Serve request context, and Serve cancels
    a disconnected request's calls, so B's stream died with A.)"""
    addr, _, _ = nodes
    prompt, n = LONG_PROMPTS[3], 600
    with SpecdClient(addr, timeout=120, token=TOKEN) as client:
        ref = client.generate(prompt=prompt, max_tokens=n, draft="truncated:2", gamma=2).token_ids
        coalesced = client.stats().coalesced_total
    oa = openai_client()
    kw = dict(model="tiny", prompt=prompt, max_tokens=n, stream=True,
              extra_body={"draft": "truncated:2", "gamma": 2, "return_token_ids": True})
    a = oa.completions.create(**kw)
    next(iter(a))  # A's generation is running
    b = oa.completions.create(**kw)  # B has its first message: it joined
    a.close()
    assert [t for c in b for t in c.choices[0].token_ids] == ref
    with SpecdClient(addr, timeout=60, token=TOKEN) as client:
        assert client.stats().coalesced_total == coalesced + 1


@pytest.fixture(scope="module")
def chat_app(nodes, tokens_file):
    """A second application on the cluster: the embedded chat model (an n-gram draft, off unless a
    request names it; no pool resources)."""
    addr, _, _ = nodes
    cfg = ClusterConfig.model_validate({
        "app_name": "specd-chat", "route_prefix": "/chat", "model": "smollm2", "dtype": "fp32", "max_len": 256,
        "auth": {"tokens_file": str(tokens_file)},
        "router": {"max_tokens": 64, "default_max_tokens": 8, "max_queue": 1},
        "verifier": {"max_batch": 2, "resources": {}},
        "drafts": [{"name": "ngram", "spec": "ngram", "placement": "colocated", "default_gamma": 4}]})
    serve.run(build_app(cfg), name=cfg.app_name, route_prefix=cfg.route_prefix, blocking=False)
    with SpecdClient(addr, timeout=120, token=TOKEN, app_name=cfg.app_name) as client:
        S.wait_serving(client, timeout=180)
        yield client


def test_openai_chat_completions_equal_the_grpc_path(chat_app):
    """Chat completions, streamed and not: the text and tokens of the SDK's gRPC call (greedy)."""
    messages = [{"role": "user", "content": "Name a color."}]
    ref = chat_app.generate(messages=messages, max_tokens=8)
    oa = openai_client(prefix="/chat")
    r = oa.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0,
                                   extra_body={"return_token_ids": True})
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].token_ids == ref.token_ids and r.usage.completion_tokens == len(ref.token_ids)
    assert r.spec_decode_metrics["num_drafts"] == 0  # no draft: speculation off
    chunks = list(oa.chat.completions.create(model="smollm2", messages=messages, max_completion_tokens=8,
                                             temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_vllm_tokenize_and_detokenize_match_what_the_server_feeds(chat_app):
    """vLLM's /tokenize and /detokenize under the app's prefix (`vllm bench serve` aligns its prompt
    lengths with them): a chat's ids are the ones the completion counts as its prompt, a prompt's
    text comes back from its ids, and the errors are the API's (401, 404, 400 naming the field)."""
    messages = [{"role": "user", "content": "Name a color."}]
    r = openai_client(prefix="/chat").chat.completions.create(model="smollm2", messages=messages, max_tokens=1)
    root, auth = f"http://{S.http_address()}/chat", {"Authorization": f"Bearer {TOKEN}"}

    def post(path: str, body: dict, headers=auth) -> tuple[int, dict]:
        req = urllib.request.Request(root + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, tok = post("/tokenize", {"model": "smollm2", "messages": messages})
    assert status == 200 and tok["count"] == len(tok["tokens"]) == r.usage.prompt_tokens
    assert tok["max_model_len"] == 256
    text = "The quick brown fox"
    ids = post("/tokenize", {"model": "smollm2", "prompt": text, "add_special_tokens": False})[1]["tokens"]
    assert post("/detokenize", {"model": "smollm2", "tokens": ids}) == (200, {"prompt": text})
    status, bad = post("/detokenize", {"model": "smollm2", "tokens": [1, 10 ** 6]})
    assert status == 400 and bad["error"]["param"] == "tokens"
    assert "tokens[1] must be in [0, 49152)" in bad["error"]["message"]
    assert post("/tokenize", {"model": "other", "prompt": text})[0] == 404
    assert post("/tokenize", {"prompt": text}, headers={})[0] == 401


class Person(pydantic.BaseModel):
    name: str
    age: int
    city: str


def test_openai_structured_output_parses_and_speculation_changes_nothing(chat_app):
    """The official client's structured-output helper (`chat.completions.parse` with a pydantic
    model: response_format json_schema, strict) against the cluster: the answer parses into the
    model, with speculation off and on (n-gram, drafting), token for token the same."""
    oa = openai_client(prefix="/chat")
    messages = [{"role": "user", "content": "Give me a JSON record for Alice, 30, who lives in Paris."}]
    outs = []
    for extra in ({"draft": "none"}, {"draft": "ngram", "gamma": 4}):
        r = oa.chat.completions.parse(model="smollm2", messages=messages, response_format=Person, max_tokens=60,
                                      temperature=0, extra_body={**extra, "return_token_ids": True})
        assert isinstance(r.choices[0].message.parsed, Person) and r.choices[0].finish_reason == "stop"
        outs.append((r.choices[0].token_ids, r.spec_decode_metrics["num_draft_tokens"]))
    assert outs[0][0] == outs[1][0] and outs[0][1] == 0 and outs[1][1] > 0


def test_openai_overload_is_429_and_coalescing_applies(chat_app):
    """The chat app admits one generation (router.max_queue = 1): while a stream runs, an identical
    greedy request joins it (coalesced: same text), and a different one is refused with 429."""
    oa = openai_client(prefix="/chat")
    story = [{"role": "user", "content": "Tell me a long story about a dragon who loves tea."}]
    ask = dict(model="smollm2", messages=story, max_tokens=32, temperature=0)
    stream = oa.chat.completions.create(stream=True, **ask)
    first = next(iter(stream))  # the generation runs on whether or not this client reads
    with pytest.raises(openai.RateLimitError) as e:
        oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert e.value.status_code == 429 and "max_queue" in e.value.body["message"]
    joined = oa.chat.completions.create(**ask)
    text = first.choices[0].delta.content + "".join(c.choices[0].delta.content or "" for c in stream)
    assert joined.choices[0].message.content == text and joined.usage.completion_tokens == 32


# ---- Prometheus metrics ----------------------------------------------------------------------------
def scrape() -> list:
    """Every sample on every node's metrics endpoint."""

    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for url in S.metrics_endpoints():
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        out += [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    return out


def total(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_count_exactly_what_the_responses_say(nodes):
    """Requests over HTTP, streamed and not: the verifiers' speculation and token counters (summed
    over both replicas) move by exactly the sums of the responses' own stats, the router's
    histograms count each request once, the gauges settle, and every metric the Grafana
    dashboard queries is in the scrape."""
    V = {"application": "specd", "deployment": "Verifier", "draft": "truncated:2"}
    R = {"application": "specd", "deployment": "Router", "draft": "truncated:2"}
    counters = {"num_drafts": "spec_decode_num_drafts", "num_draft_tokens": "spec_decode_num_draft_tokens",
                "num_accepted_tokens": "spec_decode_num_accepted_tokens"}

    def counts(samples) -> dict:
        c = {k: total(samples, f"ray_specd_{name}_total", **V) for k, name in counters.items()}
        c["generation_tokens"] = total(samples, "ray_specd_generation_tokens_total", **V)
        for j in range(2):
            for k, name in (("num_accepted_tokens_per_pos", "accepted_tokens"), ("num_draft_tokens_per_pos", "draft_tokens")):
                c[k, j] = total(samples, f"ray_specd_spec_decode_num_{name}_per_pos_total", position=str(j), **V)
        for h in ("time_to_first_token", "e2e_request_latency"):
            c[h] = total(samples, f"ray_specd_{h}_seconds_count", **R)
        return c
    before = counts(scrape())
    want = dict.fromkeys(before, 0)
    oa = openai_client()
    prompts = ["21 22 23", "31 32 33 34", "41 42"]
    for i, p in enumerate(prompts):
        if i % 2:
            m = list(oa.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0, stream=True,
                                           extra_body=SPEC))[-1].spec_decode_metrics
        else:
            m = oa.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0,
                                      extra_body=SPEC).spec_decode_metrics
        for k in counters:
            want[k] += m[k]
        for j in range(2):
            want["num_accepted_tokens_per_pos", j] += m["num_accepted_tokens_per_pos"][j]
            want["num_draft_tokens_per_pos", j] += m["num_draft_tokens_per_pos"][j]
    n = len(prompts)
    want.update(generation_tokens=10 * n, time_to_first_token=n, e2e_request_latency=n)
    assert want["num_accepted_tokens"] > 0 and want["num_draft_tokens_per_pos", 1] > 0
    end, moved = time.time() + 30, {}
    while time.time() < end:  # Ray flushes each worker's metrics every second here
        samples = scrape()
        moved = {k: v - before[k] for k, v in counts(samples).items()}
        if moved == want:
            break
        time.sleep(0.5)
    assert moved == want

    # gauges: idle verifiers, both replicas reporting γ and dtype; both draft replicas their KV
    def series(name: str, app: str = "specd") -> list:
        return [s for s in samples if s.name == name and s.labels.get("application") == app]
    running = series("ray_specd_num_requests_running")
    assert all(s.value == 0 for s in running) and len({s.labels["replica"] for s in running}) == 2
    assert {(s.labels["replica"], s.labels["draft"]) for s in series("ray_specd_spec_decode_gamma")} == {
        (r, "truncated:2") for r in {s.labels["replica"] for s in running}}
    assert [s.labels["dtype"] for s in series("ray_specd_model_dtype_info")] == ["fp32"] * 2
    draft_kv = series("ray_specd_draft_kv_cache_usage_perc")
    assert {s.labels["deployment"] for s in draft_kv} == {"Draft-truncated-2"} and len(draft_kv) == 2, [
        s.labels for s in samples if s.name == "ray_specd_draft_kv_cache_usage_perc"]
    # the chat application's test refused one request and coalesced another
    assert total(samples, "ray_specd_admission_rejections_total", application="specd-chat") == 1
    assert total(samples, "ray_specd_coalesced_requests_total", application="specd-chat") == 1

    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    queried = {name for e in exprs for name in re.findall(r"\bray_specd_\w+", e)}
    assert len(queried) >= 15 and queried <= {s.name for s in samples}, queried - {s.name for s in samples}


# ---- last: it kills a verifier replica -------------------------------------------------------------
FAILOVER_TOKENS = 320  # long enough that the streams are still running when the replica dies


def test_verifier_replica_killed_mid_stream_resumes_on_the_other(nodes):
    """Streams on both verifier replicas (three greedy, one seeded sampled); one replica's process
    is SIGKILLed mid-stream. The router resumes each of its streams on the surviving replica from
    the prompt plus the tokens already sent: every stream ends with exactly the tokens of an
    undisturbed run (none lost, none repeated), the usage counts them once, and GetStats counts
    the failovers. (Without failover the streams on the killed replica fail with an error.)"""
    import concurrent.futures as cf
    import os
    import signal
    import threading

    addr, _, _ = nodes
    asks = {f"fo-{i}": dict(prompt=p, max_tokens=FAILOVER_TOKENS, draft="truncated:2", gamma=2)
            for i, p in enumerate(LONG_PROMPTS[:3])}
    asks["fo-seeded"] = dict(prompt=LONG_PROMPTS[3], max_tokens=FAILOVER_TOKENS, temperature=0.9, seed=11,
                             draft="truncated:2", gamma=2)
    with SpecdClient(addr, timeout=120, token=TOKEN) as client:
        with cf.ThreadPoolExecutor(len(asks)) as ex:  # undisturbed runs
            ref = dict(zip(asks, ex.map(lambda rid: client.generate(request_id=rid, **asks[rid]).token_ids, asks)))
        before = client.stats().failovers_total
        verifier = serve.get_deployment_handle("Verifier", app_name="specd")
        pids = {}
        for _ in range(16):
            st = verifier.stats.remote().result()
            pids[st["replica_id"]] = st["pid"]
        assert len(pids) == 2
        assert len(client.load()) == 2  # the router's pinned handles know both replicas before the kill
        chunks: dict[str, list] = {rid: [] for rid in asks}
        errors: dict[str, Exception] = {}

        def run(rid):
            try:
                for c in client.stream(request_id=rid, **asks[rid]):
                    chunks[rid].append(c)
            except Exception as e:  # noqa: BLE001  (reported by the assertion below)
                errors[rid] = e
        threads = [threading.Thread(target=run, args=(rid,), daemon=True) for rid in asks]
        for t in threads:
            t.start()
        # Kill early: as soon as tokens flow and a replica runs a stream. Every stream takes seconds,
        # so the victim's are mid-way (a stream still queued there fails over from its start).
        # Waiting for every stream to be under way could wait until the victim's first streams
        # were at their end (a verifier runs two at a time; Serve may queue a third behind them).
        end = time.time() + 30
        while time.time() < end:
            victim = max(client.load(), key=lambda x: x.running)
            if victim.running >= 1 and any(len(c) >= 2 for c in chunks.values()):
                break
            time.sleep(0.02)
        os.kill(pids[victim.replica_id], signal.SIGKILL)
        sent = {rid: sum(len(x.token_ids) for x in c) for rid, c in list(chunks.items())}
        assert victim.running >= 1 and max(sent.values()) < FAILOVER_TOKENS // 2, sent
        for t in threads:
            t.join(120)
        assert not errors, errors
        for rid, want in ref.items():
            got = [t for c in chunks[rid] for t in c.token_ids]
            assert got == want, rid
            assert chunks[rid][-1].finish_reason == "length" and chunks[rid][-1].usage.completion_tokens == len(want)
        assert client.stats().failovers_total - before >= 1
