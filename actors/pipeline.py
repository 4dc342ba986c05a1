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
`verify`, and keeps only which micro-batch each sequence is in and whose turn it is.
"""
from __future__ import annotations

import time

from .drafting import Flight
from .sequence import Sequence


class MicroBatches:
    def __init__(self, on: bool = False):
        self.on = on
        self.turn = 0  # the micro-batch verified next

    def wanted(self, engine, seqs: list[Sequence]) -> bool:
        """Run this step pipelined: it is on and some sequence drafts remotely, or flights
        from before it was turned off are still to be verified."""
        return (self.on and any(engine.asynchronous_drafter(s) for s in seqs)) or \
            any(s.flight is not None for s in seqs)

    def step(self, engine, seqs: list[Sequence], outputs: dict) -> None:
        pipe = [s for s in seqs if engine.asynchronous_drafter(s) or s.flight is not None]
        in_pipe = {id(s) for s in pipe}
        local = [s for s in seqs if id(s) not in in_pipe]
        for s in pipe:  # newcomers join the smaller micro-batch
            if s.mb is None:
                s.mb = 0 if sum(x.mb == 0 for x in pipe) <= sum(x.mb == 1 for x in pipe) else 1
        mbs = [[s for s in pipe if s.mb == i] for i in (0, 1)]
        cur = self.turn if mbs[self.turn] else 1 - self.turn
        self.turn = 1 - cur
        bs = engine.batcher
        t0 = time.perf_counter()
        # Calls for this micro-batch first (it is waited for first), then the other's; local
        # drafters propose meanwhile, in this thread.
        for group in (mbs[cur], mbs[1 - cur] if self.on else []):
            lacking = [s for s in group if s.flight is None]
            if lacking:
                engine.launch_drafts(lacking, asynchronous=True)
        local_fl = engine.launch_drafts(local, asynchronous=False) if local else None
        mine: list[Flight] = []
        for s in mbs[cur]:
            if all(s.flight is not f for f in mine):
                mine.append(s.flight)
        for f in mine + ([local_fl] if local_fl else []):
            f.resolve()
            engine.observe_drafting(f)
        t2 = time.perf_counter()
        rows = sorted(mbs[cur] + local, key=lambda s: s.slot)
        drafts, probs, group_s, draft_s, parents = [], {}, [], [], {}
        where = {id(s): b for b, s in enumerate(rows)}
        for f in mine + ([local_fl] if local_fl else []):
            for name, frows, sec in f.group_s:
                group_s.append((name, [where[id(f.seqs[i])] for i in frows if id(f.seqs[i]) in where], sec))
        shadow = []
        for b, s in enumerate(rows):
            f = s.flight if s.flight is not None else local_fl
            i = next(i for i, x in enumerate(f.seqs) if x is s)
            drafts.append(f.drafts[i])
            shadow.append(bool(f.shadow) and f.shadow[i])
            if i in f.parents:
                parents[b] = f.parents[i]
            if i in f.probs:
                probs[b] = f.probs[i]
            draft_s.append(f.launch_s + f.wait_s)
            s.flight = None
        engine.verify(rows, engine.set_aside_shadows(rows, drafts, shadow), probs, group_s, draft_s, outputs,
                      parents)
        t3 = time.perf_counter()
        bs.pipelined_steps += 1
        bs.draft_s += t2 - t0
        bs.draft_wait_s += sum(f.wait_s for f in mine)
        bs.draft_flight_s += sum(f.done_at - f.t_launch for f in mine)
        engine.stats.draft_s += t2 - t0
        if self.on:
            # This micro-batch's next draft calls go out now, to run during the other's pass.
            # Rebalance first: finished sequences may have left the micro-batches uneven.
            live = [s for s in mbs[cur] if engine.is_active(s)]
            other = [s for s in mbs[1 - cur] if engine.is_active(s)]
            move = (len(live) - len(other)) // 2
            moved = live[len(live) - move:] if move > 0 else []
            for s in moved:
                s.mb = 1 - cur
            stay = live[:len(live) - len(moved)]
            for group in (moved, stay):  # `moved` is verified next: its calls go out first
                if group:
                    engine.launch_drafts(group, asynchronous=True)
            bs.draft_s += time.perf_counter() - t3
            engine.stats.draft_s += time.perf_counter() - t3
