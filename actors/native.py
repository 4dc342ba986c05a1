"""GGUF-born weights kept in their own 4-/8-bit blocks, run by the block kernel (or ATen's int4 kernel).

The embedded SmolLM2 ships as a GGUF: its projections are Q4_1 blocks (32 weights: an fp16 scale d,
an fp16 minimum m, 4-bit q; w = d·q + m), its tied embedding / LM head Q8_0 (32 int8 q with an fp16
scale d; w = d·q). Dequantised to bf16 or fp32 they read 3-8x more bytes per token than the blocks
do. Two kernels run them:
  the block kernel (`BlockWeight`, `kernels/blocks.cpp`): the blocks exactly as stored, repacked into
      tiles of 16 outputs; activations quantized per row to Q8 blocks (int8 and one fp32 scale per
      32, as llama.cpp's dot products do); flat in the number of rows, row-invariant by construction
      and the same bits on every ISA path. A runner whose layers are all plain Llama layers over it
      runs each layer in five fused calls (`LlamaRunner.fuse_blocks`).
  ATen's int4 kernel (`Int4Weight`), where the block kernel cannot build: ATen's CPU int4 layout
      (`torch._convert_weight_to_int4pack_for_cpu`, `torch._weight_int4pack_mm_for_cpu`, what torchao's
      CPU int4 layout is built on) is the same asymmetric group quantization, per group of 32,
      w = (q - 8)·scale + zero; so Q4_1 is one int4 matrix (scale d, zero m + 8d) and Q8_0 two over
      the same activations (q = 16·hi + lo with hi = q >> 4 in [-8, 7] and lo = q & 15: scales 16d and
      d, zeros 0 and 8d). It is fast only with bf16 activations, and then its scales and zeros are
      bf16 too: each group's scale rounded once by at most 2^-9.
Neither is the fp32 dequantisation: `specd quant`'s agreement and NLL measure how far.

The blocks are read from the GGUF with the `gguf` package (what transformers reads GGUF with),
rows permuted as transformers permutes Llama's q/k projections, and every matrix is checked at
load against the weights of the model the runner was built over: the blocks must dequantise to
them exactly (in fp32; rounded to its dtype where that is bf16), so a native runner provably
holds the model's own weights. Native matrices are shared by every runner built over the same model
weights in the process (a truncated self-draft shares the target's): built once, while any holds them.

Does not know: requests, sampling, or which format is faster (build.py measures that at load).
"""
from __future__ import annotations

import functools
import weakref
from pathlib import Path

import numpy as np
import torch

GROUP = 32
_Q4_1_BYTES, _Q8_0_BYTES = 20, 34  # bytes per block of 32 weights


class NativeWeight:
    """A weight held in GGUF-born 4-/8-bit blocks: `self(x, b)` is x @ W^T (+ b). Duck-types the few
    attributes the runner's `linear`, its row plans and warm-up read from a weight tensor."""
    is_mkldnn = False
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError


class BlockWeight(NativeWeight):
    """The GGUF's own blocks (one kind: Q4_1 or Q8_0, possibly several matrices stacked), repacked
    into tiles of 16 outputs for the compiled block kernel (`kernels/blocks.cpp`): activations are
    quantized per row to Q8 blocks and each tile's weights are unpacked once per call for all its
    rows, so the cost is nearly flat in the number of rows, and every row's bits are the same at
    every width, thread count and ISA path. The weight is exactly the GGUF's (fp16 d and m, as
    stored); the activations are rounded to int8 per block of 32, as llama.cpp's dot products do."""

    def __init__(self, kind: str, blocks: tuple, dtype=torch.bfloat16):
        """blocks: Q4_1 (q uint8 [N, K], d, m [N, K/32]) or Q8_0 (q int8 [N, K], d [N, K/32])."""
        from . import kernels

        self.ext = kernels.blocks_extension()
        if self.ext is None:
            raise RuntimeError("the block kernel could not be built")
        self.path = kernels.isa_path()
        n, k = blocks[0].shape
        if k % GROUP:
            raise ValueError(f"in_features {k} is not a multiple of the group size {GROUP}")
        self.shape, self.dtype, self.device = torch.Size((n, k)), dtype, blocks[0].device
        self.kind = kind
        self.code = 0 if kind == "Q4_1" else 1
        self.w, self.s = kernels.pack(kind, blocks)

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None, norm: torch.Tensor | None = None,
                 eps: float = 0.0, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ b); with `norm` (fp32 [K]), RMSNorm(x) @ W^T in the same call; with `residual`
        ([..., N]), residual + x @ W^T, in the residual's dtype."""
        y = self.ext.matmul(x, self.w, self.s, self.code, self.shape[0], self.path, norm, eps, residual)
        return y if b is None else y + b

    def tensors(self) -> list[torch.Tensor]:
        return [self.w, self.s]

    def dequantize(self) -> torch.Tensor:
        """The weight this computes with, [N, K] fp32 (tests): the packed tiles unpacked."""
        from .kernels import TILE

        n, k = self.shape
        tiles, nb = self.w.shape[0], k // GROUP
        s = self.s.view(torch.float16).float().view(tiles, nb, -1, TILE).permute(0, 3, 1, 2).reshape(tiles * TILE, nb, -1)
        if self.kind == "Q4_1":
            b = self.w.view(tiles, nb, 4, TILE, 4).permute(0, 3, 1, 2, 4)  # [tiles, lane, nb, quad, byte]
            q = torch.stack([b & 0xF, b >> 4], 3).reshape(tiles * TILE, k)
            return q4_1_weight(q, s[..., 0], s[..., 1])[0][:n]
        q = self.w.view(tiles, nb, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, k).view(torch.int8)
        return q8_0_weight(q, s[..., 0])[0][:n]


class Int4Weight(NativeWeight):
    """One or more ATen int4 matrices summed over the same input: `self(x)` is x @ W^T (bf16
    activations). The fallback where the block kernel cannot run (`cpu` path "block-kernel")."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dtype=torch.bfloat16):
        """parts: (q int [N, K] in 0..15, scale [N, K/32], zero [N, K/32]) with w = (q - 8)·scale + zero."""
        n, k = parts[0][0].shape
        if k % GROUP:
            raise ValueError(f"in_features {k} is not a multiple of the group size {GROUP}")
        self.shape = torch.Size((n, k))
        self.dtype, self.device = dtype, parts[0][0].device
        self.parts = [(torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2),
                       torch.stack([s, z], -1).transpose(0, 1).contiguous().to(dtype)) for q, s, z in parts]

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.shape[1])
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        packed, sz = self.parts[0]
        y = torch._weight_int4pack_mm_for_cpu(x2, packed, GROUP, sz)
        for packed, sz in self.parts[1:]:
            y.add_(torch._weight_int4pack_mm_for_cpu(x2, packed, GROUP, sz))
        if b is not None:
            y = y + b
        return y.view(*x.shape[:-1], self.shape[0])

    def tensors(self) -> list[torch.Tensor]:
        return [t for part in self.parts for t in part]

    def dequantize(self) -> torch.Tensor:
        """The weight this computes with, [N, K] fp32 (tests)."""
        eye = torch.eye(self.shape[1], dtype=self.dtype)
        return self(eye).float().T.contiguous()


def q4_1_blocks(raw: np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows (uint8 [N, K/32 · 20]) -> q uint8 [N, K], d and m fp32 [N, K/32]: w = d·q + m.
    A block: d fp16, m fp16, 16 bytes whose low nibbles are weights 0..15 and high nibbles 16..31."""
    blocks = torch.from_numpy(np.array(raw)).view(raw.shape[0], k // GROUP, _Q4_1_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    qs = blocks[..., 4:]
    q = torch.cat([qs & 0xF, qs >> 4], -1).reshape(raw.shape[0], k)
    return q, d, m


def q8_0_blocks(raw: np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows (uint8 [N, K/32 · 34]) -> q int8 [N, K], d fp32 [N, K/32]: w = d·q."""
    blocks = torch.from_numpy(np.array(raw)).view(raw.shape[0], k // GROUP, _Q8_0_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(raw.shape[0], k)
    return q, d


def _expand(g: torch.Tensor) -> torch.Tensor:
    return g.repeat_interleave(GROUP, dim=-1)


def q4_1_weight(q, d, m) -> tuple[torch.Tensor, tuple]:
    """(the fp32 weight the blocks hold, the int4 part computing it)."""
    return (q.float() * _expand(d) + _expand(m)), int4_parts("Q4_1", (q, d, m))[0]


def q8_0_weight(q, d) -> tuple[torch.Tensor, list[tuple]]:
    """(the fp32 weight, the two int4 parts whose sum computes it)."""
    return q.float() * _expand(d), int4_parts("Q8_0", (q, d))


def int4_parts(kind: str, blocks: tuple) -> list[tuple]:
    """ATen's int4 (q, scale, zero) parts whose sum computes the blocks: Q4_1 one, Q8_0 two."""
    if kind == "Q4_1":
        q, d, m = blocks
        return [(q, d, m + 8 * d)]
    q, d = blocks
    hi, lo = q.to(torch.int16) >> 4, q.to(torch.int16) & 0xF
    return [(hi + 8, 16 * d, torch.zeros_like(d)), (lo, d, 8 * d)]


def _llama_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """The GGUF row of each HF row of a Llama q or k projection: llama.cpp's converter interleaves
    each head's two rotary halves, and transformers undoes that at load (its reverse permute)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).view(n_head, dim, 2).transpose(1, 2).reshape(n_rows)


class GGUFBlocks:
    """The quantized tensors of one GGUF file, by name: where each lies in the file (`_tensor_index`),
    read through a memory map when asked for."""

    def __init__(self, path: Path):
        self.path = Path(path)
        index = _tensor_index(self.path)
        self.arch = index["arch"]
        self.tensors = index["tensors"]  # name -> [type, K (GGUF shapes are [in, out]), data shape, offset]

    def matrix(self, name: str):
        kind, k, shape, offset = self.tensors[name]
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=offset, shape=tuple(shape))
        if kind == "Q4_1":
            return "Q4_1", q4_1_blocks(raw, k)
        if kind == "Q8_0":
            return "Q8_0", q8_0_blocks(raw, k)
        raise ValueError(f"{self.path.name}: {name} is {kind}; native weights take Q4_1 and Q8_0 blocks")


def _tensor_index(path: Path) -> dict:
    """{"arch": the GGUF's architecture, "tensors": {name: [type, K, data shape, byte offset]}}: parsed
    once with `gguf`, whose reader also decodes every metadata string (the tokenizer's ~50,000 among them:
    ~2 s of every start), then kept in the specd cache, keyed by the file's path, size and mtime."""
    import hashlib
    import json
    import os

    from .models import cache_dir

    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / "gguf-index" / f"{key}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    import gguf

    reader = gguf.GGUFReader(str(path))
    index = {"arch": bytes(reader.fields["general.architecture"].parts[-1]).decode(),
             "tensors": {t.name: [t.tensor_type.name, int(t.shape[0]), list(t.data.shape), int(t.data_offset)]
                         for t in reader.tensors}}
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(index))
    tmp.replace(cached)  # atomic: replicas starting together never read half a file
    return index


_BUILT: "weakref.WeakValueDictionary[tuple, NativeWeight]" = weakref.WeakValueDictionary()


def _native(blocks: GGUFBlocks, names: list[str], rows: list[torch.Tensor | None], expect: torch.Tensor,
            dtype: torch.dtype) -> NativeWeight:
    """The GGUF tensors `names`, rows permuted by `rows` and stacked, as one native weight (the
    block kernel's where it runs here, else ATen's int4); checked exact against `expect` (the
    runner's weight, [N, K], in fp32 or rounded to its dtype)."""
    from . import cpu, kernels

    kernel = cpu.available("block-kernel")
    key = (str(blocks.path), tuple(names), dtype, expect.dtype, expect.data_ptr(), kernel,
           kernel and kernels.isa_path())  # checked against these weights, built for this path
    if key in _BUILT:
        return _BUILT[key]
    dense, raw, kinds = [], [], []
    for name, perm in zip(names, rows):
        kind, b = blocks.matrix(name)
        if perm is not None:
            b = tuple(t[perm] for t in b)
        dense.append(q4_1_weight(*b)[0] if kind == "Q4_1" else q8_0_weight(*b)[0])
        raw.append(b)
        kinds.append(kind)
    if len(set(kinds)) != 1:
        raise ValueError(f"{names}: mixed block types cannot be fused")
    got = torch.cat(dense).to(expect.dtype)
    if got.shape != expect.shape or not torch.equal(got, expect):
        diff = "shape " + str(tuple(got.shape)) if got.shape != expect.shape else \
            f"max |diff| {(got - expect.float()).abs().max().item():.3g}"
        raise ValueError(f"{blocks.path.name}: {'+'.join(names)} does not dequantise to the model's weight ({diff})")
    stacked = tuple(torch.cat(t) for t in zip(*raw))  # the matrices' blocks, one above the other
    if kernel:
        w = BlockWeight(kinds[0], stacked, dtype)
    else:
        w = Int4Weight(int4_parts(kinds[0], stacked), dtype)
    _BUILT[key] = w
    return w


def apply(runner, gguf_path: Path):
    """Give a Llama `LlamaRunner` built over the model dequantised from `gguf_path` native weights
    in place: its four projections per layer and its LM head become native weights (`BlockWeight`s
    where the block kernel runs, its layers then fused; else `Int4Weight`s, bf16 activations).
    Returns the runner, `.native` set."""
    if runner.device.type != "cpu":
        raise ValueError("native weights run on a CPU (the block kernel or ATen's int4 kernel)")
    blocks = _blocks(str(gguf_path))
    if blocks.arch != "llama" or runner.config.model_type != "llama":
        raise ValueError(f"native weights: only Llama GGUFs are mapped, not {blocks.arch!r}")
    H, Hkv, D = runner.n_heads, runner.n_kv, runner.head_dim
    bf16 = torch.bfloat16
    for i, layer in enumerate(runner.layers):
        p = f"blk.{i}."
        layer.wqkv = _native(blocks, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                             [_llama_rows(H * D, H), _llama_rows(Hkv * D, Hkv), None], layer.wqkv, bf16)
        layer.wo = _native(blocks, [p + "attn_output.weight"], [None], layer.wo, bf16)
        layer.w_gate_up = _native(blocks, [p + "ffn_gate.weight", p + "ffn_up.weight"], [None, None],
                                  layer.w_gate_up, bf16)
        layer.w_down = _native(blocks, [p + "ffn_down.weight"], [None], layer.w_down, bf16)
    head = "output.weight" if "output.weight" in blocks.tensors else "token_embd.weight"
    runner.lm_head = _native(blocks, [head], [None], runner.lm_head, bf16)
    runner.native = True
    runner.fuse_blocks()
    return runner


def kernel_label(runner) -> str:
    """Which kernel runs a native runner's weights (calibration keys: each has its own costs): the block
    kernel's ISA path and build, or ATen's int4."""
    w = runner.lm_head
    if isinstance(w, BlockWeight):
        from . import kernels

        return f"blocks:{kernels.ISAS[w.path]}:{kernels.build_tag('blocks')}"
    return "aten-int4"


def runs_here() -> bool:
    """Whether native weights run on this CPU: in the block kernel, or else in ATen's int4 kernel."""
    from . import cpu

    return cpu.available("block-kernel") or cpu.available("int4pack")


@functools.lru_cache(maxsize=2)
def _blocks(path: str) -> GGUFBlocks:
    return GGUFBlocks(Path(path))
