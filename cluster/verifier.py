"""The verifier replica: the target model and the continuous batcher (large-accelerator pool).

A thread steps the engine; requests join at step boundaries and leave the moment they
finish, are cancelled or run out of time, freeing their KV here and on their draft.
Each `generate` call is one subscription: the engine keys sequences by its own key, so
callers that reuse a request id never meet (`abort_ids` ends every sequence with the id). A request's time limit arrives as a duration
(seconds remaining when the router sent it) and becomes a deadline on this host's
monotonic clock, so clocks that differ between hosts cannot expire or extend it.

The verifier's engine is the source of truth for committed tokens.
Does not know: gRPC, tokenization or coalescing (the router's job).
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import random
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from actors.build import build_engine, spec_feature_layers
from actors.metrics import LoopStats
from actors.models import model_name
from actors.schema import AUTO_DRAFT, NO_DRAFT, Delta, Request

from .autoscale import METRIC
from .config import ClusterConfig
from .draft_server import RemoteDrafter
from .metrics import GAUGE_REFRESH_S, VerifierMetrics
from .runtime import node_id, replica_id, start_heap_trim

log = logging.getLogger("specd")


@dataclass(eq=False)
class _Ticket:
    """One generate call: where its deltas go, and its engine key once admitted."""
    request: Request
    timeout_s: float | None
    loop: asyncio.AbstractEventLoop
    inbox: asyncio.Queue
    key: int | None = None
    deadline: float | None = None
    sent: int = 0  # tokens delivered so far


@dataclass
class _Admit:
    """Batcher op: admit a ticket's request."""
    ticket: _Ticket


@dataclass
class _Drop:
    """Batcher op: a caller left; free its request's KV here and on its draft."""
    ticket: _Ticket


@dataclass
class _SetPipeline:
    """Batcher op: turn pipelining on or off; the future gets None."""
    on: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class _AbortIds:
    """Batcher op: end the requests with these ids (finish reason "abort"); the future gets those found."""
    request_ids: set[str]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


_Op = _Admit | _Drop | _SetPipeline | _AbortIds


class VerifierServer:
    RECENT = 64  # steps over which `load` reports the acceptance rate

    def __init__(self, config: dict, draft_handles: dict | None = None):
        cfg = ClusterConfig.model_validate(config)
        v = cfg.verifier
        torch.set_num_threads(v.torch_threads)
        local = {d.name: d.spec for d in cfg.drafts if not d.remote}
        specs = {d.name: d.spec for d in cfg.drafts}
        target = model_name(cfg.model)
        remote = {name: RemoteDrafter(handle, name, feature_layers=spec_feature_layers(specs.get(name, ""), target))
                  for name, handle in (draft_handles or {}).items()}
        self.ranks: list = []  # tensor parallelism: ranks 1..N-1's `run` calls (this replica is rank 0)
        group = None
        if v.tensor_parallel_size > 1:
            from actors import tp
            from actors.models import resolve_device

            from .tp import start_ranks

            device = str(resolve_device(cfg.device))
            address, self._rank_actors, self.ranks = start_ranks(
                cfg.model, cfg.dtype, v.tensor_parallel_size, cfg.exact, device, v.torch_threads,
                v.resources.ray_actor_options())
            group = tp.init(0, v.tensor_parallel_size, address, device)
        built = build_engine(cfg.model, local, cfg.dtype, max_batch=v.max_batch, max_len=cfg.max_len,
                             device=cfg.device, compile=v.compile, extra_drafters=remote, pipeline=v.pipeline,
                             prefill_chunk=v.prefill_chunk, tune_profile=v.tune_profile, quant=v.quant,
                             draft_quant={d.name: d.quant for d in cfg.drafts if not d.remote}, prepack=cfg.prepack,
                             weights=cfg.weights, exact=cfg.exact, kv_block=v.kv_block, kv_memory=v.kv_memory, tp=group,
                             default_gamma={d.name: d.default_gamma for d in cfg.drafts},
                             seq_id_base=random.getrandbits(40) << 20)  # unique ids on shared draft replicas
        self.engine = built.engine
        self.engine.prefix.on = v.prefix_cache
        for d in cfg.drafts:
            if not d.remote and not d.grammar_masking and d.name in self.engine.drafters:
                self.engine.drafters[d.name].grammar_masking = False
        log.info("verifier: target %s in %s (%s)", cfg.model, built.dtype, built.dtype_reason)
        self.replica = replica_id()
        self.node = node_id()
        self.inbox: queue.Queue = queue.Queue()
        self.tickets: dict[int, _Ticket] = {}  # engine key -> subscription
        self.loop = LoopStats()
        # (drafted, accepted) tokens, cumulative, after each of the last RECENT steps: GetLoad's
        # recent acceptance is the rate between the oldest and the newest
        self.recent: deque[tuple[int, int]] = deque([(0, 0)], maxlen=self.RECENT + 1)
        self.draft_labels = [NO_DRAFT, AUTO_DRAFT, *(d.name for d in cfg.drafts)]
        self.metrics = VerifierMetrics(cfg.served_name, self.engine.info["dtype"])
        self._export_load()
        self._thread = threading.Thread(target=self._loop, name="specd-batcher", daemon=True)
        self._thread.start()
        start_heap_trim()

    # ---- called by the router (async, on the replica's event loop) ----------------------------
    async def generate(self, request: Request, timeout_s: float | None = None):
        """Stream one request's `Delta`s; `timeout_s`: seconds it may still run (None: no limit)."""
        t = _Ticket(request, timeout_s, asyncio.get_running_loop(), asyncio.Queue())
        self.inbox.put(_Admit(t))
        finished = False
        try:
            while True:
                item = await t.inbox.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # cancelled by the caller: free the KV here and on the draft
                self.inbox.put(_Drop(t))

    async def _on_batcher(self, op: type[_SetPipeline] | type[_AbortIds], arg):
        """Run `op` on the batcher thread at the next step boundary; its result."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.inbox.put(op(arg, loop, done))
        return await done

    async def set_pipeline(self, on: bool) -> dict:
        """Turn pipelining on or off on this replica at run time (it applies at the next step
        boundary; draft calls already in flight are verified first). Returns stats()."""
        await self._on_batcher(_SetPipeline, bool(on))
        return await self.stats()

    async def abort_ids(self, request_ids: list[str]) -> list[str]:
        """Abort every request here with one of these ids: its stream ends with finish reason
        "abort" and its KV is freed. Returns the ids found."""
        return await self._on_batcher(_AbortIds, set(request_ids))

    def _colocated_kv(self) -> dict:
        """Colocated drafts that hold KV here: name -> (sequences, slots)."""
        return {name: (d.num_active(), d.num_active() + d.free_capacity()) for name, d in self.engine.drafters.items()
                if not isinstance(d, RemoteDrafter) and d.free_capacity() is not None}

    async def load(self) -> dict:
        eng = self.engine
        (d0, a0), (d1, a1) = self.recent[0], self.recent[-1]
        return {"replica_id": self.replica, "running": len(eng.active), "waiting": eng.num_waiting(),
                "kv_slots_in_use": eng.kv_slots_in_use(), "kv_slots_total": eng.max_batch,
                "draft_kv_slots_in_use": sum(used for used, _ in self._colocated_kv().values()),
                "recent_acceptance": (a1 - a0) / (d1 - d0) if d1 > d0 else 0.0,
                "kv_blocks_free": eng.cache.free_blocks, "kv_blocks_total": eng.cache.num_blocks}

    async def stats(self) -> dict:
        eng = self.engine
        return {"replica_id": self.replica, "role": "verifier", "node_id": self.node, "pid": os.getpid(),
                "active_sequences": eng.kv_slots_in_use(), "queued": eng.num_waiting(),
                "kv_slots_in_use": eng.kv_slots_in_use(), "kv_slots_total": eng.max_batch, "steps": self.loop.steps,
                "spec": eng.stats.to_dict(), "pipeline": eng.pipeline, "batcher": eng.batcher.to_dict(),
                "loop": self.loop.to_dict(), "batcher_tid": self._thread.native_id,
                "prefix_cache": eng.prefix.counts(), "kv": eng.kv_usage(), "memory": self.memory(),
                "engine": eng.info, "policy": eng.policy.state() if eng.policy is not None else None,
                "remote_drafts": {name: d.call_stats() for name, d in eng.drafters.items()
                                  if isinstance(d, RemoteDrafter)}}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric (`cluster.autoscale.kv_policy`): the share of KV blocks held."""
        c = self.engine.cache
        return {METRIC: c.used_blocks / c.num_blocks}

    def memory(self) -> dict:
        """This process's resident bytes, and of them the weights (the target's and colocated drafts')."""
        import psutil

        return {"rss_bytes": psutil.Process().memory_info().rss,
                "weights_bytes": sum(part["weights"] for part in self.engine.info.get("memory", {}).values())}

    async def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the batcher thread died")
        if self.ranks:
            from .tp import dead

            if dead(self.ranks):
                raise RuntimeError("a tensor-parallel rank died: the replica goes down with its group")

    # ---- the batcher thread ------------------------------------------------------------------------
    def _export_load(self) -> None:
        """Running and waiting requests, and the target KV blocks they hold, per draft the requests
        named; the colocated drafts' KV; the policy's γ per draft (to the metrics)."""
        eng = self.engine
        running, waiting, blocks = dict.fromkeys(self.draft_labels, 0), {}, {}
        for s in eng.active.values():
            d = s.req.speculation.draft
            running[d] = running.get(d, 0) + 1
            blocks[d] = blocks.get(d, 0) + sum(len(eng.cache.tables[m.slot])
                                               for m in (s.beam.members if s.beam is not None else [s]))
        for r in [r for _, r in eng.waiting] + [s.req for s in eng.preempted.values()]:
            waiting[r.speculation.draft] = waiting.get(r.speculation.draft, 0) + 1
        draft_kv = {name: used / total for name, (used, total) in self._colocated_kv().items()}
        gamma = {name: e.gamma for name, e in eng.policy.est.items()} if eng.policy is not None else {}
        self.metrics.load(running, waiting, blocks, eng.cache.num_blocks, draft_kv, gamma)
        self.metrics.prefix_cache(eng.prefix.queries, eng.prefix.hits)

    @staticmethod
    def _deliver(t: _Ticket, item) -> None:
        t.loop.call_soon_threadsafe(t.inbox.put_nowait, item)

    def _drop(self, t: _Ticket) -> None:
        if t.key is not None:
            self.engine.abort(t.key)
            self.tickets.pop(t.key, None)

    def _handle(self, op: _Op) -> None:
        match op:
            case _Admit(t):
                try:
                    t.key = self.engine.add_request(t.request)
                except ValueError as e:
                    self._deliver(t, e)
                    return
                if t.timeout_s is not None:
                    t.deadline = time.monotonic() + t.timeout_s
                self.tickets[t.key] = t
            case _Drop(t):
                self._drop(t)
            case _SetPipeline(on, loop, fut):
                self.engine.set_pipeline(on)
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
            case _AbortIds(ids, loop, fut):
                found = []
                for t in [t for t in self.tickets.values() if t.request.request_id in ids]:
                    self._drop(t)
                    self._deliver(t, Delta(t.request.request_id, [], "", finish_reason="abort",
                                           prompt_tokens=len(t.request.prompt_ids), completion_tokens=t.sent))
                    found.append(t.request.request_id)
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(found))

    def _loop(self) -> None:
        eng, acc, clock = self.engine, self.loop, time.perf_counter
        exported = False  # the gauges show the state as it is (exported after a step, nothing changed since)
        while True:
            block = not eng.has_work()
            t0 = clock()
            try:
                while True:  # requests join (and leave) at step boundaries; idle, it wakes to re-send the gauges
                    op = self.inbox.get(block=block, timeout=GAUGE_REFRESH_S if block else None)
                    t1 = clock()
                    if block:
                        acc.idle_s += t1 - t0
                    block, exported = False, False
                    try:
                        self._handle(op)
                    except Exception as e:  # the batcher goes on; a caller waiting on the op learns why
                        log.exception("batcher op %s failed", type(op).__name__)
                        if isinstance(op, (_SetPipeline, _AbortIds)):
                            op.loop.call_soon_threadsafe(lambda err=e, f=op.future: f.done() or f.set_exception(err))
                    t0 = clock()
                    acc.ops_s += t0 - t1
            except queue.Empty:
                if block:
                    acc.idle_s += clock() - t0
                    exported = False  # the idle refresh
            now = time.monotonic()
            for t in [t for t in self.tickets.values() if t.deadline is not None and now > t.deadline]:
                self._drop(t)
                self._deliver(t, TimeoutError(f"request {t.request.request_id!r} ran past its deadline"))
                exported = False
            if not exported:
                self._timed_export()
            if not eng.has_work():
                continue
            t1 = clock()
            try:
                outs = eng.step()
            except Exception as e:  # never let one bad step kill the replica silently
                log.exception("engine step failed")
                if self.ranks:
                    # A tensor-parallel pass failed (a rank died, or the ranks left off mid-pass): the group
                    # cannot compute another. The replica exits, so that Serve restarts the group now and
                    # the router resumes its streams on the new one (as for any lost replica).
                    log.error("tensor-parallel pass failed: the replica exits with its group")
                    os._exit(1)
                for t in list(self.tickets.values()):
                    self._drop(t)
                    self._deliver(t, RuntimeError(f"engine step failed: {e}"))
                exported = False
                continue
            t2 = clock()
            acc.step_s += t2 - t1
            acc.steps += 1
            st = eng.stats  # finished requests' counts, plus the active ones' below
            live = [s.stats for s in eng.active.values()]
            self.recent.append((st.draft_tokens + sum(x.draft_tokens for x in live),
                                st.accepted_tokens + sum(x.accepted_tokens for x in live)))
            for key, delta in outs.items():
                t = self.tickets.get(key)
                if t is None:
                    continue
                t.sent += len(delta.token_ids)
                acc.deltas += 1
                acc.tokens += len(delta.token_ids)
                if delta.finished:
                    del self.tickets[key]
                    self.metrics.finished(t.request.speculation.draft or NO_DRAFT, delta)  # as the engine resolves it
                self._deliver(t, delta)
            acc.deliver_s += clock() - t2
            self._timed_export()
            exported = True

    def _timed_export(self) -> None:
        t0 = time.perf_counter()
        self._export_load()
        self.loop.gauges_s += time.perf_counter() - t0
