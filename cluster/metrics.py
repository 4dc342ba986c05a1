"""The cluster's Prometheus metrics, defined once, exported through Ray's metrics API.

Names are vLLM's wherever vLLM has one (`vllm:spec_decode_num_drafts` becomes
`specd_spec_decode_num_drafts`: Ray refuses `:` in a name). Ray's exporter prefixes `ray_`,
and a counter gains `_total`, so what a scrape of a node's metrics port (the one KubeRay
scrapes) shows is, e.g., `ray_specd_spec_decode_num_drafts_total`; a histogram shows
`_bucket`, `_sum` and `_count`. Every metric is built with `ray.serve.metrics` (Ray's
`ray.util.metrics` plus the labels `deployment`, `replica` and `application` of the Serve
replica recording it) and carries a `model_name` label (the config's `served_model_name`, as
`/v1/models` shows it, vLLM's label) and a `draft` label: the draft a request named (resolved:
"none" = no speculation, "auto" = the engine's pick per request), or the draft whose KV or γ it
is. Built inside a replica's constructor, where Serve's replica context exists.

Mean accepted length (vLLM's mean acceptance length), per draft, over the last 5 minutes:

    1 + sum by (draft) (rate(ray_specd_spec_decode_num_accepted_tokens_total[5m]))
      / sum by (draft) (rate(ray_specd_spec_decode_num_drafts_total[5m]))

Draft acceptance rate: accepted tokens / draft tokens, the same way. Acceptance at draft
position j (what a response's `acceptance_per_position` holds):

    sum by (draft) (rate(ray_specd_spec_decode_num_accepted_tokens_per_pos_total{position="j"}[5m]))
      / sum by (draft) (rate(ray_specd_spec_decode_num_draft_tokens_per_pos_total{position="j"}[5m]))

(vLLM divides by the drafts instead; with a fixed γ and no early stop the two agree.)

Who records what:
  Verifier  speculation and token counters, once per request, when it finishes (a request
            aborted or cancelled midway is not counted); requests running and waiting, the
            target's and colocated drafts' KV in use, γ per draft, the target's dtype; prefix
            cache queries and hits (prompt tokens, vLLM's prefix_cache_queries / _hits).
  Router    latency histograms, per caller (a coalesced caller too), admission rejections,
            coalesced requests.
  Draft-*   the remote draft's KV in use, per replica.
Ray exports a gauge only while it is re-recorded (a value not refreshed for two report
intervals ages out of the scrape), so the gauges are re-sent every GAUGE_REFRESH_S, changed or not.
Does not know: how a value was computed; callers pass plain numbers and `SpecStats`.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from ray.serve.metrics import Counter, Gauge, Histogram

from actors.schema import MAX_GAMMA, NO_DRAFT, Delta, SpecStats

PREFIX = "specd_"
GAUGE_REFRESH_S = 1.0  # Ray's shortest report interval: a gauge re-sent this often never ages out
# vLLM's bucket boundaries (seconds)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]


def _tagged(metric, model_name: str):
    metric.set_default_tags({"model_name": model_name})
    return metric


def _counter(model_name: str, name: str, doc: str, *labels: str) -> Counter:
    return _tagged(Counter(PREFIX + name, doc, tag_keys=("model_name", "draft", *labels)), model_name)


def _gauge(model_name: str, name: str, doc: str, *labels: str) -> Gauge:
    return _tagged(Gauge(PREFIX + name, doc, tag_keys=("model_name", "draft", *labels)), model_name)


def _histogram(model_name: str, name: str, doc: str, buckets: list[float]) -> Histogram:
    return _tagged(Histogram(PREFIX + name, doc, boundaries=buckets, tag_keys=("model_name", "draft")), model_name)


def _draft_kv_gauge(model_name: str) -> Gauge:
    return _gauge(model_name, "draft_kv_cache_usage_perc",
                  "Draft KV in use: the draft's sequences over its slots (0..1)")


class VerifierMetrics:
    """A verifier replica's metrics: counters per finished request, gauges after each batcher step."""

    def __init__(self, model_name: str, dtype: str):
        counter, gauge = partial(_counter, model_name), partial(_gauge, model_name)
        self.num_drafts = counter("spec_decode_num_drafts", "Verify steps that had at least one draft token")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted at each draft position", "position")
        self.drafted_per_pos = counter("spec_decode_num_draft_tokens_per_pos",
                                        "Verify steps that drafted a token at each draft position", "position")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for finished requests")
        self.running = gauge("num_requests_running", "Requests holding KV on this replica")
        self.waiting = gauge("num_requests_waiting", "Requests queued for KV blocks (or preempted) on this replica")
        self.kv = gauge("kv_cache_usage_perc", "Target KV blocks held over the pool's blocks (0..1), by the draft "
                                                "of the requests holding them")
        self.draft_kv = _draft_kv_gauge(model_name)
        self.gamma = gauge("spec_decode_gamma", "The speculation policy's current gamma per draft (0 = off)")
        self.dtype = gauge("model_dtype_info", "1, labelled with the target's dtype (draft label 'none')", "dtype")
        self.dtype_tags = {"draft": NO_DRAFT, "dtype": dtype}
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "(draft label 'none')")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache: not prefilled "
                                   "again (draft label 'none')")
        self._prefix = (0, 0)  # the totals last exported
        self._last: tuple | None = None
        self._sent = 0.0  # when the gauges were last sent

    def finished(self, draft: str, delta: Delta) -> None:
        """A request finished: add its usage and speculation counts (its response's own)."""
        tags = {"draft": draft}
        for counter, value in ((self.prompt_tokens, delta.prompt_tokens),
                               (self.generation_tokens, delta.completion_tokens)):
            if value:
                counter.inc(value, tags)
        st = delta.stats or SpecStats()
        for counter, value in ((self.num_drafts, st.drafts), (self.num_draft_tokens, st.draft_tokens),
                               (self.num_accepted_tokens, st.accepted_tokens)):
            if value:
                counter.inc(value, tags)
        for j in range(MAX_GAMMA):
            pos = {"draft": draft, "position": str(j)}
            if st.drafted_per_pos[j]:
                self.drafted_per_pos.inc(st.drafted_per_pos[j], pos)
            if st.accepted_per_pos[j]:
                self.accepted_per_pos.inc(st.accepted_per_pos[j], pos)

    def load(self, running: dict[str, int], waiting: dict[str, int], kv_blocks: dict[str, int], kv_total: int,
             draft_kv: dict[str, float], gamma: dict[str, int]) -> None:
        """The replica's state after a step; per draft (every draft label the replica serves in
        `running`, so a draft whose requests left reads 0). Call it after every step and at least
        every GAUGE_REFRESH_S; unchanged state is re-sent only that often."""
        state, now = (running, waiting, kv_blocks, draft_kv, gamma), time.monotonic()
        if state == self._last and now - self._sent < GAUGE_REFRESH_S:
            return
        self._last, self._sent = state, now
        self.dtype.set(1, self.dtype_tags)
        for d in running:
            tags = {"draft": d}
            self.running.set(running[d], tags)
            self.waiting.set(waiting.get(d, 0), tags)
            self.kv.set(kv_blocks.get(d, 0) / kv_total, tags)
        for d, used in draft_kv.items():
            self.draft_kv.set(used, {"draft": d})
        for d, g in gamma.items():
            self.gamma.set(g, {"draft": d})


    def prefix_cache(self, queries: int, hits: int) -> None:
        """The prefix cache's totals (tokens looked up, found) since the replica started."""
        q0, h0 = self._prefix
        for counter, value in ((self.prefix_queries, queries - q0), (self.prefix_hits, hits - h0)):
            if value:
                counter.inc(value, {"draft": NO_DRAFT})
        self._prefix = (queries, hits)


class DraftMetrics:
    """A remote draft replica's metrics: its KV in use, read by `kv()` -> (sequences, slots) and
    sent every GAUGE_REFRESH_S from a daemon thread."""

    def __init__(self, model_name: str, draft: str, kv: Callable[[], tuple[int, int]]):
        self.tags = {"draft": draft}
        self.draft_kv = _draft_kv_gauge(model_name)
        self.read_kv = kv
        threading.Thread(target=self._refresh, name="specd-draft-metrics", daemon=True).start()

    def export(self) -> None:
        in_use, total = self.read_kv()
        self.draft_kv.set(in_use / total if total else 0.0, self.tags)

    def _refresh(self) -> None:
        while True:
            self.export()
            time.sleep(GAUGE_REFRESH_S)


class RouterMetrics:
    """A router replica's metrics: latencies as each caller sees them, admission and coalescing."""

    def __init__(self, model_name: str):
        counter, histogram = partial(_counter, model_name), partial(_histogram, model_name)
        self.ttft = histogram("time_to_first_token_seconds", "Request arrival to its first token", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Between consecutive stream messages carrying tokens "
                                                             "(a verify step may commit several)", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request arrival to its last message", E2E_BUCKETS)
        self.rejected = counter("admission_rejections", "Requests refused at admission (router.max_queue)")
        self.coalesced = counter("coalesced_requests", "Requests served by an identical in-flight generation")

    def timer(self, draft: str) -> "RequestTimer":
        return RequestTimer(self, {"draft": draft})


@dataclass
class RequestTimer:
    """One caller's stream: `sent(delta)` as each message goes out observes TTFT, then the
    inter-token latencies, and the end-to-end latency with the last message."""
    metrics: RouterMetrics
    tags: dict
    start: float = field(default_factory=time.monotonic)
    last: float | None = None  # when the latest message with tokens went out

    def sent(self, delta: Delta) -> None:
        now = time.monotonic()
        if delta.token_ids:
            if self.last is None:
                self.metrics.ttft.observe(now - self.start, self.tags)
            else:
                self.metrics.itl.observe(now - self.last, self.tags)
            self.last = now
        if delta.finished:
            self.metrics.e2e.observe(now - self.start, self.tags)
