"""Sticky routing for draft replicas: a sequence's proposals go where its draft KV lives.

The verifier passes the pinned replica's id as the Serve `session_id`. If that
replica is among the live candidates the request goes there; otherwise (a new
sequence, or the replica was lost or scaled away) the default power-of-two choice
picks a replica, and the draft server reports the sequence as `missing` so the
verifier re-sends it from its committed tokens.
"""
from __future__ import annotations

import random

import ray
from ray.serve.request_router import LocalityMixin, MultiplexMixin, RequestRouter

# `_fulfill_next_pending_request` below overrides a private method of Serve's RequestRouter,
# written against Ray 2.60 (pyproject pins it; tests/cluster/test_routing.py exercises it).
_PRIVATE = ("_fulfill_next_pending_request", "_pending_requests_to_fulfill", "_record_queue_wait_time",
            "_remove_pending_request_from_indices")
if not ray.__version__.startswith("2.60.") or not hasattr(RequestRouter, _PRIVATE[0]):
    raise ImportError(f"cluster.routing.PinnedRouter overrides Ray Serve internals of Ray 2.60; "
                      f"Ray {ray.__version__} is installed (pyproject.toml pins ray[serve]>=2.60,<2.61)")


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

    def _fulfill_next_pending_request(self, replica, request_metadata=None):
        # Match the chosen replica to its own request by identity: calls made from one
        # parent request share an internal_request_id, and a pin must not be handed to a
        # sibling call (Ray's FIFO matching would).
        for pr in list(self._pending_requests_to_fulfill):
            if pr.metadata is request_metadata and not pr.future.done():
                self._record_queue_wait_time(pr)
                pr.future.set_result(replica)
                self._pending_requests_to_fulfill.remove(pr)
                self._remove_pending_request_from_indices(pr)
                return
        super()._fulfill_next_pending_request(replica, request_metadata)
