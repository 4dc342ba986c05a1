"""The statistics every bench, soak and tune figure uses, on numpy, with one definition each.

percentile: linear interpolation between the closest ranks (numpy's default, "linear"), q in
[0, 100]; the median is its 50th. slope: the least-squares slope of (x, y) points.
leviathan_alpha: the i.i.d. acceptance rate that explains a measured tokens-per-pass.
An empty sample has no statistic (None), and a line needs three points with distinct x.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) of xs, interpolated linearly; None for no samples."""
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else None


def median(xs: Sequence[float]) -> float | None:
    return percentile(xs, 50)


def slope(points: Sequence[tuple[float, float]]) -> float | None:
    """dy/dx of the least-squares line through (x, y) points; None under three points or when
    every x is the same."""
    if len(points) < 3:
        return None
    x, y = np.asarray(points, dtype=float).T
    if np.ptp(x) == 0:
        return None
    return float(np.polyfit(x, y, 1)[0])


def leviathan_alpha(tokens_per_pass: float, gamma: int) -> float:
    """The i.i.d. per-token acceptance α whose expected tokens per pass at γ, (1-α^(γ+1))/(1-α)
    (Leviathan et al.), equals the measured one (solved by bisection, to 1e-15)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        e = gamma + 1 if mid >= 1 else (1 - mid ** (gamma + 1)) / (1 - mid)
        lo, hi = (mid, hi) if e < tokens_per_pass else (lo, mid)
    return (lo + hi) / 2
