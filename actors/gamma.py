"""Adaptive draft length: pick γ per drafter per step to maximise expected goodput.

Speculation pays when a verify pass over more tokens costs little more than one
token. At batch 1 on a bandwidth-bound target that holds; at larger batch the
pass becomes compute-bound and drafts that are likely rejected make every step
slower (vLLM #4565, SmartSpec 2024). So each step, for each drafter:

    γ* = argmax_{0 <= γ <= γ_max}  committed(γ) / (t_verify(N(γ)) + t_draft(γ))
    committed(γ) = B_other + R * (1 + sum_{j<γ} r_j)     expected tokens this step
    N(γ)         = tokens in the pass = B_other + R * (γ + 1)

R rows use this drafter, B_other rows do not; r_j is the drafter's recent rate of
"the first j+1 drafts were all accepted" (an EMA of the per-position acceptance
counters); t_verify is a measured cost curve of the target over pass sizes, and
t_draft an EMA of the drafter's time per drafted position.

Exploration: until a drafter has `min_samples` observed steps, and on every
`explore_every`-th step after that, it drafts at γ_max so its acceptance
estimates stay current even while speculation is switched off.

Greedy output is unchanged by any γ choice (the acceptance rule is exact). With
sampling the output distribution is unchanged too, but a seed reproduces the same
tokens only under a fixed γ: use the fixed policy where that matters.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import torch


class PassCost:
    """t_verify(N): measured seconds for one target pass over N tokens (piecewise linear)."""

    def __init__(self, points: list[tuple[int, float]]):
        assert points and all(n > 0 for n, _ in points), points
        self.n = [p[0] for p in sorted(points)]
        self.t = [p[1] for p in sorted(points)]

    def __call__(self, n: int) -> float:
        i = bisect.bisect_left(self.n, n)
        if i < len(self.n) and self.n[i] == n:
            return self.t[i]
        if i == 0:
            return self.t[0]
        if i == len(self.n):  # extrapolate with the last segment's slope
            i = len(self.n) - 1
        n0, n1, t0, t1 = self.n[i - 1], self.n[i], self.t[i - 1], self.t[i]
        return t0 + (t1 - t0) * (n - n0) / (n1 - n0)

    @classmethod
    def measure(cls, runner, max_tokens: int, context: int = 128, reps: int = 3) -> "PassCost":
        """Time the target over pass sizes 1, 2, 4, ... max_tokens (one row of N tokens, median)."""
        sizes = sorted({1 << i for i in range(max_tokens.bit_length())} | {max_tokens})
        cache = runner.new_cache(1, context + max(sizes))
        g = torch.Generator().manual_seed(0)
        runner.forward(cache, [0], torch.randint(0, runner.vocab_size, (1, context), generator=g))
        feeds = {n: torch.randint(0, runner.vocab_size, (1, n), generator=g) for n in sizes}
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(reps):
            for n in sizes:
                cache.truncate(0, context)
                t0 = time.perf_counter()
                runner.logits(runner.forward(cache, [0], feeds[n]))
                times[n].append(time.perf_counter() - t0)
        return cls([(n, sorted(v)[len(v) // 2]) for n, v in times.items()])


def draft_step_seconds(drafter, context: list[int], hidden: torch.Tensor | None = None, reps: int = 15,
                       seq_id: int = -1) -> float:
    """Median seconds of one draft step, measured through `Drafter.propose` alone: each call
    rolls the view back by one token and re-feeds it (the same catch-up every time), so
    (propose γ=3 − propose γ=1) / 2 is the marginal cost of one drafted token.
    hidden [len(context) - 1, E]: the target's hidden states, for feature drafters."""
    from .drafters.base import DraftSeq

    def call(keep: int, new: list[int], gamma: int, h=None) -> float:
        t0 = time.perf_counter()
        drafter.propose([DraftSeq(seq_id=seq_id, keep=keep, new_tokens=new, gamma=gamma, hidden=h,
                                  hidden_start=0)])
        return time.perf_counter() - t0

    call(0, list(context), 1, hidden if drafter.wants_hidden else None)
    n = len(context)
    t1, t3 = [], []
    try:
        for _ in range(reps):
            t1.append(call(n - 1, [context[-1]], 1))
            t3.append(call(n - 1, [context[-1]], 3))
    finally:
        drafter.release(seq_id)
    med = lambda x: sorted(x)[len(x) // 2]  # noqa: E731
    return max(med(t3) - med(t1), 0.0) / 2


@dataclass
class _DrafterEstimate:
    rates: list[float] = field(default_factory=list)  # r_j, EMA
    draft_s_per_pos: float = 0.0  # EMA of drafting seconds per drafted position (per step)
    steps: int = 0  # observed draft steps
    calls: int = 0  # choices made (also while speculation is off)


class AdaptiveGamma:
    def __init__(self, cost: PassCost, ema: float = 0.1, min_samples: int = 8, explore_every: int = 16):
        self.cost, self.ema = cost, ema
        self.min_samples, self.explore_every = min_samples, explore_every
        self.est: dict[str, _DrafterEstimate] = {}

    def choose(self, drafter: str, gamma_max: int, rows_with: int, rows_without: int) -> int:
        e = self.est.setdefault(drafter, _DrafterEstimate())
        if gamma_max <= 0:
            return 0
        e.calls += 1
        if e.steps < self.min_samples or e.calls % self.explore_every == 0:
            return gamma_max
        best, best_rate = 0, -1.0
        expected = 1.0
        for g in range(gamma_max + 1):
            if g > 0:
                expected += e.rates[g - 1] if g - 1 < len(e.rates) else 0.0
            tokens = rows_without + rows_with * expected
            seconds = self.cost(rows_without + rows_with * (g + 1)) + g * e.draft_s_per_pos
            if tokens / seconds > best_rate * (1 + 1e-9):
                best, best_rate = g, tokens / seconds
        return best

    def observe(self, drafter: str, drafted: list[int], accepted: list[int], draft_s: float) -> None:
        """One step of one drafter: per row, drafts proposed and accepted; the step's draft time."""
        e = self.est.setdefault(drafter, _DrafterEstimate())
        e.steps += 1
        width = max(drafted, default=0)
        if width == 0:
            return
        a = self.ema
        e.draft_s_per_pos = (1 - a) * e.draft_s_per_pos + a * draft_s / width if e.steps > 1 else draft_s / width
        while len(e.rates) < width:
            e.rates.append(0.5)  # neutral prior for a position never drafted before
        for j in range(width):
            rows = [acc > j for k, acc in zip(drafted, accepted) if k > j]
            if rows:
                e.rates[j] = (1 - a) * e.rates[j] + a * sum(rows) / len(rows)

    def rates(self, drafter: str) -> list[float]:
        return list(self.est.get(drafter, _DrafterEstimate()).rates)
