"""Tensor parallelism: one target over N processes, each holding 1/N of every layer (gpt-fast's scheme).

- `shard(runner, group)`: the fused qkv projection by KV-head groups (rank r its share of the KV heads
  and the query heads that read them; shares differ by at most one group where N does not divide the
  KV heads, e.g. SmolLM2's 3 over 2 ranks), the output projection by the matching columns; gate/up by
  columns, down by the matching rows (a sparse layer: each rank its share of the experts, the shared
  expert on rank 0); the LM head by vocabulary rows (padded to a multiple of N). Each rank's KV cache
  holds its own KV heads: positions and blocks are not split, so rollback, trees, beams and the prefix
  cache work unchanged. Two all-reduces per layer (after the output and the down projections, where
  gpt-fast places them) and one all-gather of the logits.
- Rank 0 (the leader) runs the engine. Each pass it makes is announced to the other ranks
  (`torch.distributed` broadcast of the pass's inputs: tokens, slots, their block tables and lengths,
  the KV copies done since the last pass, a tree mask), which run the same pass on their shards
  (`follow`); the leader reads the result. Nothing else crosses: sampling, drafting and acceptance
  stay on the leader.
- Backend: gloo on CPUs, NCCL on GPUs (`init`). An all-reduce sums two partial products where one
  process summed them in a single matmul, so logits differ from a one-process run in their last
  bits (the TP tests bound them and compare greedy tokens).

Dense weights only (no native blocks, int8 or fused-stack layouts), and no MLA layers yet.
"""
from __future__ import annotations

import datetime
import itertools
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .kv import KVCache

TIMEOUT_S = 60  # a collective that waits longer raises: a dead rank takes its group down, not forever


@dataclass
class Group:
    """A rank's place in its tensor-parallel group, and the leader's bookkeeping of its caches."""
    rank: int
    world: int
    pg: object = None  # the torch.distributed process group (None: the default one)
    caches: dict = field(default_factory=dict)  # follower: cache id -> its `Mirror`
    dead: list = field(default_factory=list)  # leader: ids of caches collected since the last pass
    ids: itertools.count = field(default_factory=itertools.count)
    comm_s: float = 0.0  # seconds in collectives (all-reduce, all-gather, announcements) on this rank
    calls: int = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        dist.all_reduce(x, group=self.pg)
        self.comm_s += time.perf_counter() - t
        self.calls += 1
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, concatenated along the last dimension."""
        t = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.pg)
        self.comm_s += time.perf_counter() - t
        self.calls += 1
        return torch.cat(parts, -1)

    def send(self, msg) -> None:
        t = time.perf_counter()
        dist.broadcast_object_list([msg], src=0, group=self.pg)
        self.comm_s += time.perf_counter() - t

    def receive(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]


def init(rank: int, world: int, address: str, device: str = "cpu") -> Group:
    """Join the group at `address` (host:port of rank 0's rendezvous)."""
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return Group(rank, world)


def part(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s share [lo, hi) of n items split over `world` ranks (sizes differ by at most one)."""
    return rank * n // world, (rank + 1) * n // world


def shard(runner, group: Group):
    """Keep this rank's part of every layer of `runner` (in place) and make its passes collective."""
    r, n = group.rank, group.world
    H, Hkv, D = runner.n_heads, runner.n_kv, runner.head_dim
    if Hkv < n:
        raise ValueError(f"tensor_parallel_size {n} exceeds the KV heads ({Hkv}): each rank holds at least one")
    if runner.mla or runner.native or runner.prepacked or runner.quant != "none" or runner.fused is not None:
        raise ValueError("tensor parallelism shards dense weights: no MLA, native blocks, prepacked or int8 layouts")
    rep = H // Hkv  # query heads per KV head
    k0, k1 = part(Hkv, r, n)
    q0, q1 = k0 * rep, k1 * rep
    h, hk = q1 - q0, k1 - k0

    def rows(t, spans):  # the rows [a, b) of each span, stacked
        return None if t is None else torch.cat([t[a:b] for a, b in spans]).contiguous()

    qkv = [(q0 * D, q1 * D), (H * D + k0 * D, H * D + k1 * D), ((H + Hkv) * D + k0 * D, (H + Hkv) * D + k1 * D)]
    for w in runner.layers:
        w.wqkv, w.bqkv = rows(w.wqkv, qkv), rows(w.bqkv, qkv)
        w.wo = w.wo[:, q0 * D:q1 * D].contiguous()
        w.bo = w.bo if r == 0 else None  # added once, by the leader's partial sum
        if w.moe is not None:  # each rank its share of the experts; the shared expert on rank 0
            w.moe.keep(*part(len(w.moe.gate_up), r, n), shared=r == 0)
            continue
        inter = w.w_down.shape[1]
        i0, i1 = part(inter, r, n)
        w.w_gate_up = rows(w.w_gate_up, [(i0, i1), (inter + i0, inter + i1)])
        w.w_down = w.w_down[:, i0:i1].contiguous()
        if w.sinks is not None:
            w.sinks = w.sinks[q0:q1].contiguous()
    V = runner.lm_head.shape[0]
    v = -(-V // n)
    head = runner.lm_head[r * v:(r + 1) * v]
    if head.shape[0] < v:  # the last rank's rows, padded to the others' count (their logits dropped)
        head = torch.cat([head, head.new_zeros(v - head.shape[0], head.shape[1])])
    runner.lm_head = head.contiguous()
    runner.n_heads, runner.n_kv = h, hk
    runner.tp, runner.tp_vocab = group, V
    return runner


class Mirror(KVCache):
    """A follower's cache: the leader's block tables and lengths, its KV heads. Blocks are the leader's
    to allocate: a pass only reads the tables it was sent."""

    def reserve(self, slot: int, end: int) -> None:
        if self.blocks(end) > len(self.tables[slot]):
            raise RuntimeError(f"the leader sent slot {slot} no block for position {end - 1}")

    def trim(self, slot: int) -> None:
        pass

    def sync(self, slots: list[int], tables: list[list[int]], lengths: list[int], moves) -> None:
        for dst, src in moves:
            self._move(dst, src)
        for s, t, n in zip(slots, tables, lengths):
            self.tables[s], self.lengths[s] = t, n


def new_cache(runner, cache: KVCache, geometry: dict) -> KVCache:
    """The leader's side of `LlamaRunner.new_cache` under tensor parallelism: the followers make the same
    cache (their heads), and the leader logs its copies for them."""
    g = runner.tp
    cache.tp_id = next(g.ids)
    cache.moves = []
    g.send(("cache", cache.tp_id, geometry))
    weakref.finalize(cache, g.dead.append, cache.tp_id)
    return cache


def announce(runner, cache: KVCache, slots: list[int], args: dict) -> None:
    """The leader's side of a pass: what the followers need to run it."""
    g = runner.tp
    moves, cache.moves = cache.moves, []
    dead, g.dead = g.dead, []
    g.send(("forward", cache.tp_id, slots, [list(cache.tables[s]) for s in slots], [cache.lengths[s] for s in slots],
            moves, dead, args))


def follow(runner) -> int:
    """A follower rank's loop: run what the leader announces until it says stop (None). Returns the
    number of passes run."""
    g, passes = runner.tp, 0
    while True:
        msg = g.receive()
        if msg is None:
            return passes
        kind, *rest = msg
        if kind == "cache":
            cid, geometry = rest
            g.caches[cid] = Mirror(runner.num_layers, n_kv=runner.n_kv, head_dim=runner.head_dim,
                                   device=runner.device, shared_kv=runner.mla, **geometry)
        elif kind == "forward":
            cid, slots, tables, lengths, moves, dead, args = rest
            for d in dead:
                g.caches.pop(d, None)
            cache = g.caches[cid]
            cache.sync(slots, tables, lengths, moves)
            runner.forward(cache, slots, **args)
            passes += 1
        elif kind == "logits":
            runner.logits(rest[0])


def stop(runner) -> None:
    """The leader tells the followers to return from `follow`."""
    runner.tp.send(None)

