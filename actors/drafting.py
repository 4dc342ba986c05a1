"""Asking the drafters: one `Flight` of draft calls for a set of sequences.

`launch` groups sequences by drafter and hands each drafter its rows as `DraftSeq`s
(the rollback point, the committed tokens it has not seen, γ, the sampling
parameters, and for feature drafters the target's hidden states from `Features`).
Asynchronous drafters (draft replicas) get their calls sent and answer later; the
rest propose in the calling thread. `Flight.resolve` waits for every answer once and
keeps the drafts per row; `gather` turns the resolved flights of a pass's rows into
its `acceptance.VerifyBatch`.

Does not know: the target, acceptance, or when the drafts are verified (the engine
verifies at once; micro-batch pipelining verifies a flight one step later).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .acceptance import Row, VerifyBatch
from .drafters.base import Drafter, DraftSeq, Proposal
from .sequence import Sequence


@dataclass(eq=False)
class Flight:
    """Draft calls for `seqs`, sent (or, for local drafters, already answered), not verified."""
    seqs: list[Sequence]
    waiters: list[tuple[str, list[int], Callable[[], Proposal]]]  # (drafter name, rows, wait)
    t_launch: float
    launch_s: float = 0.0  # time in `launch`: local drafting, sending remote calls
    own_s: dict[str, float] = field(default_factory=dict)  # per drafter: time in its launching call
    blocked_s: float = 0.0  # an asynchronous-capable drafter called synchronously (plain step)
    # Filled by `resolve`:
    drafts: list[list[int]] | None = None  # per row, the proposed tokens
    parents: dict[int, list[int]] = field(default_factory=dict)  # row -> tree parents (absent: a chain)
    probs: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> [k, V] draft distribution
    group_s: list[tuple[str, list[int], float]] = field(default_factory=list)  # (drafter, rows, seconds)
    wait_s: float = 0.0  # blocked on asynchronous answers
    done_at: float = 0.0
    error: BaseException | None = None
    shadow: list[bool] = field(default_factory=list)  # per row: drafts proposed but not to be verified

    def resolve(self) -> None:
        if self.drafts is not None:
            return
        if self.error is not None:
            raise self.error
        t0 = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in self.seqs]
        try:
            for name, rows, wait in self.waiters:
                tg = time.perf_counter()
                prop = wait()
                self.group_s.append((name, rows, self.own_s.get(name, 0.0) + time.perf_counter() - tg))
                for b, row in zip(rows, prop.rows()):
                    drafts[b] = row.tokens
                    if row.parents is not None:
                        self.parents[b] = row.parents
                    if row.probs is not None and not self.seqs[b].req.sampling.greedy:
                        self.probs[b] = row.probs
        except BaseException as e:
            self.error = e
            raise
        self.waiters = []
        self.drafts = drafts
        self.done_at = time.perf_counter()
        self.wait_s = self.done_at - t0


def gather(seqs: list[Sequence], flights: dict[int, Flight]) -> VerifyBatch:
    """The verify batch of `seqs` (in pass order) from their resolved flights (by sequence key):
    each row's drafts, tree parents, draft probabilities and draft seconds, its shadow drafts set
    aside, and each drafter call's rows renumbered to the batch."""
    rows, where = [], {}
    for b, s in enumerate(seqs):
        f = flights[s.key]
        i = where.setdefault(id(f), {id(x): i for i, x in enumerate(f.seqs)})[id(s)]
        d = f.drafts[i]
        shadow = bool(f.shadow) and f.shadow[i]
        if shadow:  # proposed only to be compared with what the target commits: nothing to verify
            rows.append(Row(s, [], draft_s=f.launch_s + f.wait_s, shadow=d))  # [] too: proposed none
        else:
            rows.append(Row(s, d, f.parents.get(i), f.probs.get(i), f.launch_s + f.wait_s))
    at = {id(s): b for b, s in enumerate(seqs)}
    groups = []
    seen = set()
    for s in seqs:
        f = flights[s.key]
        if id(f) not in seen:
            seen.add(id(f))
            groups += [(name, [at[id(f.seqs[i])] for i in frows if id(f.seqs[i]) in at], sec)
                       for name, frows, sec in f.group_s]
    return VerifyBatch(rows, groups)


class Features:
    """The target's features of committed tokens, per KV slot, for feature-level drafters
    (EAGLE heads): every layer any of them reads (`layers`), concatenated; they reach each
    drafter, cut to its own layers (`columns`), with the rollback information."""

    def __init__(self, layers: tuple[int, ...], slots: int, positions: int, width: int, dtype, device):
        self.layers = layers
        # [S, P, F * E]; only [:length] of a slot is ever read. On a CPU left uninitialised, so that the
        # pages of positions no request reached are never resident.
        new = torch.empty if torch.device(device).type == "cpu" else torch.zeros
        self.buf = new(slots, positions, len(layers) * width, dtype=dtype, device=device)
        self.length = [0] * slots  # committed tokens whose features are in buf

    def keep(self, slot: int, h: torch.Tensor) -> None:
        """Append the features [n, F * E] of newly committed tokens (all but the last one)."""
        n = self.length[slot]
        self.buf[slot, n:n + len(h)] = h
        self.length[slot] = n + len(h)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Slot dst now holds src's first n tokens (a beam fork)."""
        self.buf[dst, :n] = self.buf[src, :n]
        self.length[dst] = n

    def clear(self, slot: int) -> None:
        self.length[slot] = 0


def feature_union(drafters) -> tuple[int, ...]:
    """Every target feature layer some drafter reads: decoder layers in order, then -1 (final)."""
    layers = {i for d in drafters for i in d.feature_layers}
    return tuple(sorted(i for i in layers if i >= 0)) + ((-1,) if -1 in layers else ())


def feature_columns(kept: tuple[int, ...], wanted: tuple[int, ...], width: int,
                    device=None) -> slice | torch.Tensor | None:
    """Columns of a [.., len(kept) * width] feature row that hold `wanted`, in its order: None
    for all of them, a slice where they lie together (selecting them stays a view), else an index
    on `device`. Computed once per drafter, not per step."""
    if tuple(wanted) == tuple(kept):
        return None
    at = [kept.index(i) for i in wanted]
    if at == list(range(at[0], at[0] + len(at))):
        return slice(at[0] * width, (at[-1] + 1) * width)
    return torch.cat([torch.arange(i * width, (i + 1) * width) for i in at]).to(device)


def launch(seqs: list[Sequence], gammas: list[int], drafters: dict[str, Drafter],
           features: Features | None, asynchronous: bool, trees: list[int] | None = None,
           columns: dict[str, slice | torch.Tensor | None] | None = None,
           shadow: list[bool] | None = None) -> Flight:
    """Ask each sequence's drafter for up to gammas[b] tokens (rows with γ 0 get none), as a
    token tree of at most trees[b] nodes where that is > 0; shadow[b]: row b's drafts will only
    be compared with what the target commits, never verified (`DraftSeq.shadow`).
    asynchronous: asynchronous drafters only send their calls; otherwise every drafter
    proposes now. columns: per feature drafter, its columns of the features (`feature_columns`;
    absent: all). The drafters' views become committed + drafts (`Sequence.view`)."""
    t0 = time.perf_counter()
    groups: dict[str, list[int]] = {}
    for b, s in enumerate(seqs):
        if gammas[b] > 0:
            groups.setdefault(s.draft, []).append(b)
    shadow = list(shadow) if shadow is not None else [False] * len(seqs)
    fl = Flight(seqs=list(seqs), waiters=[], t_launch=t0, shadow=shadow)
    for name, rows in groups.items():
        drafter = drafters[name]
        cols = (columns or {}).get(name)
        dseqs = [_draft_seq(seqs[b], gammas[b], features if drafter.wants_hidden else None,
                            trees[b] if trees else 0, cols, shadow[b], drafter.grammar_masking) for b in rows]
        tg = time.perf_counter()
        if asynchronous or not drafter.asynchronous:
            wait = drafter.propose_async(dseqs)
        else:
            prop = drafter.propose(dseqs)
            wait = (lambda prop=prop: prop)
            fl.blocked_s += time.perf_counter() - tg
        fl.own_s[name] = time.perf_counter() - tg
        fl.waiters.append((name, rows, wait))
    fl.launch_s = time.perf_counter() - t0
    return fl


def _draft_seq(s: Sequence, gamma: int, features: Features | None, tree: int = 0,
               cols: slice | torch.Tensor | None = None, shadow: bool = False, masks: bool = False) -> DraftSeq:
    p, v = s.req.sampling, s.view
    ds = DraftSeq(seq_id=s.key, keep=v.keep, new_tokens=s.tokens[v.keep:], gamma=gamma,
                  temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=s.seed, coupled=s.req.coupled,
                  tree=tree, threshold=s.req.speculation.threshold or 0.0, shadow=shadow,
                  penalties=p.penalties, output_start=s.num_prompt, tenant=s.req.tenant,
                  grammar=s.constraint.matcher.deep_copy() if masks and s.constraint is not None and not tree
                  else None)
    n = None
    if features is not None:
        n = features.length[s.slot]
        kept = features.buf[s.slot, :n]  # [n, F * E]
        mine = kept if cols is None else kept[:, cols]  # this drafter's layers (an index copies them)
        ds.hidden_start = v.hid_sent
        ds.hidden = mine[v.hid_sent:].clone()
        ds.hidden_history = mine  # for a lost drafter's re-prefill
    v.sent(len(s.tokens), features=n)  # the drafter's view is now committed + its drafts
    return ds
