"""Micro-batch pipelining: verify one half of the remote-drafted sequences while the draft
replicas propose for the other half.

Sequences whose drafter is asynchronous (`Drafter.asynchronous`: drafts computed on
another process) are split into two micro-batches. Each step verifies one of them while
the draft calls for the other are already in flight; right after a micro-batch is
verified and committed its next draft calls are sent, so they run on the draft replicas
while the target verifies the other micro-batch. Sequences with local drafters (or none)
join every step's target pass and draft in the step itself. The acceptance rule and the
per-row randomness are the same as in the plain step, so greedy output is identical with
pipelining on or off.

Does not know: how verification works; it calls the engine's `launch_drafts` and
`verify`, and keeps which micro-batch each sequence is in, its flight, and whose turn it is.
"""
from __future__ import annotations

import time

from .drafting import Flight, gather
from .sequence import Sequence


class MicroBatches:
    def __init__(self, on: bool = False):
        self.on = on
        self.turn = 0  # the micro-batch verified next
        self.flights: dict[int, Flight] = {}  # sequence key -> draft calls sent for it, not yet verified
        self.mb: dict[int, int] = {}  # sequence key -> the micro-batch (0 or 1) that verifies it

    def wanted(self, engine, seqs: list[Sequence]) -> bool:
        """Run this step pipelined: it is on and some sequence drafts remotely, or flights
        from before it was turned off are still to be verified."""
        return (self.on and any(engine.asynchronous_drafter(s) for s in seqs)) or bool(self.flights)

    def drop(self, s: Sequence) -> None:
        """s is aborted: its draft call may still be running on a draft replica; let it finish
        before the release, so the replica frees the state (the drafts stay with the other rows)."""
        self.mb.pop(s.key, None)
        fl = self.flights.pop(s.key, None)
        if fl is not None:
            try:
                fl.resolve()
            except Exception:  # a failed call holds no state; the other rows see the error
                pass

    def _send(self, engine, group: list[Sequence]) -> None:
        fl = engine.launch_drafts(group, asynchronous=True)
        for s in group:
            self.flights[s.key] = fl

    def step(self, engine, seqs: list[Sequence]) -> None:
        pipe = [s for s in seqs if engine.asynchronous_drafter(s) or s.key in self.flights]
        in_pipe = {id(s) for s in pipe}
        local = [s for s in seqs if id(s) not in in_pipe]
        for s in pipe:  # newcomers join the smaller micro-batch
            if s.key not in self.mb:
                sizes = [sum(self.mb.get(x.key) == i for x in pipe) for i in (0, 1)]
                self.mb[s.key] = 0 if sizes[0] <= sizes[1] else 1
        mbs = [[s for s in pipe if self.mb[s.key] == i] for i in (0, 1)]
        cur = self.turn if mbs[self.turn] else 1 - self.turn
        self.turn = 1 - cur
        bs = engine.batcher
        t0 = time.perf_counter()
        # Calls for this micro-batch first (it is waited for first), then the other's; local
        # drafters propose meanwhile, in this thread.
        for group in (mbs[cur], mbs[1 - cur] if self.on else []):
            lacking = [s for s in group if s.key not in self.flights]
            if lacking:
                self._send(engine, lacking)
        local_fl = engine.launch_drafts(local, asynchronous=False) if local else None
        mine: list[Flight] = []
        for s in mbs[cur]:
            if all(self.flights[s.key] is not f for f in mine):
                mine.append(self.flights[s.key])
        for f in mine + ([local_fl] if local_fl else []):
            f.resolve()
            engine.observe_drafting(f)
        t2 = time.perf_counter()
        flights = {s.key: self.flights.pop(s.key) for s in mbs[cur]} | {s.key: local_fl for s in local}
        engine.verify(gather(sorted(mbs[cur] + local, key=lambda s: s.slot), flights))
        t3 = time.perf_counter()
        bs.pipelined_steps += 1
        bs.draft_s += t2 - t0
        bs.draft_wait_s += sum(f.wait_s for f in mine)
        bs.draft_flight_s += sum(f.done_at - f.t_launch for f in mine)
        engine.stats.draft_s += t2 - t0
        for s in mbs[cur]:
            if not engine.is_active(s):
                self.mb.pop(s.key, None)
        if self.on:
            # This micro-batch's next draft calls go out now, to run during the other's pass.
            # Rebalance first: finished sequences may have left the micro-batches uneven.
            live = [s for s in mbs[cur] if engine.is_active(s)]
            other = [s for s in mbs[1 - cur] if engine.is_active(s)]
            move = (len(live) - len(other)) // 2
            moved = live[len(live) - move:] if move > 0 else []
            for s in moved:
                self.mb[s.key] = 1 - cur
            stay = live[:len(live) - len(moved)]
            for group in (moved, stay):  # `moved` is verified next: its calls go out first
                if group:
                    self._send(engine, group)
            bs.draft_s += time.perf_counter() - t3
            engine.stats.draft_s += time.perf_counter() - t3
