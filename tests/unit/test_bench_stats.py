"""The cluster benchmark's statistics on hand-made records (no cluster: see
tests/cluster/test_pipeline_cluster.py for the benchmark against a real one)."""
import json
import os

import pytest

from specd.bench.records import match_ray_niceness, record, summarize


def test_summary_statistics_on_known_records():
    # a request sent at t=0: first chunk (1 token) at 0.1 s, then 3 tokens at 0.4 s, 1 at 0.5 s
    a = record(0.0, [(0.1, 1), (0.4, 3), (0.5, 1)], [1, 2, 3, 4, 5],
                {"drafts": 2, "draft_tokens": 8, "accepted_tokens": 2, "acceptance_per_position": [0.5, 0.5]}, False)
    b = record(1.0, [(1.3, 2)], [6, 7], {}, True)
    s = summarize([a, b], wall=2.0)
    assert s["tokens"] == 7 and s["tokens_per_s"] == 3.5 and s["coalesced"] == 1
    assert s["ttft_ms"]["p50"] == pytest.approx(200) and s["ttft_ms"]["mean"] == pytest.approx(200)
    assert a["itl"] == pytest.approx([0.1, 0.1, 0.1, 0.1])  # 0.3 s over 3 tokens, then 0.1 s for 1
    assert s["itl_ms"]["p50"] == pytest.approx(100) and s["chunk_gap_ms"]["p99"] == pytest.approx(299, abs=1)
    assert s["acceptance_rate"] == 0.25 and s["mean_accepted_length"] == 2.0
    assert s["acceptance_per_position"] == [0.5, 0.5]
    assert match_ray_niceness("10.1.2.3:9000") == os.nice(0)  # a remote cluster: nothing to match


def test_a_bench_report_is_written_as_json_table_and_png(tmp_path):
    """Every bench's three outputs, from one writer: a `bench.json` default takes the bench's name."""
    from specd.bench.records import write_report

    def plot(report, path):
        path.write_bytes(b"png")

    write_report({"x": 1}, "table", plot, str(tmp_path / "bench.json"), "bench_paged")
    assert json.loads((tmp_path / "bench_paged.json").read_text()) == {"x": 1}
    assert (tmp_path / "bench_paged.txt").read_text() == "table\n" and (tmp_path / "bench_paged.png").exists()
