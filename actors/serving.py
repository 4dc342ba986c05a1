"""The data plane inside Ray Serve replicas: draft servers, and verifiers running the engine.

DraftServer    hosts one model drafter; `propose` takes a batch of DraftSeq (each
               with its rollback point) and returns proposals. Draft KV is soft state:
               a sequence it does not know (new, or its replica was lost) is reported
               as `missing`, and the verifier re-sends it from the committed tokens.
               Serve runs sync methods in a thread pool, so calls that overlap (a
               pipelining verifier, several verifiers) take turns on the drafter.
RemoteDrafter  the Drafter interface over a DraftServer deployment handle: pins each
               sequence to the replica that holds its draft KV (via the session id the
               PinnedRouter reads), re-syncs missing sequences, and retries a lost replica.
VerifierServer hosts the target and the continuous batcher: a thread steps the engine;
               requests join at step boundaries and leave the moment they finish, are
               cancelled or pass their deadline, freeing their KV here and on the draft.
               With `verifier.pipeline` (or `set_pipeline(True)` at run time) the engine
               verifies one micro-batch while the draft replicas propose for the other.

The verifier's engine is the source of truth for committed tokens.
Does not know: gRPC, request validation or coalescing (the router's job).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
from dataclasses import replace

import torch

from .build import build_engine, make_drafter, spec_wants_hidden
from .drafters.base import Drafter, DraftSeq, Proposal, apply_view
from .engine import Request, SamplingParams
from .models import load_model

log = logging.getLogger("specd")


def _node_id() -> str:
    try:
        import ray
        return ray.get_runtime_context().get_node_id()
    except Exception:
        return "local"


def _replica_id() -> str:
    try:
        from ray import serve
        return serve.get_replica_context().replica_tag
    except Exception:  # outside Serve (unit tests)
        return "local"


class DraftServer:
    """One draft model behind a Serve deployment (small-accelerator pool)."""

    def __init__(self, model: str, dtype: str, spec: str, max_batch: int, max_len: int, torch_threads: int = 1):
        torch.set_num_threads(torch_threads)
        target = load_model(model, dtype)
        self.drafter: Drafter = make_drafter(spec, target, max_batch, max_len)
        self.spec = spec
        self.replica = _replica_id()
        self.calls = 0
        self.busy_s = 0.0  # time spent proposing
        self._lock = threading.Lock()  # the drafter's KV and views are not thread-safe

    def propose(self, seqs: list[DraftSeq]) -> dict:
        """-> {"replica": id, "proposal": Proposal for the known rows, "rows": their indices,
               "missing": indices of rows whose state is not here (re-send with keep=0),
               "queued_s": waiting for another call, "busy_s": proposing}."""
        t0 = time.perf_counter()
        with self._lock:
            t1 = time.perf_counter()
            self.calls += 1
            rows, missing = [], []
            for i, s in enumerate(seqs):
                have = self.drafter.view_length(s.seq_id)
                (missing if (have is None and s.keep > 0) or (have is not None and s.keep > have) else rows).append(i)
            prop = self.drafter.propose([seqs[i] for i in rows]) if rows else None
            busy = time.perf_counter() - t1
            self.busy_s += busy
        return {"replica": self.replica, "proposal": prop, "rows": rows, "missing": missing,
                "queued_s": t1 - t0, "busy_s": busy}

    def release(self, seq_ids: list[int]) -> int:
        with self._lock:
            for sid in seq_ids:
                self.drafter.release(sid)
            return self.drafter.num_active()

    def stats(self) -> dict:
        return {"replica_id": self.replica, "role": "draft", "name": self.spec, "node_id": _node_id(),
                "active_sequences": self.drafter.num_active(),
                "kv_slots_in_use": self.drafter.num_active(),
                "kv_slots_total": getattr(getattr(self.drafter, "cache", None), "slots", 0), "calls": self.calls,
                "busy_s": self.busy_s}


class RemoteDrafter(Drafter):
    """A Drafter whose model lives on DraftServer replicas (called through a Serve handle)."""

    wants_hidden = False
    RETRIES = 3

    def __init__(self, handle, name: str, wants_hidden: bool = False):
        self.handle, self.name = handle, name
        self.wants_hidden = wants_hidden  # the replicas run a feature-level head
        self.pins: dict[int, str] = {}  # seq_id -> draft replica holding its KV
        self.mirror: dict[int, list[int]] = {}  # what that replica's view should be
        self.resyncs = 0
        # Seen from here: calls answered, and the replicas' time proposing / queued behind
        # another call, summed over answers.
        self.calls, self.replica_busy_s, self.replica_queued_s = 0, 0.0, 0.0

    def propose(self, seqs: list[DraftSeq]) -> Proposal:
        return self.propose_async(seqs)()

    def propose_async(self, seqs: list[DraftSeq]):
        """Send the calls now; return a function that waits for and assembles the proposal."""
        for s in seqs:
            apply_view(self.mirror.setdefault(s.seq_id, []), s.keep, s.new_tokens)
        pending = [(rows, self._call(self.pins.get(seqs[rows[0]].seq_id), [seqs[i] for i in rows]))
                   for rows in self._groups(seqs)]
        t0 = time.perf_counter()

        def wait() -> Proposal:
            G = max(s.gamma for s in seqs)
            tokens = torch.zeros(len(seqs), G, dtype=torch.long)
            num = [0] * len(seqs)
            probs = None
            work = list(pending)
            attempts = 0
            while work:
                rows, resp = work.pop(0)
                try:
                    out = resp.result()
                except Exception as e:  # the replica died mid-call: re-sync elsewhere
                    attempts += 1
                    if attempts > self.RETRIES:
                        raise
                    log.warning("draft %s call failed (%s); re-syncing %d sequences", self.name, e, len(rows))
                    work.append((rows, self._resync(None, [seqs[i] for i in rows])))
                    continue
                self.calls += 1
                self.replica_busy_s += out.get("busy_s", 0.0)
                self.replica_queued_s += out.get("queued_s", 0.0)
                if out["missing"]:
                    miss = [rows[i] for i in out["missing"]]
                    work.append((miss, self._resync(out["replica"], [seqs[i] for i in miss])))
                prop: Proposal | None = out["proposal"]
                for j, i in enumerate(out["rows"]):
                    b = rows[i]
                    self.pins[seqs[b].seq_id] = out["replica"]
                    if prop is None:
                        continue
                    k = prop.num_draft[j]
                    tokens[b, :k] = prop.tokens[j, :k]
                    num[b] = k
                    if prop.probs is not None:
                        if probs is None:
                            probs = torch.zeros(len(seqs), G, prop.probs.shape[-1])
                        probs[b, :k] = prop.probs[j, :k]
                    self.mirror[seqs[b].seq_id].extend(prop.tokens[j, :k].tolist())
            return Proposal(tokens=tokens, num_draft=num, probs=probs,
                            timings={"draft_s": time.perf_counter() - t0})

        return wait

    def _groups(self, seqs: list[DraftSeq]) -> list[list[int]]:
        by_pin: dict[str | None, list[int]] = {}
        for i, s in enumerate(seqs):
            by_pin.setdefault(self.pins.get(s.seq_id), []).append(i)
        return list(by_pin.values())

    def _call(self, pin: str | None, seqs: list[DraftSeq]):
        h = self.handle.options(session_id=pin) if pin else self.handle
        return h.propose.remote([replace(s, hidden_history=None) for s in seqs])  # history stays here

    def _resync(self, pin: str | None, seqs: list[DraftSeq]):
        """Re-send sequences from their committed tokens (keep=0), e.g. after a lost replica."""
        self.resyncs += len(seqs)
        for s in seqs:
            self.pins.pop(s.seq_id, None)
        fresh = [replace(s, keep=0, new_tokens=list(self.mirror[s.seq_id]), hidden_start=0,
                         hidden=s.hidden_history.clone() if s.hidden_history is not None else None)
                 for s in seqs]
        return self._call(pin, fresh)

    def release(self, seq_id: int) -> None:
        pin = self.pins.pop(seq_id, None)
        self.mirror.pop(seq_id, None)
        if pin is not None:
            try:
                self.handle.options(session_id=pin).release.remote([seq_id])
            except Exception as e:  # a lost replica took the state with it
                log.info("release of %s on %s failed: %s", seq_id, pin, e)

    def num_active(self) -> int:
        return len(self.mirror)

    def call_stats(self) -> dict:
        return {"calls": self.calls, "replica_busy_s": self.replica_busy_s,
                "replica_queued_s": self.replica_queued_s, "resyncs": self.resyncs}


class VerifierServer:
    """The target model and the continuous batcher (large-accelerator pool)."""

    def __init__(self, config: dict, draft_handles: dict | None = None):
        from cluster.config import ClusterConfig  # the config schema (pure pydantic)

        cfg = ClusterConfig.model_validate(config)
        v = cfg.verifier
        torch.set_num_threads(v.torch_threads)
        local = {d.name: d.spec for d in cfg.drafts if not d.remote}
        specs = {d.name: d.spec for d in cfg.drafts}
        remote = {name: RemoteDrafter(handle, name, wants_hidden=spec_wants_hidden(specs.get(name, "")))
                  for name, handle in (draft_handles or {}).items()}
        built = build_engine(cfg.model, local, cfg.dtype, max_batch=v.max_batch, max_len=cfg.max_len,
                             adaptive_gamma=v.adaptive_gamma, extra_drafters=remote,
                             seq_id_base=random.getrandbits(40) << 20)  # unique ids on shared draft replicas
        self.engine = built.engine
        self.engine.set_pipeline(v.pipeline)
        self.replica = _replica_id()
        self.inbox: queue.Queue = queue.Queue()
        self.subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.deadlines: dict[str, float] = {}
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="specd-batcher", daemon=True)
        self._thread.start()

    # ---- called by the router (async, on the replica's event loop) ----------------------------
    async def generate(self, request: dict):
        """Stream one request: yields dicts {token_ids, text, finished, finish_reason[, stats]}."""
        rid = request["request_id"]
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self.subscribers[rid] = (loop, q)
        req = Request(rid, list(request["prompt_ids"]), SamplingParams(**request["params"]),
                      request.get("draft"), int(request.get("gamma", 0)))
        deadline = request.get("deadline")
        self.inbox.put(("add", req, deadline))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item["finished"]:
                    finished = True
                    return
        finally:
            self.subscribers.pop(rid, None)
            if not finished:  # cancelled by the caller: free the KV here and on the draft
                self.inbox.put(("abort", rid, None))

    async def set_pipeline(self, on: bool) -> dict:
        """Turn pipelining on or off on this replica at run time (it applies at the next step
        boundary; draft calls already in flight are verified first). Returns stats()."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.inbox.put(("pipeline", bool(on), (loop, done)))
        await done
        return await self.stats()

    async def stats(self) -> dict:
        eng = self.engine
        return {"replica_id": self.replica, "role": "verifier", "node_id": _node_id(),
                "active_sequences": len(eng.active),
                "queued": len(eng.waiting), "kv_slots_in_use": eng.kv_slots_in_use(),
                "kv_slots_total": eng.max_batch, "steps": self.steps,
                "spec": eng.stats.to_dict(),
                "resyncs": sum(getattr(d, "resyncs", 0) for d in eng.drafters.values()),
                "pipeline": eng.pipeline, "batcher": dict(eng.batcher_stats),
                "remote_drafts": {name: d.call_stats() for name, d in eng.drafters.items()
                                  if isinstance(d, RemoteDrafter)}}

    async def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the batcher thread died")

    # ---- the batcher thread ------------------------------------------------------------------------
    def _deliver(self, rid: str, item) -> None:
        sub = self.subscribers.get(rid)
        if sub is not None:
            loop, q = sub
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _loop(self) -> None:
        eng = self.engine
        while True:
            block = not eng.has_work()
            try:
                while True:  # requests join (and leave) at step boundaries
                    op, arg, extra = self.inbox.get(block=block, timeout=None if block else 0)
                    block = False
                    if op == "add":
                        try:
                            eng.add_request(arg)
                            if extra:
                                self.deadlines[arg.request_id] = extra
                        except ValueError as e:
                            self._deliver(arg.request_id, e)
                    elif op == "abort":
                        eng.abort(arg)
                        eng.finished.pop(arg, None)
                        self.deadlines.pop(arg, None)
                    elif op == "pipeline":
                        eng.set_pipeline(arg)
                        loop, fut = extra
                        loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))
            except queue.Empty:
                pass
            now = time.time()
            for rid, dl in list(self.deadlines.items()):
                if now > dl:
                    self.deadlines.pop(rid)
                    if eng.abort(rid):
                        eng.finished.pop(rid, None)
                        self._deliver(rid, TimeoutError(f"request {rid} passed its deadline"))
            if not eng.has_work():
                continue
            try:
                outs = eng.step()
            except Exception as e:  # never let one bad step kill the replica silently
                log.exception("engine step failed")
                for rid in list(eng.active):
                    eng.abort(rid)
                    eng.finished.pop(rid, None)
                    self._deliver(rid, RuntimeError(f"engine step failed: {e}"))
                continue
            self.steps += 1
            for o in outs:
                item = {"token_ids": o.token_ids, "text": o.text, "finished": o.finished,
                        "finish_reason": o.finish_reason}
                if o.finished:
                    seq = eng.finished.pop(o.request_id, None)
                    self.deadlines.pop(o.request_id, None)
                    if seq is not None:
                        item["stats"] = seq.stats.to_dict()
                        item["prompt_tokens"] = seq.num_prompt
                        item["completion_tokens"] = len(seq.output)
                self._deliver(o.request_id, item)
