"""Pinned routing: a sequence's proposals go where its draft KV lives, and the router reaches
every verifier (and draft) replica by id for GetStats, GetLoad and Abort.

The caller passes the pinned replica's id as the Serve `session_id`. If that
replica is among the live candidates the request goes there; otherwise (a new
sequence, or the replica was lost or scaled away) the default power-of-two choice
picks a replica, and the draft server reports the sequence as `missing` so the
verifier re-sends it from its committed tokens.

Only Serve's public request-router API (`choose_replicas`); tests/cluster/test_placement.py
checks on two replicas that no pinned call ever lands elsewhere.
"""
from __future__ import annotations

import random

from ray.serve.request_router import LocalityMixin, MultiplexMixin, RequestRouter


class PinnedRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
            pin = pending_request.metadata.session_id
            if pin:
                for r in candidate_replicas:
                    if r.replica_id.unique_id == pin:
                        return [[r]]
        if not candidate_replicas:
            return []
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
