"""Acceptance: from the target's logits over one verify pass to a verdict per row.

A verify pass scores B rows; row b feeds [its last committed token, its drafts...] (a chain,
or a token tree given by parents) and gets logits [G+1, V]. `accept` returns, per row, the
accepted path (feed indices) and the tokens to commit: the accepted drafts, then one token the
target chose after them (the correction, or the bonus when every draft was accepted).

The rule depends on the row's `Mode` (fixed at admission) and its shape:

  greedy   chain: the longest prefix equal to the target's argmax (`sampling.verify_greedy`);
           tree:  walk from the root down the child equal to the target's argmax (`walk`)
  coupled  the same on log p + g, g Gumbel noise keyed by (seed, position): the tokens depend on
           the seed and position only, so a seeded request reproduces with speculation on or off
  sampled  chain: rejection sampling against q (`sampling.verify_sampled`), per row at its own
           length so a seed reproduces whatever the batch; tree: `walk_sampled` (SpecInfer's rule)
  lossy    chains of requests that asked for `topk:K` or `typical:ε` (`lossy`); their trees fall
           back to the lossless rule of their sampling (coupled if seeded, else sampled)

Beam rows get an empty verdict: `beam.BeamGroup.advance` reads their log-probabilities.

Pure functions of (logits, batch, the rows' generators): no engine, KV cache or drafter.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .llama import TreeMask
from .sampling import coupled_scores, gumbel_noise, process_logits, sample, verify_greedy, verify_sampled
from .schema import TokenLogprob
from .sequence import Mode, Sequence


@dataclass(eq=False)
class Row:
    """One row of a verify pass: a decoding sequence and what its drafter proposed."""
    seq: Sequence
    drafts: list[int]  # proposed tokens, in feed order (feed index i + 1 holds drafts[i])
    parents: list[int] | None = None  # token tree: parents[i] is the feed index of drafts[i]'s parent
    probs: torch.Tensor | None = None  # [k, V] the draft's distribution (sampled rows of stochastic drafters)
    draft_s: float = 0.0  # seconds its draft took (the per-request stats)
    shadow: list[int] | None = None  # drafts proposed only to be compared, never verified (policy); [] none proposed
    forced: bool = False  # the drafts are the tokens its grammar forces (`grammar.forced_drafts`), no drafter's

    @property
    def rule(self) -> str:
        """What `accept` does with it: "beam", "lossy" (chains), or the mode's lossless rule."""
        s = self.seq
        if s.beam is not None:
            return "beam"
        if s.mode is Mode.LOSSY:
            return "lossy" if self.parents is None else (Mode.COUPLED if s.req.coupled else Mode.SAMPLED).value
        return s.mode.value


@dataclass(eq=False)
class VerifyBatch:
    """The rows of one target pass (sorted by KV slot) and, per drafter call, its rows and cost."""
    rows: list[Row]
    groups: list[tuple[str, list[int], float]] = field(default_factory=list)  # (drafter, row indices, seconds)
    # Set by `to_device`:
    feed: torch.Tensor | None = None  # [B, G+1] int64: root token, drafts, padding
    num_draft: torch.Tensor | None = None  # [B] int64
    tree: TreeMask | None = None  # when some row is a tree (chains become one-child-per-node trees)

    @property
    def width(self) -> int:
        """G: the most drafts of any row."""
        return max((len(r.drafts) for r in self.rows), default=0)

    def to_device(self, device) -> "VerifyBatch":
        """The pass's one host-to-device copy: feed tokens and draft counts (and the tree mask)."""
        G = self.width
        host = torch.tensor([[r.seq.tokens[-1], *r.drafts] + [0] * (G - len(r.drafts)) + [len(r.drafts)]
                             for r in self.rows]).to(device, non_blocking=True)  # [B, G+2]
        self.feed, self.num_draft = host[:, :G + 1], host[:, G + 1]
        if any(r.parents is not None for r in self.rows):
            self.tree = TreeMask.from_parents([r.parents if r.parents is not None else list(range(len(r.drafts)))
                                               for r in self.rows], G + 1, device)
        return self


@dataclass
class Verdict:
    path: list[int]  # accepted feed indices, root excluded (a chain's: 1..a)
    tokens: list[int]  # to commit: the accepted drafts, then the target's own token


def accept(logits: torch.Tensor, batch: VerifyBatch, noise_gen: torch.Generator | None = None) -> list[Verdict]:
    """logits [B, G+1, V] (float32) of `batch` (after `to_device`) -> one verdict per row.
    noise_gen: a generator the coupled rows' noise re-seeds per position (saves allocating one)."""
    rows, G = batch.rows, batch.width
    draft_t, num_draft = batch.feed[:, 1:], batch.num_draft  # [B, G], [B]
    by: dict[str, list[int]] = {}
    for b, r in enumerate(rows):
        by.setdefault(r.rule, []).append(b)
    trees = {b for b, r in enumerate(rows) if r.parents is not None}

    n_acc, out = verify_greedy(logits, draft_t, num_draft)  # [B], [B, G+1]
    choice = logits.argmax(-1) if trees else None  # [B, G+1]: each node's choice, for tree walks
    coupled = by.get(Mode.COUPLED.value, [])
    if coupled:  # exact matching on log p + g
        depth = batch.tree.depth[coupled] if batch.tree is not None else None  # [Bc, G+1]
        scores = coupled_row_scores(logits[coupled], [rows[b].seq for b in coupled], G + 1, depth, noise_gen)
        n_acc[coupled], out[coupled] = verify_greedy(scores, draft_t[coupled], num_draft[coupled])
        if choice is not None:
            choice[coupled] = scores.argmax(-1)
    sampled = [b for b in by.get(Mode.SAMPLED.value, []) if b not in trees]
    if sampled:
        _sampled_chains(logits, batch, sampled, n_acc, out)
    for b in by.get("lossy", []):
        n_acc[b], out[b] = lossy(logits[b], rows[b].seq, draft_t[b], int(num_draft[b]))

    # The pass's one device-to-host transfer: accepted counts, chain tokens, tree choices.
    res = to_host(torch.cat([n_acc[:, None], out] + ([choice] if choice is not None else []), 1))
    verdicts = []
    for b, (r, h) in enumerate(zip(rows, res)):
        if r.rule == "beam":
            verdicts.append(Verdict([], []))
        elif b not in trees:
            a = h[0]
            verdicts.append(Verdict(list(range(1, a + 1)), h[1:a + 2]))
        else:
            path, last = (walk(r.drafts, r.parents, h[G + 2:]) if r.rule != Mode.SAMPLED.value
                          else walk_sampled(logits[b], r.seq, r.drafts, r.parents))
            verdicts.append(Verdict(path, [r.drafts[i - 1] for i in path] + [last]))
    return verdicts


def first_tokens(logits: torch.Tensor, seqs: list[Sequence], noise_gen: torch.Generator | None = None) -> list[int]:
    """logits [B, V] after each prompt -> its first token (argmax, coupled or sampled draw);
    one transfer to the host."""
    toks = logits.argmax(-1)  # [B]
    coupled = [b for b, s in enumerate(seqs) if s.req.coupled]
    if coupled:
        scores = coupled_row_scores(logits[coupled, None], [seqs[b] for b in coupled], 1, None, noise_gen)
        toks[coupled] = scores[:, 0].argmax(-1)
    rows = [b for b, s in enumerate(seqs) if not s.req.sampling.greedy and not s.req.coupled]
    if rows:
        toks[rows] = sample(process(logits[rows], [seqs[b] for b in rows]), [seqs[b].gen for b in rows])
    return to_host(toks)


def token_logprobs(logits: torch.Tensor, s: Sequence, tokens: list[int]) -> list[TokenLogprob]:
    """logits [n, V] at the positions that produced `tokens` (n) -> each token's log-probability
    and the request's k likeliest there, under the distribution it was chosen from: the target's
    (penalised and masked by `Sequence.shape`) after temperature, top-k and top-p (greedy: before
    those three). Exact under speculation:
    these are the verify pass's own logits, whatever the draft proposed. (A second, small
    transfer, for the rows that asked.) A filtered-out token's -inf reads as -9999.0, as vLLM's."""
    p = s.req.sampling
    lp = (torch.log_softmax(logits.float(), -1) if p.greedy else
          torch.log(process(logits[None], [s])[0]))  # [n, V]
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0]  # [n]
    top_v, top_i = lp.topk(p.logprobs, -1) if p.logprobs else (lp[:, :0], lp[:, :0].long())  # [n, k]
    chosen, top_v, top_i = chosen.clamp_min(-9999.0).tolist(), top_v.clamp_min(-9999.0).tolist(), top_i.tolist()
    return [TokenLogprob(t, c, list(zip(i, v))) for t, c, i, v in zip(tokens, chosen, top_i, top_v)]


def to_host(t: torch.Tensor) -> list:
    """A pass's one device-to-host transfer (its results: tokens and accepted counts). Nothing
    else in a step reads a device tensor on the host (tests/unit/test_device.py holds that)."""
    return t.tolist()


def process(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits [B, ..., V] -> each row's sampling distribution (temperature, top-k, top-p)."""
    dev = logits.device
    return process_logits(
        logits,
        torch.tensor([s.req.sampling.temperature for s in seqs], device=dev),
        torch.tensor([s.req.sampling.top_k for s in seqs], dtype=torch.long, device=dev),
        torch.tensor([s.req.sampling.top_p for s in seqs], device=dev))


def coupled_row_scores(logits: torch.Tensor, seqs: list[Sequence], width: int, depth: torch.Tensor | None = None,
                       noise_gen: torch.Generator | None = None) -> torch.Tensor:
    """logits [Bc, W, V] -> log p + g, the noise g at each row's next positions: feed index i
    of a chain is position len(tokens) + i; a tree node's is len(tokens) + its depth [Bc, W]."""
    p = process(logits, seqs)  # [Bc, W, V]
    noise = torch.stack([gumbel_noise(s.seed, range(len(s.tokens), len(s.tokens) + width), p.shape[-1],
                                      p.device, noise_gen) for s in seqs])  # [Bc, W, V]
    if depth is not None:
        noise = noise.gather(1, depth[:, :, None].expand(-1, -1, noise.shape[-1]))
    return coupled_scores(p, noise)


def _sampled_chains(logits: torch.Tensor, batch: VerifyBatch, idx: list[int], n_acc: torch.Tensor,
                    out: torch.Tensor) -> None:
    """Rejection sampling for the sampled chains `idx`, written into n_acc [B] and out [B, G+1].
    Each row is verified at its own draft length, so its random draws (k uniforms, one sample)
    do not depend on the rest of the batch: a seed reproduces the output."""
    rows, G, V = batch.rows, batch.width, logits.shape[-1]
    draft_t, num_draft = batch.feed[:, 1:], batch.num_draft
    seqs = [rows[b].seq for b in idx]
    p = process(logits[idx], seqs)  # [Bs, G+1, V]
    q = None
    if any(rows[b].probs is not None for b in idx):
        q = torch.zeros(len(idx), G, V, device=logits.device)  # [Bs, G, V]
        for i, b in enumerate(idx):
            k = len(rows[b].drafts)
            if rows[b].probs is not None:
                q[i, :k] = rows[b].probs[:k].to(q.device)
            elif k:  # a deterministic drafter in a mixed batch: one-hot q
                q[i, :k].scatter_(-1, draft_t[b, :k, None], 1.0)
    by_len: dict[int, list[int]] = {}
    for i, b in enumerate(idx):
        by_len.setdefault(len(rows[b].drafts), []).append(i)
    for g, sub in by_len.items():
        rb = [idx[i] for i in sub]
        s_acc, s_out = verify_sampled(p[sub, :g + 1], None if q is None else q[sub, :g], draft_t[rb, :g],
                                      num_draft[rb], [seqs[i].gen for i in sub])
        n_acc[rb] = s_acc
        out[rb] = -1
        out[rb, :g + 1] = s_out


def lossy(logits: torch.Tensor, s: Sequence, drafts: torch.Tensor, k: int) -> tuple[int, torch.Tensor]:
    """A lossy chain: logits [G+1, V], drafts [G] -> (accepted count, tokens [G+1], -1 padded).
    "topk:K" accepts a draft among the target's K likeliest tokens; "typical:ε" one whose target
    probability is at least min(ε, √ε·exp(-H)) (Medusa's typical acceptance, H the entropy there).
    The token after the accepted prefix is drawn from the target. An accepted x is emitted with
    probability 1 where the target has p(x): the output deviates by 1 - p(x) in TV there."""
    kind, val = s.req.acceptance_rule
    G = drafts.shape[0]
    p = process(logits[None], [s])[0]  # [G+1, V]
    px = p[:G].gather(-1, drafts[:, None])[:, 0]  # [G]
    if kind == "topk":
        ok = (p[:G] > px[:, None]).sum(-1) < val  # rank of the draft token < K
    else:
        ent = -(p[:G] * torch.log(p[:G].clamp_min(1e-30))).sum(-1)
        ok = px >= torch.minimum(torch.full_like(ent, val), val ** 0.5 * torch.exp(-ent))
    a = 0
    for j in range(k):  # (a host loop: lossy rows are an opt-in)
        if not bool(ok[j]):
            break
        a += 1
    out = torch.full((G + 1,), -1, dtype=torch.long, device=logits.device)
    out[:a] = drafts[:a]
    out[a] = sample(p[a][None], [s.gen])[0]
    return a, out


def children(parents: list[int]) -> dict[int, list[int]]:
    """Feed index -> its children's feed indices, in proposal order (node i has feed index i)."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents, start=1):
        kids.setdefault(p, []).append(i)
    return kids


def depths(parents: list[int]) -> list[int]:
    """Each draft node's depth (the root's children: 1)."""
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return depth[1:]


def feed_paths(k: int, parents: list[int] | None = None) -> list[list[int]]:
    """For each feed position of a row with k drafts (the root, then the drafts), the indices into
    drafts of the tokens on the path to it, root first: a chain's position j has drafts[:j]; a tree
    node, its ancestors' and its own. What a grammar or a penalty sees as context there."""
    if parents is None:
        return [list(range(j)) for j in range(k + 1)]
    paths = [[]]
    for i, p in enumerate(parents):
        paths.append(paths[p] + [i])
    return paths


def walk(drafts: list[int], parents: list[int], choice: list[int]) -> tuple[list[int], int]:
    """Greedy (or coupled) acceptance down a token tree: from the root, follow the child whose
    token is the target's choice at the current node; stop where no child matches. Returns the
    accepted path (feed indices) and the target's choice there (the bonus or correction)."""
    kids = children(parents)
    path, cur = [], 0
    while True:
        nxt = next((i for i in kids.get(cur, []) if drafts[i - 1] == choice[cur]), None)
        if nxt is None:
            return path, choice[cur]
        path.append(nxt)
        cur = nxt


def walk_sampled(logits: torch.Tensor, s: Sequence, drafts: list[int], parents: list[int]) -> tuple[list[int], int]:
    """Rejection sampling down a tree of deterministic drafts (logits [G+1, V]): at a node, test
    its children in order, each accepted with probability p'(x), where p' is the target's
    distribution with the children already rejected removed and renormalised (SpecInfer's
    multi-draft rule with one-hot drafts); the first accepted child is the next node; when
    none is, a token is drawn from what is left of p'. Every committed token is then
    distributed as the target's p: this is sampling from p by first offering candidates."""
    kids = children(parents)
    path, cur = [], 0
    while True:
        p = process(logits[cur][None], [s])[0]  # [V]
        for node in kids.get(cur, []):
            x = drafts[node - 1]
            if float(torch.rand((), generator=s.gen, device=p.device)) * float(p.sum()) < float(p[x]):
                path.append(node)
                cur = node
                break
            p[x] = 0.0
        else:
            return path, int(sample(p[None], [s.gen])[0])


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] entropy (nats) of the target's distribution (temperature 1); a token
    masked to -inf (a grammar) counts 0, not NaN."""
    return torch.special.entr(torch.softmax(logits.float(), -1)).sum(-1)
