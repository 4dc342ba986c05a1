"""The verifier pool's autoscaling policy: Serve's ongoing-requests rule, and enough replicas that
their paged KV pools stay below `KV_TARGET` held on average.

Each verifier replica reports the share of its KV blocks held (`VerifierServer.record_autoscaling_stats`,
Serve's custom autoscaling metrics); Serve averages it over the look-back window per replica and
calls `kv_policy` with that, then applies the config's bounds and up/downscale delays as it does
for its own policy. Requests ask for blocks, not for slots, so a pool of long requests scales on
memory before its request count says so.
"""
from __future__ import annotations

KV_TARGET = 0.8  # the share of a replica's KV blocks held above which the pool wants another replica
METRIC = "kv_blocks_held"


def kv_policy(ctx) -> tuple[float, dict]:
    """Desired replicas: the larger of ongoing requests ÷ target_ongoing_requests (Serve's default) and
    current replicas × mean KV share held ÷ KV_TARGET."""
    current = ctx.current_num_replicas
    if current == 0:
        return ctx.target_num_replicas, {}
    by_requests = ctx.total_num_requests / ctx.config.get_target_ongoing_requests()
    held = (ctx.aggregated_metrics or {}).get(METRIC) or {}
    by_kv = current * (sum(held.values()) / len(held)) / KV_TARGET if held else 0.0
    return max(by_requests, by_kv), {}
