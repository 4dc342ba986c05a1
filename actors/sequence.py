"""The engine's per-sequence state: one admitted request, from prefill to its last token.

Shared by the engine (`engine.py`), drafting (`drafting.py`), acceptance (`acceptance.py`), beam
search (`beam.py`) and micro-batch pipelining (`pipeline.py`); it imports none of them.

Invariants: `tokens` = prompt + committed output. The target KV of `slot` holds every
committed token but the last one (which is the first input of the next verify pass),
except while the prompt is still being prefilled (`prefilled < num_prompt`): then it
holds the first `prefilled` prompt tokens and nothing is committed yet. A sequence preempted
for KV blocks (`refill`) gets back the KV of every committed token but the last by a prefill.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from .schema import Request, SpecStats
from .text import TextStream


class Mode(str, Enum):
    """How a row's drafts are accepted; fixed at admission from the request (`mode_of`)."""
    GREEDY = "greedy"  # the target's argmax
    COUPLED = "coupled"  # sampled with a seed: argmax of log p + Gumbel noise keyed by (seed, position)
    SAMPLED = "sampled"  # rejection sampling against the draft's q (one-hot for deterministic drafts)
    LOSSY = "lossy"  # a lossy rule the request asked for (`topk:K`, `typical:ε`), chains only


def mode_of(req: Request) -> Mode:
    if req.sampling.greedy:
        return Mode.GREEDY
    if req.acceptance_rule[0] != "lossless":
        return Mode.LOSSY
    return Mode.COUPLED if req.coupled else Mode.SAMPLED


@dataclass
class DraftView:
    """What the sequence's drafter holds of it: the first `keep` tokens of its view (committed
    tokens plus the drafts it proposed last) are still valid, and it has received the target's
    features of the first `hid_sent` committed tokens. The drafter rolls back to `keep` on its
    next call (`DraftSeq.keep`)."""
    keep: int = 0
    hid_sent: int = 0

    def sent(self, committed: int, features: int | None = None) -> None:
        """A draft call went out with every committed token (and `features` rows of features):
        its view is those plus what it drafts now (counted when verified, `accepted`)."""
        self.keep = committed
        if features is not None:
            self.hid_sent = features

    def accepted(self, n: int) -> None:
        """n of the chain's drafts were accepted: they stay in the drafter's view."""
        self.keep += n

    def rebase(self, seen: list[int], chain: list[int], now: list[int]) -> None:
        """The sequence now holds `now` (a beam step moved it): the view was `seen` + `chain`;
        what survives is their common prefix with `now` (features: that of `seen`)."""
        self.keep = min(self.keep + len(chain), common_prefix(seen + chain, now))
        self.hid_sent = min(self.hid_sent, common_prefix(seen, now))

    def reset(self) -> None:
        """A new drafter: it starts from the committed tokens."""
        self.keep = self.hid_sent = 0


@dataclass(eq=False)
class Sequence:
    key: int  # engine-internal id, unique per engine (and per shared drafter, see seq_id_base)
    req: Request  # validated: defaults resolved
    slot: int  # the target KV slot
    tokens: list[int]  # prompt + committed output
    num_prompt: int
    seed: int  # the request's seed, or a random one; the drafter derives its generator from it
    gen: torch.Generator  # the target-side sampler of this request
    text: TextStream | None  # None without a tokenizer
    mode: Mode = Mode.GREEDY
    prefilled: int = 0  # prompt tokens in the target KV (chunked prefill; after a preemption: tokens)
    refill: int | None = None  # preempted: the tokens its KV holds again before it decodes (no new commit)
    view: DraftView = field(default_factory=DraftView)
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None
    draft: str | None = None  # the drafter speculating for it now (with draft "auto": the selector's pick)
    entropy: float | None = None  # EMA of the target's entropy (nats) at its committed positions (entropy gate)
    shadow: tuple[int, list[int]] | None = None  # (committed length, drafts) proposed but not verified
    beam: object | None = None  # beam search: the request's `beam.BeamGroup` (every member points to it)
    constraint: object | None = None  # structured output: its `grammar.Constraint` (state: the committed tokens)
    penalties: object | None = None  # its `penalties.Penalties` (state: the committed output's counts)

    def shape(self, logits: torch.Tensor, drafts: list[int] = (), parents: list[int] | None = None) -> None:
        """The target's logits at this row's feed positions [k+1, V] as the request scores them, in
        place: its penalties, then its grammar's masks (each at a position's own context)."""
        if self.penalties is not None:
            self.penalties.apply(logits, list(drafts), parents)
        if self.constraint is not None:
            self.constraint.mask(logits, list(drafts), parents)

    def consume(self, token: int) -> None:
        """`token` is committed: the penalties count it and the grammar advances over it."""
        if self.penalties is not None:
            self.penalties.commit(token)
        if self.constraint is not None:
            self.constraint.commit(token)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def fill(self) -> int:
        """Tokens the target KV holds before the sequence decodes: its prompt, or after a preemption
        every committed token but the last."""
        return self.num_prompt if self.refill is None else self.refill

    @property
    def decoding(self) -> bool:
        """Its prompt is in the KV and its first token committed: it takes part in verify steps."""
        return self.prefilled == self.fill


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
