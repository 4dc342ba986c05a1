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
import threading
import time
from dataclasses import replace
from typing import Callable

import torch

from actors.drafters.base import Drafter, DraftSeq, Proposal, apply_view

log = logging.getLogger("specd")


class DraftServer:
    def __init__(self, drafter: Drafter, replica_id: str = "local", lease_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        self.drafter, self.replica, self.lease_s, self.clock = drafter, replica_id, lease_s, clock
        self.last_seen: dict[int, float] = {}  # seq_id -> when a caller last asked about it
        self.calls = self.batches = self.expired = 0
        self.busy_s = 0.0  # time spent proposing
        self._lock = threading.Lock()  # the drafter's KV and views are not thread-safe

    def propose_batch(self, calls: list[list[DraftSeq]]) -> list[dict]:
        """Answer several calls with one propose. Per call: {"replica", "proposal" (for `rows`),
        "rows", "missing", "full", "queued_s", "busy_s"} (indices into the call's list)."""
        t0 = self.clock()
        with self._lock:
            t1 = self.clock()
            self._expire(t1)
            self.batches += 1
            self.calls += len(calls)
            room = self.drafter.free_capacity()
            flat: list[DraftSeq] = []
            answers = []
            for seqs in calls:
                rows, missing, full = [], [], []
                for i, s in enumerate(seqs):
                    have = self.drafter.view_length(s.seq_id)
                    if (have is None and s.keep > 0) or (have is not None and s.keep > have):
                        missing.append(i)
                    elif have is None and room is not None and room <= 0:
                        full.append(i)
                    else:
                        if have is None and room is not None:
                            room -= 1
                        rows.append(i)
                        self.last_seen[s.seq_id] = t1
                answers.append({"replica": self.replica, "rows": rows, "missing": missing, "full": full,
                                "first": len(flat)})
                flat += [seqs[i] for i in rows]
            prop = self.drafter.propose(flat) if flat else None
            busy = self.clock() - t1
            self.busy_s += busy
        for a in answers:
            first = a.pop("first")
            a["proposal"] = _slice(prop, first, len(a["rows"])) if a["rows"] else None
            a["queued_s"], a["busy_s"] = t1 - t0, busy
        return answers

    def _expire(self, now: float) -> None:
        for sid, seen in list(self.last_seen.items()):
            if now - seen > self.lease_s:
                self.drafter.release(sid)
                del self.last_seen[sid]
                self.expired += 1

    def release(self, seq_ids: list[int]) -> int:
        with self._lock:
            for sid in seq_ids:
                self.drafter.release(sid)
                self.last_seen.pop(sid, None)
            return self.drafter.num_active()

    def stats(self) -> dict:
        cap = self.drafter.free_capacity()
        active = self.drafter.num_active()
        return {"replica_id": self.replica, "role": "draft", "name": self.drafter.name,
                "active_sequences": active, "kv_slots_in_use": active,
                "kv_slots_total": active + cap if cap is not None else 0,
                "calls": self.calls, "batches": self.batches, "expired": self.expired, "busy_s": self.busy_s}


def _slice(prop: Proposal, first: int, n: int) -> Proposal:
    """Rows [first, first + n) of a proposal."""
    sl = slice(first, first + n)
    return Proposal(tokens=prop.tokens[sl], num_draft=prop.num_draft[sl],
                    probs=prop.probs[sl] if prop.probs is not None else None)


class RemoteDrafter(Drafter):
    """A Drafter whose model lives on draft replicas (called through a Serve handle)."""

    asynchronous = True
    RETRIES = 3

    def __init__(self, handle, name: str, wants_hidden: bool = False):
        self.handle, self.name = handle, name
        self.wants_hidden = wants_hidden  # the replicas run a feature-level head
        self.pins: dict[int, str] = {}  # seq_id -> draft replica holding its KV
        self.mirror: dict[int, list[int]] = {}  # what that replica's view should be
        self.resyncs = self.full_rows = 0
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
                self.replica_busy_s += out["busy_s"]
                self.replica_queued_s += out["queued_s"]
                if out["missing"]:
                    miss = [rows[i] for i in out["missing"]]
                    work.append((miss, self._resync(out["replica"], [seqs[i] for i in miss])))
                for i in out["full"]:  # no slot there: γ=0 this step; unpinned, a later step retries
                    self.pins.pop(seqs[rows[i]].seq_id, None)
                    self.full_rows += 1
                prop: Proposal | None = out["proposal"]
                for j, i in enumerate(out["rows"]):
                    b = rows[i]
                    self.pins[seqs[b].seq_id] = out["replica"]
                    k = prop.num_draft[j]
                    tokens[b, :k] = prop.tokens[j, :k]
                    num[b] = k
                    if prop.probs is not None:
                        if probs is None:
                            probs = torch.zeros(len(seqs), G, prop.probs.shape[-1])
                        probs[b, :k] = prop.probs[j, :k]
                    self.mirror[seqs[b].seq_id].extend(prop.tokens[j, :k].tolist())
            return Proposal(tokens=tokens, num_draft=num, probs=probs)

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
                "replica_queued_s": self.replica_queued_s, "resyncs": self.resyncs, "full_rows": self.full_rows}
