"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024; Arctic Inference's `suffix` method in vLLM):
model-free drafts from the continuations of the longest match of the context's suffix, in the
request's own prompt and output and in a bounded cache of past outputs.

Per step, for each sequence:
  1. Find the earlier occurrences of the context's last n tokens (n = 3, else 2, else 1) in the
     request's own tokens and in the cached outputs its scope may read, and extend each match
     backwards (up to `max_depth` tokens): the match length of an occurrence.
  2. Keep the occurrences of the longest match, m tokens, and count their continuations in a
     trie: a node's probability is its count over its parent's (the suffix tree's frequency).
  3. Propose at most min(γ, ⌊max_spec_factor · m + max_spec_offset⌋) tokens: a chain following
     the most frequent child, or a token tree best-first by path probability within the
     request's node budget, never below `min_token_prob` (path probability).

Drafts are deterministic: the acceptance rule treats them as one-hot (lossless when sampling too).

The cache of past outputs holds each finished request's output (prompts stay with their request:
re-sent histories are matched there). It is bounded in requests and in bytes (`max_cached_requests`,
`max_cache_bytes`, bytes counted as tokens × BYTES_PER_TOKEN, measured by tests/unit/test_suffix.py)
and evicts the least recently used output first (an output is used when it supplied a draft).

Tenancy (`scope`): cached outputs shape other requests' drafts. Output stays lossless, but how fast a
request is accepted can reveal what another tenant generated. "global" shares one cache; "per_token"
keeps one cache per tenant (`DraftSeq.tenant`: the router's id of the caller's bearer token; the
cluster's default when auth is on); "per_request" caches nothing across requests.

The index (`TokenIndex`) maps each n-gram (n = 1..3) of its documents to where it ends; an
n-gram is an int key (tokens packed 21 bits apiece), so a vocabulary may have up to 2 M tokens.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict

from .base import Drafter, DraftSeq, Proposal, RowDraft, apply_view

SCOPES = ("global", "per_token", "per_request")
MAX_N = 3  # longest n-gram indexed
BITS = 21
# Bytes one cached token costs at most (its place in a document and in MAX_N n-gram lists, with the
# dict and list overheads when every n-gram is new: the worst case); tests/unit/test_suffix.py measures it.
BYTES_PER_TOKEN = 600
MAX_OCCURRENCES = 64  # the latest occurrences of an n-gram looked at per document set


def _key(tokens: list[int]) -> int:
    k = len(tokens)
    for t in tokens:
        k = (k << BITS) | t
    return k


class TokenIndex:
    """Documents (token lists) and, for each n-gram in them (n = 1..MAX_N), the (document, end
    position) of its occurrences, in insertion order. Documents grow at the end and may be cut back
    (`truncate`) or removed."""

    def __init__(self):
        self.docs: dict[int, list[int]] = {}
        self.grams: dict[int, list[int]] = {}  # key -> [doc << 32 | end], end: the index after the gram

    def tokens(self) -> int:
        return sum(len(d) for d in self.docs.values())

    def extend(self, doc: int, tokens: list[int]) -> None:
        d = self.docs.setdefault(doc, [])
        for t in tokens:
            d.append(t)
            end = len(d)
            for n in range(1, min(MAX_N, end) + 1):
                self.grams.setdefault(_key(d[end - n:end]), []).append(doc << 32 | end)

    def truncate(self, doc: int, length: int) -> None:
        d = self.docs[doc]
        while len(d) > length:
            end = len(d)
            for n in range(1, min(MAX_N, end) + 1):
                key = _key(d[end - n:end])
                occ = self.grams[key]
                occ.remove(doc << 32 | end)  # the latest of this document: near the end
                if not occ:
                    del self.grams[key]
            d.pop()

    def remove(self, doc: int) -> None:
        d = self.docs.pop(doc)
        keys = {_key(d[end - n:end]) for end in range(1, len(d) + 1) for n in range(1, min(MAX_N, end) + 1)}
        for key in keys:
            occ = [o for o in self.grams[key] if o >> 32 != doc]
            if occ:
                self.grams[key] = occ
            else:
                del self.grams[key]

    def occurrences(self, gram: list[int]) -> list[tuple[int, int]]:
        """The latest MAX_OCCURRENCES (doc, end) of `gram`, latest first."""
        occ = self.grams.get(_key(gram), ())
        return [(o >> 32, o & 0xFFFFFFFF) for o in occ[:-MAX_OCCURRENCES - 1:-1]]


class SuffixCache:
    """Past outputs, per scope key, bounded in requests and bytes with least-recently-used eviction."""

    def __init__(self, max_requests: int, max_bytes: int):
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self.indexes: dict[str, TokenIndex] = {}
        self.lru: OrderedDict[tuple[str, int], int] = OrderedDict()  # (scope key, doc) -> tokens
        self.tokens = 0
        self._next = 0

    @property
    def nbytes(self) -> int:
        return self.tokens * BYTES_PER_TOKEN

    def add(self, scope: str, output: list[int]) -> None:
        if not output or self.max_requests == 0 or len(output) * BYTES_PER_TOKEN > self.max_bytes:
            return
        self._next += 1
        self.indexes.setdefault(scope, TokenIndex()).extend(self._next, output)
        self.lru[(scope, self._next)] = len(output)
        self.tokens += len(output)
        while len(self.lru) > self.max_requests or self.nbytes > self.max_bytes:
            (s, doc), n = self.lru.popitem(last=False)
            self.indexes[s].remove(doc)
            if not self.indexes[s].docs:
                del self.indexes[s]
            self.tokens -= n

    def touch(self, scope: str, doc: int) -> None:
        self.lru.move_to_end((scope, doc))


class SuffixDrafter(Drafter):
    name = "suffix"
    free_drafting = True
    tree_drafting = True

    def __init__(self, scope: str = "global", max_depth: int = 24, max_spec_factor: float = 1.0,
                 max_spec_offset: float = 0.0, min_token_prob: float = 0.1, max_cached_requests: int = 1000,
                 max_cache_bytes: int = 64 << 20):
        if scope not in SCOPES:
            raise ValueError(f"suffix scope must be one of {list(SCOPES)}, got {scope!r}")
        if max_depth < 1 or max_spec_factor <= 0 or not 0 <= min_token_prob <= 1 or max_cached_requests < 0 \
                or max_cache_bytes < 0:
            raise ValueError("suffix: need max_depth >= 1, max_spec_factor > 0, min_token_prob in [0, 1], "
                             "max_cached_requests >= 0 and max_cache_bytes >= 0")
        self.scope, self.max_depth = scope, max_depth
        self.factor, self.offset, self.min_prob = max_spec_factor, max_spec_offset, min_token_prob
        self.cache = SuffixCache(max_cached_requests if scope != "per_request" else 0, max_cache_bytes)
        self.views: dict[int, list[int]] = {}
        self.local: dict[int, TokenIndex] = {}  # per sequence: its committed tokens (doc 0)
        self.meta: dict[int, tuple[str, int]] = {}  # per sequence: (scope key, output start)

    def _scope_key(self, s: DraftSeq) -> str | None:
        return {"global": "", "per_token": s.tenant or "", "per_request": None}[self.scope]

    def propose(self, seqs: list[DraftSeq]) -> Proposal:
        rows, parents = [], []
        for s in seqs:
            view = apply_view(self.views.setdefault(s.seq_id, []), s.keep, s.new_tokens)
            self.meta.setdefault(s.seq_id, (self._scope_key(s), s.output_start))
            local = self.local.setdefault(s.seq_id, TokenIndex())
            have = len(local.docs.get(0, ()))
            if have > s.keep:
                local.truncate(0, s.keep)
                have = s.keep
            local.extend(0, view[have:])  # the committed tokens (drafts join the view only)
            toks, par = self.speculate(s.seq_id, view, s.gamma, s.tree)
            rows.append(toks)
            parents.append(par)
            if par is None:
                view.extend(toks)  # the view includes the chain; the next `keep` says how many survived
        return Proposal.stack([RowDraft(r, parents=p) for r, p in zip(rows, parents)],
                              max((len(r) for r in rows), default=0))

    def _matches(self, seq_id: int, ctx: list[int]) -> tuple[int, list[tuple[TokenIndex, int, int]]]:
        """The longest match length m of the context's suffix and its occurrences (index, doc, end)."""
        scope = self.meta[seq_id][0]
        sources = [self.local[seq_id]] + ([self.cache.indexes[scope]] if scope in self.cache.indexes else [])
        for n in range(min(MAX_N, len(ctx)), 0, -1):
            found = []
            for idx in sources:
                for doc, end in idx.occurrences(ctx[-n:]):
                    d = idx.docs[doc]
                    if end >= len(d):
                        continue  # nothing follows (the context itself)
                    m = n
                    while m < min(self.max_depth, end, len(ctx)) and d[end - m - 1] == ctx[-m - 1]:
                        m += 1
                    found.append((m, idx, doc, end))
            if found:
                best = max(f[0] for f in found)
                return best, [(idx, doc, end) for m, idx, doc, end in found if m == best]
        return 0, []

    def speculate(self, seq_id: int, ctx: list[int], gamma: int, tree: int) -> tuple[list[int], list[int] | None]:
        """Drafts for a context: a chain (parents None) or a tree within `tree` nodes."""
        m, occ = self._matches(seq_id, ctx)
        depth = min(gamma, int(self.factor * m + self.offset))
        if not occ or depth < 1:
            return [], None if tree <= 0 else []
        scope = self.meta[seq_id][0]
        counts: dict[tuple[int, ...], int] = {}  # continuation prefix -> occurrences
        for idx, doc, end in occ:
            cont = idx.docs[doc][end:end + depth]
            for i in range(1, len(cont) + 1):
                counts[tuple(cont[:i])] = counts.get(tuple(cont[:i]), 0) + 1
            if idx is not self.local[seq_id]:
                self.cache.touch(scope, doc)
        total = len(occ)

        def prob(path: tuple) -> float:
            return counts[path] / total  # the path's probability: the product of the step frequencies

        if tree <= 0:  # a chain: the most frequent child, while its path stays likely enough
            path: tuple = ()
            while len(path) < depth:
                kids = [p for p in counts if len(p) == len(path) + 1 and p[:-1] == path]
                if not kids:
                    break
                best = max(kids, key=lambda p: counts[p])
                if prob(best) < self.min_prob:
                    break
                path = best
            return list(path), None
        kids: dict[tuple, list[tuple]] = {}
        for p in counts:
            kids.setdefault(p[:-1], []).append(p)
        kept, heap = [], [(-prob(p), p) for p in kids.get((), [])]
        heapq.heapify(heap)
        while heap and len(kept) < tree:
            negp, p = heapq.heappop(heap)
            if -negp < self.min_prob:
                break
            kept.append(p)
            for c in kids.get(p, []):
                heapq.heappush(heap, (-prob(c), c))
        kept.sort(key=len)  # parents before children
        idx_of = {p: i + 1 for i, p in enumerate(kept)}
        return [p[-1] for p in kept], [idx_of.get(p[:-1], 0) for p in kept]

    def release(self, seq_id: int) -> None:
        """The sequence is done: its output (as of its last draft call) joins its scope's cache."""
        self.views.pop(seq_id, None)
        local = self.local.pop(seq_id, None)
        scope, start = self.meta.pop(seq_id, (None, 0))
        if scope is not None and local is not None:
            self.cache.add(scope, local.docs.get(0, [])[start:])

    def num_active(self) -> int:
        return len(self.views)
