"""The client SDK (specd_client) against a scripted gRPC server over loopback.

The server here is a TEST DOUBLE for the client's transport behaviour only:
a small scripted SpecDecode servicer plus the standard grpc.health.v1 servicer,
behind an interceptor that rejects calls lacking the Ray Serve `application`
metadata (as Ray Serve's proxy does), counts calls per method and can be told
to fail the first N calls with UNAVAILABLE, to fail with INVALID_ARGUMENT /
RESOURCE_EXHAUSTED, to stall, or to break a stream after k chunks. It echoes
the prompt as deterministic tokens. The real server (Ray Serve ingress, engine)
is tested elsewhere.

Behaviour tests run against both SpecdClient and AsyncSpecdClient (the async
one through a small event-loop facade); test_async_native uses the async API
directly. Retries are gRPC's own (the channel's service config): the tests count
the attempts the double sees. test_sdk_imports_only_grpc_and_protobuf proves the
import isolation in a fresh venv that has only grpcio, protobuf and
grpcio-health-checking; test_sdk_install.py installs the SDK's own wheel and
streams from `serve()` here.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import specd_client
from protos import specd_pb2, specd_pb2_grpc
from specd_client import (
    AsyncSpecdClient,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SpecdClient,
    SpecdError,
    Unavailable,
)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MAX_TOKENS = 16  # the double's "server default" for max_tokens = 0
CHUNK = 3  # tokens per streamed message


# ------------------------------------------------------------ the test double

class Script:
    """What the double does next; reset before every test."""

    def __init__(self):
        self.lock = threading.Lock()
        self.app = "specd"  # required `application` metadata value (None: must be absent)
        self.fail_unavailable = 0  # fail the next N calls (any method) with UNAVAILABLE
        self.error: tuple[grpc.StatusCode, str] | None = None  # fail every SpecDecode call with this
        self.delay = 0.0  # seconds to stall before answering (respects cancellation)
        self.break_stream_after: int | None = None  # abort a stream with UNAVAILABLE after k chunks
        self.coalesced = False
        self.calls: dict[str, int] = {}  # method name -> calls seen (including rejected ones)
        self.metadata: list[dict] = []
        self.requests: list = []  # GenerateRequests received

    def count(self, method: str) -> int:
        return self.calls.get(method, 0)


def _abort_handler(code, details):
    def handler(request, context):
        context.abort(code, details)
    return handler


class Interceptor(grpc.ServerInterceptor):
    """Counts calls, enforces the application metadata, injects UNAVAILABLE failures."""

    def __init__(self, script: Script):
        self.script = script

    def intercept_service(self, continuation, details):
        s = self.script
        method = details.method.rsplit("/", 1)[-1]
        md = dict(details.invocation_metadata)
        with s.lock:
            s.calls[method] = s.calls.get(method, 0) + 1
            s.metadata.append(md)
            fail = s.fail_unavailable > 0
            if fail:
                s.fail_unavailable -= 1
        handler = continuation(details)
        if md.get("application") != s.app:
            failure = (grpc.StatusCode.NOT_FOUND, f"application {md.get('application')!r} not found")
        elif fail:
            failure = (grpc.StatusCode.UNAVAILABLE, "no replica ready (scripted)")
        else:
            return handler
        abort = _abort_handler(*failure)
        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(abort)
        return grpc.unary_unary_rpc_method_handler(abort)


def _source(req: specd_pb2.GenerateRequest) -> str:
    return req.prompt if req.WhichOneof("input") == "prompt" else req.messages.messages[-1].content


SPEC = dict(drafts=2, draft_tokens=8, accepted_tokens=6, acceptance_rate=0.75, mean_accepted_length=4.0,
            acceptance_per_position=[1.0, 0.75, 0.5, 0.25], target_passes=3, draft_seconds=0.5,
            verify_seconds=1.5)


class Servicer(specd_pb2_grpc.SpecDecodeServicer):
    """Echoes the prompt (or the last chat message) as tokens = code points, one char per token."""

    def __init__(self, script: Script):
        self.s = script

    def _begin(self, request, context):
        with self.s.lock:
            self.s.requests.append(request)
        end = time.monotonic() + self.s.delay
        while time.monotonic() < end and context.is_active():
            time.sleep(0.005)
        if self.s.error:
            context.abort(*self.s.error)
        src = _source(request)
        n = request.sampling.max_tokens or DEFAULT_MAX_TOKENS
        text = src[:n]
        reason = specd_pb2.FINISH_REASON_LENGTH if len(src) >= n else specd_pb2.FINISH_REASON_STOP
        rid = request.request_id or "srv-1"
        return rid, text, reason

    def Generate(self, request, context):
        rid, text, reason = self._begin(request, context)
        return specd_pb2.GenerateResponse(
            request_id=rid, text=text, token_ids=[ord(c) for c in text], finish_reason=reason,
            usage=specd_pb2.Usage(prompt_tokens=len(_source(request)), completion_tokens=len(text)),
            spec_stats=specd_pb2.SpecStats(**SPEC), coalesced=self.s.coalesced)

    def GenerateStream(self, request, context):
        rid, text, reason = self._begin(request, context)
        pieces = [text[i:i + CHUNK] for i in range(0, len(text), CHUNK)] or [""]
        for k, piece in enumerate(pieces):
            if self.s.break_stream_after is not None and k == self.s.break_stream_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "replica died mid-stream (scripted)")
            last = k == len(pieces) - 1
            msg = specd_pb2.GenerateResponse(request_id=rid, text=piece, token_ids=[ord(c) for c in piece],
                                             coalesced=self.s.coalesced)
            if last:
                msg.finish_reason = reason
                msg.usage.prompt_tokens, msg.usage.completion_tokens = len(_source(request)), len(text)
                msg.spec_stats.CopyFrom(specd_pb2.SpecStats(**SPEC))
            yield msg

    def GetStats(self, request, context):
        if self.s.error:
            context.abort(*self.s.error)
        return specd_pb2.StatsResponse(
            requests_total=7, requests_active=2, requests_queued=1, coalesced_total=3, rejected_total=1,
            tokens_total=321, spec_stats=specd_pb2.SpecStats(**SPEC), uptime_seconds=9.5,
            replicas=[specd_pb2.ReplicaStats(replica_id="v0", role="verifier", active_sequences=2,
                                             kv_slots_in_use=2, kv_slots_total=8),
                      specd_pb2.ReplicaStats(replica_id="d0", role="draft", active_sequences=1,
                                             kv_slots_in_use=1, kv_slots_total=8)])

    def ListModels(self, request, context):
        return specd_pb2.ListModelsResponse(
            target="smollm2", max_gamma=16, max_tokens=2048, context_length=8192,
            drafts=[specd_pb2.DraftInfo(name="none", kind="none"),
                    specd_pb2.DraftInfo(name="ngram", kind="ngram", default=True, default_gamma=4),
                    specd_pb2.DraftInfo(name="truncated:4", kind="truncated", default_gamma=3)])


@contextlib.contextmanager
def serve(script: Script):
    """The double and the standard health servicer on a loopback port: yields "127.0.0.1:PORT"."""
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=16), interceptors=[Interceptor(script)])
    specd_pb2_grpc.add_SpecDecodeServicer_to_server(Servicer(script), srv)
    hs = health.HealthServicer()
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    hs.set("specd.v1.SpecDecode", health_pb2.HealthCheckResponse.SERVING)
    hs.set("draining", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(hs, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        srv.stop(grace=None)


@pytest.fixture(scope="module")
def server():
    script = Script()
    with serve(script) as address:
        yield address, script


@pytest.fixture
def script(server):
    s = server[1]
    s.__init__()  # fresh behaviour and counters for each test
    return s


# ------------------------------------------------ one surface for both clients

def _collect_sync(it):
    chunks = []
    try:
        for c in it:
            chunks.append(c)
    except SpecdError as e:
        return chunks, e
    return chunks, None


class SyncFacade:
    def __init__(self, address, **kw):
        self.c = SpecdClient(address, **kw)

    def __getattr__(self, name):
        return getattr(self.c, name)

    def stream_collect(self, *a, **kw):
        return _collect_sync(self.c.stream(*a, **kw))


class AsyncFacade:
    """Drives an AsyncSpecdClient on one private event loop, exposing a blocking surface."""

    def __init__(self, address, **kw):
        self.loop = asyncio.new_event_loop()
        self.c = AsyncSpecdClient(address, **kw)

    def _run(self, coro):
        return self.loop.run_until_complete(coro)

    def __getattr__(self, name):
        attr = getattr(self.c, name)
        if not callable(attr):  # plain attributes (channel_options, metadata) as they are
            return attr
        return lambda *a, **kw: self._run(attr(*a, **kw))

    def stream_collect(self, *a, **kw):
        async def go():
            chunks = []
            try:
                async for c in self.c.stream(*a, **kw):
                    chunks.append(c)
            except SpecdError as e:
                return chunks, e
            return chunks, None
        return self._run(go())

    def close(self):
        self._run(self.c.close())
        self.loop.close()


@pytest.fixture(params=["sync", "async"])
def make_client(request, server):
    made = []

    def make(address=server[0], **kw):
        kw.setdefault("backoff", 0.01)
        c = (SyncFacade if request.param == "sync" else AsyncFacade)(address, **kw)
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


# --------------------------------------------------------------------- tests

def test_generate_unary(make_client, script):
    c = make_client()
    r = c.generate("hello world", max_tokens=5, temperature=0.0, seed=7, stop=["\n"], draft="ngram", gamma=2,
                   request_id="req-1")
    assert r.text == "hello" and r.token_ids == [ord(ch) for ch in "hello"]
    assert r.finish_reason == "length" and r.request_id == "req-1" and r.coalesced is False
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (11, 5)
    assert r.spec_stats == SPEC
    req = script.requests[-1]
    assert req.prompt == "hello world" and req.request_id == "req-1"
    assert req.sampling.max_tokens == 5 and req.sampling.HasField("temperature") and req.sampling.seed == 7
    assert not req.sampling.HasField("top_p") and list(req.sampling.stop) == ["\n"]
    assert req.speculation.draft == "ngram" and req.speculation.gamma == 2
    assert script.metadata[-1]["application"] == "specd"

    # defaults: everything unset, so the server applies its own
    r = c.generate(messages=[{"role": "system", "content": "x"}, ("user", "hi")])
    assert r.text == "hi" and r.finish_reason == "stop" and r.request_id == "srv-1"
    req = script.requests[-1]
    assert req.WhichOneof("input") == "messages" and [m.role for m in req.messages.messages] == ["system", "user"]
    assert req.sampling.max_tokens == 0 and not req.sampling.HasField("temperature")
    assert not req.sampling.HasField("seed") and not req.speculation.HasField("gamma")
    assert req.speculation.draft == "" and req.request_id == ""
    script.coalesced = True
    assert c.generate("again").coalesced is True


def test_stream(make_client, script):
    c = make_client()
    chunks, err = c.stream_collect("abcdefgh", max_tokens=8)
    assert err is None and len(chunks) == 3  # 3 + 3 + 2 tokens
    assert "".join(ch.text for ch in chunks) == "abcdefgh"
    assert [t for ch in chunks for t in ch.token_ids] == [ord(ch) for ch in "abcdefgh"]
    assert [ch.finish_reason for ch in chunks] == [None, None, "length"]
    assert all(ch.usage is None and ch.spec_stats is None for ch in chunks[:-1])
    assert chunks[-1].final and chunks[-1].usage.completion_tokens == 8 and chunks[-1].spec_stats == SPEC
    assert script.count("GenerateStream") == 1


def test_health_stats_list_models(make_client, script):
    c = make_client()
    assert c.health() == "SERVING" and c.health(specd_client.HEALTH_SERVICE) == "SERVING"
    assert c.health("draining") == "NOT_SERVING" and c.is_healthy("draining") is False
    assert c.is_healthy() is True
    with pytest.raises(NotFound):  # the standard servicer answers NOT_FOUND for unknown services
        c.health("no-such-service")
    assert script.count("Check") == 6 and all(md.get("application") == "specd" for md in script.metadata)

    st = c.stats()
    assert (st.requests_total, st.requests_active, st.requests_queued) == (7, 2, 1)
    assert (st.coalesced_total, st.rejected_total, st.tokens_total, st.uptime_seconds) == (3, 1, 321, 9.5)
    assert st.spec_stats["acceptance_per_position"] == [1.0, 0.75, 0.5, 0.25]
    assert [(r.replica_id, r.role, r.kv_slots_in_use) for r in st.replicas] == [("v0", "verifier", 2),
                                                                                 ("d0", "draft", 1)]
    m = c.list_models()
    assert m.target == "smollm2" and (m.max_gamma, m.max_tokens, m.context_length) == (16, 2048, 8192)
    assert [d.name for d in m.drafts] == ["none", "ngram", "truncated:4"] and m.default_draft == "ngram"


def test_application_metadata(make_client, script):
    with pytest.raises(NotFound, match="application 'other' not found"):
        make_client(app_name="other").generate("x")
    with pytest.raises(NotFound):  # no application key at all
        make_client(app_name=None).generate("x")
    script.app = None  # a direct server: the client must be able to send no application key
    assert make_client(app_name=None, metadata=[("x-trace", "t1")]).generate("ok").text == "ok"
    assert "application" not in script.metadata[-1] and script.metadata[-1]["x-trace"] == "t1"


def test_retry_on_unavailable_then_succeed(make_client, script):
    script.fail_unavailable = 2
    assert make_client(retries=3).generate("hi").text == "hi"
    assert script.count("Generate") == 3
    script.fail_unavailable = 1
    assert make_client(retries=1).health() == "SERVING" and script.count("Check") == 2
    script.fail_unavailable = 2
    assert make_client(retries=2).stats().requests_total == 7 and script.count("GetStats") == 3


def test_retry_gives_up_after_retries(make_client, script):
    script.fail_unavailable = 100
    with pytest.raises(Unavailable, match="no replica ready") as ei:
        make_client(retries=2).generate("hi")
    assert script.count("Generate") == 3  # 1 attempt + 2 retries
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE and ei.value.retryable
    with pytest.raises(Unavailable):
        make_client(retries=0).list_models()
    assert script.count("ListModels") == 1


def _service_config(client) -> dict:
    options = dict(client.channel_options)
    assert options["grpc.enable_retries"] == 1
    return json.loads(options["grpc.service_config"])


def test_retry_policy_is_grpcs(make_client, script):
    """The retries are gRPC's: the channel's service config carries the configured policy, and the
    server sees exactly retries + 1 attempts of a call that keeps failing with UNAVAILABLE."""
    services = [{"service": "specd.v1.SpecDecode"}, {"service": "grpc.health.v1.Health"}]
    for retries in (1, 4):
        c = make_client(retries=retries, backoff=0.01, max_backoff=0.25)
        [method] = _service_config(c)["methodConfig"]
        assert method == {"name": services, "retryPolicy": {
            "maxAttempts": retries + 1, "initialBackoff": "0.01s", "maxBackoff": "0.25s", "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"]}}
        script.__init__()
        script.fail_unavailable = 100
        with pytest.raises(Unavailable):
            c.generate("hi")
        with pytest.raises(Unavailable):
            c.health()
        chunks, err = c.stream_collect("hi")
        assert chunks == [] and isinstance(err, Unavailable)
        assert script.count("Generate") == script.count("Check") == script.count("GenerateStream") == retries + 1

    c = make_client(retries=0)  # no retryPolicy at all: one attempt
    assert _service_config(c) == {"methodConfig": [{"name": services}]}
    script.__init__()
    script.fail_unavailable = 100
    with pytest.raises(Unavailable):
        c.generate("hi")
    assert script.count("Generate") == 1

    # a grpc.service_config among the caller's options replaces the client's (here: no retries)
    c = make_client(retries=3, options=[("grpc.service_config", json.dumps({"methodConfig": []}))])
    assert _service_config(c) == {"methodConfig": []}
    script.__init__()
    script.fail_unavailable = 100
    with pytest.raises(Unavailable):
        c.generate("hi")
    assert script.count("Generate") == 1


@pytest.mark.parametrize("kw,match", [({"retries": 5}, "retries must be an integer in \\[0, 4\\]"),
                                      ({"retries": -1}, "retries must be"), ({"retries": 1.5}, "retries must be"),
                                      ({"backoff": 0}, "backoff must be > 0"),
                                      ({"max_backoff": -1.0}, "max_backoff must be > 0"),
                                      ({"backoff": float("nan")}, "backoff must be a finite")])
def test_retry_arguments_are_validated(kw, match):
    for cls in (SpecdClient, AsyncSpecdClient):
        with pytest.raises(ValueError, match=match):
            cls("127.0.0.1:1", **kw)


def test_backoff_reaches_grpc(make_client, script):
    """gRPC waits `backoff` (jittered by +-20%) before the first retry, doubling up to `max_backoff`."""
    script.fail_unavailable = 2
    t0 = time.monotonic()
    assert make_client(retries=2, backoff=0.1, max_backoff=0.15).generate("hi").text == "hi"
    assert time.monotonic() - t0 >= 0.8 * (0.1 + 0.15) - 0.01  # 0.1 s, then 0.2 s capped at 0.15 s
    assert script.count("Generate") == 3
    script.fail_unavailable = 4
    t0 = time.monotonic()
    make_client(retries=4, backoff=0.05, max_backoff=0.05).generate("hi")  # uncapped: 0.75 s
    assert 0.8 * 4 * 0.05 - 0.01 <= time.monotonic() - t0 < 0.5 and script.count("Generate") == 3 + 5


def test_unreachable_server_gives_up(make_client):
    with socket_port() as port:  # a port nobody listens on
        addr = f"127.0.0.1:{port}"
    with pytest.raises(Unavailable):
        make_client(addr, retries=1, timeout=5).generate("hi")
    assert make_client(addr, retries=0).is_healthy() is False


@contextlib.contextmanager
def socket_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.mark.parametrize("code,cls", [(grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
                                      (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted)])
def test_no_retry_on_client_or_capacity_errors(make_client, script, code, cls):
    details = f"max_tokens must be in [1, 2048], got 5000 ({code.name})"
    script.error = (code, details)
    c = make_client(retries=4)
    with pytest.raises(cls) as ei:
        c.generate("hi", max_tokens=5000)
    assert script.count("Generate") == 1
    e = ei.value
    assert isinstance(e, SpecdError) and e.code == code and e.details == details
    assert details in str(e) and code.name in str(e) and not e.retryable
    assert isinstance(e.__cause__, grpc.RpcError)
    chunks, err = c.stream_collect("hi")
    assert chunks == [] and isinstance(err, cls) and err.details == details
    assert script.count("GenerateStream") == 1


def test_deadline(make_client, script):
    script.delay = 5.0
    c = make_client(retries=3, timeout=0.2)  # client default deadline
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as ei:
        c.generate("slow")
    assert time.monotonic() - t0 < 2.0 and ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert script.count("Generate") == 1  # never retried
    chunks, err = c.stream_collect("slow", timeout=0.2)  # per-call override
    assert chunks == [] and isinstance(err, DeadlineExceeded) and script.count("GenerateStream") == 1
    script.delay = 0.0
    assert c.generate("fast", timeout=None).text == "fast"  # None = no deadline


def test_deadline_bounds_retries(make_client, script):
    """The timeout is one deadline for all attempts: gRPC stops retrying when it passes."""
    script.fail_unavailable = 100
    c = make_client(retries=4, backoff=0.2, max_backoff=1.0, timeout=0.3)  # retries alone would take ~3 s
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        c.generate("hi")
    assert time.monotonic() - t0 < 1.0 and 1 <= script.count("Generate") < 5
    t0 = time.monotonic()
    chunks, err = c.stream_collect("hi")
    assert chunks == [] and isinstance(err, DeadlineExceeded)
    assert time.monotonic() - t0 < 1.0 and 1 <= script.count("GenerateStream") < 5


def test_stream_retried_only_before_first_chunk(make_client, script):
    script.fail_unavailable = 2  # fails before any chunk: retried, tokens delivered once
    chunks, err = make_client(retries=3).stream_collect("abcdefg")
    assert err is None and "".join(ch.text for ch in chunks) == "abcdefg" and chunks[-1].finish_reason
    assert script.count("GenerateStream") == 3

    script.__init__()
    script.break_stream_after = 1  # one chunk delivered, then UNAVAILABLE: must NOT be retried
    chunks, err = make_client(retries=3).stream_collect("abcdefg")
    assert [ch.text for ch in chunks] == ["abc"] and isinstance(err, Unavailable)
    assert "mid-stream" in err.details and script.count("GenerateStream") == 1


def test_prompt_xor_messages(make_client, script):
    c = make_client()
    with pytest.raises(ValueError, match="exactly one"):
        c.generate()
    with pytest.raises(ValueError, match="exactly one"):
        c.generate("p", messages=[("user", "m")])
    with pytest.raises(ValueError, match="exactly one"):
        c.stream_collect()
    with pytest.raises(TypeError):
        c.generate(messages="not a list")
    assert script.count("Generate") == script.count("GenerateStream") == 0


def test_async_native(server, script):
    """The asyncio API as an application uses it: async with, await, async for, early close."""
    async def main():
        async with AsyncSpecdClient(server[0], backoff=0.01) as c:
            r, models, ok = await asyncio.gather(c.generate("concurrent", max_tokens=4), c.list_models(),
                                                 c.is_healthy(specd_client.HEALTH_SERVICE))
            assert r.text == "conc" and models.target == "smollm2" and ok
            text = [ch.text async for ch in c.stream("streaming!")]
            assert "".join(text) == "streaming!"
            it = c.stream("abcdefghijkl")
            first = await it.__anext__()
            await it.aclose()  # cancels the RPC
            assert first.text == "abc"
            script.fail_unavailable = 1
            assert (await c.stats()).tokens_total == 321
    asyncio.run(main())
    assert script.count("GetStats") == 2


def test_sync_stream_close_cancels(server, script):
    with SpecdClient(server[0]) as c:
        it = c.stream("abcdefghijkl")
        assert next(it).text == "abc"
        it.close()  # early close: the generator cancels the call
        assert c.generate("still works").text == "still works"


# ------------------------------------------------------------ import isolation

ISOLATED_SCRIPT = r"""
import importlib, json, sys
import specd_client
from specd_client import AsyncSpecdClient, SpecdClient, build_request
c = SpecdClient("127.0.0.1:1", timeout=1.0, retries=0)
assert c.metadata == (("application", "specd"),)
assert c.is_healthy(timeout=0.5) is False  # a real (failing) RPC through grpc + the health stubs
c.close()
AsyncSpecdClient("127.0.0.1:1")
assert build_request("hi", max_tokens=3).sampling.max_tokens == 3
heavy = ["torch", "ray", "transformers", "numpy"]
loaded = [m for m in heavy if m in sys.modules]
importable = []
for name in heavy:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    else:
        importable.append(name)
third_party = sorted({m.split(".")[0] for m in sys.modules} - set(sys.stdlib_module_names)
                     - set(sys.builtin_module_names) - {"__main__"})
print(json.dumps({"prefix": sys.prefix, "loaded": loaded, "importable": importable,
                  "third_party": third_party}))
"""


def _dist_dir(dist: str) -> Path:
    """The .dist-info directory of an installed distribution."""
    d = importlib.metadata.distribution(dist)
    return Path(d.locate_file(f"{d.metadata['Name'].replace('-', '_')}-{d.version}.dist-info"))


def _runtime_requires(dist: str) -> set[str]:
    reqs = importlib.metadata.requires(dist) or []
    return {r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].split("~")[0].strip()
            .lower().replace("_", "-") for r in reqs if "extra ==" not in r}


def test_sdk_imports_only_grpc_and_protobuf(tmp_path):
    """Importing the SDK pulls in only grpcio, protobuf and grpcio-health-checking: proven in a fresh
    venv without ray or torch.

    The venv (`venv --without-pip`, no system site-packages) sees, via one .pth
    file, a directory holding symlinks to exactly: grpc, google.protobuf (+ its
    upb extension), grpc_health, typing_extensions (grpcio's only runtime
    dependency), their dist-info, and this repo's specd_client and protos packages.
    """
    import google.protobuf
    import grpc_health
    import typing_extensions

    # the shim must cover the declared runtime deps of grpcio, protobuf and grpcio-health-checking
    assert _runtime_requires("grpcio") <= {"typing-extensions"}, _runtime_requires("grpcio")
    assert _runtime_requires("protobuf") == set(), _runtime_requires("protobuf")
    assert _runtime_requires("grpcio-health-checking") <= {"grpcio", "protobuf"}, \
        _runtime_requires("grpcio-health-checking")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()

    shim = tmp_path / "shim"
    (shim / "google").mkdir(parents=True)  # namespace package: only protobuf goes in
    protobuf_dir = Path(google.protobuf.__file__).parent
    links = {
        shim / "grpc": Path(grpc.__file__).parent,
        shim / "google" / "protobuf": protobuf_dir,
        shim / "grpc_health": Path(grpc_health.__file__).parent,
        shim / "typing_extensions.py": Path(typing_extensions.__file__),
        shim / "specd_client": ROOT / "specd_client",
        shim / "protos": ROOT / "protos",
    }
    if (protobuf_dir.parent / "_upb").is_dir():  # protobuf's C extension lives in google/_upb
        links[shim / "google" / "_upb"] = protobuf_dir.parent / "_upb"
    for dist in ("grpcio", "protobuf", "grpcio-health-checking", "typing_extensions"):
        info = _dist_dir(dist)
        if info.is_dir():
            links[shim / info.name] = info
    for link, target in links.items():
        link.symlink_to(target, target_is_directory=target.is_dir())
    Path(purelib, "specd_shim.pth").write_text(str(shim) + "\n")

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run([str(py), "-I", "-c", ISOLATED_SCRIPT], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["prefix"]).resolve() == venv.resolve()
    assert out["loaded"] == [] and out["importable"] == [], out
    allowed = {"grpc", "google", "grpc_health", "typing_extensions", "specd_client", "protos"}
    extra = {m for m in out["third_party"] if m not in allowed and not m.startswith(("_cython", "cython_"))}
    assert not extra, f"the SDK imported unexpected third-party modules: {sorted(extra)}"


def _self_signed(host: str = "localhost") -> tuple[bytes, bytes]:
    """A throwaway self-signed certificate for `host` and its key (PEM)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def test_tls_channel_and_bearer_token(script):
    """The SDK over TLS (what a client of a TLS-terminating ingress does): a TLS server started
    here with a self-signed certificate; the SDK with channel credentials trusting it gets its
    answers (sync and async), and sends the bearer token as `authorization` metadata. A
    plaintext client, or one that does not trust the certificate, cannot talk to it."""
    cert, key = _self_signed()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[Interceptor(script)])
    specd_pb2_grpc.add_SpecDecodeServicer_to_server(Servicer(script), srv)
    port = srv.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    srv.start()
    try:
        trust = grpc.ssl_channel_credentials(root_certificates=cert)
        with SpecdClient(f"localhost:{port}", credentials=trust, token="tok-1", timeout=10) as c:
            assert c.generate("hello", max_tokens=5).text == "hello"
        assert script.metadata[-1]["authorization"] == "Bearer tok-1"

        async def via_async():
            async with AsyncSpecdClient(f"localhost:{port}", credentials=trust, timeout=10) as ac:
                return (await ac.generate("tls", max_tokens=3)).text
        assert asyncio.run(via_async()) == "tls"

        other, _ = _self_signed()
        for creds in (None, grpc.ssl_channel_credentials(root_certificates=other)):
            with SpecdClient(f"localhost:{port}", credentials=creds, timeout=3, retries=0) as bad:
                with pytest.raises(Unavailable):
                    bad.generate("hello", max_tokens=5)
    finally:
        srv.stop(grace=None)
