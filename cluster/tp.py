"""A tensor-parallel verifier's other ranks as Ray actors (`actors.tp` holds the math and the protocol).

The verifier replica is rank 0: it runs the engine. `start_ranks` starts ranks 1..N-1, each in its own
bundle of the replica's placement group where it has one (Serve's `placement_group_bundles`: bundle 0
holds the replica, bundle r rank r), and returns their rendezvous address; the replica then joins the
group itself (`actors.tp.init` with rank 0). A rank that dies ends its `run` call: `dead` tells the
replica's health check, and the replica's next collective fails within `actors.tp.TIMEOUT_S`.
"""
from __future__ import annotations

import os
import socket

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@ray.remote(num_cpus=0)
class Rank:
    """One follower rank: its shard of the target, running what rank 0 announces."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, model: str, dtype: str, rank: int, world: int, address: str, exact: str, device: str,
            threads: int) -> int:
        import torch
        import torch.distributed as dist

        from actors import tp

        torch.set_num_threads(threads)
        group = tp.init(rank, world, address, device)
        try:
            return tp.follow(shard_of(model, dtype, group, exact, device))
        finally:
            dist.destroy_process_group()


def shard_of(model: str, dtype: str, group, exact: str = "auto", device: str = "cpu"):
    """A rank's shard of `model` (a spec `actors.models.load_model` takes), exact as rank 0's."""
    from actors.build import with_exact
    from actors.llama import LlamaRunner
    from actors.models import load_model
    from actors.tp import shard

    return with_exact(shard(LlamaRunner(load_model(model, dtype, device).model), group), exact)


def free_address() -> str:
    """This node's address and a free port for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


def start_ranks(model: str, dtype: str, world: int, exact: str = "auto", device: str = "cpu",
                threads: int = 1, resources: dict | None = None) -> tuple[str, list, list]:
    """Ranks 1..world-1 (in the current placement group's bundles 1..world-1 where there is one):
    (rendezvous address, actor handles, their `run` refs). The caller joins as rank 0 next."""
    address = free_address()
    pg = get_current_placement_group()
    actors = []
    for r in range(1, world):
        opts = {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)} if pg \
            else {}
        actors.append(Rank.options(**opts, **(resources or {})).remote())
    refs = [a.run.remote(model, dtype, r, world, address, exact, device, threads) for r, a in enumerate(actors, 1)]
    return address, actors, refs


def dead(refs: list) -> list:
    """The ranks whose `run` has returned or failed (a live group's never do until rank 0 stops them)."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    return done
