"""The router without Ray: the real router deployment (the transport-neutral core and its gRPC
adapter, `RouterDeployment`) over a fake verifier handle that streams from a real in-process
engine (tiny model), driven with real proto messages.

  * validation is the request schema's: INVALID_ARGUMENT carries exactly the message the engine
    raises for the same request;
  * the time a request has left crosses to the verifier as a duration, never as a wall-clock
    deadline (regression: an absolute time.time() deadline, wrong under clock skew);
  * prompts are tokenized off the event loop;
  * two in-flight requests with the same request_id each get their own output;
  * admission: of requests validated together, exactly `router.max_queue` are admitted and the rest
    get RESOURCE_EXHAUSTED, and a generation cancelled before its task ran gives its place back;
  * health: NOT_SERVING until a verifier answers, NOT_FOUND for unknown services;
  * Abort ends one caller's stream, also of a coalesced generation, which goes on for the other;
  * bearer tokens: none, a wrong one or another scheme is UNAUTHENTICATED on every RPC.
"""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from actors.drafters import NgramDrafter
from actors.engine import SpecEngine
from actors.llama import LlamaRunner
from actors.schema import Request, SamplingParams, SpeculationParams
from cluster.config import ClusterConfig
from cluster.grpc_api import RouterDeployment as Router
from cluster.router import RouterError, Status
from protos import specd_pb2
from specd_client import build_request

CONFIG = {"model": "tiny", "dtype": "fp32", "max_len": 128,
          "router": {"max_queue": 8, "max_tokens": 32, "default_max_tokens": 8, "coalesce": True,
                     "default_draft": "ngram"},
          "drafts": [{"name": "ngram", "spec": "ngram", "default_gamma": 3}]}


class FakeVerifier:
    """`handle.options(stream=True).generate.remote(req, timeout_s)` -> an async stream of the
    engine's deltas for that request; records what it was called with."""

    def __init__(self, engine: SpecEngine):
        self.engine, self.calls = engine, []
        self.generate = self
        self.pending: dict[int, list] = {}  # key -> deltas stepped out but not yet streamed

    def options(self, **_):
        return self

    def remote(self, req: Request, timeout_s=None):
        self.calls.append((req, timeout_s))
        return self._stream(req)

    async def _stream(self, req: Request):
        key = self.engine.add_request(req)
        self.pending[key] = []
        while True:
            if not self.pending[key]:
                for k, d in self.engine.step().items():
                    self.pending[k].append(d)
            while self.pending[key]:
                d = self.pending[key].pop(0)
                yield d
                if d.finished:
                    return
            await asyncio.sleep(0)


class Context:
    def __init__(self, remaining=None, metadata=()):
        self.remaining, self.code, self.details, self.metadata = remaining, None, None, list(metadata)

    def invocation_metadata(self):
        return self.metadata

    def time_remaining(self):
        return self.remaining

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


@pytest.fixture
def router(tiny):
    eng = SpecEngine(LlamaRunner(tiny.model), {"ngram": NgramDrafter()}, max_batch=4, max_len=128,
                     default_gamma={"ngram": 3})
    return Router(CONFIG, FakeVerifier(eng))


def generate(router, req_pb, ctx=None):
    async def go():
        return [d async for d, _ in router._stream(req_pb, ctx or Context())]
    return asyncio.run(go())


BAD = [dict(prompt="1 2 3", max_tokens=0), dict(prompt="1 2 3", max_tokens=33), dict(prompt="1 2 3", top_p=2.0),
       dict(prompt="1 2 3", temperature=-1.0), dict(prompt="1 2 3", draft="nope"),
       dict(prompt="1 2 3", draft="ngram", gamma=17), dict(prompt="1 2 3", top_k=-2)]


@pytest.mark.parametrize("kw", BAD, ids=lambda kw: "-".join(k for k in kw if k != "prompt"))
def test_invalid_argument_message_is_the_engine_s(router, kw):
    with pytest.raises(RouterError) as ei:
        generate(router, build_request(**kw))
    assert ei.value.status == Status.INVALID_ARGUMENT
    # The same request, built by hand for the engine with the router's limits, fails identically.
    from actors.schema import SamplingParams, SpeculationParams, validate
    r = build_request(**kw)
    req = Request("x", [1, 2, 3], SamplingParams(max_tokens=r.sampling.max_tokens if r.sampling.HasField("max_tokens")
                                                 else None, temperature=r.sampling.temperature, top_k=r.sampling.top_k,
                                                 top_p=r.sampling.top_p if r.sampling.HasField("top_p") else 1.0),
                  SpeculationParams(r.speculation.draft or None,
                                    r.speculation.gamma if r.speculation.HasField("gamma") else None))
    with pytest.raises(ValueError) as ve:
        validate(req, ClusterConfig.model_validate(CONFIG).limits())
    assert str(ve.value) == ei.value.message


def test_time_left_crosses_as_a_duration(router):
    out = generate(router, build_request(prompt="5 6 7 8", max_tokens=6), Context(remaining=7.5))
    assert out[-1].finished
    req, timeout_s = router.verifier.calls[-1]
    assert timeout_s == 7.5  # seconds left, to be added to the verifier's own clock
    assert not any("deadline" in str(v) for v in vars(req).values())


def test_prompts_are_tokenized_off_the_event_loop(tiny):
    threads = []

    class Tok:  # records the thread it runs on; stands in for a slow tokenizer
        chat_template = None

        def encode(self, text, add_special_tokens=False):
            threads.append(threading.current_thread())
            return [int(t) for t in text.split()]

    eng = SpecEngine(LlamaRunner(tiny.model), {"ngram": NgramDrafter()}, max_batch=4, max_len=128)
    r = Router(CONFIG, FakeVerifier(eng))
    r.tokenizer = Tok()

    async def go():
        loop_thread = threading.current_thread()
        req = await r.request("", SamplingParams(), SpeculationParams(), prompt="5 6 7")
        return loop_thread, req
    loop_thread, req = asyncio.run(go())
    assert req.prompt_ids == [5, 6, 7] and threads and threads[0] is not loop_thread


def test_same_request_id_twice_in_flight(router, tiny, hf_greedy):
    async def both():
        a = build_request(prompt="5 6 7 8", max_tokens=12, request_id="dup")
        b = build_request(prompt="9 10 11", max_tokens=12, request_id="dup")

        async def one(pb):
            return [t for d, _ in [x async for x in router._stream(pb, Context())] for t in d.token_ids]
        return await asyncio.gather(one(a), one(b))
    a, b = asyncio.run(both())
    assert a == hf_greedy(tiny.model, [5, 6, 7, 8], 12, eos=None)
    assert b == hf_greedy(tiny.model, [9, 10, 11], 12, eos=None)


def test_admission_counts_requests_validated_together(router, tiny, hf_greedy):
    """Twelve distinct requests arrive at once for eight places: exactly four are refused. (Regression:
    the place was counted when the generation's task first ran, so callers whose validation finished
    together all passed the check and none was refused.)"""
    prompts = [[20 + i, 21 + i, 22 + i] for i in range(12)]
    plain = router.verifier._stream
    rejected_before = router.counters["rejected_total"]

    async def held(req):  # no generation ends before every caller has had its admission answer
        deadline = time.monotonic() + 30
        while router.admitted + router.counters["rejected_total"] - rejected_before < len(prompts):
            assert time.monotonic() < deadline, (
                f"30 s and only {router.admitted} admitted + "
                f"{router.counters['rejected_total'] - rejected_before} refused of {len(prompts)} callers")
            await asyncio.sleep(0.001)
        async for d in plain(req):
            yield d
    router.verifier._stream = held

    async def all_at_once():
        async def one(ids):
            try:
                return [t for d, _ in [x async for x in router._stream(build_request(token_ids=ids, max_tokens=6),
                                                                        Context())] for t in d.token_ids]
            except RouterError as e:
                return e
        return await asyncio.gather(*map(one, prompts))
    out = asyncio.run(all_at_once())
    refused = [o for o in out if isinstance(o, RouterError)]
    assert len(refused) == 12 - 8
    assert all(e.status == Status.RESOURCE_EXHAUSTED and "router.max_queue = 8" in e.message for e in refused)
    for ids, o in zip(prompts, out):
        if not isinstance(o, RouterError):
            assert o == hf_greedy(tiny.model, ids, 6, eos=None)
    assert router.admitted == 0 and not router.inflight


def test_generation_cancelled_before_it_ran_gives_back_its_place(router):
    """The only caller leaves before its generation's task first runs (its body never executes):
    the admission place and the coalescing entry are still given back, so a later identical
    request is served instead of joining a generation that will never finish."""
    pb = build_request(prompt="5 6 7 8", max_tokens=6)

    async def go():
        agen = router._stream(pb, Context())
        first = asyncio.ensure_future(agen.__anext__())
        while router.admitted == 0:  # admitted, its pump task created but not yet run
            await asyncio.sleep(0)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await agen.aclose()
        for _ in range(3):
            await asyncio.sleep(0)  # let the task's done callback run
        assert router.admitted == 0 and not router.inflight
        return [t for d, _ in [x async for x in router._stream(pb, Context())] for t in d.token_ids]
    assert len(asyncio.run(go())) == 6


def test_wire_conversion_keeps_presence(router):
    """An unset field stays unset until the schema applies the server default."""
    from cluster.wire import request_from_proto

    req = asyncio.run(router.request(**request_from_proto(specd_pb2.GenerateRequest(prompt="4 5 6"))))
    assert req.sampling.max_tokens == 8 and req.speculation.draft == "ngram" and req.speculation.gamma == 3
    req = asyncio.run(router.request(**request_from_proto(build_request(prompt="4 5 6", gamma=0, max_tokens=3))))
    assert req.sampling.max_tokens == 3 and req.draft is None and req.gamma == 0
    assert req.sampling.ignore_eos is False
    req = asyncio.run(router.request(**request_from_proto(build_request(prompt="4 5 6", ignore_eos=True))))
    assert req.sampling.ignore_eos is True  # vLLM's ignore_eos crosses the wire
    req = asyncio.run(router.request(**request_from_proto(build_request(
        prompt="4 5 6", presence_penalty=0.5, frequency_penalty=-0.1, repetition_penalty=1.1))))
    assert req.sampling.penalties == (0.5, -0.1, 1.1)
    # a penalty changes the output: coalescing keys on it
    plain = asyncio.run(router.request(**request_from_proto(build_request(prompt="4 5 6"))))
    assert router._coalesce_key(req) != router._coalesce_key(plain)
    with pytest.raises(RouterError) as ei:
        generate(router, build_request(prompt="4 5 6", repetition_penalty=0.0))
    assert ei.value.status == Status.INVALID_ARGUMENT
    assert ei.value.message == "sampling.repetition_penalty must be in (0, 10.0], got 0.0"


def test_health_is_not_serving_until_a_verifier_answers(router):
    """grpc.health.v1 Check: NOT_SERVING while no verifier replica has loaded (its health call
    does not return: Serve holds calls until a replica is up), SERVING once one answers, and
    NOT_FOUND for a service this server does not have. (The verifier handle is a fake here;
    tests/cluster/ checks SERVING on a real cluster.)"""
    from grpc_health.v1 import health_pb2

    class Loading:  # a handle whose replica is still constructing
        async def _never(self):
            await asyncio.sleep(3600)

        def remote(self):
            return self._never()

    class Ready:
        async def _ok(self):
            return None

        def remote(self):
            return self._ok()

    def check(service):
        ctx = Context()
        return asyncio.run(router.Check(health_pb2.HealthCheckRequest(service=service), ctx)), ctx

    S = health_pb2.HealthCheckResponse
    router.HEALTH_TIMEOUT_S = 0.05
    router.verifier.check_health = Loading()
    for service in ("", "specd.v1.SpecDecode"):
        assert check(service)[0].status == S.NOT_SERVING
    router.verifier.check_health = Ready()
    for service in ("", "specd.v1.SpecDecode"):
        assert check(service)[0].status == S.SERVING
    resp, ctx = check("specd.v1.Nope")
    assert ctx.code == grpc.StatusCode.NOT_FOUND and "specd.v1.Nope" in ctx.details


def test_abort_ends_one_caller_of_a_coalesced_generation(router, tiny, hf_greedy):
    """Two identical greedy requests share one generation (coalescing); Abort of the first id
    ends that caller's stream with finish reason "abort" and usage counting what it received,
    while the other caller still gets the whole output. Unknown ids are not reported."""
    ref = hf_greedy(tiny.model, [5, 6, 7, 8], 24, eos=None)

    async def go():
        a = build_request(prompt="5 6 7 8", max_tokens=24, request_id="A", gamma=0)
        b = build_request(prompt="5 6 7 8", max_tokens=24, request_id="B", gamma=0)
        got = {"A": [], "B": []}
        # The generation pauses after two deltas until B has joined it: on a fast machine it would
        # otherwise end, or lose its only caller to the abort, before B's prompt is tokenized.
        joined, plain = asyncio.Event(), router.verifier._stream

        async def gated(req):
            n = 0
            async for d in plain(req):
                yield d
                n += 1
                if n == 2:
                    await joined.wait()
        router.verifier._stream = gated

        async def one(pb):
            async for d, _ in router._stream(pb, Context()):
                got[pb.request_id].append(d)
                if pb.request_id == "A" and len(got["A"]) == 2:
                    while router.counters["coalesced_total"] == 0:
                        await asyncio.sleep(0.001)
                    resp = await router.Abort(specd_pb2.AbortRequest(request_ids=["A", "nope"]), Context())
                    assert list(resp.aborted) == ["A"]
                    joined.set()
        await asyncio.gather(one(a), one(b))
        return got
    got = asyncio.run(go())
    a, b = got["A"], got["B"]
    assert a[-1].finish_reason == "abort" and a[-1].completion_tokens == sum(len(d.token_ids) for d in a) < 24
    assert [t for d in b for t in d.token_ids] == ref and b[-1].finish_reason == "length"
    assert router.counters["coalesced_total"] == 1 and not router.subscriptions


def test_bearer_tokens(tiny, tmp_path, monkeypatch):
    eng = SpecEngine(LlamaRunner(tiny.model), {"ngram": NgramDrafter()}, max_batch=4, max_len=128)
    (tmp_path / "tokens").write_text("# comment\n tok-a , tok-b\n\n")
    monkeypatch.setenv("SPECD_TEST_TOKENS", "tok-c")
    r = Router({**CONFIG, "auth": {"tokens_file": str(tmp_path / "tokens"), "tokens_env": "SPECD_TEST_TOKENS"}},
               FakeVerifier(eng))
    ok = build_request(prompt="5 6 7", max_tokens=2)
    for tok in ("tok-a", "tok-b", "tok-c"):
        assert generate(r, ok, Context(metadata=[("authorization", f"Bearer {tok}")]))[-1].finished
    # each token is its own tenant (a suffix draft's cache scope, coalescing): a digest, never the token
    tenants = [req.tenant for req, _ in r.verifier.calls[-3:]]
    assert len(set(tenants)) == 3 and all(t and "tok" not in t for t in tenants)
    for md in ([], [("authorization", "Bearer tok-")], [("authorization", "Basic tok-a")],
               [("authorization", "Bearer # comment")], [("x-token", "tok-a")]):
        with pytest.raises(RouterError) as ei:
            generate(r, ok, Context(metadata=md))
        assert ei.value.status == Status.UNAUTHENTICATED
        assert not any(v.split()[-1] in ei.value.message for _, v in md)  # what was sent is not echoed
        for rpc, msg in ((r.GetStats, specd_pb2.StatsRequest()), (r.GetLoad, specd_pb2.LoadRequest()),
                         (r.ListModels, specd_pb2.ListModelsRequest()),
                         (r.Abort, specd_pb2.AbortRequest(request_ids=["x"]))):
            ctx = Context(metadata=md)
            asyncio.run(rpc(msg, ctx))
            assert ctx.code == grpc.StatusCode.UNAUTHENTICATED, rpc.__name__
    monkeypatch.delenv("SPECD_TEST_TOKENS")
    with pytest.raises(ValueError, match="SPECD_TEST_TOKENS"):  # a named source that is missing
        Router({**CONFIG, "auth": {"tokens_env": "SPECD_TEST_TOKENS"}}, FakeVerifier(eng))


def test_a_request_may_name_a_draft_by_the_spec_it_serves():
    """The README's `openai` example sends draft "default"; the shipped config serves that spec as
    "eagle" (and "truncated:4" under its own name). Either name reaches the same draft; an unknown
    one is still refused, listing the names and the specs they serve."""
    from dataclasses import replace

    from actors.schema import SpeculationParams, validate
    from cluster.config import LOCAL_CONFIG

    limits = ClusterConfig.load(LOCAL_CONFIG).limits()
    assert limits.aliases == {"default": "eagle"}
    req = Request("r", [5, 6, 7], speculation=SpeculationParams(draft="default", gamma="auto"))
    for draft in ("default", "eagle"):
        assert validate(replace(req, speculation=SpeculationParams(draft=draft)), limits).speculation.draft == "eagle"
    with pytest.raises(ValueError, match=r"unknown; available: .* \(or the specs they serve: \['default'\]\)"):
        validate(replace(req, speculation=SpeculationParams(draft="nope")), limits)


def test_logprobs_cross_the_wire_to_the_sdk():
    """A delta's per-token log-probabilities reach the SDK's Chunk and Result (gRPC), and the
    request's k and grammar cross the other way."""
    from actors.schema import Delta, TokenLogprob
    from cluster.wire import delta_to_proto, sampling_from_proto
    from specd_client.client import _chunk, _result

    d = Delta("r", [5, 6], "", logprobs=[TokenLogprob(5, -0.5, [(5, -0.5), (9, -1.5)]), TokenLogprob(6, -0.25)])
    pb = delta_to_proto(d, "r", False)
    for got in (_chunk(pb).logprobs, _result(pb).logprobs):
        assert [(x.token_id, x.logprob, x.top) for x in got] == [(5, -0.5, [(5, -0.5), (9, -1.5)]), (6, -0.25, [])]
    assert sampling_from_proto(build_request(prompt="1", logprobs=3).sampling).logprobs == 3
    assert sampling_from_proto(build_request(prompt="1").sampling).logprobs is None
    g = ("json_schema", '{"type": "object"}')  # and a grammar (structured output)
    assert sampling_from_proto(build_request(prompt="1", grammar=g).sampling).grammar == g
    assert sampling_from_proto(build_request(prompt="1").sampling).grammar is None
