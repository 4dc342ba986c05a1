"""specd/stats.py: one definition of each statistic, the one every bench, soak and tune figure uses."""
from __future__ import annotations

import pytest

from specd.stats import median, percentile, slope


def test_percentiles_interpolate_between_ranks():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert median(xs) == 2.5  # between the two middle values, not one of them
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile([], 50) is None and median([]) is None


def test_slope_is_the_least_squares_line():
    assert slope([(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]) == pytest.approx(2.0)
    assert slope([(0.0, 0.0), (1.0, 2.0), (2.0, 0.0)]) == pytest.approx(0.0)
    assert slope([(0.0, 1.0), (1.0, 2.0)]) is None  # too few points to call a trend
    assert slope([(1.0, 1.0), (1.0, 2.0), (1.0, 3.0)]) is None  # no spread in x
