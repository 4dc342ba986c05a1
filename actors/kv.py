"""The KV cache: fixed-size blocks of positions, a block table per slot, a pool of free blocks.

Layout per layer: [num_blocks, block_size, Hkv, D]. Slot s's position p lives in block
`tables[s][p // block_size]` at offset `p % block_size` (vLLM's PagedAttention layout, which
FlexAttention and flash-attn read through a block table too). A slot holds the blocks its length
needs, so a request pays for what it uses, not for `max_len`; the pool is sized by memory
(`blocks_for_memory`), not by slots × context. With `block_size` = the context (one block per
slot) it is the slotted cache of earlier versions: the default of `LlamaRunner.new_cache`.

- Rollback is a length update (`truncate`); whole blocks past the new length go back to the pool.
- Blocks are shared by reference (`refs`): a prefix (`copy_prefix`) or a beam's fork (`fork`)
  shares the source's blocks, its last partial block included; the first write into a shared
  block copies it first (copy-on-write, in `reserve`).
- `reserve` makes positions writable before a pass writes them (the runner calls it); it raises
  `OutOfBlocks` when the pool is short, and changes nothing then. The engine checks `need`
  first and makes room (evicting cached prefixes, then preempting the youngest request).

Positions at or beyond a slot's length hold garbage and are never attended; the pool starts
zeroed, so that garbage is finite (a masked key is weighed by an exact zero, and 0 × NaN is not
zero). On a CPU the pool is an anonymous memory map: zeros the OS supplies page by page on first
write, so an idle pool is address space, and the resident KV grows with the blocks requests use.
"""
from __future__ import annotations

import math
import mmap

import torch


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros; on a CPU in an anonymous memory map (resident only where written)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=dtype, count=math.prod(shape)).view(shape)


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a reservation needs."""


def blocks_for_memory(budget: int, block_size: int, bytes_per_position: int) -> int:
    """How many blocks of `block_size` positions `budget` bytes hold."""
    return max(1, budget // (block_size * bytes_per_position))


class KVCache:
    def __init__(self, num_layers: int, slots: int, max_len: int, n_kv: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, shared_kv: bool = False,
                 block_size: int | None = None, num_blocks: int | None = None):
        """max_len: the most positions one slot may hold. block_size: positions per block (None: max_len,
        one block per slot); num_blocks: the pool (None: enough for every slot at max_len)."""
        self.block_size = bs = min(block_size or max_len, max_len)
        self.num_blocks = num_blocks if num_blocks is not None else slots * math.ceil(max_len / bs)
        if self.num_blocks < 1:
            raise ValueError(f"a KV cache needs at least one block, got {self.num_blocks}")
        shape = (num_layers, self.num_blocks, bs, n_kv, head_dim)
        self.k = _zeros(shape, dtype, device)
        self.v = self.k if shared_kv else _zeros(shape, dtype, device)  # MLA: one latent vector is both
        self.lengths = [0] * slots  # python ints: read on every step, never a device sync
        self.tables: list[list[int]] = [[] for _ in range(slots)]
        self.refs = [0] * self.num_blocks  # slots (cached prefixes included) holding each block
        self._recycled: list[int] = []  # blocks given back, taken again first (their pages are resident)
        self._fresh = 0  # blocks [_fresh, num_blocks) were never taken
        self.max_len = max_len
        self.forked_positions = 0  # positions copied by `fork` and copy-on-write so far (all layers, K and V)
        self.moves: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # a list: every copy logged (`_move`)

    # ---- sizes --------------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        return len(self.lengths)

    @property
    def free_blocks(self) -> int:
        return len(self._recycled) + self.num_blocks - self._fresh

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def bytes_per_block(self) -> int:
        return sum(t[:, 0].numel() * t.element_size() for t in self._tensors())

    def blocks(self, positions: int) -> int:
        """Blocks that hold `positions` positions."""
        return -(-positions // self.block_size)

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        """The cache's tensors, each once (MLA's keys are its values)."""
        return (self.k,) if self.v is self.k else (self.k, self.v)

    # ---- blocks -------------------------------------------------------------------------------
    def _take(self) -> int:
        if self._recycled:
            b = self._recycled.pop()
        else:
            if self._fresh >= self.num_blocks:
                raise OutOfBlocks("no free KV block")
            b, self._fresh = self._fresh, self._fresh + 1
        self.refs[b] = 1
        return b

    def _drop(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self._recycled.append(b)

    def _shared_write(self, slot: int, end: int) -> bool:
        """Whether writing the slot's positions [length, end) starts in a block it shares."""
        table, first = self.tables[slot], self.lengths[slot] // self.block_size
        return end > self.lengths[slot] and first < len(table) and self.refs[table[first]] > 1

    def need(self, slot: int, end: int) -> int:
        """Blocks `reserve(slot, end)` would take from the pool."""
        return max(0, self.blocks(end) - len(self.tables[slot])) + self._shared_write(slot, end)

    def reserve(self, slot: int, end: int) -> None:
        """Make positions [length, end) of a slot writable: blocks for them, and a private copy of a
        shared block they fall in. OutOfBlocks (nothing changed) when the pool is short."""
        if end > self.max_len:
            raise ValueError(f"sequence would reach {end} positions, cache holds {self.max_len}")
        n = self.need(slot, end)
        if n == 0:
            return
        if n > self.free_blocks:
            raise OutOfBlocks(f"slot {slot} needs {n} KV blocks up to position {end}, {self.free_blocks} free")
        table, first = self.tables[slot], self.lengths[slot] // self.block_size
        if self._shared_write(slot, end):  # copy-on-write
            old, new = table[first], self._take()
            at = torch.arange(self.block_size, device=self.k.device)
            self._move(new * self.block_size + at, old * self.block_size + at)
            self._drop(old)
            table[first] = new
            self.forked_positions += self.lengths[slot] - first * self.block_size
        while len(table) < self.blocks(end):
            table.append(self._take())

    def trim(self, slot: int) -> None:
        """Give back the slot's blocks past its length."""
        table = self.tables[slot]
        keep = self.blocks(self.lengths[slot])
        while len(table) > keep:
            self._drop(table.pop())

    def table(self, slots: list[int], device) -> torch.Tensor:
        """int64 [B, P]: each slot's block table, padded with its last block (never read past its length)."""
        tabs = [self.tables[s] or [0] for s in slots]
        P = max(len(t) for t in tabs)
        return torch.tensor([t + t[-1:] * (P - len(t)) for t in tabs], device=device)

    def flat(self, c: torch.Tensor) -> torch.Tensor:
        """A cache tensor as [layers, num_blocks * block_size, Hkv, D]: one index per position."""
        return c.view(c.shape[0], -1, *c.shape[3:])

    def _move(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the KV at flat indices src to dst, every layer (logged in `moves` where it is a list: a
        tensor-parallel group's other ranks repeat the copies on their heads, `actors.tp`)."""
        for c in self._tensors():
            f = self.flat(c)
            f[:, dst] = f[:, src]
        if self.moves is not None:
            self.moves.append((dst, src))

    def where(self, slot: int, positions) -> torch.Tensor:
        """The flat indices of a slot's positions (a list or an int64 tensor, on the cache's device)."""
        bs = self.block_size
        tab = torch.tensor(self.tables[slot], device=self.k.device)
        p = positions if isinstance(positions, torch.Tensor) else torch.tensor(positions, device=self.k.device)
        return tab[p // bs] * bs + p % bs

    def read(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's first n positions, keys and values, as [layers, n, Hkv, D] copies."""
        at = self.where(slot, list(range(n)))
        return self.flat(self.k)[:, at], self.flat(self.v)[:, at]

    # ---- what the engine does with a slot -----------------------------------------------------
    def truncate(self, slot: int, length: int) -> None:
        """Roll a slot back to its first `length` positions (no recompute, no copy)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length
        self.trim(slot)

    def compact(self, slot: int, start: int, src: list[int]) -> None:
        """Move the KV at positions start + src[i] to start + i, for every layer: the accepted
        path of a token tree becomes contiguous (no recompute)."""
        if src == list(range(len(src))):
            return
        self._move(self.where(slot, list(range(start, start + len(src)))), self.where(slot, [start + i for i in src]))

    def _share(self, src: int, dst: int, n: int) -> None:
        """Slot dst (emptied) holds src's first n positions by sharing the blocks they lie in."""
        self.truncate(dst, 0)
        shared = self.tables[src][:self.blocks(n)]
        for b in shared:
            self.refs[b] += 1
        self.tables[dst] = list(shared)
        self.lengths[dst] = n

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Slot dst becomes src's first n positions (prefix caching): shared blocks, no copy."""
        self._share(src, dst, n)

    def fork(self, src: int, dst: int, prefix: int, tail: list[int]) -> None:
        """A beam that splits: slot dst becomes src's first `prefix` positions (shared blocks)
        followed by a copy of src's positions prefix + tail[i]."""
        self._share(src, dst, prefix)
        if tail:
            self.reserve(dst, prefix + len(tail))
            self._move(self.where(dst, list(range(prefix, prefix + len(tail)))), self.where(src, [prefix + t for t in tail]))
            self.lengths[dst] = prefix + len(tail)
        self.forked_positions += len(tail)

    def free(self, slot: int) -> None:
        self.truncate(slot, 0)
