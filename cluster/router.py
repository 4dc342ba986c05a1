"""The gRPC ingress (Ray Serve deployment): validation, admission, coalescing, streaming.

Methods are named after the RPCs of `specd.v1.SpecDecode` (and `Check` for the
standard grpc.health.v1 service); Serve's gRPC proxy routes to them by the
`application` metadata key.

- Validation: the request schema (`actors.schema.validate` against `ClusterConfig.limits`);
  every bad field gets INVALID_ARGUMENT naming the field and its limit. Prompts are
  tokenized off the event loop, so a long one never stalls other streams.
- Admission: at most `router.max_queue` generations in flight per router replica;
  beyond that RESOURCE_EXHAUSTED (clients back off; nothing queues unboundedly).
- Coalescing: identical in-flight requests (same input, sampling params and
  speculation, and deterministic: greedy or seeded) share one generation; every
  caller gets the full stream from its first token.
- Verifier choice: power of two choices, the less loaded by queue length
  (`cluster.routing.PinnedRouter`, which also lets GetStats, GetLoad and Abort reach every
  verifier replica by its id).
- Access: with `auth` configured, every RPC but the health check needs a bearer token.
- HTTP: the same router serves the OpenAI-compatible API (`cluster.http`) as its Serve ingress
  app, through the same validation, admission and coalescing.
- Failover: a stream whose verifier replica is lost resumes on another from the prompt plus
  the tokens already streamed (`_pump`).
- Metrics: latencies per caller, admission rejections, coalesced requests (`cluster.metrics`).
Does not know: models or KV caches (the verifier's job); it only tokenizes.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field, replace

import grpc
from ray.exceptions import ActorUnavailableError, RayActorError

from actors.build import draft_kind
from actors.calibrate import hardware_line
from actors.schema import MAX_BEAMS, MAX_GAMMA, NO_DRAFT, Delta, Request, SpecStats, validate
from actors.text import encode_prompt
from protos import specd_pb2

from .config import ClusterConfig, draft_deployment_name
from .metrics import RouterMetrics
from .wire import delta_to_proto, sampling_from_proto, speculation_from_proto, stats_to_proto

log = logging.getLogger("specd")
HEALTH_SERVICES = ("", "specd.v1.SpecDecode")


def _answer_replica(answer) -> str | None:
    """The replica id a replica's answer carries (stats and load do), else None."""
    return answer.get("replica_id") if isinstance(answer, dict) else None


class RpcError(Exception):
    """End the call with this gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details

    def __reduce__(self):  # crosses Ray process boundaries inside Serve's error wrapper
        return (RpcError, (self.code, self.details))


@dataclass
class _Generation:
    """One generation fanned out to every caller that asked for it."""
    chunks: list[Delta] = field(default_factory=list)
    done: bool = False
    error: BaseException | None = None
    subscribers: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


@dataclass(eq=False)
class _Subscription:
    """One caller of a generation; `aborted` by an Abort RPC naming its request id."""
    gen: _Generation
    aborted: bool = False


class Router:
    HEALTH_TIMEOUT_S = 2.0  # a verifier that does not answer a health call within this is not serving
    CONTROL_TIMEOUT_S = 5.0  # per replica, for GetStats, GetLoad and Abort
    REPLICAS_TTL_S = 1.0  # how long the controller's list of replicas is reused
    FAILOVER_ATTEMPTS = 3  # resumptions per request after a lost verifier replica
    FAILOVER_BACKOFF_S = 0.5  # times the attempt, before resuming

    def __init__(self, config: dict, verifier, drafts: dict | None = None):
        from actors.models import load_tokenizer, model_vocab_size

        self.cfg = ClusterConfig.model_validate(config)
        self._tokens = [t.encode() for t in self.cfg.auth.tokens()]  # never logged
        self.limits = replace(self.cfg.limits(), vocab_size=model_vocab_size(self.cfg.model))
        self.verifier = verifier
        self.draft_handles = drafts or {}
        self.tokenizer = load_tokenizer(self.cfg.model)  # None: token-id prompts only (space-separated ids)
        self.inflight: dict[str, _Generation] = {}
        self.subscriptions: dict[str, list[_Subscription]] = {}  # caller's request id -> its streams here
        self._replicas_cache: tuple[float, dict[str, list[str]]] = (0.0, {})
        self.admitted = 0
        self.counters = {"requests_total": 0, "coalesced_total": 0, "rejected_total": 0, "tokens_total": 0,
                         "failovers_total": 0}
        self.spec_totals = SpecStats()
        self.started = time.time()
        self.metrics = RouterMetrics(self.cfg.served_name)

    def __serve_build_asgi_app__(self):
        """The OpenAI-compatible HTTP API over this router (Serve calls it once the replica is built)."""
        from .http import build_http_app

        return build_http_app(self)

    # ---- access control ----------------------------------------------------------------------------
    def _authorize(self, grpc_context) -> None:
        """With auth configured: the call must carry ("authorization", "Bearer <token>") with an
        accepted token, compared in constant time against every one; else UNAUTHENTICATED."""
        if not self._tokens:
            return
        md = dict(grpc_context.invocation_metadata()) if grpc_context is not None else {}
        scheme, _, given = md.get("authorization", "").partition(" ")
        ok = False
        for t in self._tokens:  # no early exit: the time taken does not depend on which matched
            ok |= hmac.compare_digest(given.strip().encode(), t)
        if scheme.lower() != "bearer" or not ok:
            raise RpcError(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token "
                                                            "(metadata 'authorization: Bearer <token>')")

    def _refuses(self, grpc_context) -> bool:
        """For the unary RPCs: True (with UNAUTHENTICATED set on the call) when unauthorized."""
        try:
            self._authorize(grpc_context)
            return False
        except RpcError as e:
            if grpc_context is None:
                raise
            grpc_context.set_code(e.code)
            grpc_context.set_details(e.details)
            return True

    # ---- validation --------------------------------------------------------------------------------
    def _encode(self, req: specd_pb2.GenerateRequest) -> list[int]:
        """The prompt's token ids (runs off the event loop: tokenizing a long prompt takes a while)."""
        which = req.WhichOneof("input")
        if which is None:
            raise ValueError("one of prompt, messages or token_ids is required")
        if which == "token_ids":
            if not req.token_ids.ids:
                raise ValueError("token_ids.ids must not be empty")
            return list(req.token_ids.ids)  # the schema checks them against the vocabulary
        if which == "prompt":
            if not req.prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                try:
                    return [int(t) for t in req.prompt.split()]
                except ValueError:
                    raise ValueError("prompt must be space-separated token ids for this model") from None
            return encode_prompt(self.tokenizer, prompt=req.prompt)
        msgs = [{"role": m.role, "content": m.content} for m in req.messages.messages]
        if self.tokenizer is None:
            raise ValueError("messages need a model with a chat template")
        return encode_prompt(self.tokenizer, messages=msgs)

    async def validate(self, req: specd_pb2.GenerateRequest) -> Request:
        """The validated request (defaults resolved); ValueError names the field and the limit."""
        ids = await asyncio.to_thread(self._encode, req)
        spec = speculation_from_proto(req.speculation)
        return validate(Request(req.request_id or uuid.uuid4().hex, ids, sampling_from_proto(req.sampling), spec),
                        self.limits)

    @staticmethod
    def _coalesce_key(req: Request) -> str | None:
        if not req.sampling.greedy and req.sampling.seed is None:
            return None  # unseeded sampling: each caller is owed its own draw
        return json.dumps([req.prompt_ids, asdict(req.sampling), asdict(req.speculation)], sort_keys=True,
                          default=list)

    # ---- streaming core --------------------------------------------------------------------------------
    async def _stream(self, req_pb: specd_pb2.GenerateRequest, grpc_context):
        """Validate, admit, coalesce; yield the generation's `Delta`s with a `coalesced` flag."""
        self._authorize(grpc_context)
        self.counters["requests_total"] += 1
        try:
            req = await self.validate(req_pb)
        except ValueError as e:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        draft = req.speculation.draft
        key = self._coalesce_key(req) if self.cfg.router.coalesce else None
        gen = self.inflight.get(key) if key is not None else None
        coalesced = gen is not None
        if coalesced:
            self.counters["coalesced_total"] += 1
            self.metrics.coalesced.inc(1, {"draft": draft})
        else:
            if self.admitted >= self.cfg.router.max_queue:
                self.counters["rejected_total"] += 1
                self.metrics.rejected.inc(1, {"draft": draft})
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"server at capacity: {self.admitted} requests in flight "
                               f"(router.max_queue = {self.cfg.router.max_queue}); retry later")
            # The time left travels as a duration: the verifier's clock need not agree with ours.
            remaining = grpc_context.time_remaining() if hasattr(grpc_context, "time_remaining") else None
            gen = _Generation()
            # Counted here, not when the task first runs: callers validated together would all pass
            # the check above before any of their tasks started.
            self.admitted += 1
            gen.task = asyncio.create_task(self._pump(gen, req, remaining or None))
            gen.task.add_done_callback(lambda _task, gen=gen, key=key: self._release(gen, key))
            if key is not None:
                self.inflight[key] = gen
        gen.subscribers += 1
        sub = _Subscription(gen)
        self.subscriptions.setdefault(req.request_id, []).append(sub)
        timer = self.metrics.timer(draft)
        sent = 0
        try:
            while True:
                while sent < len(gen.chunks) and not sub.aborted:
                    timer.sent(gen.chunks[sent])
                    yield gen.chunks[sent], coalesced
                    sent += 1
                if sub.aborted:  # this caller only: a coalesced generation goes on for the others
                    end = Delta(req.request_id, [], "", finish_reason="abort", prompt_tokens=len(req.prompt_ids),
                                completion_tokens=sum(len(c.token_ids) for c in gen.chunks[:sent]))
                    timer.sent(end)
                    yield end, coalesced
                    return
                if gen.error is not None:
                    raise gen.error
                if gen.done:
                    return
                gen.changed.clear()
                await gen.changed.wait()
        finally:
            subs = self.subscriptions.get(req.request_id, [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self.subscriptions.pop(req.request_id, None)
            gen.subscribers -= 1
            if gen.subscribers == 0 and not gen.done and gen.task is not None:
                gen.task.cancel()  # last caller left: stop the generation, free its KV

    def _release(self, gen: _Generation, key: str | None) -> None:
        """A generation's task ended (finished, failed, or cancelled, even before it first ran): wake its
        subscribers and give back its admission and its coalescing entry."""
        gen.done = True
        gen.changed.set()
        self.admitted -= 1
        if key is not None and self.inflight.get(key) is gen:
            del self.inflight[key]

    async def _pump(self, gen: _Generation, req: Request, timeout_s: float | None) -> None:
        """Run `req` on a verifier replica, appending its deltas to `gen`. When the replica is lost
        mid-stream, resume on another: the prompt plus every token streamed so far, for the
        tokens still owed (`_resume`), so the caller's stream goes on with no token lost or
        repeated. Greedy output is unchanged, and so is a seeded sampled one (its noise is keyed by
        seed and absolute position, not by the replica). Beams cannot resume mid-search (their
        hypotheses lived on the lost replica): they fail over only before their first token."""
        deadline = time.monotonic() + timeout_s if timeout_s else None
        streamed: list[int] = []  # committed tokens the callers have been sent
        attempt, current, before = 0, req, 0  # before: tokens streamed before `current` started
        try:
            while True:
                left = timeout_s if deadline is None or attempt == 0 else max(deadline - time.monotonic(), 1e-3)
                stream = self.verifier.options(stream=True).generate.remote(current, left)
                try:
                    async for delta in stream:
                        if delta.finished and current is not req:  # usage of the whole request
                            delta = replace(delta, prompt_tokens=len(req.prompt_ids),
                                            completion_tokens=before + delta.completion_tokens)
                        streamed += delta.token_ids
                        gen.chunks.append(delta)
                        gen.changed.set()
                        if delta.finished:
                            self.counters["tokens_total"] += delta.completion_tokens
                            if delta.stats is not None:
                                self.spec_totals.add(delta.stats)
                    return
                except asyncio.CancelledError:
                    stream.cancel()
                    raise
                except (RayActorError, ActorUnavailableError) as e:
                    if attempt >= self.FAILOVER_ATTEMPTS or (streamed and req.sampling.num_beams > 1):
                        raise
                    if len(streamed) >= req.sampling.max_tokens:  # lost between its last tokens and the end
                        gen.chunks.append(Delta(req.request_id, [], "", finish_reason="length",
                                                prompt_tokens=len(req.prompt_ids), completion_tokens=len(streamed)))
                        self.counters["tokens_total"] += len(streamed)
                        return
                    attempt += 1
                    self.counters["failovers_total"] += 1
                    log.warning("verifier replica lost mid-stream for %r after %d tokens (%s); resuming on "
                                "another, attempt %d", req.request_id, len(streamed), type(e).__name__, attempt)
                    await asyncio.sleep(self.FAILOVER_BACKOFF_S * attempt)  # the controller notices the loss
                    current, before = self._resume(req, streamed), len(streamed)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # surfaced to every subscriber
            gen.error = e

    @staticmethod
    def _resume(req: Request, streamed: list[int]) -> Request:
        """`req` continued after `streamed`: those tokens join the prompt and count against max_tokens.
        Known limits: text the lost replica held back (a partial UTF-8 character, a possible
        stop-string prefix) is not re-sent, though its tokens are; a stop string spanning the
        resume point is not matched; the final speculation stats cover the resumed part only."""
        if not streamed:
            return req
        s = req.sampling
        return replace(req, prompt_ids=req.prompt_ids + streamed,
                       sampling=replace(s, max_tokens=s.max_tokens - len(streamed)))

    @staticmethod
    def _error(grpc_context, e: BaseException) -> None:
        if isinstance(e, RpcError):
            code = e.code
        elif isinstance(e, TimeoutError):
            code = grpc.StatusCode.DEADLINE_EXCEEDED
        else:  # a server-side failure: the client gets a short reason and an incident id, the log the traceback
            incident = uuid.uuid4().hex[:12]
            log.error("incident %s: request failed", incident, exc_info=e)
            cause = getattr(e, "cause", None) or e  # a RayTaskError wraps the remote exception
            first = next((ln for ln in str(cause).splitlines() if ln.strip()), "")
            grpc_context.set_code(grpc.StatusCode.INTERNAL)
            grpc_context.set_details(f"internal error ({type(cause).__name__}: {first[:200]}); "
                                     f"incident {incident} in the router's log")
            return
        grpc_context.set_code(code)
        grpc_context.set_details(str(e))

    # ---- RPCs ----------------------------------------------------------------------------------------
    async def GenerateStream(self, request: specd_pb2.GenerateRequest, grpc_context):
        rid = request.request_id
        try:
            async for delta, coalesced in self._stream(request, grpc_context):
                yield delta_to_proto(delta, rid or delta.request_id, coalesced)
        except Exception as e:
            self._error(grpc_context, e)
            raise  # a stream must raise for Serve to end it with the status set above

    async def Generate(self, request: specd_pb2.GenerateRequest, grpc_context) -> specd_pb2.GenerateResponse:
        deltas, coalesced = [], False
        try:
            async for delta, coalesced in self._stream(request, grpc_context):
                deltas.append(delta)
        except Exception as e:
            self._error(grpc_context, e)
            return specd_pb2.GenerateResponse()
        if not deltas:
            return specd_pb2.GenerateResponse()
        last = deltas[-1]
        joined = Delta(last.request_id, [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas),
                       last.finish_reason, last.prompt_tokens, last.completion_tokens, last.stats, last.stop_string)
        return delta_to_proto(joined, request.request_id or last.request_id, coalesced)

    # ---- every replica of a deployment ------------------------------------------------------------
    async def _replica_ids(self) -> dict[str, list[str]]:
        """Running replicas' unique ids per deployment of this application, from the Serve
        controller (the view Serve routes by; cached for REPLICAS_TTL_S); {} when it cannot be
        asked (outside Serve)."""
        at, cached = self._replicas_cache
        if time.monotonic() - at < self.REPLICAS_TTL_S:
            return cached
        try:
            import ray
            from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

            if not ray.is_initialized():
                return {}
            ctrl = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
            details = await ctrl.get_serve_instance_details.remote()
        except Exception as e:
            log.warning("Serve controller unavailable: %s", e)
            return {}
        deps = (details.get("applications", {}).get(self.cfg.app_name) or {}).get("deployments", {})
        ids = {name: [r["replica_id"] for r in d.get("replicas", []) if r.get("state") == "RUNNING"]
               for name, d in deps.items()}
        self._replicas_cache = (time.monotonic(), ids)
        return ids

    async def _each(self, handle, deployment: str, method: str, *args) -> list:
        """Call `method` on every running replica of `deployment` (pinned by replica id through
        cluster.routing.PinnedRouter), each within CONTROL_TIMEOUT_S; a replica that does not
        answer is left out. Without a controller (unit tests) the handle's one answer. Answers
        that carry a replica_id are deduplicated by it (an unknown pin falls back to any replica).
        The calls go one after another: pinned calls issued together through one handle left one
        of them unrouted until its timeout (5 s per GetLoad on Ray 2.60), one at a time each
        takes milliseconds."""
        ids = (await self._replica_ids()).get(deployment)

        async def one(pin):
            h = handle.options(session_id=pin) if pin else handle
            return await asyncio.wait_for(getattr(h, method).remote(*args), timeout=self.CONTROL_TIMEOUT_S)
        pins = ids or [None]
        results = {}
        for pin in pins:
            try:
                results[pin] = await one(pin)
            except Exception as e:
                results[pin] = e
        for pin, x in results.items():
            # A handle that is still learning its replicas may hold a pinned call back or send it
            # elsewhere: ask that replica once more (every method here may be repeated).
            if pin is not None and (isinstance(x, BaseException) or _answer_replica(x) not in (None, pin)):
                try:
                    results[pin] = await one(pin)
                except Exception as e:
                    results[pin] = e
        out, seen = [], set()
        for x in results.values():
            if isinstance(x, BaseException):
                log.warning("%s.%s unavailable on a replica: %r", deployment, method, x)
                continue
            rid = _answer_replica(x)
            if rid is None or rid not in seen:
                seen.add(rid)
                out.append(x)
        return out

    async def GetStats(self, request, grpc_context=None) -> specd_pb2.StatsResponse:
        """Router counters, and every live verifier and draft replica (each asked through its
        own pinned call, so all of a pool's replicas appear, not the one a handle picked)."""
        if self._refuses(grpc_context):
            return specd_pb2.StatsResponse()
        r = specd_pb2.StatsResponse(requests_active=self.admitted, uptime_seconds=time.time() - self.started,
                                    **self.counters)
        if self.spec_totals.target_passes:
            r.spec_stats.CopyFrom(stats_to_proto(self.spec_totals))
        for v in await self._each(self.verifier, "Verifier", "stats"):
            r.requests_queued += v.get("queued", 0)
            rep = r.replicas.add(replica_id=v["replica_id"], role="verifier", active_sequences=v["active_sequences"],
                                 kv_slots_in_use=v["kv_slots_in_use"], kv_slots_total=v["kv_slots_total"],
                                 dtype=v["engine"].get("dtype", ""), dtype_reason=v["engine"].get("dtype_reason", ""),
                                 hardware=hardware_line(v["engine"].get("hardware", {})),
                                 prepacked=bool(v["engine"].get("prepacked")),
                                 cpu_paths=v["engine"].get("cpu_paths", {}))
            for name, st in ((v.get("policy") or {}).get("drafters") or {}).items():
                rep.policy.add(draft=name, gamma=st["gamma"], speculated_share=st["speculated_share"],
                               acceptance=st["accept_curve"], steps=st["steps"],
                               speculated_steps=st["speculated_steps"])
        for name, h in self.draft_handles.items():
            for d in await self._each(h, draft_deployment_name(name), "stats"):
                r.replicas.add(replica_id=d["replica_id"], role="draft", active_sequences=d["active_sequences"],
                               kv_slots_in_use=d["kv_slots_in_use"], kv_slots_total=d["kv_slots_total"])
        return r

    async def GetLoad(self, request, grpc_context=None) -> specd_pb2.LoadResponse:
        if self._refuses(grpc_context):
            return specd_pb2.LoadResponse()
        r = specd_pb2.LoadResponse()
        for v in await self._each(self.verifier, "Verifier", "load"):
            r.replicas.add(**v)
        return r

    async def Abort(self, request: specd_pb2.AbortRequest, grpc_context=None) -> specd_pb2.AbortResponse:
        """Streams of these ids on this router replica end with finish reason "abort" (a coalesced
        generation goes on for its other callers; one left without callers is cancelled, which
        frees its KV). Ids this replica does not hold are aborted on every verifier replica (a
        request another router replica streams)."""
        if self._refuses(grpc_context):
            return specd_pb2.AbortResponse()
        ids = list(dict.fromkeys(i for i in request.request_ids if i))
        found = {i for i in ids if i in self.subscriptions}
        for i in found:
            for sub in self.subscriptions[i]:
                sub.aborted = True
                sub.gen.changed.set()
        rest = [i for i in ids if i not in found]
        if rest:
            for got in await self._each(self.verifier, "Verifier", "abort_ids", rest):
                found.update(got)
        return specd_pb2.AbortResponse(aborted=[i for i in ids if i in found])

    async def ListModels(self, request, grpc_context=None) -> specd_pb2.ListModelsResponse:
        if self._refuses(grpc_context):
            return specd_pb2.ListModelsResponse()
        cfg = self.cfg
        r = specd_pb2.ListModelsResponse(target=cfg.served_name, max_gamma=MAX_GAMMA, max_tokens=cfg.router.max_tokens,
                                         context_length=cfg.max_len, max_beams=min(MAX_BEAMS, self.limits.max_beams))
        r.drafts.add(name=NO_DRAFT, kind=NO_DRAFT, default=cfg.router.default_draft == NO_DRAFT)
        for d in cfg.drafts:
            auto = d.default_gamma == "auto"
            r.drafts.add(name=d.name, kind=draft_kind(d.spec), default=d.name == cfg.router.default_draft,
                         default_gamma=0 if auto else d.default_gamma, default_gamma_auto=auto, placement=d.placement)
        return r

    async def Check(self, request, grpc_context=None):
        """grpc.health.v1: service "" (the server) and "specd.v1.SpecDecode" are SERVING while a
        verifier replica is running (its models loaded), NOT_SERVING before and while none is;
        any other service name is NOT_FOUND. Read from the Serve controller, so a busy verifier
        (every slot streaming) still reads as serving."""
        from grpc_health.v1 import health_pb2

        if request.service not in HEALTH_SERVICES:
            if grpc_context is not None:
                grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
                grpc_context.set_details(f"unknown service {request.service!r}; known: {list(HEALTH_SERVICES)}")
            return health_pb2.HealthCheckResponse()
        S = health_pb2.HealthCheckResponse
        status = S.SERVING if await self.serving() else S.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def serving(self) -> bool:
        """Whether a verifier replica is running (its models loaded): the health check's answer."""
        ids = await self._replica_ids()
        if ids:  # the controller's view: a replica is RUNNING once its models have loaded
            return bool(ids.get("Verifier"))
        try:  # no controller to ask: whether a verifier answers (a call waits while none has loaded)
            await asyncio.wait_for(self.verifier.check_health.remote(), timeout=self.HEALTH_TIMEOUT_S)
            return True
        except Exception:
            return False
