"""Speculative beam search that returns exactly what the target's own beam search returns.

The search (`BeamSearch`) is Hugging Face's (`generate(num_beams=B, do_sample=False)`, transformers
5), step for step: the B running beams' next-token log-probabilities plus their scores give B·V
candidates; the top 2B (one extra per EOS) are kept; a top-B candidate that ends in EOS (or hits
max length) enters the finished hypotheses with score / generated_length ** length_penalty; the
best B candidates that did not finish become the next running beams; the search stops when no
running beam can beat the worst finished one (the `early_stopping` heuristic), when B hypotheses
have finished and early_stopping is True, or at max length.

Speculation. Every running beam drafts a continuation (a chain, or a token tree), and one target
pass scores every node of every beam's draft. A beam step needs, for each running beam, the
target's distribution after its last token. The first step of a pass always has it (each beam's
root is in the pass). After that step, each new running beam is (an old beam r, a token t); the
next step can be taken from the same pass iff, for EVERY new running beam, t is a child of the node
it extends in r's draft (the root, then deeper), because that node's logits are exactly what the
plain search would compute for that beam. So a drafted token is accepted only when the plain
search itself kept the beam prefix that contains it: the speculative search takes exactly the
plain search's steps, with the same candidates, scores and finished hypotheses, and stops a pass
at the first step where any surviving beam leaves the drafted tree. Nothing is guessed: a pass
advances 1 + (number of further steps all of whose beams stayed on drafted nodes).

The engine keeps a beam request as a `BeamGroup`: B member sequences, each with its own KV slot
and drafter state, member i carrying running beam i. After a pass (`advance`), a new beam that is
the first to continue an old one stays in that member's slot (its accepted nodes compacted in
place, like a tree path); a second child of the same beam takes the slot of a beam that died, and
its KV is copied there (copy-on-fork: the prompt is copied once per member when the search starts,
and a fork copies its whole prefix). A member's drafter rolls back to the longest common prefix of
what it drafted from and the beam it now carries (`DraftView.rebase`).

Does not know: models or drafters; the engine feeds it log-probabilities per node, and the KV
cache and the features store to move beams between slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from .acceptance import depths

if TYPE_CHECKING:
    from .sequence import Sequence

NEG = -1.0e9


@dataclass
class Beam:
    tokens: list[int]  # generated so far (prompt excluded)
    score: float  # sum of log-probabilities


@dataclass
class Finished:
    tokens: list[int]
    score: float  # length-normalised


class BeamSearch:
    """HF beam search for one request, advanced one step at a time from log-probabilities."""

    def __init__(self, num_beams: int, eos: set[int], max_new: int, length_penalty: float = 1.0,
                 early_stopping: bool = False):
        self.B, self.eos, self.max_new = num_beams, set(eos), max_new
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.keep = max(2, 1 + len(self.eos)) * num_beams  # candidates kept per step (HF's beams_to_keep)
        # At the start every running beam is the prompt; only the first counts (HF: scores -1e9).
        self.running = [Beam([], 0.0 if b == 0 else NEG) for b in range(num_beams)]
        self.finished: list[Finished] = []  # at most B, best first
        self.heuristic_unsatisfied = True
        self.done = False
        self.steps = 0

    def step(self, log_probs: torch.Tensor) -> list[tuple[int, int]]:
        """One beam step. log_probs [B, V] (float32 log-softmax of the target's logits after each
        running beam). Returns, per new running beam, (index of the running beam it extends, token)."""
        B, V = log_probs.shape
        scores = torch.tensor([b.score for b in self.running], dtype=torch.float32, device=log_probs.device)
        acc = (log_probs.float() + scores[:, None]).reshape(-1)  # [B*V]
        top_lp, top_idx = torch.topk(acc, k=self.keep)
        cur = len(self.running[0].tokens)  # generated tokens before this step
        cands = []  # (log prob, parent, token, hits stop)
        for lp, idx in zip(top_lp.tolist(), top_idx.tolist()):
            parent, tok = divmod(idx, V)
            stop = tok in self.eos or cur + 1 >= self.max_new
            cands.append((lp, parent, tok, stop))
        # Finished hypotheses: only the top B candidates may finish (HF's top_num_beam_mask).
        full = self.early_stopping is True and len(self.finished) >= self.B
        if not full and self.heuristic_unsatisfied:
            for i, (lp, parent, tok, stop) in enumerate(cands[:self.B]):
                if stop:
                    norm = lp / ((cur + 1) ** self.length_penalty)
                    self.finished.append(Finished(self.running[parent].tokens + [tok], norm))
            self.finished.sort(key=lambda f: -f.score)
            self.finished = self.finished[:self.B]
        # Next running beams: the best B that did not stop (stopped ones get -1e9, as in HF).
        running = sorted(((lp + (NEG if stop else 0.0), parent, tok) for lp, parent, tok, stop in cands),
                         key=lambda c: -c[0])[:self.B]
        new = [(parent, tok) for _, parent, tok in running]
        self.running = [Beam(self.running[p].tokens + [t], lp) for lp, p, t in running]
        self.steps += 1
        # The stopping heuristic (HF's _check_early_stop_heuristic with early_stopping False / True).
        best_running = self.running[0].score / ((cur + 1) ** self.length_penalty)
        worst_finished = self.finished[-1].score if len(self.finished) >= self.B else -1.0e9
        self.heuristic_unsatisfied = self.heuristic_unsatisfied and best_running > worst_finished
        all_stop = all(stop for _, _, _, stop in cands)
        exists_open = not (len(self.finished) >= self.B and self.early_stopping is True)
        if not (self.heuristic_unsatisfied and exists_open and not all_stop):
            self.done = True
        return new

    def result(self) -> Finished:
        """The best hypothesis (HF returns the first of the finished ones, best first; if none
        finished, the best running beam — it can only happen at max length)."""
        if self.finished:
            return self.finished[0]
        b = self.running[0]
        return Finished(b.tokens, b.score / (max(1, len(b.tokens)) ** self.length_penalty))


@dataclass
class Advance:
    """What one pass did to one new running beam."""
    origin: int  # the running beam (member) at the start of the pass that it extends
    tokens: list[int]  # the tokens it gained (the last is its new root: not in the KV yet)
    nodes: list[int]  # feed indices, in the origin's draft, of tokens[:-1]: their KV is in the origin's slot


def advance(search: BeamSearch, log_probs: Callable[[int, int], torch.Tensor],
            children: list[dict[int, dict[int, int]]]) -> list[Advance]:
    """Take every beam step one target pass allows (see the module docstring), at least one.
    log_probs(i, node) -> [V]: the target's log-probabilities after running beam i's root
    (node 0) or one of its draft nodes; children[i][node] -> {token: child node} in beam i's
    draft. Returns the new running beams, in the search's order."""
    # Per running beam: (origin, the node whose logits it steps from (None: off the draft),
    # tokens gained, the nodes it stepped from so far).
    cur = [(i, 0, [], []) for i in range(search.B)]
    while True:
        new = search.step(torch.stack([log_probs(o, n) for o, n, _, _ in cur]))
        nxt = []
        for p, tok in new:
            o, node, toks, nodes = cur[p]
            nxt.append((o, children[o].get(node, {}).get(tok), toks + [tok], nodes + [node]))
        cur = nxt
        if search.done or any(node is None for _, node, _, _ in cur):
            # nodes[0] is the root; nodes[1:] are the draft nodes of tokens[:-1].
            return [Advance(o, toks, nodes[1:]) for o, _, toks, nodes in cur]


@dataclass(eq=False)
class BeamGroup:
    """A beam request in the engine: members[i] carries running beam i of `search`; the group
    does the KV surgery that moves beams between the members' slots."""
    search: BeamSearch
    leader: "Sequence"  # the member keyed by the request's key (it stays one of the members)
    members: list["Sequence"]

    def start(self, cache, features, logits: torch.Tensor) -> None:
        """The prompt is prefilled in the leader's slot: take the first beam step from its last
        logits [V], and give every member the prompt's KV (copy-on-fork)."""
        lead = self.leader
        lp = torch.log_softmax(logits.float(), -1)
        adv = advance(self.search, lambda i, node: lp, [{} for _ in self.members])
        n = cache.lengths[lead.slot]  # the prompt
        for m, a in zip(self.members, adv):
            if m is not lead:
                cache.fork(lead.slot, m.slot, n, [])
                if features is not None:
                    features.copy(lead.slot, m.slot, features.length[lead.slot])
                m.prefilled = m.num_prompt
            m.tokens = list(m.req.prompt_ids) + a.tokens
        lead.stats.record(0, 0)

    def verified(self, cache, features, rows: list, logits: torch.Tensor, feats: torch.Tensor | None,
                starts: list[int]) -> None:
        """After a pass: take every beam step the drafts allow (`advance`), then rebuild each
        member's KV, features, tokens and drafter view for the beam it now carries.
        rows[i]: member i's `acceptance.Row`; logits [len(rows), G+1, V] and feats [.., G+1, F*E]
        (or None) their rows of the pass; starts[i]: member i's KV length before it."""
        lp = torch.log_softmax(logits, -1)  # [B, G+1, V]
        kids = []
        for r in rows:
            ch: dict[int, dict[int, int]] = {}
            for i, (par, tok) in enumerate(zip(r.parents if r.parents is not None else range(len(r.drafts)),
                                               r.drafts), start=1):
                ch.setdefault(par, {}).setdefault(tok, i)
            kids.append(ch)
        adv = advance(self.search, lambda i, node: lp[i, node], kids)
        # A new beam continues in its origin's slot if it is the origin's first child; the others
        # take the slots of beams that died.
        owner: list[int | None] = [None] * len(adv)
        taken: set[int] = set()
        for j, a in enumerate(adv):
            if a.origin not in taken:
                owner[j] = a.origin
                taken.add(a.origin)
        spare = [i for i in range(len(adv)) if i not in taken]
        owner = [o if o is not None else spare.pop() for o in owner]
        mem, old = self.members, [list(m.tokens) for m in self.members]
        for j, a in enumerate(adv):  # forks first: they read the origins' KV before it is compacted
            if owner[j] != a.origin:
                src, dst, n = mem[a.origin], mem[owner[j]], starts[a.origin]
                cache.fork(src.slot, dst.slot, n, [0] + a.nodes)
                if features is not None:
                    features.copy(src.slot, dst.slot, n)
        for j, a in enumerate(adv):
            if owner[j] == a.origin:
                m, n = mem[a.origin], starts[a.origin]
                cache.compact(m.slot, n, [0] + a.nodes)
                cache.truncate(m.slot, n + 1 + len(a.nodes))
        for j, a in enumerate(adv):
            m, r = mem[owner[j]], rows[owner[j]]
            if feats is not None:
                features.keep(m.slot, feats[a.origin, [0] + a.nodes])
            new = old[a.origin] + a.tokens
            m.view.rebase(old[owner[j]], r.drafts if r.parents is None else [], new)  # its view: old + its chain
            m.tokens = new
        self.members = [mem[o] for o in owner]
        depth = max((max(depths(r.parents)) if r.parents is not None else len(r.drafts) for r in rows), default=0)
        # one beam's drafts (the widest): acceptance reads as "beam steps taken from drafts per draft"
        self.leader.stats.record(max(len(r.drafts) for r in rows), len(adv[0].tokens) - 1, depth)
        self.leader.stats.draft_s += max(r.draft_s for r in rows)

    def result(self) -> tuple[list[int], str]:
        """The search is over: the best finished hypothesis and its finish reason."""
        best = self.search.result()
        return list(best.tokens), "stop" if best.tokens and best.tokens[-1] in self.search.eos else "length"

