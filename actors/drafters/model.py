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

import math

import torch

from ..grammar import DraftMasks
from ..llama import LlamaRunner
from ..penalties import DraftPenalties
from ..sampling import coupled_scores, gumbel_noise, new_generator, process_logits, sample
from .base import KV_HEADROOM, Drafter, DraftSeq, Proposal, apply_view


class ModelDrafter(Drafter):
    def __init__(self, runner: LlamaRunner, name: str, max_batch: int = 8, max_len: int = 2048,
                 vocab_map: torch.Tensor | None = None, vocab_size: int | None = None):
        """vocab_map: int64 [R], the target token id of each of the runner's R output rows, for a
        draft whose LM head keeps only the R most frequent tokens (None: the full vocabulary)."""
        self.runner, self.name = runner, name
        self.vocab_map = vocab_map
        self.vocab_size = vocab_size or runner.vocab_size  # the target's vocabulary
        if vocab_map is not None and len(vocab_map) != runner.vocab_size:
            # A full-vocabulary model serving a restricted head: keep only the head's rows.
            if len(vocab_map) > runner.vocab_size or int(vocab_map.max()) >= runner.vocab_size:
                raise ValueError(f"vocab_map has {len(vocab_map)} ids for an LM head of {runner.vocab_size} rows")
            runner.lm_head = runner.lm_head[vocab_map].contiguous()
            runner.vocab_size = len(vocab_map)
        self.cache = runner.new_cache(max_batch, max_len + KV_HEADROOM)
        self.slots: dict[int, int] = {}
        self.views: dict[int, list[int]] = {}
        self.gens: dict[int, torch.Generator] = {}
        self.free = list(range(max_batch))
        self._noise_gen = new_generator(runner.device)  # re-seeded per (request, position)

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
            self.gens[s.seq_id] = new_generator(self.runner.device).manual_seed(
                (s.seed * 1_000_003 + 17) % (1 << 63))
        return slot

    tree_drafting = True
    grammar_masking = True  # chains (`grammar.DraftMasks`)
    rebases_views = True
    TREE_BRANCH = 4  # children expanded per frontier node, and frontier nodes kept per depth

    @torch.inference_mode()
    def propose(self, seqs: list[DraftSeq]) -> Proposal:
        if any(s.tree > 0 for s in seqs):
            chains = [i for i, s in enumerate(seqs) if s.tree == 0]
            out = self._propose_chains([seqs[i] for i in chains]) if chains else None
            return self._with_trees(seqs, chains, out)
        return self._propose_chains(seqs)

    def _propose_chains(self, seqs: list[DraftSeq]) -> Proposal:
        B = len(seqs)
        G = max(s.gamma for s in seqs)
        slots = [self._slot(s) for s in seqs]
        last = self._sync(seqs, slots)  # [B, E] caller order: the feature that predicts draft 1
        order = sorted(range(B), key=lambda b: slots[b])  # contiguous slots -> cache views, no gather
        inv = [order.index(b) for b in range(B)]
        s_slots = [slots[b] for b in order]

        dev = self.runner.device
        sampled = [b for b, s in enumerate(seqs) if s.temperature > 0 and not s.coupled]
        coupled = [b for b, s in enumerate(seqs) if s.temperature > 0 and s.coupled]
        if coupled:
            ctemp = torch.tensor([seqs[b].temperature for b in coupled], device=dev)
            ctop_k = torch.tensor([seqs[b].top_k for b in coupled], dtype=torch.long, device=dev)
            ctop_p = torch.tensor([seqs[b].top_p for b in coupled], device=dev)
            base = [len(self.views[seqs[b].seq_id]) for b in coupled]  # position of each row's first draft
        if sampled:
            temp = torch.tensor([seqs[b].temperature for b in sampled], device=dev)
            top_k = torch.tensor([seqs[b].top_k for b in sampled], dtype=torch.long, device=dev)
            top_p = torch.tensor([seqs[b].top_p for b in sampled], device=dev)
            gens = [self.gens[seqs[b].seq_id] for b in sampled]
            probs = torch.zeros(B, G, self.vocab_size, device=dev)  # [B, G, V]
        else:
            probs = None

        tokens = torch.zeros(B, G, dtype=torch.long, device=dev)  # [B, G]
        vmap = self.vocab_map
        K = self.record_topk
        topk = torch.zeros(B, G, K, dtype=torch.long, device=dev) if K else None  # [B, G, K]
        tau = [s.threshold for s in seqs]
        conf = torch.ones(B, G, device=dev) if any(tau) else None  # [B, G] draft prob of each drafted token
        pen = DraftPenalties.of(seqs, [self.views[s.seq_id] for s in seqs], self.vocab_size, dev)
        masks = DraftMasks.of(seqs, self.vocab_size)
        for j in range(G):
            logits = self.runner.logits(last).float()  # [B, R]
            if pen is not None:  # as the target will score them
                pen.apply(logits, vmap)
            if masks is not None:  # only what the grammar allows (the target masks its own logits too)
                masks.apply(logits, vmap)
            tok = logits.argmax(-1)  # head rows
            if K:
                top = logits.topk(min(K, logits.shape[-1]), dim=-1).indices  # [B, K] head rows
                topk[:, j, :top.shape[1]] = top if vmap is None else vmap[top]
            # Rows draw only while j < their own γ: a request's randomness is its own.
            live = [i for i, b in enumerate(sampled) if j < seqs[b].gamma]
            if live:
                rows = [sampled[i] for i in live]
                q = process_logits(logits[rows], temp[live], top_k[live], top_p[live])  # [Bs, R]
                tok[rows] = sample(q, [gens[i] for i in live])
                if vmap is None:
                    probs[rows, j] = q
                else:  # tokens outside the head get q = 0: still an exact rejection-sampling q
                    probs[rows, j] = torch.zeros(len(rows), self.vocab_size, device=dev).index_copy_(1, vmap, q)
            live = [i for i, b in enumerate(coupled) if j < seqs[b].gamma]
            if live:  # the draft at position p: argmax(log q + g_p), g_p the target's own noise there
                rows = [coupled[i] for i in live]
                q = process_logits(logits[rows], ctemp[live], ctop_k[live], ctop_p[live])  # [Bc, R]
                noise = torch.stack([gumbel_noise(seqs[b].seed, [base[i] + j], self.vocab_size, q.device,
                                                  self._noise_gen)[0] for i, b in zip(live, rows)])  # [Bc, V]
                tok[rows] = coupled_scores(q, noise if vmap is None else noise[:, vmap]).argmax(-1)
            if conf is not None:  # the draft's own probability of what it proposed (before the vocab map)
                conf[:, j] = torch.softmax(logits, -1).gather(1, tok[:, None])[:, 0]
            tok = tok if vmap is None else vmap[tok]  # target token ids
            tokens[:, j] = tok
            if pen is not None:
                pen.drafted(tok)
            if masks is not None:
                masks.drafted(tok)
            if j + 1 < G:  # the last draft is proposed, not fed: the target verifies it
                last = self._advance(s_slots, tok[order], last[order])[inv]
        num_draft = [s.gamma for s in seqs]
        if conf is not None:  # the confidence threshold: stop before the first token below τ
            low = (conf < torch.tensor(tau, device=dev)[:, None]).tolist()
            num_draft = [next((j for j in range(s.gamma) if low[b][j]), s.gamma) for b, s in enumerate(seqs)]
        for s, row, k in zip(seqs, tokens.tolist(), num_draft):
            self.views[s.seq_id].extend(row[:k])
        return Proposal(tokens=tokens, num_draft=num_draft, probs=probs, topk=topk)

    # ---- token trees (EAGLE-2's dynamic tree) -------------------------------------------------------
    def _with_trees(self, seqs: list[DraftSeq], chains: list[int], chain_prop: Proposal | None) -> Proposal:
        """Trees for the rows that asked for one, one row at a time, merged with the chains."""
        trees = {i: self._tree(s) for i, s in enumerate(seqs) if s.tree > 0}
        G = max([len(t) for t, _ in trees.values()] + ([chain_prop.tokens.shape[1]] if chain_prop else []))
        tokens = torch.zeros(len(seqs), max(G, 1), dtype=torch.long, device=self.runner.device)
        num, parents = [0] * len(seqs), [None] * len(seqs)
        for i, (toks, par) in trees.items():
            tokens[i, :len(toks)] = torch.tensor(toks, dtype=torch.long, device=tokens.device)
            num[i], parents[i] = len(toks), par
        for j, i in enumerate(chains):
            k = chain_prop.num_draft[j]
            tokens[i, :k] = chain_prop.tokens[j, :k]
            num[i] = k
        return Proposal(tokens=tokens, num_draft=num, parents=parents)

    def _tree_inputs(self, tok: torch.Tensor, parent_feat: torch.Tensor) -> dict:
        """What the runner takes for frontier tokens tok [1, k] (a token-level draft: the tokens)."""
        return {"tokens": tok}

    def _tree(self, s: DraftSeq) -> tuple[list[int], list[int]]:
        """A token tree for one sequence, EAGLE-2's way: from the root (the last committed token),
        expand the TREE_BRANCH likeliest children of the frontier, keep the TREE_BRANCH nodes with
        the highest cumulative draft log-probability as the next frontier, down to depth s.gamma;
        then keep the s.tree nodes with the highest cumulative log-probability (a child never
        outranks its parent, so the kept set is a tree). The tree's tokens are fed to the draft's
        own KV past the committed view with a tree mask, and dropped on the next call (the view
        is not extended; the verifier sends the accepted path back as new tokens). Returns the
        tokens and their parents (feed indices, 0 = the root), parents before children."""
        from ..llama import TreeMask

        dev, K = self.runner.device, self.TREE_BRANCH
        slot = self._slot(s)
        last = self._sync([s], [slot])  # [1, E]: predicts depth 1
        vmap = self.vocab_map
        # nodes: (token, parent node id or -1 for the root, cumulative logp, depth); ids = list order
        nodes: list[tuple[int, int, float, int]] = []
        feats: dict[int, torch.Tensor] = {}  # node id -> hidden state after feeding it ([E])
        fed: list[int] = []  # node ids in the order they entered the draft KV
        frontier: list[tuple[int, torch.Tensor, float]] = [(-1, last[0], 0.0)]  # (node id, feature, cum)
        for depth in range(1, max(1, s.gamma) + 1):
            cands = []
            logits = self.runner.logits(torch.stack([f for _, f, _ in frontier])).float()  # [F, R]
            logp = torch.log_softmax(logits, -1)
            top = logp.topk(min(K, logp.shape[-1]), dim=-1)
            for fi, (nid, _, cum) in enumerate(frontier):
                for lp, t in zip(top.values[fi].tolist(), top.indices[fi].tolist()):
                    cands.append((cum + lp, int(t if vmap is None else vmap[t]), nid))
            if s.threshold > 0:  # a node whose path probability is below τ is not proposed
                cands = [c for c in cands if c[0] >= math.log(s.threshold)]
            cands.sort(key=lambda c: -c[0])
            chosen = cands[:K]
            if not chosen:
                break
            ids = []
            for cum, tok, parent in chosen:
                nodes.append((tok, parent, cum, depth))
                ids.append(len(nodes) - 1)
            if depth == s.gamma or len(nodes) >= s.tree * 2:
                break
            # Feed the new frontier into the draft: each node sees the context, its ancestors, itself.
            P = len(fed)
            anc = torch.zeros(1, len(ids), P + len(ids), dtype=torch.bool, device=dev)
            pos_of = {nid: i for i, nid in enumerate(fed)}
            for j, nid in enumerate(ids):
                anc[0, j, P + j] = True
                a = nodes[nid][1]
                while a >= 0:
                    anc[0, j, pos_of[a]] = True
                    a = nodes[a][1]
            tok = torch.tensor([[nodes[n][0] for n in ids]], device=dev)  # [1, F]
            parent_feat = torch.stack([feats[nodes[n][1]] if nodes[n][1] >= 0 else last[0] for n in ids])[None]
            depth_off = torch.full((1, len(ids)), depth - 1 - P, device=dev, dtype=torch.long)
            hidden = self.runner.forward(self.cache, [slot], tree=TreeMask(depth_off, anc, P),
                                         **self._tree_inputs(tok, parent_feat))[0]  # [F, E]
            for j, nid in enumerate(ids):
                feats[nid] = hidden[j]
            fed += ids
            frontier = [(nid, feats[nid], nodes[nid][2]) for nid in ids]
        # Rerank to the budget, ancestors first.
        keep: set[int] = set()
        for nid in sorted(range(len(nodes)), key=lambda n: -nodes[n][2]):
            if len(keep) >= s.tree:
                break
            if nodes[nid][1] < 0 or nodes[nid][1] in keep:
                keep.add(nid)
        order = sorted(keep, key=lambda n: (nodes[n][3], n))
        feed_idx = {nid: i + 1 for i, nid in enumerate(order)}
        return ([nodes[n][0] for n in order], [feed_idx.get(nodes[n][1], 0) for n in order])

    def _sync(self, seqs: list[DraftSeq], slots: list[int]) -> torch.Tensor:
        """Roll each row back to `keep`, feed the committed tokens it has not seen, and return
        each row's last hidden state [B, E] (the one that predicts the first draft)."""
        pending = []
        for s, slot in zip(seqs, slots):
            view = apply_view(self.views[s.seq_id], s.keep, s.new_tokens)
            # Roll back: the KV may hold rejected drafts past `keep`.
            self.cache.truncate(slot, min(self.cache.lengths[slot], s.keep))
            pending.append(view[self.cache.lengths[slot]:])  # committed tokens the draft has not seen
        return self._catch_up(slots, pending)

    def _advance(self, slots: list[int], tok: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Feed one drafted token per row (slot order); return the new last hidden states [B, E]."""
        return self.runner.forward(self.cache, slots, tok[:, None])[:, 0]

    def _catch_up(self, slots: list[int], pending: list[list[int]]) -> torch.Tensor:
        """Feed each row its unseen committed tokens; return each row's last hidden state [B, E].

        Rows with a few pending tokens (the usual 1-2) share one padded pass; rows with many
        (a new or re-prefilled sequence) run on their own, so padding to the widest row can
        never push a long sequence past its cache.
        """
        B = len(slots)
        dev = self.runner.device
        last = torch.empty(B, self.runner.hidden_size, dtype=self.runner.dtype, device=dev)
        short = [b for b in range(B) if len(pending[b]) <= KV_HEADROOM]
        groups = ([sorted(short, key=lambda b: slots[b])] if short else []) + \
            [[b] for b in range(B) if len(pending[b]) > KV_HEADROOM]
        for rows in groups:
            num = [len(pending[b]) for b in rows]
            W = max(num)
            feed = torch.tensor([pending[b] + [0] * (W - len(pending[b])) for b in rows], device=dev)  # [R, W]
            hidden = self.runner.forward(self.cache, [slots[b] for b in rows], feed, num)  # [R, W, E]
            last[rows] = hidden[torch.arange(len(rows), device=dev), torch.tensor(num, device=dev) - 1]
        return last

    def set_view(self, seq_id: int, tokens: list[int], kv_valid: int) -> None:
        """Replace a sequence's view and keep only the first `kv_valid` positions of its KV (which
        must hold `tokens[:kv_valid]`): a draft server that explored alternative continuations
        puts the sequence back where the verifier believes it is."""
        slot = self.slots[seq_id]
        self.views[seq_id] = list(tokens)
        self.cache.truncate(slot, min(self.cache.lengths[slot], kv_valid))

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

    def warm(self) -> int:
        return self.runner.warm()

    def free_capacity(self) -> int:
        return len(self.free)
