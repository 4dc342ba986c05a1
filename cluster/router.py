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
- Verifier choice: Serve's handle routing (power of two choices, least loaded by
  queue length) picks the verifier replica for each generation.
Does not know: models or KV caches (the verifier's job); it only tokenizes.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field, replace

import grpc

from actors.build import draft_kind
from actors.calibrate import hardware_line
from actors.schema import MAX_GAMMA, NO_DRAFT, Delta, Request, SpecStats, validate
from actors.text import encode_prompt
from protos import specd_pb2

from .config import ClusterConfig
from .wire import delta_to_proto, sampling_from_proto, speculation_from_proto, stats_to_proto

log = logging.getLogger("specd")


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


class Router:
    def __init__(self, config: dict, verifier, drafts: dict | None = None):
        from transformers import AutoTokenizer

        from actors.models import EMBEDDED, embedded_dir, ensure_embedded, model_vocab_size

        self.cfg = ClusterConfig.model_validate(config)
        self.limits = replace(self.cfg.limits(), vocab_size=model_vocab_size(self.cfg.model))
        self.verifier = verifier
        self.draft_handles = drafts or {}
        if self.cfg.model == EMBEDDED:
            ensure_embedded(verbose=False)
            self.tokenizer = AutoTokenizer.from_pretrained(embedded_dir())
        elif self.cfg.model.startswith("tiny"):
            self.tokenizer = None  # token-id prompts only ("prompt" holds space-separated ids)
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model)
        self.inflight: dict[str, _Generation] = {}
        self.admitted = 0
        self.counters = {"requests_total": 0, "coalesced_total": 0, "rejected_total": 0, "tokens_total": 0}
        self.spec_totals = SpecStats()
        self.started = time.time()

    # ---- validation --------------------------------------------------------------------------------
    def _encode(self, req: specd_pb2.GenerateRequest) -> list[int]:
        """The prompt's token ids (runs off the event loop: tokenizing a long prompt takes a while)."""
        which = req.WhichOneof("input")
        if which is None:
            raise ValueError("one of prompt or messages is required")
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
        self.counters["requests_total"] += 1
        try:
            req = await self.validate(req_pb)
        except ValueError as e:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        key = self._coalesce_key(req) if self.cfg.router.coalesce else None
        gen = self.inflight.get(key) if key is not None else None
        coalesced = gen is not None
        if coalesced:
            self.counters["coalesced_total"] += 1
        else:
            if self.admitted >= self.cfg.router.max_queue:
                self.counters["rejected_total"] += 1
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"server at capacity: {self.admitted} requests in flight "
                               f"(router.max_queue = {self.cfg.router.max_queue}); retry later")
            # The time left travels as a duration: the verifier's clock need not agree with ours.
            remaining = grpc_context.time_remaining() if hasattr(grpc_context, "time_remaining") else None
            gen = _Generation()
            gen.task = asyncio.create_task(self._pump(gen, req, remaining or None, key))
            if key is not None:
                self.inflight[key] = gen
        gen.subscribers += 1
        sent = 0
        try:
            while True:
                while sent < len(gen.chunks):
                    yield gen.chunks[sent], coalesced
                    sent += 1
                if gen.error is not None:
                    raise gen.error
                if gen.done:
                    return
                gen.changed.clear()
                await gen.changed.wait()
        finally:
            gen.subscribers -= 1
            if gen.subscribers == 0 and not gen.done and gen.task is not None:
                gen.task.cancel()  # last caller left: stop the generation, free its KV

    async def _pump(self, gen: _Generation, req: Request, timeout_s: float | None, key: str | None) -> None:
        self.admitted += 1
        stream = self.verifier.options(stream=True).generate.remote(req, timeout_s)
        try:
            async for delta in stream:
                gen.chunks.append(delta)
                gen.changed.set()
                if delta.finished:
                    self.counters["tokens_total"] += delta.completion_tokens
                    if delta.stats is not None:
                        self.spec_totals.add(delta.stats)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as e:  # surfaced to every subscriber
            gen.error = e
        finally:
            gen.done = True
            gen.changed.set()
            self.admitted -= 1
            if key is not None and self.inflight.get(key) is gen:
                del self.inflight[key]

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
                       last.finish_reason, last.prompt_tokens, last.completion_tokens, last.stats)
        return delta_to_proto(joined, request.request_id or last.request_id, coalesced)

    async def GetStats(self, request, grpc_context=None) -> specd_pb2.StatsResponse:
        r = specd_pb2.StatsResponse(requests_active=self.admitted, uptime_seconds=time.time() - self.started,
                                    **self.counters)
        if self.spec_totals.target_passes:
            r.spec_stats.CopyFrom(stats_to_proto(self.spec_totals))
        try:
            v = await self.verifier.stats.remote()
            r.requests_queued = v.get("queued", 0)
            rep = r.replicas.add(replica_id=v["replica_id"], role="verifier", active_sequences=v["active_sequences"],
                                 kv_slots_in_use=v["kv_slots_in_use"], kv_slots_total=v["kv_slots_total"],
                                 dtype=v["engine"].get("dtype", ""), dtype_reason=v["engine"].get("dtype_reason", ""),
                                 hardware=hardware_line(v["engine"].get("hardware", {})))
            for name, st in ((v.get("policy") or {}).get("drafters") or {}).items():
                rep.policy.add(draft=name, gamma=st["gamma"], speculated_share=st["speculated_share"],
                               acceptance=st["accept_curve"], steps=st["steps"],
                               speculated_steps=st["speculated_steps"])
            for h in self.draft_handles.values():
                d = await h.stats.remote()
                r.replicas.add(replica_id=d["replica_id"], role="draft", active_sequences=d["active_sequences"],
                               kv_slots_in_use=d["kv_slots_in_use"], kv_slots_total=d["kv_slots_total"])
        except Exception as e:  # stats must not fail because one replica is busy restarting
            log.warning("replica stats unavailable: %s", e)
        return r

    async def ListModels(self, request, grpc_context=None) -> specd_pb2.ListModelsResponse:
        cfg = self.cfg
        r = specd_pb2.ListModelsResponse(target=cfg.model, max_gamma=MAX_GAMMA, max_tokens=cfg.router.max_tokens,
                                         context_length=cfg.max_len, max_beams=self.limits.max_beams)
        r.drafts.add(name=NO_DRAFT, kind=NO_DRAFT, default=cfg.router.default_draft == NO_DRAFT)
        for d in cfg.drafts:
            auto = d.default_gamma == "auto"
            r.drafts.add(name=d.name, kind=draft_kind(d.spec), default=d.name == cfg.router.default_draft,
                         default_gamma=0 if auto else d.default_gamma, default_gamma_auto=auto, placement=d.placement)
        return r

    async def Check(self, request, grpc_context=None):
        from grpc_health.v1 import health_pb2

        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
