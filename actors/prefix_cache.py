"""Prefix caching: finished sequences' KV slots stay on an LRU, and a request whose prompt shares a
prefix with one of them starts from that KV and prefills only the rest (vLLM's automatic prefix
caching, SGLang's radix cache; here at the granularity of a slot, the engine's unit of KV).

- `release`: a finished sequence's slot joins the cache with the tokens whose KV it holds.
- `take`: the slot for a new sequence, and how many leading prompt tokens it already holds. On a
  hit (the longest common prefix with a cached slot, at least `min_tokens`, and never the whole
  prompt: the last prompt token is fed to get the first token's logits), the prefix's KV (and the
  target features a feature-level drafter reads) is copied into a free slot, so the cached slot
  stays for the next request that shares it (a system prompt); with no free slot left, the cached
  slot itself is taken. On a miss: a free slot, else the least recently used cached slot.

Cached slots count as free for admission: one is evicted before any request would wait. Drafters
keep no part of this: a model drafter prefills its own KV for the whole prompt (recomputed), a
feature head reads the copied features (kept). Greedy output is the same with the cache on or off:
the reused KV is the target's own for those tokens.

Counters, as vLLM names its metrics: `queries` (prompt tokens looked up) and `hits` (prompt tokens
found), and the requests looked up and hit.
"""
from __future__ import annotations

from collections import OrderedDict

from .sequence import common_prefix


class PrefixCache:
    def __init__(self, cache, features=None, on: bool = True, min_tokens: int = 16):
        """cache: the target's `llama.KVCache`; features: the engine's `drafting.Features` (or None)."""
        self.cache, self.features, self.on, self.min_tokens = cache, features, on, min_tokens
        self.entries: OrderedDict[int, list[int]] = OrderedDict()  # slot -> tokens its KV holds, LRU first
        self.queries = self.hits = 0  # prompt tokens looked up / found in the cache
        self.requests = self.hit_requests = 0

    def counts(self) -> dict[str, int]:
        return {"queries": self.queries, "hits": self.hits, "requests": self.requests,
                "hit_requests": self.hit_requests, "slots": self.slots}

    @property
    def slots(self) -> int:
        """Slots holding cached KV (free for admission)."""
        return len(self.entries)

    def release(self, slot: int, tokens: list[int] | None) -> bool:
        """A finished sequence's slot, whose KV holds `tokens`, joins the cache: True. False: it is
        freed (caching is off, or tokens None: nothing to keep), and the caller frees the slot."""
        if not self.on or not tokens:
            self._reset(slot, 0)
            return False
        self.entries[slot] = tokens
        return True

    def evict(self) -> int:
        """Free the least recently used cached slot and return it."""
        slot, _ = self.entries.popitem(last=False)
        self._reset(slot, 0)
        return slot

    def _reset(self, slot: int, length: int) -> None:
        self.cache.truncate(slot, length)
        if self.features is not None:
            self.features.length[slot] = length

    def take(self, prompt: list[int] | None, free_slots: list[int]) -> tuple[int, int]:
        """The slot for a new sequence with this prompt (taken from `free_slots`, which it updates,
        or from the cache) and how many leading prompt tokens that slot's KV already holds.
        prompt None: any slot (no lookup)."""
        best, hit = None, 0
        if self.on and prompt is not None:
            self.requests += 1
            self.queries += len(prompt)
            for slot, tokens in self.entries.items():
                n = min(common_prefix(tokens, prompt), len(prompt) - 1)
                if n > hit:
                    best, hit = slot, n
        if best is None or hit < self.min_tokens:
            return (free_slots.pop(0) if free_slots else self.evict()), 0
        self.hits += hit
        self.hit_requests += 1
        if not free_slots:  # take the cached slot itself
            del self.entries[best]
            self._reset(best, hit)
            return best, hit
        dst = free_slots.pop(0)
        self.cache.copy_prefix(best, dst, hit)
        if self.features is not None:
            self.features.copy(best, dst, hit)
        self.entries.move_to_end(best)
        return dst, hit
