"""Where the engine's time goes: the batcher's own accounting, cumulative over its life.

Per-request speculation counters are `schema.SpecStats`; this module holds what only
the batcher sees: target passes and rows, and the split of its wall time between
verifying, prefilling and drafting (drafting it did or waited for, and, pipelined,
drafting hidden behind target passes).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class BatcherStats:
    target_passes: int = 0  # verify passes (prefill passes not counted)
    rows_verified: int = 0  # sequences over all verify passes
    pipelined_steps: int = 0
    prefill_passes: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0  # sequences whose KV blocks were taken back (recomputed when readmitted)
    verify_s: float = 0.0  # target pass + acceptance + commit
    prefill_s: float = 0.0
    draft_s: float = 0.0  # drafting not hidden behind a target pass
    draft_wait_s: float = 0.0  # of which: blocked on asynchronous (remote) answers
    draft_flight_s: float = 0.0  # pipelined: send -> answers in hand; minus the waits = hidden drafting
    grammar_s: float = 0.0  # shaping the target's logits in verify passes (grammar masks, and penalties), within verify_s

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoopStats:
    """A serving replica's batcher thread: where its wall time went between engine steps.
    `step_s` is inside `engine.step` (split further by `BatcherStats`); the rest is the replica's own:
    admitting and dropping requests (`ops_s`), exporting the load gauges (`gauges_s`), handing each
    step's deltas to the event loop (`deliver_s`), and waiting for work (`idle_s`)."""
    steps: int = 0
    step_s: float = 0.0
    ops_s: float = 0.0
    gauges_s: float = 0.0
    deliver_s: float = 0.0
    idle_s: float = 0.0
    deltas: int = 0  # stream messages handed on (one per request per step that committed or ended it)
    tokens: int = 0  # tokens those carried

    def to_dict(self) -> dict:
        return asdict(self)
