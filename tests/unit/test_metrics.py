"""cluster/metrics.py without a cluster: every metric is one Ray accepts (a valid name, an ASCII
description, declared labels) and records what it is given. (Regression: a description with a
non-ASCII character killed every verifier replica at construction.) That the counts reach a
scrape exactly is tests/cluster/test_placement.py's."""
from __future__ import annotations

import warnings

from actors.schema import Delta, SpecStats
from cluster.metrics import DraftMetrics, RouterMetrics, VerifierMetrics


def test_every_metric_is_accepted_and_records():
    """Construction raises on a description Ray cannot encode; an invalid name warns (an error here)."""
    st = SpecStats()
    st.record(drafted=2, accepted=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Ray only warns (then drops the metric) on an invalid name
        v = VerifierMetrics("my-model", "fp32")
        v.finished("ngram", Delta("r", [1], "", finish_reason="length", prompt_tokens=3, completion_tokens=2, stats=st))
        v.finished("none", Delta("r", [1], "", finish_reason="stop", prompt_tokens=3, completion_tokens=1))
        v.load({"none": 0, "ngram": 1}, {"ngram": 1}, {"ngram": 1}, 4, {"truncated:2": 0.25}, {"ngram": 3})
        DraftMetrics("my-model", "truncated:2", kv=lambda: (1, 4)).export()
        r = RouterMetrics("my-model")
        timer = r.timer("ngram")
        timer.sent(Delta("r", [1], ""))
        timer.sent(Delta("r", [2], "", finish_reason="length"))
        r.rejected.inc(1, {"draft": "ngram"})
        r.coalesced.inc(1, {"draft": "ngram"})
    assert v.num_drafts._name == "specd_spec_decode_num_drafts" and not v.num_drafts._discard_metric
    for metric in (v.num_drafts, v.dtype, r.ttft, r.rejected):  # every metric says which model it is
        assert metric._default_tags == {"model_name": "my-model"}
