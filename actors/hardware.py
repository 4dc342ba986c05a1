"""What this process computes on: the GPU's name, or the CPU model and its matmul flags, the torch
version and intra-op threads. Every measured figure (pass costs, tuner profiles, benchmarks) is
keyed by or printed with it.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma")


def hardware(device: str | torch.device = "cpu") -> dict:
    """What this process computes on: the GPU's name, or the CPU model and its matmul flags,
    plus the torch version and intra-op threads (both change pass costs), and the instruction
    sets ATen's and oneDNN's kernels are held to where a variable lowered them (`_isa`)."""
    dev = torch.device(device)
    info = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if dev.type == "cuda":
        return {**info, "device": "cuda", "name": torch.cuda.get_device_name(dev)}
    name, flags, ident = platform.processor() or "cpu", set(), {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key, val = key.strip(), val.strip()
            if key == "model name" and name in ("cpu", platform.processor()):
                name = val
            elif key in ("cpu family", "model", "stepping") and key not in ident:
                ident[key] = val
            elif key == "flags" and not flags:
                flags = set(val.split())
    except OSError:  # not Linux: the model name alone
        pass
    return {**info, "device": "cpu", "name": name, **{k.replace(" ", "_"): v for k, v in ident.items()},
            "flags": [f for f in FLAGS if f in flags], "cores": os.cpu_count(), **_isa()}


def _isa() -> dict:
    """The instruction sets ATen's and oneDNN's CPU kernels are held to, where a variable lowers
    them below the CPU's best (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA: an AVX-512 machine running
    an AVX2 CPU's kernels); {} when neither is set, so other fingerprints stay as they were."""
    out = {}
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        out["aten_isa"] = torch.backends.cpu.get_cpu_capability()
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        out["onednn_isa"] = os.environ["ONEDNN_MAX_CPU_ISA"]
    return out


def hardware_line(hw: dict) -> str:
    """One line for logs and GetStats: 'AMD EPYC (avx2, fma), 2 cores, 1 thread'."""
    if not hw:
        return ""
    if hw.get("device") == "cuda":
        return f"{hw['name']} (cuda), torch {hw['torch']}"
    return (f"{hw.get('name', 'cpu')} ({', '.join(hw.get('flags', [])) or 'no avx2'}), {hw.get('cores')} cores, "
            f"{hw.get('threads')} thread{'s' if hw.get('threads', 1) != 1 else ''}, torch {hw.get('torch')}"
            + "".join(f", {k.split('_')[0]} kernels held to {hw[k]}" for k in ("aten_isa", "onednn_isa") if hw.get(k)))
