"""An oracle drafter for measurements: it knows the target's greedy continuation of each prompt
and proposes the right next token with probability p, a wrong one otherwise. With random
weights (the GPU check) or for drafts of controlled quality (`specd lab`), it stands in for a
draft whose acceptance is known in advance. Not for serving.
"""
from __future__ import annotations

import random

import torch

from .base import Drafter, DraftSeq, Proposal, apply_view


class OracleDrafter(Drafter):
    """Proposes the target's own next greedy token with probability p, a wrong one otherwise.
    `refs` maps each prompt (as a tuple) to its greedy continuation; positions past it get a
    wrong token."""

    name = "oracle"

    def __init__(self, refs: dict[tuple, list[int]], p: float, vocab: int, seed: int = 0):
        self.refs, self.p, self.vocab = refs, p, vocab
        self.rng = random.Random(seed)
        self.views: dict[int, list[int]] = {}
        self.prompts: dict[int, tuple] = {}

    def propose(self, seqs: list[DraftSeq]) -> Proposal:
        G = max(s.gamma for s in seqs)
        tokens = torch.zeros(len(seqs), G, dtype=torch.long)
        for b, s in enumerate(seqs):
            view = apply_view(self.views.setdefault(s.seq_id, []), s.keep, s.new_tokens)
            if s.seq_id not in self.prompts:
                self.prompts[s.seq_id] = next(k for k in self.refs if tuple(view[:len(k)]) == k)
            prompt = self.prompts[s.seq_id]
            ref = self.refs[prompt]
            at = len(view) - len(prompt)
            for j in range(s.gamma):
                right = ref[at + j] if at + j < len(ref) else 0
                tokens[b, j] = right if self.rng.random() < self.p else (right + 1) % self.vocab
            view.extend(tokens[b, :s.gamma].tolist())
        return Proposal(tokens=tokens, num_draft=[s.gamma for s in seqs])

    def release(self, seq_id: int) -> None:
        self.views.pop(seq_id, None)
        self.prompts.pop(seq_id, None)

    def num_active(self) -> int:
        return len(self.views)
