"""Model drafters: a separate small draft model, or the target's own first K layers.

Both run the fast llama runner over their own slotted KV cache. Rollback is a
cache truncation to the accepted prefix; catching up feeds only the committed
tokens the draft has not seen (usually the correction or bonus token, two
tokens after a fully accepted block), so there is never a re-prefill.

The truncated self-draft (`truncated(target_model, K)`) shares the target's
weight tensors: embeddings, first K decoder layers, final norm and LM head. It
costs no memory beyond its KV cache and needs no training to be usable.
"""
from __future__ import annotations

import time

import torch

from ..llama import LlamaRunner
from ..sampling import process_logits, sample
from .base import KV_HEADROOM, Drafter, DraftSeq, Proposal, apply_view


class ModelDrafter(Drafter):
    def __init__(self, runner: LlamaRunner, name: str, max_batch: int = 8, max_len: int = 2048):
        self.runner, self.name = runner, name
        self.cache = runner.new_cache(max_batch, max_len + KV_HEADROOM)
        self.slots: dict[int, int] = {}
        self.views: dict[int, list[int]] = {}
        self.gens: dict[int, torch.Generator] = {}
        self.free = list(range(max_batch))

    @classmethod
    def truncated(cls, target_hf, num_layers: int, **kw) -> "ModelDrafter":
        return cls(LlamaRunner(target_hf, num_layers=num_layers), f"truncated:{num_layers}", **kw)

    def _slot(self, s: DraftSeq) -> int:
        slot = self.slots.get(s.seq_id)
        if slot is None:
            if not self.free:
                raise RuntimeError(f"draft {self.name!r} has no free KV slot ({self.cache.slots} in use)")
            slot = self.slots[s.seq_id] = self.free.pop(0)
            self.views[s.seq_id] = []
            self.gens[s.seq_id] = torch.Generator().manual_seed((s.seed * 1_000_003 + 17) % (1 << 63))
        return slot

    @torch.inference_mode()
    def propose(self, seqs: list[DraftSeq]) -> Proposal:
        t0 = time.perf_counter()
        B = len(seqs)
        G = max(s.gamma for s in seqs)
        slots, pending = [], []
        for s in seqs:
            slot = self._slot(s)
            view = apply_view(self.views[s.seq_id], s.keep, s.new_tokens)
            # Roll back: the KV may hold rejected drafts past `keep`.
            self.cache.truncate(slot, min(self.cache.lengths[slot], s.keep))
            slots.append(slot)
            pending.append(view[self.cache.lengths[slot]:])  # committed tokens the draft has not seen
        order = sorted(range(B), key=lambda b: slots[b])  # contiguous slots -> cache views, no gather
        inv = [order.index(b) for b in range(B)]
        s_slots = [slots[b] for b in order]

        sampled = [b for b, s in enumerate(seqs) if s.temperature > 0]
        if sampled:
            temp = torch.tensor([seqs[b].temperature for b in sampled])
            top_k = torch.tensor([seqs[b].top_k for b in sampled], dtype=torch.long)
            top_p = torch.tensor([seqs[b].top_p for b in sampled])
            gens = [self.gens[seqs[b].seq_id] for b in sampled]
            probs = torch.zeros(B, G, self.runner.vocab_size)
        else:
            probs = None

        tokens = torch.zeros(B, G, dtype=torch.long)
        last = self._catch_up(slots, pending)  # [B, E], caller order
        for j in range(G):
            logits = self.runner.logits(last).float()  # [B, V]
            tok = logits.argmax(-1)
            # Rows draw only while j < their own γ: a request's randomness is its own.
            live = [i for i, b in enumerate(sampled) if j < seqs[b].gamma]
            if live:
                rows = [sampled[i] for i in live]
                q = process_logits(logits[rows], temp[live], top_k[live], top_p[live])  # [Bs, V]
                tok[rows] = sample(q, [gens[i] for i in live])
                probs[rows, j] = q
            tokens[:, j] = tok
            if j + 1 < G:  # the last draft is proposed, not fed: the target verifies it
                last = self.runner.forward(self.cache, s_slots, tok[order][:, None])[:, 0][inv]
        num_draft = [s.gamma for s in seqs]
        for b, s in enumerate(seqs):
            self.views[s.seq_id].extend(tokens[b, :num_draft[b]].tolist())
        return Proposal(tokens=tokens, num_draft=num_draft, probs=probs,
                        timings={"draft_s": time.perf_counter() - t0})

    def _catch_up(self, slots: list[int], pending: list[list[int]]) -> torch.Tensor:
        """Feed each row its unseen committed tokens; return each row's last hidden state [B, E].

        Rows with a few pending tokens (the usual 1-2) share one padded pass; rows with many
        (a new or re-prefilled sequence) run on their own, so padding to the widest row can
        never push a long sequence past its cache.
        """
        B = len(slots)
        last = torch.empty(B, self.runner.hidden_size, dtype=self.runner.dtype)
        short = [b for b in range(B) if len(pending[b]) <= KV_HEADROOM]
        groups = ([sorted(short, key=lambda b: slots[b])] if short else []) + \
            [[b] for b in range(B) if len(pending[b]) > KV_HEADROOM]
        for rows in groups:
            num = [len(pending[b]) for b in rows]
            feed = torch.zeros(len(rows), max(num), dtype=torch.long)
            for i, b in enumerate(rows):
                feed[i, :num[i]] = torch.tensor(pending[b], dtype=torch.long)
            hidden = self.runner.forward(self.cache, [slots[b] for b in rows], feed, num)  # [R, W, E]
            last[rows] = hidden[torch.arange(len(rows)), torch.tensor(num) - 1]
        return last

    def release(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.cache.free(slot)
            self.free.append(slot)
            self.free.sort()
        self.views.pop(seq_id, None)
        self.gens.pop(seq_id, None)

    def num_active(self) -> int:
        return len(self.slots)
