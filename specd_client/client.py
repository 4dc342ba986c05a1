"""Sync and asyncio clients of the specd.v1.SpecDecode gRPC service.

    with SpecdClient("localhost:9000") as c:
        r = c.generate("Once upon a time", max_tokens=64, draft="ngram")
        print(r.text, r.finish_reason, r.spec_stats["mean_accepted_length"])
        for chunk in c.stream(messages=[{"role": "user", "content": "Hi"}], max_tokens=32):
            print(chunk.text, end="", flush=True)

    async with AsyncSpecdClient("localhost:9000") as c:
        r = await c.generate("Once upon a time", max_tokens=64)
        async for chunk in c.stream("Once upon a time"):
            ...

Transport behaviour, identical for both clients:
  * Routing: every call carries ("application", app_name) metadata, which Ray
    Serve's gRPC proxy routes by (app_name defaults to "specd"; None sends no
    application key, for servers that are not behind Ray Serve).
  * Deadlines: `timeout` (seconds; per call, else the client's default; None =
    no deadline) is the call's gRPC deadline: ONE deadline covering the call and
    all its retries (a retry that would start after it never starts).
  * Retries: done by gRPC itself, from the retry policy in the channel's service
    config (`channel_options`: grpc.enable_retries and grpc.service_config, for
    the specd.v1.SpecDecode and grpc.health.v1.Health services). Only
    UNAVAILABLE is retried, at most `retries` times after the first attempt
    (retries in [0, 4]: gRPC caps an RPC at 5 attempts), with exponential
    backoff: about `backoff` seconds before the first retry, doubling per retry
    up to `max_backoff`, each delay jittered by gRPC. Never on
    INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED or any other code.
    gRPC retries a call only until it is committed, i.e. until the server sent
    its first response (headers or a message): so a stream is retried only if
    it failed before its first chunk, and delivered tokens are never duplicated.
    gRPC keeps a request for its retries only up to the channel's
    grpc.per_rpc_retry_buffer_size (256 KiB by default): a larger one is not retried.
  * Errors: every failed RPC raises a typed `specd_client.errors.SpecdError`
    subclass carrying the status code and the server's details.

Imports only grpc, protobuf, grpc_health (grpcio-health-checking), the stdlib and
the generated `protos` stubs.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Iterator, Mapping, Sequence

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import specd_pb2, specd_pb2_grpc

from . import errors
from .errors import SpecdError

__all__ = ["SpecdClient", "AsyncSpecdClient", "Result", "Chunk", "TokenLogprob", "Usage", "Stats", "ReplicaStats",
           "ModelsInfo", "DraftInfo", "HEALTH_SERVICE", "MAX_RETRIES", "service_config"]

#: Service name the server registers with grpc.health.v1 (the empty name "" = whole server).
HEALTH_SERVICE = "specd.v1.SpecDecode"

#: The most re-attempts a client may ask for: gRPC caps a retry policy's maxAttempts at 5.
MAX_RETRIES = 4

#: The services the retry policy covers: the wire API and the standard health check.
_RETRIED_SERVICES = (specd_pb2.DESCRIPTOR.services_by_name["SpecDecode"].full_name,
                     health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)

_FINISH = {
    specd_pb2.FINISH_REASON_UNSPECIFIED: None,
    specd_pb2.FINISH_REASON_LENGTH: "length",
    specd_pb2.FINISH_REASON_STOP: "stop",
    specd_pb2.FINISH_REASON_ABORT: "abort",
}


class _Default:
    def __repr__(self) -> str:
        return "<client default>"


_DEFAULT: Any = _Default()  # "use the client's default timeout" (None means no deadline)


# ------------------------------------------------------------------ results

@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Result:
    """A finished generation (unary Generate)."""
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "length" | "stop" | "abort"
    usage: Usage
    # Keys = specd.v1.SpecStats field names: drafts, draft_tokens, accepted_tokens,
    # acceptance_rate, mean_accepted_length, acceptance_per_position, target_passes,
    # draft_seconds, verify_seconds. None if the server sent none.
    spec_stats: dict[str, Any] | None
    coalesced: bool = False
    stop_string: str = ""  # the stop string that ended the generation ("" otherwise)
    # With logprobs=k: per token, (token id, log-probability, [(token id, log-probability)] of the k likeliest).
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Chunk:
    """One streamed delta. finish_reason, usage and spec_stats are set on the last chunk only."""
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    spec_stats: dict[str, Any] | None = None
    coalesced: bool = False
    stop_string: str = ""  # last chunk: the stop string that ended the generation ("" otherwise)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids entry, with logprobs=k

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ReplicaStats:
    replica_id: str
    role: str  # "verifier" | "draft"
    active_sequences: int
    kv_slots_in_use: int
    kv_slots_total: int
    dtype: str = ""  # verifiers: the target's dtype, and why it was chosen
    dtype_reason: str = ""
    hardware: str = ""
    # verifiers: per draft, the speculation policy's last γ, share of steps speculated, its
    # acceptance estimate per position, and step counts:
    # {"draft": {"gamma", "speculated_share", "acceptance", "steps", "speculated_steps"}}
    policy: dict[str, dict[str, Any]] = field(default_factory=dict)
    prepacked: bool = False  # verifiers on a CPU: the target's weights in oneDNN's prepacked layout
    # verifiers on a CPU: each optional fast path's trial at load, "ok" or why it is unavailable
    cpu_paths: dict[str, str] = field(default_factory=dict)
    # verifiers: the prefix cache since the replica started (vLLM's counters: prompt tokens looked
    # up, and found in cached KV), requests looked up and served from it, and slots holding it now
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_requests: int = 0
    prefix_cache_hit_requests: int = 0
    prefix_cache_slots: int = 0
    # verifiers: whether the target's passes are row-invariant (speculation never changes greedy
    # output, bit for bit), and why or why not
    exact: bool = False
    exact_reason: str = ""
    # verifiers: the target's paged KV cache: blocks free and in all, positions per block, bytes of
    # the pool and of the blocks held; running sequences preempted for blocks (recomputed, not lost)
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    kv_block_size: int = 0
    kv_bytes_reserved: int = 0
    kv_bytes_used: int = 0
    preemptions: int = 0
    rss_bytes: int = 0  # the replica process's resident memory, and of it the weights
    weights_bytes: int = 0


@dataclass
class ReplicaLoad:
    """One verifier replica's load now (GetLoad)."""
    replica_id: str
    running: int
    waiting: int
    kv_slots_in_use: int
    kv_slots_total: int
    draft_kv_slots_in_use: int
    recent_acceptance: float
    kv_blocks_free: int = 0  # the target's KV blocks free now, and in all (admission reads these)
    kv_blocks_total: int = 0


@dataclass
class Stats:
    requests_total: int
    requests_active: int
    requests_queued: int
    coalesced_total: int
    rejected_total: int
    tokens_total: int
    spec_stats: dict[str, Any] | None
    replicas: list[ReplicaStats] = field(default_factory=list)
    uptime_seconds: float = 0.0
    failovers_total: int = 0  # streams resumed on another verifier replica after theirs was lost


@dataclass
class DraftInfo:
    name: str
    kind: str  # "none" | "ngram" | "truncated" | "eagle" | "model"
    default: bool
    default_gamma: int | str  # an integer, or "auto" (the server's speculation policy chooses per step)
    placement: str = ""  # "colocated" | "remote"


@dataclass
class ModelsInfo:
    target: str
    drafts: list[DraftInfo]
    max_gamma: int
    max_tokens: int
    context_length: int
    max_beams: int = 1

    @property
    def default_draft(self) -> str | None:
        return next((d.name for d in self.drafts if d.default), None)


# -------------------------------------------------------- proto conversions

def _spec_stats(msg: specd_pb2.SpecStats) -> dict[str, Any]:
    return {f.name: (list(getattr(msg, f.name)) if _is_repeated(f) else getattr(msg, f.name))
            for f in msg.DESCRIPTOR.fields}


def _is_repeated(f) -> bool:
    is_rep = getattr(f, "is_repeated", None)  # protobuf >= 5.x; `label` is deprecated
    return bool(is_rep) if is_rep is not None else f.label == f.LABEL_REPEATED


def _usage(msg: specd_pb2.Usage) -> Usage:
    return Usage(prompt_tokens=msg.prompt_tokens, completion_tokens=msg.completion_tokens)


def _result(r: specd_pb2.GenerateResponse) -> Result:
    return Result(request_id=r.request_id, text=r.text, token_ids=list(r.token_ids),
                  finish_reason=_FINISH.get(r.finish_reason), usage=_usage(r.usage),
                  spec_stats=_spec_stats(r.spec_stats) if r.HasField("spec_stats") else None,
                  coalesced=r.coalesced, stop_string=r.stop_string, logprobs=_logprobs(r))


def _logprobs(r: specd_pb2.GenerateResponse) -> list[TokenLogprob]:
    return [TokenLogprob(x.token_id, x.logprob, [(t.token_id, t.logprob) for t in x.top]) for x in r.logprobs]


def _chunk(r: specd_pb2.GenerateResponse) -> Chunk:
    return Chunk(request_id=r.request_id, text=r.text, token_ids=list(r.token_ids),
                 finish_reason=_FINISH.get(r.finish_reason),
                 usage=_usage(r.usage) if r.HasField("usage") else None,
                 spec_stats=_spec_stats(r.spec_stats) if r.HasField("spec_stats") else None,
                 coalesced=r.coalesced, stop_string=r.stop_string, logprobs=_logprobs(r))


def _load(r: specd_pb2.LoadResponse) -> list[ReplicaLoad]:
    return [ReplicaLoad(x.replica_id, x.running, x.waiting, x.kv_slots_in_use, x.kv_slots_total,
                        x.draft_kv_slots_in_use, x.recent_acceptance, x.kv_blocks_free, x.kv_blocks_total)
            for x in r.replicas]


def _stats(r: specd_pb2.StatsResponse) -> Stats:
    return Stats(requests_total=r.requests_total, requests_active=r.requests_active,
                 requests_queued=r.requests_queued, coalesced_total=r.coalesced_total,
                 rejected_total=r.rejected_total, tokens_total=r.tokens_total,
                 spec_stats=_spec_stats(r.spec_stats) if r.HasField("spec_stats") else None,
                 replicas=[ReplicaStats(x.replica_id, x.role, x.active_sequences, x.kv_slots_in_use,
                                        x.kv_slots_total, x.dtype, x.dtype_reason, x.hardware,
                                        {p.draft: {"gamma": p.gamma, "speculated_share": p.speculated_share,
                                                   "acceptance": list(p.acceptance), "steps": p.steps,
                                                   "speculated_steps": p.speculated_steps} for p in x.policy},
                                        x.prepacked, dict(x.cpu_paths), x.prefix_cache_queries,
                                        x.prefix_cache_hits, x.prefix_cache_requests, x.prefix_cache_hit_requests,
                                        x.prefix_cache_slots, x.exact, x.exact_reason, x.kv_blocks_free,
                                        x.kv_blocks_total, x.kv_block_size, x.kv_bytes_reserved, x.kv_bytes_used,
                                        x.preemptions, x.rss_bytes, x.weights_bytes)
                           for x in r.replicas],
                 uptime_seconds=r.uptime_seconds, failovers_total=r.failovers_total)


def _models(r: specd_pb2.ListModelsResponse) -> ModelsInfo:
    return ModelsInfo(target=r.target,
                      drafts=[DraftInfo(d.name, d.kind, d.default, "auto" if d.default_gamma_auto else d.default_gamma,
                                        d.placement) for d in r.drafts],
                      max_gamma=r.max_gamma, max_tokens=r.max_tokens, context_length=r.context_length,
                      max_beams=r.max_beams)


def _chat_message(m: Any) -> specd_pb2.ChatMessage:
    if isinstance(m, specd_pb2.ChatMessage):
        return m
    if isinstance(m, Mapping):
        return specd_pb2.ChatMessage(role=m["role"], content=m["content"])
    if isinstance(m, (tuple, list)) and len(m) == 2:
        return specd_pb2.ChatMessage(role=m[0], content=m[1])
    raise TypeError(f"a chat message must be a {{'role', 'content'}} mapping, a (role, content) pair "
                    f"or a specd_pb2.ChatMessage, got {m!r}")


def build_request(prompt: str | None = None, messages: Iterable[Any] | None = None, *,
                  max_tokens: int | None = None, temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                  stop: str | Sequence[str] | None = None, num_beams: int | None = None,
                  length_penalty: float | None = None, early_stopping: bool | None = None,
                  ignore_eos: bool = False, logprobs: int | None = None,
                  grammar: tuple[str, str] | None = None, presence_penalty: float | None = None,
                  frequency_penalty: float | None = None, repetition_penalty: float | None = None,
                  draft: str | None = None,
                  gamma: int | str | None = None,
                  tree: int | None = None,
                  threshold: float | None = None, entropy_gate: float | None = None,
                  acceptance: str | None = None, request_id: str | None = None,
                  token_ids: Sequence[int] | None = None) -> specd_pb2.GenerateRequest:
    """The GenerateRequest for these arguments. None = unset = the server's default.

    Exactly one of `prompt` (raw text), `messages` (chat turns: mappings with
    role/content, (role, content) pairs or ChatMessage protos) and `token_ids` (the
    target's token ids, used as they are) is required.
    Values are not range-checked here: the server validates and answers
    INVALID_ARGUMENT naming the field and its limit.
    """
    if (prompt is not None) + (messages is not None) + (token_ids is not None) != 1:
        raise ValueError("pass exactly one of prompt=, messages= or token_ids=")
    req = specd_pb2.GenerateRequest(request_id=request_id or "")
    if token_ids is not None:
        req.token_ids.SetInParent()  # selects the oneof even for an empty list (server rejects it)
        req.token_ids.ids.extend(int(t) for t in token_ids)
    elif prompt is not None:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        req.prompt = prompt
    else:
        if isinstance(messages, (str, bytes)):
            raise TypeError("messages must be a sequence of chat messages, not a string (use prompt=)")
        req.messages.SetInParent()  # selects the oneof even for an empty list (server rejects it)
        req.messages.messages.extend(_chat_message(m) for m in messages)
    s = req.sampling
    s.top_k = top_k or 0
    s.ignore_eos = bool(ignore_eos)
    if grammar is not None:  # structured output: (kind, spec), e.g. ("json_schema", json.dumps(schema))
        s.grammar.kind, s.grammar.spec = grammar
    if stop is not None:
        s.stop.extend([stop] if isinstance(stop, str) else list(stop))
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p), ("seed", seed),
                        ("num_beams", num_beams), ("length_penalty", length_penalty),
                        ("early_stopping", early_stopping), ("logprobs", logprobs),
                        ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                        ("repetition_penalty", repetition_penalty)):
        if value is not None:  # an optional field: set = sent, None = the server's default
            setattr(s, name, value)
    sp = req.speculation
    sp.draft = draft or ""
    if gamma == "auto":
        sp.gamma_auto = True
    elif gamma is not None:
        sp.gamma = gamma
    for name, value in (("tree", tree), ("threshold", threshold), ("entropy_gate", entropy_gate),
                        ("acceptance", acceptance)):
        if value is not None:
            setattr(sp, name, value)
    return req


# ------------------------------------------------- retry policy (service config)

def _duration(seconds: float, name: str) -> str:
    """`seconds` as a google.protobuf.Duration JSON string ("0.1s"), which the service config takes."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        raise ValueError(f"{name} must be a finite number of seconds, got {seconds!r}")
    text = f"{seconds:.9f}".rstrip("0").rstrip(".")
    if seconds <= 0 or text == "0":
        raise ValueError(f"{name} must be > 0 seconds (at least 1 ns), got {seconds!r}")
    return text + "s"


def service_config(retries: int = 3, backoff: float = 0.1, max_backoff: float = 2.0) -> dict[str, Any]:
    """The gRPC service config the clients' channels carry (as JSON, option grpc.service_config).

    One methodConfig for every method of specd.v1.SpecDecode and grpc.health.v1.Health;
    with retries > 0, its retryPolicy: maxAttempts = retries + 1, retry on UNAVAILABLE
    only, initialBackoff = backoff, maxBackoff = max_backoff, backoffMultiplier 2.
    retries = 0: no retryPolicy (one attempt). Raises ValueError outside retries in
    [0, MAX_RETRIES] or for a backoff that is not > 0.
    """
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
        raise ValueError(f"retries must be an integer in [0, {MAX_RETRIES}] (gRPC makes at most "
                         f"{MAX_RETRIES + 1} attempts per call), got {retries!r}")
    method: dict[str, Any] = {"name": [{"service": s} for s in _RETRIED_SERVICES]}
    initial, cap = _duration(backoff, "backoff"), _duration(max_backoff, "max_backoff")
    if retries:
        method["retryPolicy"] = {"maxAttempts": retries + 1, "initialBackoff": initial, "maxBackoff": cap,
                                 "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
    return {"methodConfig": [method]}


def _health_status(resp: health_pb2.HealthCheckResponse) -> str:
    value = resp.DESCRIPTOR.fields_by_name["status"].enum_type.values_by_number.get(resp.status)
    return value.name if value is not None else "UNKNOWN"


# ------------------------------------------------------------- shared core

class _Base:
    def __init__(self, address: str, *, timeout: float | None = None, retries: int = 3,
                 backoff: float = 0.1, max_backoff: float = 2.0,
                 app_name: str | None = "specd", metadata: Sequence[tuple[str, str]] = (),
                 credentials: grpc.ChannelCredentials | None = None,
                 options: Sequence[tuple[str, Any]] = (), token: str | None = None):
        config = service_config(retries, backoff, max_backoff)  # validates retries and the backoffs
        self.address = address
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.app_name = app_name
        md = [("application", app_name)] if app_name is not None else []
        md += [(str(k).lower(), v) for k, v in metadata]
        if token is not None:
            md.append(("authorization", f"Bearer {token}"))
        self.metadata: tuple[tuple[str, str], ...] = tuple(md)
        self._credentials = credentials
        # The channel's options: the retry policy, then the caller's (an option the caller
        # names, e.g. its own grpc.service_config, replaces the client's).
        user = list(options)
        named = {k for k, _ in user}
        ours = [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))]
        self.channel_options: tuple[tuple[str, Any], ...] = tuple([o for o in ours if o[0] not in named] + user)

    def _timeout(self, timeout: Any) -> float | None:
        """The call's gRPC deadline in seconds from now (it spans every retry gRPC makes)."""
        return self.timeout if timeout is _DEFAULT else timeout


# -------------------------------------------------------------- sync client

class SpecdClient(_Base):
    """Blocking client. Thread-safe (one gRPC channel, shared).

    address: "host:port" of the Ray Serve gRPC proxy (or of a direct server).
    timeout: default per-call deadline in seconds (None = none); overridable per call.
    retries / backoff / max_backoff: gRPC's retry policy for UNAVAILABLE (see module doc):
        retries in [0, 4] re-attempts (0 = none), about `backoff` seconds before the first,
        doubling up to `max_backoff`. ValueError outside these ranges.
    app_name: Ray Serve application to route to, sent as ("application", app_name)
        metadata on every call; None sends no application key (direct servers).
    metadata: extra (key, value) metadata sent on every call.
    credentials: grpc.ssl_channel_credentials(...) for TLS; None = plaintext.
    options: extra grpc channel options, after the client's own (`channel_options`); one
        named here replaces the client's (a grpc.service_config given here replaces the
        retry policy built from retries / backoff / max_backoff).
    token: a bearer token for servers with `auth` configured, sent as
        ("authorization", "Bearer <token>") metadata on every call.
    """

    def __init__(self, address: str, **kwargs: Any):
        super().__init__(address, **kwargs)
        if self._credentials is not None:
            self._channel = grpc.secure_channel(address, self._credentials, options=self.channel_options)
        else:
            self._channel = grpc.insecure_channel(address, options=self.channel_options)
        self._stub = specd_pb2_grpc.SpecDecodeStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _unary(self, rpc, request, timeout: Any, method: str):
        try:
            return rpc(request, timeout=self._timeout(timeout), metadata=self.metadata)
        except grpc.RpcError as e:  # after gRPC's retries, if any were allowed
            raise errors.from_rpc_error(e, method) from e

    def generate(self, prompt: str | None = None, messages: Iterable[Any] | None = None, *,
                 timeout: float | None = _DEFAULT, **params: Any) -> Result:
        """Generate a whole completion (unary Generate). `params`: the keyword arguments of
        `build_request` (sampling, beam search, speculation); unset = the server's defaults."""
        req = build_request(prompt, messages, **params)
        return _result(self._unary(self._stub.Generate, req, timeout, "Generate"))

    def stream(self, prompt: str | None = None, messages: Iterable[Any] | None = None, *,
               timeout: float | None = _DEFAULT, **params: Any) -> Iterator[Chunk]:
        """Stream a completion as Chunk deltas (GenerateStream).

        The request is validated (exactly one input) immediately; the RPC starts
        on the first next(). Closing the iterator early (break / .close()) cancels
        the RPC, which aborts the generation server-side.
        """
        req = build_request(prompt, messages, **params)
        return self._stream(req, timeout)

    def _stream(self, req: specd_pb2.GenerateRequest, timeout: Any) -> Iterator[Chunk]:
        call = self._stub.GenerateStream(req, timeout=self._timeout(timeout), metadata=self.metadata)
        try:
            for resp in call:
                yield _chunk(resp)
        except grpc.RpcError as e:  # gRPC retried it only if nothing had arrived yet
            raise errors.from_rpc_error(e, "GenerateStream") from e
        finally:
            call.cancel()  # no-op when the call already finished

    def health(self, service: str = "", *, timeout: float | None = _DEFAULT) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN".

        service "" = the whole server, HEALTH_SERVICE = the SpecDecode service.
        Raises a SpecdError if the check itself fails (e.g. NotFound for an
        unregistered service name, Unavailable when unreachable after retries).
        """
        resp = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout,
                           "Health.Check")
        return _health_status(resp)

    def is_healthy(self, service: str = "", *, timeout: float | None = _DEFAULT) -> bool:
        """True iff health(service) is SERVING; False on any error."""
        try:
            return self.health(service, timeout=timeout) == "SERVING"
        except SpecdError:
            return False

    def stats(self, *, timeout: float | None = _DEFAULT) -> Stats:
        """Server-wide counters, aggregate speculation stats and per-replica load (GetStats)."""
        return _stats(self._unary(self._stub.GetStats, specd_pb2.StatsRequest(), timeout, "GetStats"))

    def list_models(self, *, timeout: float | None = _DEFAULT) -> ModelsInfo:
        """The target model, the available drafts and the server's limits (ListModels)."""
        return _models(self._unary(self._stub.ListModels, specd_pb2.ListModelsRequest(), timeout,
                                   "ListModels"))

    def abort(self, request_ids: str | Sequence[str], *, timeout: float | None = _DEFAULT) -> list[str]:
        """Abort in-flight requests by id (Abort); returns the ids that were in flight."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        return list(self._unary(self._stub.Abort, specd_pb2.AbortRequest(request_ids=ids), timeout,
                                "Abort").aborted)

    def load(self, *, timeout: float | None = _DEFAULT) -> list[ReplicaLoad]:
        """Per verifier replica: running, waiting, KV in use and recent acceptance (GetLoad)."""
        return _load(self._unary(self._stub.GetLoad, specd_pb2.LoadRequest(), timeout, "GetLoad"))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "SpecdClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------ async client

class AsyncSpecdClient(_Base):
    """asyncio client (grpc.aio) with SpecdClient's surface; every method is a coroutine
    except stream(), which returns an async iterator.

    The channel is created lazily inside the running event loop on first use, so the
    client may be constructed anywhere; use it from one event loop only.
    """

    def __init__(self, address: str, **kwargs: Any):
        super().__init__(address, **kwargs)
        self._channel: grpc.aio.Channel | None = None
        self._stub: specd_pb2_grpc.SpecDecodeStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None

    def _ensure(self) -> specd_pb2_grpc.SpecDecodeStub:
        if self._channel is None:
            if self._credentials is not None:
                self._channel = grpc.aio.secure_channel(self.address, self._credentials,
                                                        options=self.channel_options)
            else:
                self._channel = grpc.aio.insecure_channel(self.address, options=self.channel_options)
            self._stub = specd_pb2_grpc.SpecDecodeStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
        return self._stub

    async def _unary(self, get_rpc, request, timeout: Any, method: str):
        self._ensure()
        try:
            return await get_rpc()(request, timeout=self._timeout(timeout), metadata=self.metadata)
        except grpc.RpcError as e:  # after gRPC's retries, if any were allowed
            raise errors.from_rpc_error(e, method) from e

    async def generate(self, prompt: str | None = None, messages: Iterable[Any] | None = None, *,
                       timeout: float | None = _DEFAULT, **params: Any) -> Result:
        """Generate a whole completion (unary Generate). `params`: the keyword arguments of
        `build_request` (sampling, beam search, speculation); unset = the server's defaults."""
        req = build_request(prompt, messages, **params)
        return _result(await self._unary(lambda: self._stub.Generate, req, timeout, "Generate"))

    def stream(self, prompt: str | None = None, messages: Iterable[Any] | None = None, *,
               timeout: float | None = _DEFAULT, **params: Any) -> AsyncIterator[Chunk]:
        """Stream a completion as Chunk deltas: `async for chunk in client.stream(...)`.

        exactly one input is checked immediately; the RPC starts on the first
        iteration. Closing the iterator early (`await it.aclose()`, or
        contextlib.aclosing) cancels the RPC, aborting the generation server-side.
        """
        req = build_request(prompt, messages, **params)
        return self._stream(req, timeout)

    async def _stream(self, req: specd_pb2.GenerateRequest, timeout: Any) -> AsyncIterator[Chunk]:
        stub = self._ensure()
        call = stub.GenerateStream(req, timeout=self._timeout(timeout), metadata=self.metadata)
        try:
            async for resp in call:
                yield _chunk(resp)
        except grpc.RpcError as e:  # gRPC retried it only if nothing had arrived yet
            raise errors.from_rpc_error(e, "GenerateStream") from e
        finally:
            call.cancel()  # no-op when the call already finished

    async def health(self, service: str = "", *, timeout: float | None = _DEFAULT) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN"."""
        resp = await self._unary(lambda: self._health.Check, health_pb2.HealthCheckRequest(service=service),
                                 timeout, "Health.Check")
        return _health_status(resp)

    async def is_healthy(self, service: str = "", *, timeout: float | None = _DEFAULT) -> bool:
        """True iff health(service) is SERVING; False on any error."""
        try:
            return await self.health(service, timeout=timeout) == "SERVING"
        except SpecdError:
            return False

    async def stats(self, *, timeout: float | None = _DEFAULT) -> Stats:
        """Server-wide counters, aggregate speculation stats and per-replica load (GetStats)."""
        return _stats(await self._unary(lambda: self._stub.GetStats, specd_pb2.StatsRequest(), timeout,
                                        "GetStats"))

    async def list_models(self, *, timeout: float | None = _DEFAULT) -> ModelsInfo:
        """The target model, the available drafts and the server's limits (ListModels)."""
        return _models(await self._unary(lambda: self._stub.ListModels, specd_pb2.ListModelsRequest(),
                                         timeout, "ListModels"))

    async def abort(self, request_ids: str | Sequence[str], *, timeout: float | None = _DEFAULT) -> list[str]:
        """Abort in-flight requests by id (Abort); returns the ids that were in flight."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        r = await self._unary(lambda: self._stub.Abort, specd_pb2.AbortRequest(request_ids=ids), timeout, "Abort")
        return list(r.aborted)

    async def load(self, *, timeout: float | None = _DEFAULT) -> list[ReplicaLoad]:
        """Per verifier replica: running, waiting, KV in use and recent acceptance (GetLoad)."""
        return _load(await self._unary(lambda: self._stub.GetLoad, specd_pb2.LoadRequest(), timeout, "GetLoad"))

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = self._health = None

    async def __aenter__(self) -> "AsyncSpecdClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
