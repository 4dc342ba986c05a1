"""Int8 quantization of the fast runner's weights, through torchao.

Owns: the quantization modes a target or a draft may run in, and applying one to a
`LlamaRunner` (and to an EAGLE head's input projection). The runner keeps calling
`F.linear(x, w)`; torchao's quantized tensor subclasses take over that call, so the
decoder math in `llama.py` does not change.

Modes (the same names for a target and a draft):
  "none"          the weights as loaded (bf16 or fp32)
  "int8-weight"   weight-only int8, per output channel, symmetric: every projection and the
                  LM head (torchao `Int8WeightOnlyConfig`); activations stay in the model dtype
  "int8-dynamic"  int8 weights and int8 activations quantized per token at run time
                  (`Int8DynamicActivationInt8WeightConfig`): integer matmuls
  "mixed"         int8 weight-only MLP projections; attention projections and the LM head
                  stay in the model dtype (the MLP holds ~2/3 of a layer's weights)

A quantized *target* changes the output: it is lossy, never chosen by `dtype: auto`, and
measured by `specd quant` (greedy agreement with the unquantized target, NLL under it). A
quantized *draft* keeps the output exact under the lossless rule: the target still decides
every token; only acceptance can move.

Does not know: models, requests, sampling.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from .schema import QUANT_MODES as MODES

_ATTN, _MLP = ("wqkv", "wo"), ("w_gate_up", "w_down")


def check_mode(mode: str, what: str = "quant") -> str:
    if mode not in MODES:
        raise ValueError(f"{what} must be one of {list(MODES)}, got {mode!r}")
    return mode


def _torchao():
    """torchao.quantization, imported quietly: at import torchao logs a warning for each optional
    CUDA or MX kernel library it cannot load (all of them on a CPU build), and registers an enum
    that torch's pytree warns about; neither matters here."""
    import logging

    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.quantization as tq
            import torchao.quantization.qat  # noqa: F401
    finally:
        for lg, lvl in zip(quiet, levels):
            lg.setLevel(lvl)
    return tq


def quantize_weight(w: torch.Tensor, mode: str) -> torch.Tensor:
    """w [out, in] -> a torchao tensor that `F.linear(x, ·)` runs in `mode` (a new tensor; `w`
    itself is untouched, so weights shared with another runner stay as they were)."""
    tq = _torchao()
    config = tq.Int8DynamicActivationInt8WeightConfig() if mode == "int8-dynamic" else tq.Int8WeightOnlyConfig()
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    tq.quantize_(lin, config)
    return lin.weight.detach()


def quantize_runner(runner, mode: str):
    """Quantize a `LlamaRunner`'s projections (and, in full modes, its LM head) in place; the
    embedding, norms and KV cache are left alone. Returns the runner, with `.quant` set."""
    check_mode(mode)
    if mode == "none":
        return runner
    if any(layer.moe is not None for layer in runner.layers):
        raise ValueError(f"quant {mode!r}: the experts of a mixture-of-experts model are not quantized by specd "
                         f"(quant: none serves it)")
    names = _MLP if mode == "mixed" else _ATTN + _MLP
    for layer in runner.layers:
        for name in names:
            setattr(layer, name, quantize_weight(getattr(layer, name), mode))
    if mode != "mixed":
        runner.lm_head = quantize_weight(runner.lm_head, mode)
    runner.quant = mode
    return runner


def quantize_drafter(drafter, mode: str):
    """A model-backed drafter (truncated, separate model, EAGLE head) in `mode`; an n-gram
    drafter has no weights and is returned as is. A truncated draft gets its own quantized
    copies of the layers it shares with the target, so the target stays as configured."""
    check_mode(mode, "draft quant")
    runner = getattr(drafter, "runner", None)
    if mode == "none" or runner is None:
        return drafter
    quantize_runner(runner, mode)
    if mode != "mixed":  # an EAGLE head's input projection [E, 2E] and layer fusion [E, F E]
        for name in ("fc", "fuse"):
            if getattr(drafter, name, None) is not None:
                setattr(drafter, name, quantize_weight(getattr(drafter, name), mode))
    return drafter


# ---- quantization-aware training (`specd distill --qat`) -------------------------------------------
def prepare_qat(module: nn.Module, mode: str) -> nn.Module:
    """Fake-quantize, in place, the trainable linears of `module` as `mode` will run them
    (torchao QAT): training then sees the int8 rounding and learns around it. In "mixed" mode
    only MLP projections. Frozen linears (a draft's borrowed LM head) stay as they are."""
    check_mode(mode)
    if mode == "none":
        return module
    tq = _torchao()
    weight = tq.qat.IntxFakeQuantizeConfig(torch.int8, "per_channel")  # the grid quantize_weight uses
    act = tq.qat.IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False) \
        if mode == "int8-dynamic" else None
    mlp = ("gate_proj", "up_proj", "down_proj")

    def wanted(m: nn.Module, name: str) -> bool:
        return (isinstance(m, nn.Linear) and m.weight.requires_grad
                and (mode != "mixed" or name.rsplit(".", 1)[-1] in mlp))
    tq.quantize_(module, tq.qat.QATConfig(activation_config=act, weight_config=weight, step="prepare"),
                 filter_fn=wanted)
    return module


def convert_qat(module: nn.Module) -> nn.Module:
    """Drop the fake quantizers after QAT: plain linears holding the trained weights (quantized
    for real when the draft loads, by `quantize_drafter`)."""
    tq = _torchao()
    tq.quantize_(module, tq.qat.QATConfig(step="convert"))
    return module
