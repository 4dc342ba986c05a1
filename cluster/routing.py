"""Routing to replicas. Pinned: a sequence's proposals go where its draft KV lives, and the router
reaches every verifier (and draft) replica by id for GetStats, GetLoad and Abort. Prefix-aware
(`PrefixRouter`, verifiers): a generation goes where its prompt's prefix was sent before.

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
import time

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


def _prefix_router_base():
    # Ray Serve LLM's router. Its public alias, ray.serve.llm.request_router.PrefixCacheAffinityRouter,
    # is this class, but importing that package requires vLLM or SGLang; the module itself does not.
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )
    return PrefixCacheAffinityRouter


class PrefixRouter(_prefix_router_base()):
    """Prefix-aware routing of generations across verifier replicas: Ray Serve LLM's
    `PrefixCacheAffinityRouter` (a prefix tree of what each replica was sent, in a Ray actor), which
    sends a request to the replica holding the longest match of its prompt while the replicas'
    queues differ by at most `imbalanced_threshold`, to the replica that was sent the least when
    nothing matches well, and by power-of-two choices otherwise. Its "text" here is the request's
    tenant (a suffix draft's cache is per tenant) followed by its prompt token ids, one character
    each, so a match is a shared token prefix. Pinned calls (control RPCs, by session id) go where
    they are pinned, as `PinnedRouter` sends them. With one replica running there is nothing to choose,
    and the tree is not asked (each ask is an actor call on the request's path); it still learns where
    every prompt went, for when a second replica starts."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        pin = pending_request.metadata.session_id if pending_request is not None else None
        if pin:
            return await PinnedRouter.choose_replicas(self, candidate_replicas, pending_request)
        if len(candidate_replicas) == 1:  # nothing to choose: no trip to the prefix tree's actor
            return [list(candidate_replicas)]
        return await super().choose_replicas(candidate_replicas, pending_request)

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        """Record where the prompt went, without waiting: Ray's version blocks this router's event loop
        on the prefix tree actor (`ray.get`) after every request, which serialises routing under load.
        The insert lands a moment later; a request routed in between matches a little less."""
        text = self._extract_text_from_request(pending_request) if pending_request is not None else None
        if text is not None:
            self._tree_actor.insert.remote(text, replica_id.to_full_id_str(), time.time())

    def _extract_text_from_request(self, pending_request) -> str | None:
        from actors.schema import Request

        req = next((a for a in pending_request.args if isinstance(a, Request)), None)
        if req is None:  # not a generation
            return None
        return req.tenant + "\0" + "".join(chr(0x10000 + t) for t in req.prompt_ids)  # (no surrogates)
