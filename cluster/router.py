"""The router's core (Ray Serve deployment, transport-neutral): validation, admission,
coalescing, streaming, failover. gRPC (`cluster.grpc_api`) and HTTP (`cluster.http`) are thin
adapters over it: each turns its own request into a `schema.Request` (`Router.request`) and
streams `Router.generate`, and maps a `RouterError`'s `Status` onto its own codes.

- Validation: the request schema (`actors.schema.validate` against `ClusterConfig.limits`);
  every bad field gets INVALID_ARGUMENT naming the field and its limit. Prompts are
  tokenized off the event loop, so a long one never stalls other streams.
- Admission: at most `router.max_queue` generations in flight per router replica;
  beyond that RESOURCE_EXHAUSTED (clients back off; nothing queues unboundedly).
- Coalescing: identical in-flight requests (same input, sampling params and
  speculation, and deterministic: greedy or seeded) share one generation; every
  caller gets the full stream from its first token.
- Deadlines: the time a request has left (the adapter's: gRPC's deadline, HTTP's header, else
  `router.request_timeout_s`) crosses to the verifier as a duration.
- Verifier choice: power of two choices, the less loaded by queue length
  (`cluster.routing.PinnedRouter`, which also lets stats, load and abort reach every
  verifier replica by its id).
- Access: with `auth` configured, every call but the health check needs a bearer token.
- Failover: a stream whose verifier replica is lost resumes on another from the prompt plus
  the tokens already streamed (`_pump`).
- Metrics: latencies per caller, admission rejections, coalesced requests (`cluster.metrics`).
Does not know: models or KV caches (the verifier's job), gRPC or HTTP; it only tokenizes.
"""
from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from enum import Enum

from ray.exceptions import ActorUnavailableError, RayActorError

from actors.build import draft_kind
from actors.grammar import Grammars
from actors.models import model_name
from actors.schema import (
    MAX_BEAMS,
    MAX_GAMMA,
    NO_DRAFT,
    Delta,
    Request,
    SamplingParams,
    SpecStats,
    SpeculationParams,
    validate,
)
from actors.text import encode_prompt

from .config import ClusterConfig
from .metrics import RouterMetrics

log = logging.getLogger("specd")
HEALTH_SERVICES = ("", "specd.v1.SpecDecode")


def _answer_replica(answer) -> str | None:
    """The replica id a replica's answer carries (stats and load do), else None."""
    return answer.get("replica_id") if isinstance(answer, dict) else None


class Status(Enum):
    """Why a call failed, in gRPC's terms (each adapter maps it: `grpc.StatusCode[status.name]`, an
    HTTP status in `cluster.http.STATUS`)."""
    INVALID_ARGUMENT = "invalid_argument"
    UNAUTHENTICATED = "unauthenticated"
    NOT_FOUND = "not_found"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    INTERNAL = "internal"


class RouterError(Exception):
    """End the call with this status and message."""

    def __init__(self, status: Status, message: str):
        super().__init__(message)
        self.status, self.message = status, message

    def __reduce__(self):  # crosses Ray process boundaries inside Serve's error wrapper
        return (RouterError, (self.status, self.message))


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
        self.grammars = Grammars(self.tokenizer, self.limits.vocab_size)
        self.inflight: dict[str, _Generation] = {}
        self.subscriptions: dict[str, list[_Subscription]] = {}  # caller's request id -> its streams here
        self._replicas_cache: tuple[float, dict[str, list[str]]] = (0.0, {})
        self.admitted = 0
        self.counters = {"requests_total": 0, "coalesced_total": 0, "rejected_total": 0, "tokens_total": 0,
                         "failovers_total": 0}
        self.spec_totals = SpecStats()
        self.started = time.time()
        self.metrics = RouterMetrics(self.cfg.served_name)

    # ---- access control ----------------------------------------------------------------------------
    def authorize(self, authorization: str | None) -> str:
        """With auth configured: `authorization` (the call's "Bearer <token>", gRPC metadata or HTTP
        header) must carry an accepted token, compared in constant time against every one; else
        UNAUTHENTICATED. Returns the caller's tenant (`Request.tenant`): a digest of its token, never
        the token; "" without auth."""
        if not self._tokens:
            return ""
        scheme, _, given = (authorization or "").partition(" ")
        ok = False
        for t in self._tokens:  # no early exit: the time taken does not depend on which matched
            ok |= hmac.compare_digest(given.strip().encode(), t)
        if scheme.lower() != "bearer" or not ok:
            raise RouterError(Status.UNAUTHENTICATED, "missing or invalid bearer token "
                                                      "(metadata 'authorization: Bearer <token>')")
        return hashlib.sha256(given.strip().encode()).hexdigest()[:16]

    # ---- validation --------------------------------------------------------------------------------
    def encode(self, prompt: str | None = None, messages: list[dict] | None = None,
               token_ids: list[int] | None = None) -> list[int]:
        """The prompt's token ids, from exactly one of the three inputs (runs off the event loop:
        tokenizing a long prompt takes a while)."""
        if (prompt is not None) + (messages is not None) + (token_ids is not None) != 1:
            raise ValueError("one of prompt, messages or token_ids is required")
        if token_ids is not None:
            if not token_ids:
                raise ValueError("token_ids.ids must not be empty")
            return list(token_ids)  # the schema checks them against the vocabulary
        if prompt is not None:
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                try:
                    return [int(t) for t in prompt.split()]
                except ValueError:
                    raise ValueError("prompt must be space-separated token ids for this model") from None
            return encode_prompt(self.tokenizer, prompt=prompt)
        if self.tokenizer is None:
            raise ValueError("messages need a model with a chat template")
        return encode_prompt(self.tokenizer, messages=list(messages))

    async def request(self, request_id: str, sampling: SamplingParams, speculation: SpeculationParams,
                      tenant: str = "", **source) -> Request:
        """The validated request (server defaults applied to what is unset: None) for an input
        (`encode`'s keywords) from `tenant` (`authorize`); INVALID_ARGUMENT names the field and the limit."""
        self.counters["requests_total"] += 1
        try:
            ids = await asyncio.to_thread(self.encode, **source)
            req = validate(Request(request_id or uuid.uuid4().hex, ids, sampling, speculation, tenant), self.limits)
            if req.sampling.grammar is not None:  # a grammar that cannot compile is refused here, by name
                await asyncio.to_thread(self.grammars.check, *req.sampling.grammar)
            return req
        except ValueError as e:
            raise RouterError(Status.INVALID_ARGUMENT, str(e)) from None

    def timeout_s(self, remaining: float | None) -> float | None:
        """The seconds a request has: what its caller gave, else `router.request_timeout_s`."""
        return remaining if remaining else self.cfg.router.request_timeout_s

    @staticmethod
    def _coalesce_key(req: Request) -> str | None:
        if not req.sampling.greedy and req.sampling.seed is None:
            return None  # unseeded sampling: each caller is owed its own draw
        # (per tenant: a coalesced answer's speed would tell one tenant what another asked)
        return json.dumps([req.tenant, req.prompt_ids, asdict(req.sampling), asdict(req.speculation)],
                          sort_keys=True, default=list)

    def token_text(self, token: int) -> str:
        """One token as text (for logprobs), as vLLM shows it: the tokenizer's decoding of that token
        alone, or "token_id:N" for a model without a tokenizer."""
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token])

    # ---- streaming core --------------------------------------------------------------------------------
    async def generate(self, req: Request, timeout_s: float | None = None):
        """Admit, coalesce and stream a validated request (`request`; the caller authorized it):
        yields (Delta, coalesced). timeout_s: the seconds it has (`timeout_s`). The caller closing
        the stream early leaves its generation; the last caller leaving cancels it, which frees its
        KV on the verifier."""
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
                raise RouterError(Status.RESOURCE_EXHAUSTED,
                                  f"server at capacity: {self.admitted} requests in flight "
                                  f"(router.max_queue = {self.cfg.router.max_queue}); retry later")
            gen = _Generation()
            # Counted here, not when the task first runs: callers validated together would all pass
            # the check above before any of their tasks started.
            self.admitted += 1
            # The time left travels as a duration: the verifier's clock need not agree with ours.
            # In a context of its own: the task is not any one caller's. (In the caller's, Serve would
            # count the verifier call as that caller's request and cancel it when that caller
            # disconnects, ending a coalesced generation for every other caller too.)
            gen.task = asyncio.create_task(self._pump(gen, req, timeout_s or None), context=contextvars.Context())
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
    def failure(e: BaseException) -> RouterError:
        """What a call that raised `e` ends with: a RouterError as it is, a timeout as
        DEADLINE_EXCEEDED, anything else (a server-side failure) as INTERNAL with a short reason and
        an incident id for the caller, the traceback in the log."""
        if isinstance(e, RouterError):
            return e
        if isinstance(e, TimeoutError):
            return RouterError(Status.DEADLINE_EXCEEDED, str(e) or "deadline exceeded")
        incident = uuid.uuid4().hex[:12]
        log.error("incident %s: request failed", incident, exc_info=e)
        cause = getattr(e, "cause", None) or e  # a RayTaskError wraps the remote exception
        first = next((ln for ln in str(cause).splitlines() if ln.strip()), "")
        return RouterError(Status.INTERNAL, f"internal error ({type(cause).__name__}: {first[:200]}); "
                                            f"incident {incident} in the router's log")

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

    async def each(self, handle, deployment: str, method: str, *args) -> list:
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

    async def abort(self, request_ids: list[str]) -> list[str]:
        """Streams of these ids on this router replica end with finish reason "abort" (a coalesced
        generation goes on for its other callers; one left without callers is cancelled, which
        frees its KV). Ids this replica does not hold are aborted on every verifier replica (a
        request another router replica streams). Returns the ids found, in the order asked."""
        ids = list(dict.fromkeys(i for i in request_ids if i))
        found = {i for i in ids if i in self.subscriptions}
        for i in found:
            for sub in self.subscriptions[i]:
                sub.aborted = True
                sub.gen.changed.set()
        rest = [i for i in ids if i not in found]
        if rest:
            for got in await self.each(self.verifier, "Verifier", "abort_ids", rest):
                found.update(got)
        return [i for i in ids if i in found]

    def models(self) -> dict:
        """What this router serves: the model's served name, limits and drafts (with each draft's
        kind as it resolves for this target)."""
        cfg = self.cfg
        drafts = [{"name": NO_DRAFT, "kind": NO_DRAFT, "default": cfg.router.default_draft == NO_DRAFT,
                   "placement": "", "default_gamma": 0}]
        target = model_name(cfg.model)
        drafts += [{"name": d.name, "kind": draft_kind(d.spec, target), "default": d.name == cfg.router.default_draft,
                    "placement": d.placement, "default_gamma": d.default_gamma} for d in cfg.drafts]
        return {"target": cfg.served_name, "max_gamma": MAX_GAMMA, "max_tokens": cfg.router.max_tokens,
                "context_length": cfg.max_len, "max_beams": min(MAX_BEAMS, self.limits.max_beams), "drafts": drafts}

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
