"""The gRPC ingress (Ray Serve deployment): validation, admission, coalescing, streaming.

Methods are named after the RPCs of `specd.v1.SpecDecode` (and `Check` for the
standard grpc.health.v1 service); Serve's gRPC proxy routes to them by the
`application` metadata key.

- Validation: every bad field gets INVALID_ARGUMENT naming the field and its limit.
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
from dataclasses import dataclass, field

import grpc

from actors.build import ROLES
from actors.drafters.base import MAX_GAMMA
from protos import specd_pb2

from .config import ClusterConfig

log = logging.getLogger("specd")
FINISH = {"length": specd_pb2.FINISH_REASON_LENGTH, "stop": specd_pb2.FINISH_REASON_STOP,
          "abort": specd_pb2.FINISH_REASON_ABORT}
STATS_FIELDS = {"drafts": "drafts", "draft_tokens": "draft_tokens", "accepted_tokens": "accepted_tokens",
                "acceptance_rate": "acceptance_rate", "mean_accepted_length": "mean_accepted_length",
                "target_passes": "target_passes", "draft_s": "draft_seconds", "verify_s": "verify_seconds"}


class BadRequest(ValueError):
    """A request field is invalid: becomes INVALID_ARGUMENT with this message."""


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
    chunks: list[dict] = field(default_factory=list)
    done: bool = False
    error: BaseException | None = None
    subscribers: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


def spec_stats_proto(stats: dict) -> specd_pb2.SpecStats:
    msg = specd_pb2.SpecStats(**{dst: stats[src] for src, dst in STATS_FIELDS.items() if src in stats})
    msg.acceptance_per_position.extend(stats.get("acceptance_per_position", []))
    return msg


class Router:
    def __init__(self, config: dict, verifier, drafts: dict | None = None):
        from transformers import AutoTokenizer

        from actors.models import EMBEDDED, embedded_dir, ensure_embedded

        self.cfg = ClusterConfig.model_validate(config)
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
        self.spec_totals: dict = {}
        self.started = time.time()

    # ---- validation --------------------------------------------------------------------------------
    def _encode(self, req: specd_pb2.GenerateRequest) -> list[int]:
        which = req.WhichOneof("input")
        if which is None:
            raise BadRequest("one of prompt or messages is required")
        if which == "prompt":
            if not req.prompt:
                raise BadRequest("prompt must not be empty")
            if self.tokenizer is None:
                try:
                    return [int(t) for t in req.prompt.split()]
                except ValueError:
                    raise BadRequest("prompt must be space-separated token ids for this model") from None
            return self.tokenizer.encode(req.prompt, add_special_tokens=False)
        msgs = req.messages.messages
        if not msgs:
            raise BadRequest("messages must not be empty")
        for i, m in enumerate(msgs):
            if m.role not in ROLES:
                raise BadRequest(f"messages[{i}].role must be one of {list(ROLES)}, got {m.role!r}")
        if self.tokenizer is None:
            raise BadRequest("messages need a model with a chat template")
        ids = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs],
                                                 add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def validate(self, req: specd_pb2.GenerateRequest) -> dict:
        """-> the verifier's request dict; raises BadRequest naming the field and the limit."""
        cfg, rc = self.cfg, self.cfg.router
        ids = self._encode(req)
        s = req.sampling
        max_tokens = s.max_tokens if s.HasField("max_tokens") else rc.default_max_tokens
        if not 1 <= max_tokens <= rc.max_tokens:
            raise BadRequest(f"sampling.max_tokens must be in [1, {rc.max_tokens}], got {max_tokens}")
        if len(ids) + max_tokens > cfg.max_len:
            raise BadRequest(f"prompt is {len(ids)} tokens; prompt + sampling.max_tokens ({max_tokens}) must fit "
                             f"the context of {cfg.max_len} tokens")
        temperature = s.temperature if s.HasField("temperature") else 0.0
        if not temperature >= 0:
            raise BadRequest(f"sampling.temperature must be >= 0, got {temperature}")
        top_p = s.top_p if s.HasField("top_p") else 1.0
        if not 0 < top_p <= 1:
            raise BadRequest(f"sampling.top_p must be in (0, 1], got {top_p}")
        if s.top_k < 0:
            raise BadRequest(f"sampling.top_k must be >= 0, got {s.top_k}")
        if any(not x for x in s.stop):
            raise BadRequest("sampling.stop strings must be non-empty")
        draft = req.speculation.draft or rc.default_draft
        names = [d.name for d in cfg.drafts]
        if draft != "none" and draft not in names:
            raise BadRequest(f"speculation.draft {draft!r} is unknown; available: {['none', *names]}")
        if req.speculation.HasField("gamma"):
            gamma = req.speculation.gamma
            if not 0 <= gamma <= MAX_GAMMA:
                raise BadRequest(f"speculation.gamma must be in [0, {MAX_GAMMA}], got {gamma}")
        else:
            gamma = cfg.draft(draft).default_gamma if draft != "none" else 0
        if draft == "none":
            gamma = 0
        return {"request_id": req.request_id or uuid.uuid4().hex, "prompt_ids": ids,
                "params": {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                           "top_k": s.top_k, "seed": s.seed if s.HasField("seed") else None,
                           "stop": tuple(s.stop)},
                "draft": None if gamma == 0 else draft, "gamma": gamma}

    @staticmethod
    def _coalesce_key(vreq: dict) -> str | None:
        p = vreq["params"]
        if p["temperature"] > 0 and p["seed"] is None:
            return None  # unseeded sampling: each caller is owed its own draw
        return json.dumps([vreq["prompt_ids"], p, vreq["draft"], vreq["gamma"]], sort_keys=True, default=list)

    # ---- streaming core --------------------------------------------------------------------------------
    async def _stream(self, req: specd_pb2.GenerateRequest, grpc_context):
        """Validate, admit, coalesce; yield verifier chunks (dicts) and a final `coalesced` flag."""
        self.counters["requests_total"] += 1
        try:
            vreq = self.validate(req)
        except BadRequest as e:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        key = self._coalesce_key(vreq) if self.cfg.router.coalesce else None
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
            remaining = grpc_context.time_remaining() if hasattr(grpc_context, "time_remaining") else None
            if remaining:
                vreq["deadline"] = time.time() + remaining
            gen = _Generation()
            gen.task = asyncio.create_task(self._pump(gen, vreq, key))
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

    async def _pump(self, gen: _Generation, vreq: dict, key: str | None) -> None:
        self.admitted += 1
        stream = self.verifier.options(stream=True).generate.remote(vreq)
        try:
            async for chunk in stream:
                gen.chunks.append(chunk)
                gen.changed.set()
                if chunk["finished"]:
                    self.counters["tokens_total"] += chunk.get("completion_tokens", 0)
                    self._add_stats(chunk.get("stats", {}))
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

    def _add_stats(self, st: dict) -> None:
        t = self.spec_totals
        for k in ("drafts", "draft_tokens", "accepted_tokens", "target_passes", "draft_s", "verify_s"):
            t[k] = t.get(k, 0) + st.get(k, 0)

    @staticmethod
    def _response(rid: str, chunk: dict, coalesced: bool) -> specd_pb2.GenerateResponse:
        r = specd_pb2.GenerateResponse(request_id=rid, text=chunk["text"], token_ids=chunk["token_ids"],
                                       coalesced=coalesced)
        if chunk["finished"]:
            r.finish_reason = FINISH[chunk["finish_reason"]]
            r.usage.prompt_tokens = chunk.get("prompt_tokens", 0)
            r.usage.completion_tokens = chunk.get("completion_tokens", 0)
            if "stats" in chunk:
                r.spec_stats.CopyFrom(spec_stats_proto(chunk["stats"]))
        return r

    @staticmethod
    def _error(grpc_context, e: BaseException) -> None:
        if isinstance(e, RpcError):
            code = e.code
        elif isinstance(e, TimeoutError):
            code = grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            code = grpc.StatusCode.INTERNAL
        grpc_context.set_code(code)
        grpc_context.set_details(str(e))

    # ---- RPCs ----------------------------------------------------------------------------------------
    async def GenerateStream(self, request: specd_pb2.GenerateRequest, grpc_context):
        rid = request.request_id
        try:
            async for chunk, coalesced in self._stream(request, grpc_context):
                yield self._response(rid, chunk, coalesced)
        except Exception as e:
            self._error(grpc_context, e)
            raise  # a stream must raise for Serve to end it with the status set above

    async def Generate(self, request: specd_pb2.GenerateRequest, grpc_context) -> specd_pb2.GenerateResponse:
        text, ids, last, coalesced = [], [], None, False
        try:
            async for chunk, coalesced in self._stream(request, grpc_context):
                text.append(chunk["text"])
                ids.extend(chunk["token_ids"])
                last = chunk
        except Exception as e:
            self._error(grpc_context, e)
            return specd_pb2.GenerateResponse()
        if last is None:
            return specd_pb2.GenerateResponse()
        return self._response(request.request_id, {**last, "text": "".join(text), "token_ids": ids}, coalesced)

    async def GetStats(self, request, grpc_context=None) -> specd_pb2.StatsResponse:
        r = specd_pb2.StatsResponse(requests_active=self.admitted, uptime_seconds=time.time() - self.started,
                                    **self.counters)
        t = self.spec_totals
        if t:
            r.spec_stats.CopyFrom(spec_stats_proto({
                **t, "acceptance_rate": t["accepted_tokens"] / t["draft_tokens"] if t.get("draft_tokens") else 0.0,
                "mean_accepted_length": 1 + t["accepted_tokens"] / t["drafts"] if t.get("drafts") else 1.0}))
        try:
            v = await self.verifier.stats.remote()
            r.requests_queued = v.get("queued", 0)
            r.replicas.add(replica_id=v["replica_id"], role="verifier", active_sequences=v["active_sequences"],
                           kv_slots_in_use=v["kv_slots_in_use"], kv_slots_total=v["kv_slots_total"])
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
                                         context_length=cfg.max_len)
        for d in cfg.drafts:
            kind = "ngram" if not d.remote else ("truncated" if d.spec.startswith("truncated:") else "model")
            r.drafts.add(name=d.name, kind=kind, default=d.name == cfg.router.default_draft,
                         default_gamma=d.default_gamma)
        return r

    async def Check(self, request, grpc_context=None):
        from grpc_health.v1 import health_pb2

        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
