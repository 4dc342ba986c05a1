"""The soak's verdict (specd/soak.py): which statuses it may blame on itself, the RSS growth fit,
and KV left in use. The soak itself runs outside the suite (`make soak`)."""
from __future__ import annotations

import pytest

from specd.soak import Outcome, provoked, slope_mb_per_min, summarize


def _o(status: str, action: str = "run", end: float = 30.0, finish: str | None = "length") -> Outcome:
    return Outcome(start=end - 2.0, end=end, status=status, finish_reason=finish, ttft=0.1, tokens=10,
                   draft="ngram", action=action)


def test_only_the_statuses_the_soak_caused_are_forgiven():
    assert provoked(_o("OK"))
    assert provoked(_o("RESOURCE_EXHAUSTED"))  # admission under overload, whatever the request
    assert provoked(_o("CANCELLED", "close"))
    assert provoked(_o("DEADLINE_EXCEEDED", "deadline"))
    # the same codes on a request the soak left alone are the server's doing
    assert not provoked(_o("CANCELLED", "run"))
    assert not provoked(_o("DEADLINE_EXCEEDED", "run"))
    assert not provoked(_o("DEADLINE_EXCEEDED", "abort"))
    assert not provoked(_o("INTERNAL"))
    assert not provoked(_o("UNAVAILABLE", "deadline"))


def test_slope_is_mb_per_minute_by_least_squares():
    assert slope_mb_per_min([(0.0, 100.0), (60.0, 101.0), (120.0, 102.0)]) == pytest.approx(1.0)
    assert slope_mb_per_min([(0.0, 100.0), (30.0, 110.0), (60.0, 100.0)]) == pytest.approx(0.0)
    assert slope_mb_per_min([(0.0, 1.0), (1.0, 2.0)]) is None  # too few points to call a trend


def _summary(outcomes, rss, kv, private=None):
    return summarize(outcomes, rss, kv, duration=600.0, window=60.0, slope_minutes=8.0, max_slope=2.0,
                     private=private)


FLAT = {"Verifier#a": [(t, 2000.0 + (30.0 if t < 100 else 0.0)) for t in range(0, 600, 5)]}


def test_verdict_passes_a_clean_soak_and_fits_only_the_last_minutes():
    r = _summary([_o("OK"), _o("CANCELLED", "close"), _o("DEADLINE_EXCEEDED", "deadline")], FLAT, {"v": 0})
    assert r["pass"], r["checks"]
    assert r["replicas"]["Verifier#a"]["private_slope_mb_per_min"] == pytest.approx(0.0)  # the early drop is outside
    assert r["statuses"] == {"OK": 1, "CANCELLED": 1, "DEADLINE_EXCEEDED": 1}


@pytest.mark.parametrize("outcomes, rss, kv, failed", [
    ([_o("INTERNAL")], FLAT, {"v": 0}, "statuses"),
    ([_o("OK")], {"Verifier#a": [(t, 2000.0 + t / 20) for t in range(0, 600, 5)]}, {"v": 0}, "memory"),  # 3 MB/min
    ([_o("OK")], FLAT, {"v": 0, "draft": 1}, "kv_end"),
])
def test_verdict_fails_on_an_unprovoked_status_a_growing_replica_or_kv_left(outcomes, rss, kv, failed):
    r = _summary(outcomes, rss, kv)
    assert not r["pass"]
    assert [k for k, ok in r["checks"].items() if not ok] == [failed]


def test_a_replica_started_late_is_fitted_after_its_warm_up():
    late = {"Verifier#b": [(t, 1500.0 + 10 * min(t - 300, 60) / 60) for t in range(300, 600, 5)]}
    r = _summary([_o("OK")], late, {"v": 0})
    assert r["replicas"]["Verifier#b"]["slope_from_s"] == pytest.approx(360.0)
    assert r["checks"]["memory"]


GROWING = {"Verifier#a": [(t, 2000.0 + t / 20) for t in range(0, 600, 5)]}  # 3 MB/min


def test_the_memory_check_fits_rss_and_reports_private_growth_beside_it():
    r = _summary([_o("OK")], GROWING, {"v": 0}, private=FLAT)  # growth in shared pages still counts
    assert not r["checks"]["memory"]
    assert r["replicas"]["Verifier#a"]["private_slope_mb_per_min"] == pytest.approx(0.0)
    r = _summary([_o("OK")], FLAT, {"v": 0}, private=GROWING)
    assert r["checks"]["memory"] and r["replicas"]["Verifier#a"]["private_slope_mb_per_min"] == pytest.approx(3.0)
