"""Kernels whose result for a row does not depend on the pass around it (issue "lossless means
identical"): the single-token pass and every wider pass (a chain of drafts, a token tree, a batch,
a prefill chunk) compute a row's logits and the KV it writes with the same bits.

Owns three things:
  attention   over the runner's slotted KV cache: a C++ kernel (`attention.cpp`, built once per
              machine with `torch.utils.cpp_extension` into the specd cache) that reduces each query
              row over its visible keys in one fixed order (its `attend_rope`: with RoPE and the KV
              write of a fused qkv in the same call, what the block kernel's layer loop calls); where it cannot run (no compiler,
              `SPECD_DISABLE=attn-kernel`, a GPU's cache), `attention_per_row`: one SDPA call per query row
              over exactly its visible keys, gathered, which is row-invariant by construction (the
              same call, on the same inputs, for every width) but slow for wide passes.
  the block   matmul of GGUF Q4_1 / Q8_0 blocks (`blocks.cpp`, `pack`, `native.BlockWeight`): Q8
  kernel      activations, the same kernel at every width, each row's reduction in one order on every
              ISA path (`isa_path`: AMX after `amx_runs`' trial, AVX-512 VNNI, AVX2, scalar; SPECD_ISA
              forces a lower one); built for the baseline ISA with each path behind a target attribute.
  row plans   for matmuls (`probe_plan`, `RowPlan`): a linear kernel whose rows depend on how many
              rows a call has (MKL's fp32 GEMV against its GEMM; oneDNN's bf16 past 32 rows on an AMX
              Xeon) is probed once per kind of weight at load, on a loaded weight, and then called over
              chunks of at most `chunk` rows, each padded to `pad` rows where fixed-shape calls are
              what agree. The probe compares every row of calls of 1..64 rows with the same row run
              alone on one thread, bitwise.

Does not know: models, requests, or whether exactness is asked for (the runner's `exact`).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger("specd")
SOURCE = Path(__file__).with_name("attention.cpp")
BLOCKS_SOURCE = Path(__file__).with_name("blocks.cpp")
ISA_ENV = "SPECD_ISA"
ISAS = ("scalar", "avx2", "avx512", "amx")  # the block kernel's paths, by rank (blocks.cpp)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


# at::parallel_for is header code: without OpenMP in the extension's own build it runs one thread
_OPENMP = ["-fopenmp"] if torch.backends.openmp.is_available() else []


_BUILD_DIRS: dict[str, Path] = {}  # extension name -> where it was built (AMX's trial marker sits there)


def build_tag(name: str) -> str:
    """The build key of extension `name` (its source, torch and the CPU's flags), once it was built."""
    return _BUILD_DIRS[name].name if name in _BUILD_DIRS else ""


def _build(name: str, source: Path, flags: list[str]):
    """`source` compiled by `torch.utils.cpp_extension` into the specd cache, keyed by the source,
    torch's version and this CPU's flags (a build for one CPU's ISA never runs on another that
    shares the cache); None where it cannot be built, why logged once."""
    from ..models import cache_dir

    tag = hashlib.sha256(source.read_bytes() + torch.__version__.encode() + _cpu_flags().encode()
                         + " ".join(flags).encode()).hexdigest()[:12]
    build = cache_dir() / "kernels" / tag
    build.mkdir(parents=True, exist_ok=True)
    _BUILD_DIRS[name] = build
    try:
        from torch.utils import cpp_extension

        return cpp_extension.load(name=f"specd_{name}_{tag}", sources=[str(source)], extra_cflags=flags,
                                  extra_ldflags=[f for f in flags if f == "-fopenmp"], build_directory=str(build),
                                  verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: the fallback serves
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        log.warning("specd: the %s kernel could not be built (%s); the ATen fallback serves instead "
                    "(same results where exact, slower)", name, msg[:300])
        return None


@functools.cache
def extension():
    """The compiled attention kernel, built on first use (about 30 s on 2 cores, once per machine;
    `specd setup` does it), or None where it cannot be built."""
    flags = ["-O3", "-ffp-contract=fast"] + _OPENMP
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
    return _build("attention", SOURCE, flags)


@functools.cache
def blocks_extension():
    """The compiled GGUF block matmul (`blocks.cpp`), or None where it cannot be built. Built for the
    baseline ISA with each fast path behind a target attribute (so that SPECD_ISA=avx2 runs AVX2
    code only, as an AVX2 machine would), contraction off (the paths agree bit for bit)."""
    return _build("blocks", BLOCKS_SOURCE, ["-O3", "-ffp-contract=off"] + _OPENMP)


_AMX_TRIAL_ENV = "SPECD_AMX_TRIAL"


def isa_path() -> int:
    """The block kernel's ISA path (index into ISAS): the best this CPU runs, or lower where SPECD_ISA
    names one (tests and users emulating an older CPU); naming one the CPU lacks is an error. AMX is
    taken only after a trial in a child process has run it (`amx_runs`)."""
    ext = blocks_extension()
    best = ext.isa() if ext is not None else 0
    if best == ISAS.index("amx") and not amx_runs():
        best = ISAS.index("avx512")
    want = os.environ.get(ISA_ENV, "").strip().lower()
    if not want:
        return best
    if want not in ISAS:
        raise ValueError(f"{ISA_ENV}={want!r}: expected one of {list(ISAS)}")
    if ISAS.index(want) > best:
        raise ValueError(f"{ISA_ENV}={want}: this CPU runs at most {ISAS[best]}")
    return ISAS.index(want)


TILE = 16  # outputs per tile of the block kernel
BLOCK = 32  # inputs per GGUF block


def pack(kind: str, blocks: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF blocks -> the block kernel's tiles (layout in `kernels/blocks.cpp`): weights uint8
    [tiles, K/32 * 256 (Q4_1) or 512 (Q8_0)], scales fp16 bits as int16 [tiles, K/32 * 32 or 16].
    Rows past N (the last tile's padding) are zero weights."""
    q = blocks[0]
    n, k = q.shape
    tiles, nb = -(-n // TILE), k // BLOCK
    pad = tiles * TILE - n

    def padded(t):
        return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t
    q = padded(q)
    scales = [padded(t.to(torch.float16)) for t in blocks[1:]]  # exact: the GGUF stores fp16
    if kind == "Q4_1":
        q = q.to(torch.uint8).view(tiles, TILE, nb, 2, 4, 4)  # tile, lane, block, half, quad, byte
        w = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # [tiles, nb, quad, lane, byte]
    else:
        w = q.view(torch.uint8).view(tiles, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4)
    s = torch.stack([t.view(tiles, TILE, nb) for t in scales], 3).permute(0, 2, 3, 1)  # [tiles, nb, d|m, lane]
    return w.reshape(tiles, -1).contiguous(), s.reshape(tiles, -1).contiguous().view(torch.int16)


def block_matmul(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, kind: str, n: int, path: int) -> torch.Tensor:
    """The block kernel's plain call: x [..., K] @ W^T over `pack`'s tiles."""
    return blocks_extension().matmul(x, w, s, 0 if kind == "Q4_1" else 1, n, path, None, 0.0, None)


def _trial_weights(g: torch.Generator, kind: str, n: int = 40, k: int = 96) -> tuple:
    """Random GGUF blocks of `kind` (tests and trials) and the fp32 weight they hold."""
    nb = k // BLOCK
    d = (torch.rand(n, nb, generator=g) / 8).half().float()
    if kind == "Q4_1":
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        m = -(torch.rand(n, nb, generator=g) / 4).half().float()
        return (q, d, m), q.float() * d.repeat_interleave(BLOCK, -1) + m.repeat_interleave(BLOCK, -1)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return (q, d), q.float() * d.repeat_interleave(BLOCK, -1)


def block_trial() -> None:
    """`cpu.probe("block-kernel")`'s trial: the kernel builds, SPECD_ISA names a path it runs, and a
    small matmul over each block kind is the fp32 one's to Q8 activation rounding."""
    if blocks_extension() is None:
        raise RuntimeError("the block kernel could not be built (see the log)")
    path = isa_path()  # a bad SPECD_ISA is refused here
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=g)
    for kind in ("Q4_1", "Q8_0"):
        blocks, dense = _trial_weights(g, kind)
        got, want = block_matmul(x, *pack(kind, blocks), kind, 40, path), F.linear(x, dense)
        if not torch.allclose(got, want, atol=0.05 * want.abs().max().item()):
            raise RuntimeError(f"{kind}: computed {got.flatten()[:3].tolist()}, expected {want.flatten()[:3].tolist()}")


@functools.cache
def amx_runs() -> bool:
    """Whether the block kernel's AMX path runs here and computes the AVX-512 path's bits: tried once
    per machine in a child process (an illegal instruction there, as llama.cpp's AMX kernels die with
    in some KVM guests, costs the child, not this process), the answer kept beside the build."""
    if os.environ.get(_AMX_TRIAL_ENV):  # the child itself
        return True
    marker = {ok: _BUILD_DIRS["blocks"] / f"amx-{'ok' if ok else 'fails'}" for ok in (True, False)}
    for ok, path in marker.items():
        if path.exists():
            return ok
    import subprocess
    import sys

    code = "from actors.kernels import amx_trial; amx_trial()"
    try:
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, _AMX_TRIAL_ENV: "1"}, timeout=300,
                           capture_output=True, text=True)
        ok = r.returncode == 0
        why = f"exit code {r.returncode}: {r.stderr.strip()[-300:]}"
    except (OSError, subprocess.SubprocessError) as e:
        ok, why = False, str(e)
    if not ok:
        log.warning("specd: the block kernel's AMX path failed its trial (%s); AVX-512 serves instead", why)
    marker[ok].write_text(why if not ok else "")
    return ok


def amx_trial() -> None:
    """`amx_runs`'s child: AMX against AVX-512 on both block kinds, bitwise; exits 3 where they differ."""
    import sys

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g)
    for kind in ("Q4_1", "Q8_0"):
        w, s = pack(kind, _trial_weights(g, kind)[0])
        amx = block_matmul(x, w, s, kind, 40, ISAS.index("amx"))
        if not torch.equal(amx, block_matmul(x, w, s, kind, 40, ISAS.index("avx512"))):
            sys.exit(3)


def attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, mask: torch.Tensor | None,
              lo: int, end: int, scale: float, softcap: float | None = None, compiled: bool = True,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Each query row over its visible keys, in one order at every width.
    q [B, T, H, D]; kc, vc [N, bs, Hkv, D] (one layer's cache of N blocks, `actors.kv`); table int64 [B, P]:
    row b's position p in block table[b, p // bs]; mask bool [B, T, end - lo] or None (every key in [lo, end)
    visible); compiled: whether the kernel may run (the caller's `cpu.available("attn-kernel")`); sinks [H]:
    gpt-oss's sink logits (per row, not in the kernel). Returns [B, T, H * D] in kc's dtype."""
    q = q.to(kc.dtype)
    if compiled and kc.device.type == "cpu" and kc.dtype == torch.float32 and sinks is None:
        m = torch.empty(0, dtype=torch.bool) if mask is None else mask.contiguous()
        return extension().attend(q, kc, vc, table, m, lo, end, scale, softcap or 0.0)
    return attention_per_row(q, kc, vc, table, mask, lo, end, scale, softcap, sinks)


@functools.cache
def attend_rope_address() -> int:
    """Where the attention kernel's `attend_rope` lives, for the block kernel's layer loop to call it."""
    return extension().attend_rope_address()


def attention_per_row(q, kc, vc, table, mask, lo, end, scale, softcap=None, sinks=None) -> torch.Tensor:
    """`attention` as one SDPA call per query row over exactly its visible keys, gathered into a
    fresh [1, Hkv, n, D] block: the same call (shapes, strides, values) for a row at every width.
    (Gemma2's soft-capped scores and gpt-oss's sinks: the eager softmax over them, also per row.)"""
    B, T, H, D = q.shape
    bs, Hkv = kc.shape[1], kc.shape[2]
    kf, vf = kc.view(-1, Hkv, D), vc.view(-1, Hkv, D)  # one row per (block, offset)
    out = q.new_empty(B, T, H * D)
    keys = torch.arange(lo, end, device=kc.device)
    at = table[:, keys // bs] * bs + keys % bs  # [B, end - lo]: where each row's keys are
    for b in range(B):
        for t in range(T):
            idx = at[b] if mask is None else at[b][mask[b, t]]
            k = kf.index_select(0, idx).transpose(0, 1)[None]  # [1, Hkv, n, D]
            v = vf.index_select(0, idx).transpose(0, 1)[None]
            qr = q[b, t][None, :, None, :]  # [1, H, 1, D]
            if sinks is not None:
                s = torch.matmul(qr.reshape(1, Hkv, H // Hkv, D), k.transpose(2, 3)) * scale
                s = torch.cat([s, sinks.to(s.dtype).view(1, Hkv, H // Hkv, 1)], dim=-1)
                p = torch.softmax(s - s.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
                a = torch.matmul(p, v)
            elif softcap:
                s = torch.matmul(qr.reshape(1, Hkv, H // Hkv, D), k.transpose(2, 3)) * scale
                p = torch.softmax(torch.tanh(s / softcap) * softcap, dim=-1, dtype=torch.float32).to(q.dtype)
                a = torch.matmul(p, v)
            else:
                a = F.scaled_dot_product_attention(qr, k, v, scale=scale, enable_gqa=Hkv != H)
            out[b, t] = a.reshape(H * D)
    return out


def trial() -> None:
    """`cpu.probe("attn-kernel")`'s trial: the kernel builds, and computes attention (checked against
    SDPA to fp32 rounding, with a mask)."""
    ext = extension()
    if ext is None:
        raise RuntimeError("the attention kernel could not be built (see the log)")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 16, generator=g)
    kc, vc = torch.randn(5, 4, 2, 16, generator=g), torch.randn(5, 4, 2, 16, generator=g)  # blocks of 4 positions
    table = torch.tensor([[3, 0], [1, 4]])
    mask = torch.rand(2, 3, 6, generator=g) > 0.3
    mask[..., 0] = True
    got = ext.attend(q, kc, vc, table, mask, 1, 7, 0.25, 0.0)
    want = attention_per_row(q, kc, vc, table, mask, 1, 7, 0.25)
    if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
        raise RuntimeError(f"computed {got.flatten()[:3].tolist()}, expected {want.flatten()[:3].tolist()}")


@dataclass(frozen=True)
class RowPlan:
    """How a linear kernel is called so that each row's result is the one it gets alone: over chunks
    of at most `chunk` rows, each padded to `pad` rows (0: not padded)."""
    chunk: int
    pad: int = 0
    why: str = ""

    @property
    def cheap(self) -> bool:
        """Whether the plan costs little: a row-by-row plan re-reads the weight for every row."""
        return self.chunk >= 8

    def label(self) -> str:
        if self.chunk >= UNBOUNDED:
            return "any rows"
        return f"rows<={self.chunk}" + (f" padded to {self.pad}" if self.pad else "")


PROBE_ROWS = 64
UNBOUNDED = 1 << 30


def probe_plan(fn, k: int, dtype: torch.dtype, device) -> RowPlan:
    """The plan for the kernel `fn(x [M, k]) -> [M, N]`, found by trial: the largest chunk c (all
    of 2..PROBE_ROWS, else 32, 16, 8) such that every call of 1..c rows gives each row the
    bits it gets alone on one thread (so that a replica running one torch thread and a process
    running several compute alike); failing that, calls of a fixed 8 or 4 rows (padded), where every
    row agrees with the same row padded alone on one thread; failing that, unpadded chunks of 4 or 2
    where those agreed, else one row per call."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(PROBE_ROWS * 2, k, generator=g).to(dtype=dtype, device=device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference: each row alone on one thread (a served replica's count)
    try:
        alone = torch.cat([fn(x[i:i + 1]) for i in range(PROBE_ROWS)])
    finally:
        torch.set_num_threads(threads)

    def agrees(m: int) -> bool:
        return torch.equal(fn(x[:m]), alone[:m])

    sizes = [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64]
    bad = next((m for m in sizes if not agrees(m)), None)
    if bad == 1:
        bad = 2  # a row alone differs between thread counts: no plan of unpadded calls agrees
    if bad is None:
        big = fn(x)  # 128 rows: a kernel that agrees up to 64 is trusted with longer chunks too
        if torch.equal(big[:PROBE_ROWS], alone):
            return RowPlan(UNBOUNDED, 0, "every width agrees")
        return RowPlan(PROBE_ROWS, 0, "agrees up to 64 rows")
    fits = [m for m in sizes if m < bad]
    c = 1 << int(math.log2(fits[-1])) if fits and fits[-1] >= 2 else 1
    if c >= 8:
        return RowPlan(c, 0, f"rows of a {bad}-row call differ from the row alone")
    # Short unpadded chunks agreed on the probe's rows only; fixed-size calls agree by construction
    # (the same call shape for every row), so they come first (seen: a 2-row per-head matmul that the
    # probe passed rounding a real row otherwise than the row alone).
    for pad in (8, 4):
        torch.set_num_threads(1)
        try:
            padded = torch.cat([fn(F.pad(x[i:i + 1], (0, 0, 0, pad - 1)))[:1] for i in range(pad * 2)])
        finally:
            torch.set_num_threads(threads)
        if all(torch.equal(fn(x[j:j + pad]), padded[j:j + pad]) for j in (0, pad)):
            return RowPlan(pad, pad, f"rows depend on the call's rows ({bad} differ); fixed {pad}-row calls agree")
    if c >= 2:
        return RowPlan(c, 0, f"rows of a {bad}-row call differ from the row alone; padded calls too")
    return RowPlan(1, 0, "rows depend on the call's rows at every width")


def apply_plan(fn, x: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """fn over x [..., K] called as `plan` says."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if m <= plan.chunk and not plan.pad:
        return fn(x)
    x2 = x.reshape(m, k)
    outs = []
    for i in range(0, m, plan.chunk):
        c = x2[i:i + plan.chunk]
        n = c.shape[0]
        outs.append(fn(F.pad(c, (0, 0, 0, plan.pad - n)))[:n] if plan.pad > n else fn(c))
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
    return y.view(*x.shape[:-1], y.shape[-1])


