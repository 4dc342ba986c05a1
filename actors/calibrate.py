"""Measure the hardware at load: what a target pass costs, by batch and tokens per row.

Whether speculation pays depends on the machine. On a CPU with native bf16 matmuls (AMX,
AVX-512-BF16) a bf16 pass over 5 tokens costs ~1.1x one token; on an AVX2-only CPU it costs
~2.6x, and 16 rows cost 7.5x one row in bf16 but 3.2x in fp32. So an engine measures, while it
loads, the target's pass cost t(B, T) over a small grid of B rows x T tokens per row, in each
dtype it may use, caches the result per hardware and model (a later load on the same machine
reuses it), and the speculation policy (`policy.py`) and the dtype choice read it.

`hardware()` is the fingerprint every benchmark JSON records too: CPU model and the flags that
decide bf16 speed (AMX, AVX-512-BF16, AVX-512, AVX2), or the GPU's name.

Does not know: drafters' acceptance or requests; only what a pass costs.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import cpu
from .hardware import hardware
from .llama import LlamaRunner, context_features

log = logging.getLogger("specd")
# A calibration during which other processes kept more than this share of one core busy is not
# cached: the machine was busy, and its pass costs would become every later load's truth.
BUSY_CORES = 0.25

BATCHES = (1, 2, 4, 8, 16, 32)  # the grid, capped at the engine's max_batch (which is always included)
TOKENS = (1, 2, 3, 5, 9)  # tokens per row: 1 + γ for γ = 0, 1, 2, 4, 8
MAX_GRID_TOKENS = 64  # wider points are extrapolated (a pass that wide is compute-bound: linear in T)
CONTEXT = 128  # positions already in each row's KV while timing


@dataclass
class PassCost:
    """t(B, T): seconds of one target pass (forward + LM head) over B rows of T new tokens,
    measured on a grid; bilinear in between, linear beyond the largest T and B."""
    points: dict[tuple[int, int], float]  # (B, T) -> seconds
    dtype: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.bs = sorted({b for b, _ in self.points})
        self.ts = {b: sorted(t for bb, t in self.points if bb == b) for b in self.bs}  # T measured per B
        self._memo: dict[tuple[int, int], float] = {}  # (rows, tokens) -> seconds: the policy asks ~30 per step

    @staticmethod
    def _bracket(xs: list[int], x: float) -> tuple[int, int, float]:
        i = bisect.bisect_left(xs, x)
        if i < len(xs) and xs[i] == x:
            return xs[i], xs[i], 0.0
        if i == 0:
            return xs[0], xs[0], 0.0
        if i == len(xs):  # extrapolate with the last segment
            i = len(xs) - 1
        lo, hi = xs[i - 1], xs[i]
        return lo, hi, (x - lo) / (hi - lo)

    def _at(self, b: int, tokens: int) -> float:
        t0, t1, ft = self._bracket(self.ts[b], tokens)
        return self.points[b, t0] + (self.points[b, t1] - self.points[b, t0]) * ft

    def __call__(self, rows: int, tokens: int) -> float:
        got = self._memo.get((rows, tokens))
        if got is None:
            b0, b1, fb = self._bracket(self.bs, rows)
            at_b0, at_b1 = self._at(b0, tokens), self._at(b1, tokens)
            got = self._memo[rows, tokens] = max(at_b0 + (at_b1 - at_b0) * fb, 1e-6)
        return got

    def per_token(self, rows: int) -> float:
        """Seconds per generated token when `rows` sequences decode one token each."""
        return self(rows, 1) / rows

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "meta": self.meta,
                "points": [[b, t, s] for (b, t), s in sorted(self.points.items())]}

    @classmethod
    def from_json(cls, d: dict) -> "PassCost":
        return cls({(b, t): s for b, t, s in d["points"]}, d.get("dtype", ""), d.get("meta", {}))


def grid(max_batch: int, tokens: tuple[int, ...] = TOKENS, cap: int = MAX_GRID_TOKENS) -> list[tuple[int, int]]:
    """The (B, T) points measured: B up to max_batch, T in `tokens`, B·T at most `cap`
    (every B keeps at least two T, so each row of the grid has a slope)."""
    bs = sorted({b for b in BATCHES if b < max_batch} | {max_batch})
    pts = []
    for b in bs:
        ts = [t for t in tokens if b * t <= cap] or [tokens[0]]
        if len(ts) < 2 and len(tokens) > 1:
            ts = list(tokens[:2])
        pts += [(b, t) for t in ts]
    return pts


def measure(runner, max_batch: int, reps: int = 2, context: int = CONTEXT, progress=None,
            tokens: tuple[int, ...] = TOKENS, cap: int = MAX_GRID_TOKENS) -> PassCost:
    """Time the runner over the grid (min of `reps` interleaved runs, after one warm-up pass), at a
    `context` of cached positions (fewer where the runner serves fewer)."""
    points = grid(max_batch, tokens, cap)
    context = min(context, runner.max_position - max(tokens) - 1)
    rows = max(b for b, _ in points)
    cache = runner.new_cache(rows, context + max(tokens) + 1)
    dev = runner.device
    g = torch.Generator().manual_seed(0)
    runner.forward(cache, list(range(rows)), torch.randint(0, runner.vocab_size, (rows, context), generator=g).to(dev))
    feeds = {t: torch.randint(0, runner.vocab_size, (rows, t), generator=g).to(dev) for t in tokens}
    best: dict[tuple[int, int], float] = {}
    runner.logits(runner.forward(cache, [0], feeds[tokens[0]][:1]))  # warm-up
    for rep in range(1, reps + 1):
        for b, t in points:
            for s in range(b):
                cache.truncate(s, context)
            _sync(dev)
            t0 = time.perf_counter()
            runner.logits(runner.forward(cache, list(range(b)), feeds[t][:b]))
            _sync(dev)
            dt = time.perf_counter() - t0
            best[b, t] = min(best.get((b, t), dt), dt)
            if progress is not None:
                progress()
    return PassCost(best, str(runner.dtype).replace("torch.", ""))


def _sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize(dev)


def cache_path(key: dict) -> Path:
    from .models import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "calibration" / f"{digest}.json"


def calibrated(runner, model_name: str, max_batch: int, device="cpu", reps: int = 2,
               use_cache: bool = True, tokens: tuple[int, ...] = TOKENS) -> PassCost:
    """The pass-cost grid of this runner on this hardware: from the cache when this hardware,
    model, dtype, thread count and grid were measured before, else measured now and cached.
    tokens=(1,) measures decoding alone (a draft replica choosing its dtype)."""
    key = {"hardware": hardware(device), "model": model_name, "dtype": str(runner.dtype),
           "layers": runner.num_layers, "grid": grid(max_batch, tokens), "context": CONTEXT}
    if getattr(runner, "quant", "none") != "none":
        key["quant"] = runner.quant
    if getattr(runner, "prepacked", False):
        key["prepacked"] = True
    if getattr(runner, "native", False):
        from .native import kernel_label

        key["native"] = kernel_label(runner)  # the block kernel's ISA path and build, or ATen's int4
    if getattr(runner, "exact", False):
        key["exact"] = True  # row-invariant kernels (actors/kernels): another cost
    if runner.dtype != torch.float32 and not cpu.onednn_bf16():
        key["onednn_bf16"] = False  # plain bf16 matmuls off oneDNN (actors/cpu.py): another kernel
    path = cache_path(key)
    if use_cache and path.exists():
        try:
            cost = PassCost.from_json(json.loads(path.read_text()))
            cost.meta = {**cost.meta, "cached": str(path)}
            return cost
        except (ValueError, KeyError):
            pass  # a broken cache file: measure again
    t0 = time.perf_counter()
    cost, busy = _quiet_measure(runner, max_batch, reps, tokens)
    cost.meta = {"key": key, "measured_s": time.perf_counter() - t0, "measured_at": time.time()}
    if busy is not None:
        cost.meta["busy_cores"] = busy
    if busy is not None and busy > BUSY_CORES:
        log.warning("calibration of %s (%s): other processes kept %.2f cores busy while it ran, twice; its pass "
                    "costs serve this load only and are not cached (the next load measures again)",
                    model_name, key["dtype"], busy)
    elif use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cost.to_json(), indent=1))
        os.replace(tmp, path)
    return cost


def others_busy_s() -> tuple[float, float] | None:
    """(CPU seconds every process has used, this process's), from /proc (None where there is none):
    two readings apart give how busy the rest of the machine kept its cores meanwhile."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        ticks = os.sysconf("SC_CLK_TCK")
        busy = sum(int(x) for i, x in enumerate(fields[:8]) if i not in (3, 4))  # all but idle and iowait
        with open(f"/proc/{os.getpid()}/stat") as f:
            mine = f.read().rsplit(")", 1)[1].split()
        return busy / ticks, (int(mine[11]) + int(mine[12])) / ticks
    except (OSError, ValueError, IndexError):
        return None


def _quiet_measure(runner, max_batch: int, reps: int, tokens) -> tuple[PassCost, float | None]:
    """`measure`, checked against the rest of the machine: where other processes kept more than
    BUSY_CORES of a core busy meanwhile, measured once more, and the faster of the two kept. Returns
    (cost, cores the others kept busy on the last try; None where it cannot be read)."""
    best, busy = None, None
    for _ in range(2):
        a, t0 = others_busy_s(), time.perf_counter()
        with torch.inference_mode():
            cost = measure(runner, max_batch, reps, tokens=tokens)
        b, wall = others_busy_s(), time.perf_counter() - t0
        busy = None if a is None or b is None else max(0.0, (b[0] - a[0]) - (b[1] - a[1])) / max(wall, 1e-9)
        if best is None or cost(1, 1) < best(1, 1):
            best = cost
        if busy is None or busy <= BUSY_CORES:
            break
    return best, busy


def draft_step_seconds(drafter, context: list[int], target: LlamaRunner | None = None, reps: int = 15,
                       seq_id: int = -1, rows: int = 1) -> float:
    """Median seconds of one draft step, measured through `Drafter.propose` alone: each call
    rolls the view back by one token and re-feeds it (the same catch-up every time), so
    (propose γ=3 − propose γ=1) / 2 is the marginal cost of one drafted token.
    target: the target runner, whose features of the context a feature drafter is handed first.
    rows: sequences drafted together in each call (ids seq_id, seq_id - 1, ...; the same context)."""
    from .drafters.base import DraftSeq

    def call(keep: int, new: list[int], gamma: int, h=None) -> float:
        t0 = time.perf_counter()
        drafter.propose([DraftSeq(seq_id=seq_id - r, keep=keep, new_tokens=new, gamma=gamma, hidden=h,
                                  hidden_start=0) for r in range(rows)])
        return time.perf_counter() - t0

    if drafter.wants_hidden and target is None:
        raise ValueError(f"draft {drafter.name!r} reads target features: pass the target runner")
    call(0, list(context), 1, context_features(target, context, drafter.feature_layers) if drafter.wants_hidden
         else None)
    n = len(context)
    t1, t3 = [], []
    try:
        for _ in range(reps):
            t1.append(call(n - 1, [context[-1]], 1))
            t3.append(call(n - 1, [context[-1]], 3))
    finally:
        for r in range(rows):
            drafter.release(seq_id - r)
    med = lambda x: sorted(x)[len(x) // 2]  # noqa: E731
    return max(med(t3) - med(t1), 0.0) / 2


def choose_dtype(costs: dict, expected_batch: int, label=str) -> tuple:
    """The option (a dtype, or any key: `load_target` weighs (dtype, weight layout) pairs) whose
    decode step costs least per token at the expected batch, and why (`label` names a key).
    The caller never offers an int8 target (native GGUF weights are offered: the model's own blocks)."""
    per_token = {k: c.per_token(expected_batch) for k, c in costs.items()}
    best = min(per_token, key=per_token.get)
    why = ", ".join(f"{label(k)} {s * 1e3:.1f} ms/token" for k, s in sorted(per_token.items(), key=lambda kv: kv[1]))
    return best, f"{label(best)}: least time per token at batch {expected_batch} (max_batch) — {why}"
