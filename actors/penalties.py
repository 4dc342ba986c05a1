"""Repetition, frequency and presence penalties (vLLM's and OpenAI's semantics), applied to the
target's logits at every position of a verify pass, so that speculation stays lossless under them.

- `repetition_penalty` r (Hugging Face's and vLLM's): the logit of a token that appears in the
  prompt or the output so far is divided by r when positive, multiplied by r otherwise;
- `frequency_penalty` f: minus f times the token's count in the output so far;
- `presence_penalty` p: minus p when the token appears in the output so far.

Applied in that order, to the raw logits: before temperature, top-k, top-p and a grammar's mask.

Under speculation (`Penalties.apply`): at feed position j of a row the context is the committed
tokens and the drafts on the path to j (a chain: drafts[:j]; a tree: node j's ancestors and node
j), so the penalties there count exactly those tokens. Position j's distribution is then the one
plain decoding would use had those drafts been committed, and the acceptance rule runs unchanged
on it: greedy output is identical with and without speculation, sampled output keeps the penalised
target's law. Model drafters apply the same `penalize` to their own chain logits
(`drafters.model`), which only raises acceptance; losslessness never depends on it.

Does not know: the engine, drafters or models.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import feed_paths


def penalize(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, presence, frequency,
             repetition) -> torch.Tensor:
    """logits [N, V], penalised in place. counts [N, V]: each token's count in the output so far;
    seen [N or 1, V] bool: the token is in the prompt. presence, frequency, repetition: floats, or
    [N, 1] tensors for per-row values."""
    hit = seen | (counts > 0)
    logits.copy_(torch.where(hit, torch.where(logits > 0, logits / repetition, logits * repetition), logits))
    logits -= frequency * counts
    logits -= presence * (counts > 0).to(logits.dtype)
    return logits


@dataclass(eq=False)
class Penalties:
    """One request's penalties and its state: the prompt's tokens and the committed output's counts."""
    presence: float
    frequency: float
    repetition: float
    seen: torch.Tensor  # [1, V] bool: in the prompt
    counts: torch.Tensor  # [V] float32: occurrences in the committed output

    @classmethod
    def of(cls, params: tuple[float, float, float] | None, prompt: list[int], vocab_size: int,
           device) -> "Penalties | None":
        """For a request's (presence, frequency, repetition) (`SamplingParams.penalties`); None: none."""
        if params is None:
            return None
        seen = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
        seen[0, torch.tensor(prompt, dtype=torch.long, device=device)] = True
        return cls(*params, seen=seen, counts=torch.zeros(vocab_size, device=device))

    def apply(self, logits: torch.Tensor, drafts: list[int], parents: list[int] | None = None) -> None:
        """logits [k+1, V] of a row (root, then its k drafts in feed order), penalised in place:
        position j by the committed output and the drafts on the path to j."""
        counts = self.counts.expand(len(drafts) + 1, -1).clone()  # [k+1, V]
        pairs = [(j, drafts[i]) for j, path in enumerate(feed_paths(len(drafts), parents)) for i in path]
        if pairs:
            idx = torch.tensor(pairs, dtype=torch.long, device=counts.device)  # [P, 2]
            counts.index_put_((idx[:, 0], idx[:, 1]), torch.ones(len(pairs), device=counts.device), accumulate=True)
        penalize(logits, counts, self.seen, self.presence, self.frequency, self.repetition)

    def commit(self, token: int) -> None:
        self.counts[token] += 1


class DraftPenalties:
    """The penalised rows of a drafter's batch (`drafters.base.DraftSeq.penalties`): counts from
    each row's view (prompt, then output), advanced by the row's own drafts as it proposes them."""

    def __init__(self, rows: list[int], params: list[tuple[float, float, float]], views: list[list[int]],
                 output_starts: list[int], vocab_size: int, device):
        self.rows = rows
        p = torch.tensor(params, device=device)  # [N, 3]
        self.presence, self.frequency, self.repetition = p[:, 0:1], p[:, 1:2], p[:, 2:3]  # [N, 1] each
        self.counts = torch.zeros(len(rows), vocab_size, device=device)  # [N, V]
        self.seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
        for i, (view, start) in enumerate(zip(views, output_starts)):
            self.seen[i, torch.tensor(view[:start], dtype=torch.long, device=device)] = True
            out = torch.tensor(view[start:], dtype=torch.long, device=device)
            self.counts[i].index_add_(0, out, torch.ones(len(out), device=device))

    @classmethod
    def of(cls, seqs, views: list[list[int]], vocab_size: int, device) -> "DraftPenalties | None":
        """For the rows of `seqs` (DraftSeqs) that carry penalties, with views[b] row b's view."""
        rows = [b for b, s in enumerate(seqs) if s.penalties is not None]
        if not rows:
            return None
        return cls(rows, [seqs[b].penalties for b in rows], [views[b] for b in rows],
                   [seqs[b].output_start for b in rows], vocab_size, device)

    def apply(self, logits: torch.Tensor, vocab_map: torch.Tensor | None = None) -> None:
        """logits [B, R] of the next drafts, penalised in place (R: the head's rows, vocab_map their
        target ids; None: the whole vocabulary)."""
        cols = slice(None) if vocab_map is None else vocab_map
        logits[self.rows] = penalize(logits[self.rows], self.counts[:, cols], self.seen[:, cols], self.presence,
                                     self.frequency, self.repetition)

    def drafted(self, tokens: torch.Tensor) -> None:
        """tokens [B]: each row's draft (target ids), now part of its context."""
        self.counts[torch.arange(len(self.rows), device=self.counts.device), tokens[self.rows]] += 1
