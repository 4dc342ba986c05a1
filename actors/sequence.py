"""The engine's per-sequence state: one admitted request, from prefill to its last token.

Shared by the engine's core step (`engine.py`), drafting (`drafting.py`) and
micro-batch pipelining (`pipeline.py`); it imports none of them.

Invariants: `tokens` = prompt + committed output. The target KV of `slot` holds every
committed token but the last one (which is the first input of the next verify pass),
except while the prompt is still being prefilled (`prefilled < num_prompt`): then it
holds the first `prefilled` prompt tokens and nothing is committed yet.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .schema import Request, SpecStats
from .text import TextStream

if TYPE_CHECKING:  # (types only: drafting imports this module)
    from .beam import BeamGroup
    from .drafting import Flight


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
    prefilled: int = 0  # prompt tokens in the target KV (chunked prefill)
    draft_keep: int = 0  # tokens of the drafter's view that are still valid
    hid_len: int = 0  # committed tokens whose target hidden state is in the engine's buffer
    hid_sent: int = 0  # of those, how many the drafter has received
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None
    draft: str | None = None  # the drafter speculating for it now (with draft "auto": the selector's pick)
    entropy: float | None = None  # EMA of the target's entropy (nats) at its committed positions (entropy gate)
    draft_steps: dict = field(default_factory=dict)  # drafter -> verify steps it drafted (draft "auto")
    shadow: tuple[int, list[int]] | None = None  # (committed length, drafts) proposed but not verified
    mb: int | None = None  # pipelined: which micro-batch (0 or 1) verifies it
    flight: "Flight | None" = None  # pipelined: draft calls sent for it, not yet verified
    beam: "BeamGroup | None" = None  # beam search: the request's group (every member points to it)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def decoding(self) -> bool:
        """Its prompt is in the KV and its first token committed: it takes part in verify steps."""
        return self.prefilled == self.num_prompt
