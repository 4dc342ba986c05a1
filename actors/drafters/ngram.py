"""Prompt-lookup (n-gram) drafter: model-free, and the engine's test double.

Find the most recent earlier occurrence of the sequence's last n tokens (trying
n = max_n down to min_n) and propose the tokens that followed it. Drafts are
deterministic, so the acceptance rule treats q as one-hot (lossless in sampling
mode too). Costs microseconds; pays off on inputs that repeat (code edits,
summaries quoting their source, extraction).
"""
from __future__ import annotations

from .base import Drafter, DraftSeq, Proposal, RowDraft, apply_view


class NgramDrafter(Drafter):
    name = "ngram"
    free_drafting = True
    tree_drafting = True

    def __init__(self, max_n: int = 3, min_n: int = 1, lookahead: int | None = None):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if lookahead is not None and lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        self.max_n, self.min_n, self.lookahead = max_n, min_n, lookahead
        self.views: dict[int, list[int]] = {}

    def propose(self, seqs: list[DraftSeq]) -> Proposal:
        rows, parents = [], []
        for s in seqs:
            view = apply_view(self.views.setdefault(s.seq_id, []), s.keep, s.new_tokens)
            k = s.gamma if self.lookahead is None else min(s.gamma, self.lookahead)
            if s.tree > 0:
                toks, par = self.lookup_tree(view, k, s.tree)
                rows.append(toks)
                parents.append(par)  # the view stays the committed tokens: the path comes back as new tokens
                continue
            r = self.lookup(view, k)
            rows.append(r)
            parents.append(None)
            view.extend(r)  # the view includes the proposals; the next `keep` says how many survived
        return Proposal.stack([RowDraft(r, parents=p) for r, p in zip(rows, parents)],
                              max((len(r) for r in rows), default=0))

    def lookup_tree(self, tokens: list[int], depth: int, budget: int, matches: int = 8) -> tuple[list[int], list[int]]:
        """The continuations of up to `matches` earlier occurrences of the longest matching suffix
        n-gram (latest first), merged into a trie of at most `budget` nodes (continuations seen
        more often first). Returns tokens and parents (feed indices, 0 = the root)."""
        n_tok = len(tokens)
        conts: list[list[int]] = []
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            suffix = tokens[n_tok - n:]
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    cont = tokens[start + n:start + n + depth]
                    if cont:
                        conts.append(cont)
                        if len(conts) >= matches:
                            break
            if conts:
                break
        trie: dict[tuple, int] = {}  # path prefix -> count
        for c in conts:
            for i in range(1, len(c) + 1):
                trie[tuple(c[:i])] = trie.get(tuple(c[:i]), 0) + 1
        kept: list[tuple] = []
        for path in sorted(trie, key=lambda p: (-trie[p], len(p))):  # a prefix counts at least its extensions
            if len(kept) >= budget:
                break
            if len(path) == 1 or path[:-1] in kept:
                kept.append(path)
        kept.sort(key=len)
        idx = {p: i + 1 for i, p in enumerate(kept)}
        return [p[-1] for p in kept], [idx.get(p[:-1], 0) for p in kept]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Continuation of the latest earlier match of the longest matching suffix n-gram."""
        n_tok = len(tokens)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            suffix = tokens[n_tok - n:]
            # Scan right-to-left for the most recent earlier occurrence.
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    cont = tokens[start + n:start + n + k]
                    if cont:
                        return cont
        return []

    def release(self, seq_id: int) -> None:
        self.views.pop(seq_id, None)

    def num_active(self) -> int:
        return len(self.views)
