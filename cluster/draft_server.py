"""Remote drafts: the draft server on the small-accelerator pool, and the verifier's view of it.

DraftServer     Ray-free core of a draft replica: one drafter, its per-sequence KV as soft
                state. `propose_batch` answers several callers' rows in ONE propose: a row
                whose state is not here (new on this replica after a loss, or expired) is
                reported `missing`, and a new row that finds no free KV slot is reported
                `full`; neither takes state. State of sequences nobody has asked about for
                `lease_s` expires (their verifier died), so slots are never orphaned.
RemoteDrafter   the `Drafter` interface over a deployment handle, inside the verifier: pins each
                sequence to the replica that holds its draft KV (the session id PinnedRouter
                reads), re-sends `missing` rows from the committed tokens (keep=0), runs `full`
                rows at γ=0 this step (a later step tries again), and re-syncs elsewhere when a
                replica dies mid-call.

Ray-free (the Serve deployment around DraftServer is `cluster.app.DraftDeployment`), so both
run in unit tests behind a fake handle. Does not know: acceptance, or committed tokens beyond
what each call carries.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from actors.drafters.base import Drafter, DraftSeq, Proposal, RowDraft, apply_view

log = logging.getLogger("specd")


@dataclass
class _Block:
    """A block of drafts just sent to a verifier, and the next blocks prepared for its verdicts."""
    call: DraftSeq  # the call that asked for it (sampling parameters, γ)
    anchor: int  # committed tokens before the block: every possible verdict keeps them
    view: list[int]  # committed + the block: what the verifier believes the draft's view is
    block: list[int]  # the drafts
    topk: list[list[int]]  # the draft's likeliest tokens at each drafted position
    branches: dict = field(default_factory=dict)  # (keep, new_tokens) -> (drafts, probs [γ, V] or None)
    done: bool = False  # every planned branch prepared


@dataclass
class DraftAnswer:
    """A draft replica's answer to one call: what became of each of the call's rows (indices into
    its list of sequences) and the proposal for `rows`."""
    replica: str  # the replica that answered: later calls for these sequences are pinned to it
    rows: list[int]  # drafted (the proposal's rows, in this order)
    missing: list[int]  # no state here (a new replica, or expired): re-send from the committed tokens
    full: list[int]  # new here but no free KV slot: γ=0 this step
    prepared: list[int]  # of `rows`, answered from a block drafted ahead (overlap)
    proposal: Proposal | None = None
    queued_s: float = 0.0  # waiting behind another batch
    busy_s: float = 0.0  # the batch's propose


class DraftServer:
    """Overlap (`overlap=True`, token-level model drafts): after answering a call, a worker thread
    drafts the NEXT block for the verdicts the verifier is most likely to return (all drafts
    accepted plus the draft's top bonus candidates; the first rejection plus its top correction
    candidates), up to `branches` of them, while the target verifies. A call whose (keep,
    new_tokens) matches a prepared verdict is answered at once, without drafting; any other is
    drafted as usual. Prepared drafts are only proposals, so greedy output and the sampled
    distribution are unchanged. Real calls always go first: the worker yields between branches."""

    def __init__(self, drafter: Drafter, replica_id: str = "local", lease_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic, overlap: bool = False, branches: int = 3):
        self.drafter, self.replica, self.lease_s, self.clock = drafter, replica_id, lease_s, clock
        self.last_seen: dict[int, float] = {}  # seq_id -> when a caller last asked about it
        self.calls = self.batches = self.expired = 0
        self.busy_s = 0.0  # time spent proposing for callers
        self._lock = threading.Lock()  # the drafter's KV and views are not thread-safe
        self.overlap = overlap and not drafter.wants_hidden and drafter.rebases_views
        self.branches = branches
        self.blocks: dict[int, _Block] = {}
        self.alpha: dict[int, float] = {}  # per sequence: EMA of the accepted share of its blocks
        self.hits = self.misses = self.prepared = 0
        self.prepare_s = 0.0
        self._waiting = 0  # callers waiting for the lock: the worker yields to them
        self._todo: deque[int] = deque()
        self._wake = threading.Event()
        self._busy = False  # the worker is preparing
        if self.overlap:
            drafter.record_topk = branches
            threading.Thread(target=self._worker, name="draft-overlap", daemon=True).start()

    def propose_batch(self, calls: list[list[DraftSeq]]) -> list[DraftAnswer]:
        """Answer several calls with one propose: a `DraftAnswer` per call."""
        t0 = self.clock()
        self._waiting += 1
        with self._lock:
            self._waiting -= 1
            t1 = self.clock()
            self._expire(t1)
            self.batches += 1
            self.calls += len(calls)
            room = self.drafter.free_capacity()
            flat: list[DraftSeq] = []
            ready: dict[tuple[int, int], tuple[list[int], torch.Tensor | None]] = {}  # (call, row) -> prepared
            answers: list[DraftAnswer] = []
            drafted: list[list[int]] = []  # per call: its rows drafted in this batch's propose
            for c, seqs in enumerate(calls):
                rows, missing, full, flat_rows = [], [], [], []
                for i, s in enumerate(seqs):
                    have = self.drafter.view_length(s.seq_id)
                    if (have is None and s.keep > 0) or (have is not None and s.keep > have):
                        missing.append(i)
                        continue
                    if have is None and room is not None and room <= 0:
                        full.append(i)
                        continue
                    if have is None and room is not None:
                        room -= 1
                    rows.append(i)
                    self.last_seen[s.seq_id] = t1
                    hit = self._take_prepared(s) if self.overlap else None
                    if hit is not None:
                        ready[c, i] = hit
                    else:
                        flat_rows.append(i)
                        flat.append(s)
                answers.append(DraftAnswer(self.replica, rows, missing, full,
                                           sorted(i for cc, i in ready if cc == c)))
                drafted.append(flat_rows)
            prop = self.drafter.propose(flat) if flat else None
            busy = self.clock() - t1
            self.busy_s += busy
            first = 0
            for c, (seqs, a, flat_rows) in enumerate(zip(calls, answers, drafted)):
                part = _slice(prop, first, len(flat_rows)) if flat_rows else None
                first += len(flat_rows)
                a.proposal = _assemble([seqs[i] for i in a.rows], a.rows, flat_rows, part,
                                       {i: ready[c, i] for i in a.prepared})
                a.queued_s, a.busy_s = t1 - t0, busy
                if self.overlap and a.proposal is not None:
                    self._remember(seqs, a.rows, a.proposal)
        if self.overlap:
            self._wake.set()
        return answers

    # ---- overlap ---------------------------------------------------------------------------------
    def _take_prepared(self, s: DraftSeq) -> tuple[list[int], torch.Tensor | None] | None:
        """The prepared next block for this verdict, or None (then it is drafted as usual)."""
        blk = self.blocks.pop(s.seq_id, None)
        if blk is None:
            return None
        if s.tree:  # trees are drafted fresh (blocks are prepared as chains)
            self.drafter.set_view(s.seq_id, blk.view, blk.anchor)
            return None
        accepted = s.keep - blk.anchor
        if 0 <= accepted <= len(blk.block):
            a = self.alpha.get(s.seq_id, 0.3)
            self.alpha[s.seq_id] = 0.5 * a + 0.5 * accepted / max(1, len(blk.block))
        got = blk.branches.get((s.keep, tuple(s.new_tokens)))
        same = got is not None and len(got[0]) >= s.gamma and (s.temperature, s.top_k, s.top_p, s.coupled) == \
            (blk.call.temperature, blk.call.top_k, blk.call.top_p, blk.call.coupled)
        if not same:
            self.misses += 1
            self.drafter.set_view(s.seq_id, blk.view, blk.anchor)  # as the verifier believes it, KV up to the anchor
            return None
        self.hits += 1
        drafts, probs = got[0][:s.gamma], None if got[1] is None else got[1][:s.gamma]
        self.drafter.set_view(s.seq_id, blk.view[:s.keep] + list(s.new_tokens) + drafts, blk.anchor)
        return drafts, probs

    def _remember(self, seqs: list[DraftSeq], rows: list[int], prop: Proposal) -> None:
        for j, i in enumerate(rows):
            s = seqs[i]
            k = prop.num_draft[j]
            if k == 0 or s.tree or s.shadow:  # a shadow block is never verified: no verdict to prepare for
                continue
            view = list(self.drafter.views[s.seq_id])  # committed + the block just proposed
            block = view[len(view) - k:]
            topk = prop.topk[j, :k].tolist() if prop.topk is not None else [[] for _ in range(k)]
            self.blocks[s.seq_id] = _Block(call=s, anchor=len(view) - k, view=view, block=block, topk=topk)
            self._todo.append(s.seq_id)

    def _plan(self, sid: int, blk: _Block, bonus: list[int]) -> list[tuple[int, int]]:
        """The likeliest verdicts (accepted count a, next token c), by a rough probability:
        all accepted with the draft's bonus candidates; the first rejection at j with the draft's
        other candidates there (rank-weighted, since the draft's top choice was rejected)."""
        alpha, k = self.alpha.get(sid, 0.3), len(blk.block)
        rank_w = (0.6, 0.2, 0.1, 0.05)
        cands = [(alpha ** k * rank_w[r], k, c) for r, c in enumerate(bonus[:len(rank_w)])]
        for j in range(k):
            others = [c for c in blk.topk[j] if c != blk.block[j]]
            cands += [(alpha ** j * (1 - alpha) * rank_w[r], j, c) for r, c in enumerate(others[:len(rank_w)])]
        cands.sort(key=lambda x: -x[0])
        return [(a, c) for _, a, c in cands[:self.branches]]

    def _worker(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while self._todo:
                self._busy = True
                sid = self._todo.popleft()
                try:
                    self._prepare(sid)
                except Exception:  # preparing is best effort: the call will be drafted as usual
                    log.exception("draft preparation failed for sequence %s", sid)
                finally:
                    self._busy = False

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until every queued preparation is done (tests and benchmarks)."""
        end = time.monotonic() + timeout
        while (self._todo or self._busy) and time.monotonic() < end:
            time.sleep(0.001)

    def _branch(self, sid: int, blk: _Block, keep: int, new: list[int], gamma: int):
        """One guessed verdict, drafted under the lock; the view is put back after."""
        while self._waiting:
            time.sleep(0.0005)  # a caller goes first
        with self._lock:
            if self.blocks.get(sid) is not blk:
                return None  # its verdict arrived meanwhile, or it was released
            t0 = self.clock()
            c = blk.call
            prop = self.drafter.propose([DraftSeq(seq_id=sid, keep=keep, new_tokens=new, gamma=gamma,
                                                  temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
                                                  seed=c.seed, coupled=c.coupled)])
            self.drafter.set_view(sid, blk.view, keep)
            self.prepared += 1
            self.prepare_s += self.clock() - t0
            n = prop.num_draft[0]
            return (prop.tokens[0, :n].tolist(), None if prop.probs is None else prop.probs[0, :n].clone(),
                    prop.topk[0].tolist() if prop.topk is not None else [])

    def _prepare(self, sid: int) -> None:
        blk = self.blocks.get(sid)
        if blk is None or blk.done:
            return
        k, g = len(blk.block), blk.call.gamma
        # Feed the block's last draft and draft one more than γ: the first token is the draft's
        # bonus guess, the rest the next block after it (the likeliest verdict, all accepted).
        got = self._branch(sid, blk, blk.anchor + k - 1, [blk.block[-1]], g + 1)
        if got is None:
            return
        drafts, probs, topk = got
        if drafts:  # the verdict "all accepted, the bonus is the draft's own next token" comes free
            blk.branches[blk.anchor + k, (drafts[0],)] = (drafts[1:], None if probs is None else probs[1:])
        bonus = topk[0] if topk else drafts[:1]
        for a, c in self._plan(sid, blk, bonus):
            if self.blocks.get(sid) is not blk:
                return
            key = (blk.anchor + a, (c,))
            if key in blk.branches:
                continue
            got = self._branch(sid, blk, blk.anchor + a, [c], g)
            if got is None:
                return
            blk.branches[key] = got[:2]
        blk.done = True

    def _forget(self, sid: int) -> None:
        """Drop every piece of state held for one sequence: its draft KV and view, its lease, its
        prepared block and its acceptance estimate (under the lock)."""
        self.drafter.release(sid)
        self.last_seen.pop(sid, None)
        self.blocks.pop(sid, None)
        self.alpha.pop(sid, None)

    def _expire(self, now: float) -> None:
        for sid, seen in list(self.last_seen.items()):
            if now - seen > self.lease_s:
                self._forget(sid)
                self.expired += 1

    def release(self, seq_ids: list[int]) -> int:
        with self._lock:
            for sid in seq_ids:
                self._forget(sid)
            return self.drafter.num_active()

    def stats(self) -> dict:
        cap = self.drafter.free_capacity()
        active = self.drafter.num_active()
        return {"replica_id": self.replica, "role": "draft", "pid": os.getpid(), "name": self.drafter.name,
                "active_sequences": active, "kv_slots_in_use": active,
                "kv_slots_total": active + cap if cap is not None else 0,
                "calls": self.calls, "batches": self.batches, "expired": self.expired, "busy_s": self.busy_s,
                "overlap": self.overlap, "prepared_hits": self.hits, "prepared_misses": self.misses,
                "hit_rate": self.hits / (self.hits + self.misses) if self.hits + self.misses else None,
                "prepared_branches": self.prepared, "prepare_s": self.prepare_s}


def _slice(prop: Proposal, first: int, n: int) -> Proposal:
    """Rows [first, first + n) of a proposal."""
    sl = slice(first, first + n)
    return Proposal(tokens=prop.tokens[sl].cpu(), num_draft=prop.num_draft[sl],
                    probs=prop.probs[sl].cpu() if prop.probs is not None else None,
                    topk=prop.topk[sl].cpu() if prop.topk is not None else None,
                    parents=prop.parents[sl] if prop.parents is not None else None)


def _assemble(seqs: list[DraftSeq], rows: list[int], drafted: list[int], part: Proposal | None,
              ready: dict[int, tuple[list[int], torch.Tensor | None]]) -> Proposal | None:
    """One proposal for a call's answered `rows` (in order): those in `drafted` from `part`, the
    rest from prepared blocks."""
    if not rows:
        return None
    if not ready:
        return part
    fresh = dict(zip(drafted, part.rows())) if part is not None else {}
    return Proposal.stack([RowDraft(*ready[i]) if i in ready else fresh[i] for i in rows],
                          max(max(s.gamma, s.tree) for s in seqs))


class RemoteDrafter(Drafter):
    """A Drafter whose model lives on draft replicas (called through a Serve handle)."""

    asynchronous = True
    RETRIES = 3

    def __init__(self, handle, name: str, feature_layers: tuple[int, ...] = ()):
        self.handle, self.name = handle, name
        self.feature_layers = tuple(feature_layers)  # the replicas run a feature-level head reading these
        self.pins: dict[int, str] = {}  # seq_id -> draft replica holding its KV
        self.mirror: dict[int, list[int]] = {}  # what that replica's view should be
        self.resyncs = self.full_rows = self.prepared_rows = 0
        # Seen from here: calls answered, and the replicas' time proposing / queued behind
        # another batch, summed over answers.
        self.calls, self.replica_busy_s, self.replica_queued_s = 0, 0.0, 0.0

    def propose(self, seqs: list[DraftSeq]) -> Proposal:
        return self.propose_async(seqs)()

    def propose_async(self, seqs: list[DraftSeq]) -> Callable[[], Proposal]:
        """Send the calls now; return a function that waits for and assembles the proposal."""
        for s in seqs:
            apply_view(self.mirror.setdefault(s.seq_id, []), s.keep, s.new_tokens)
        pending = [(rows, self._call(self.pins.get(seqs[rows[0]].seq_id), [seqs[i] for i in rows]))
                   for rows in self._groups(seqs)]

        def wait() -> Proposal:
            out_rows = [RowDraft([]) for _ in seqs]  # a row no replica drafted (missing, full): none
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
                self.replica_busy_s += out.busy_s
                self.replica_queued_s += out.queued_s
                self.prepared_rows += len(out.prepared)
                if out.missing:
                    miss = [rows[i] for i in out.missing]
                    work.append((miss, self._resync(out.replica, [seqs[i] for i in miss])))
                for i in out.full:  # no slot there: γ=0 this step; unpinned, a later step retries
                    self.pins.pop(seqs[rows[i]].seq_id, None)
                    self.full_rows += 1
                for i, row in zip(out.rows, out.proposal.rows() if out.rows else []):
                    b = rows[i]
                    self.pins[seqs[b].seq_id] = out.replica
                    out_rows[b] = row
                    if row.parents is None:  # a chain (a tree leaves the replica's view at the committed tokens)
                        self.mirror[seqs[b].seq_id].extend(row.tokens)
            return Proposal.stack(out_rows, max(max(s.gamma, s.tree) for s in seqs))

        return wait

    def _groups(self, seqs: list[DraftSeq]) -> list[list[int]]:
        by_pin: dict[str | None, list[int]] = {}
        for i, s in enumerate(seqs):
            by_pin.setdefault(self.pins.get(s.seq_id), []).append(i)
        return list(by_pin.values())

    def _call(self, pin: str | None, seqs: list[DraftSeq]):
        h = self.handle.options(session_id=pin) if pin else self.handle
        return h.propose.remote([replace(s, hidden_history=None, grammar=None) for s in seqs])  # verifier-local

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
                "replica_queued_s": self.replica_queued_s, "resyncs": self.resyncs, "full_rows": self.full_rows,
                "prepared_rows": self.prepared_rows}
