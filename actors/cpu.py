"""Which optional CPU fast paths this process can run: found by trial, never assumed from flags.

Users' CPUs differ (an AMX Xeon, an AVX-512-BF16 EPYC, an AVX2-only EPYC), and so do the
machines the project is developed and tested on. Each optional path is tried once per process
on a tiny tensor before anything chooses it:

  bf16          a bf16 matmul at all (every CPU torch supports runs one; without native bf16
                it is slow, which the dtype calibration then measures)
  prepack-bf16  bf16 weights in oneDNN's prepacked layout (`LlamaRunner.prepack`). ATen gates it
                and the oneDNN route of plain bf16 matmuls on one CPU check (AVX-512 BW/VL/DQ or
                AVX-NE-CONVERT), so where it fails, bf16 matmuls do not run per-shape cached
                oneDNN kernels either and `llama.linear` does not bucket their rows
  prepack-fp32  fp32 weights in oneDNN's prepacked layout (fp32 matmuls otherwise go to MKL)
  int4pack      ATen's CPU int4 matmul over bf16 activations (`_weight_int4pack_mm_for_cpu`), what
                a GGUF-born model's native weights run in (`native.py`)
  block-kernel  the compiled GGUF block matmul (`kernels/blocks.cpp`, Q8 activations x Q4_1/Q8_0
                blocks, flat in width and row-invariant), what native weights run in where it builds;
                without it they run in ATen's int4 kernel (int4pack). Its ISA path (AVX-512 VNNI,
                AVX2, scalar) is the best the CPU runs unless SPECD_ISA names a lower one
  attn-kernel   the row-invariant attention kernel (`kernels/attention.cpp`), built with the machine's
                compiler on first use; without it exact passes run one SDPA call per query row

A path whose trial raises (or computes something else) is never chosen by "auto"; an explicit
setting that needs it fails at load with `require`'s message, naming what the CPU lacks and
what to set instead.

`SPECD_DISABLE` forces trials to fail, so that a developer on an AMX Xeon runs the code paths of
an AVX2 machine: a comma-separated list of the names above, or "all" for every fast path
(prepack-bf16, prepack-fp32, int4pack, block-kernel and attn-kernel; bf16 itself only by name, since every CPU runs it). Forcing
prepack-bf16 off also switches off ATen's oneDNN route for bf16 matmuls
(`torch.backends.mkldnn.enabled`), as that CPU check would. `reset()` re-reads the variable
(tests set it through a fixture).

Does not know: models, dtypes' speed (calibrate.py measures that) or GPUs (the paths are CPU-only).
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger("specd")

DISABLE_ENV = "SPECD_DISABLE"
PATHS = {
    "bf16": "bf16 matmuls",
    "prepack-bf16": "oneDNN's prepacked bf16 layout (and bf16 matmuls through oneDNN)",
    "prepack-fp32": "oneDNN's prepacked fp32 layout",
    "int4pack": "ATen's int4 CPU matmul (native GGUF weights)",
    "block-kernel": "the compiled GGUF block matmul (native weights, flat in width)",
    "attn-kernel": "the compiled row-invariant attention kernel",
}
FAST_PATHS = ("prepack-bf16", "prepack-fp32", "int4pack", "block-kernel", "attn-kernel")  # what SPECD_DISABLE=all forces off
_MKLDNN_DEFAULT = torch.backends.mkldnn.enabled


@dataclass(frozen=True)
class Probe:
    name: str
    ok: bool
    reason: str = ""  # why not, when not ok: the trial's error, or the variable that forced it off


def forced_off() -> set[str]:
    """The paths SPECD_DISABLE names (unknown names are refused: a typo would test nothing)."""
    raw = {s.strip() for s in os.environ.get(DISABLE_ENV, "").split(",") if s.strip()}
    unknown = raw - set(PATHS) - {"all"}
    if unknown:
        raise ValueError(f"{DISABLE_ENV}: unknown path(s) {sorted(unknown)}; known: {sorted(PATHS)} or 'all'")
    return (raw - {"all"}) | (set(FAST_PATHS) if "all" in raw else set())


@functools.cache
def probe(name: str) -> Probe:
    """The path's trial, once per process (until `reset`)."""
    if name not in PATHS:
        raise KeyError(name)
    if name in forced_off():
        return Probe(name, False, f"forced off by {DISABLE_ENV}={os.environ.get(DISABLE_ENV)}")
    try:
        _TRIALS[name]()
    except Exception as e:  # noqa: BLE001 - any failure means the path is not to be chosen
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return Probe(name, False, msg)
    return Probe(name, True)


def available(name: str) -> bool:
    return probe(name).ok


def probes() -> dict[str, Probe]:
    """Every path's trial (what `engine.info["cpu_paths"]` and GetStats report)."""
    return {name: probe(name) for name in PATHS}


def unavailable_line() -> str:
    """One line naming each path this process cannot use, and why ('' when all run); logged once
    per process (and after each `reset`) the first time it is asked for."""
    line = "; ".join(f"{p.name} ({p.reason})" for p in probes().values() if not p.ok)
    if line and line not in _LOGGED:
        _LOGGED.add(line)
        log.warning("specd: CPU paths unavailable here, never chosen by 'auto': %s", line)
    return line


_LOGGED: set[str] = set()


@functools.cache
def onednn_bf16() -> bool:
    """Whether a plain bf16 matmul runs a per-shape cached oneDNN kernel here (see module doc)."""
    return available("prepack-bf16") and torch.backends.mkldnn.enabled


def require(name: str, setting: str, instead: str) -> None:
    """Raise at load when an explicit `setting` needs a path this CPU cannot run: the message names
    the path, the trial's error, the CPU's flags and what to set `instead`."""
    p = probe(name)
    if p.ok:
        return
    from .hardware import hardware, hardware_line

    raise ValueError(f"{setting} needs {PATHS[name]}, which this CPU cannot run: {p.reason}. "
                     f"This CPU: {hardware_line(hardware('cpu'))}. Set {instead} instead.")


def reset() -> None:
    """Re-read SPECD_DISABLE and forget earlier trials (tests; the next `probe` tries again)."""
    probe.cache_clear()
    onednn_bf16.cache_clear()
    _LOGGED.clear()
    torch.backends.mkldnn.enabled = _MKLDNN_DEFAULT and "prepack-bf16" not in forced_off()


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    if not torch.allclose(a.float(), b.float(), atol=tol, rtol=tol):
        raise RuntimeError(f"computed {a.float().flatten()[:3].tolist()}, expected {b.float().flatten()[:3].tolist()}")


def _tiny() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 32, generator=g), torch.randn(16, 32, generator=g)  # x [M, K], w [N, K]


def _trial_bf16() -> None:
    x, w = _tiny()
    _close(F.linear(x.bfloat16(), w.bfloat16()), F.linear(x, w), 0.1)


def _trial_prepack(dtype: torch.dtype) -> None:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        raise RuntimeError("this torch build has no oneDNN (mkldnn) linear")
    x, w = (t.to(dtype) for t in _tiny())
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    _close(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), F.linear(x, w), 0.1)


def _trial_int4pack() -> None:
    x, w = _tiny()
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, w.shape, generator=g, dtype=torch.int32)
    scale, zero = torch.rand(w.shape[0], 1, generator=g) / 8, -torch.rand(w.shape[0], 1, generator=g)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16()  # one group of 32: K
    got = torch._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, sz)
    _close(got, F.linear(x, (q - 8) * scale + zero), 0.1)


def _trial_block_kernel() -> None:
    from .kernels import block_trial

    block_trial()


def _trial_attn_kernel() -> None:
    from .kernels import trial

    trial()


_TRIALS = {"bf16": _trial_bf16,
           "prepack-bf16": lambda: _trial_prepack(torch.bfloat16),
           "prepack-fp32": lambda: _trial_prepack(torch.float32),
           "int4pack": _trial_int4pack,
           "block-kernel": _trial_block_kernel,
           "attn-kernel": _trial_attn_kernel}

reset()
