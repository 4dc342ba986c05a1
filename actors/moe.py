"""Mixture-of-experts MLPs for the fast runner: routing, and expert compute grouped by expert.

Owns: a sparse MLP block's weights, taken from the Hugging Face module (views of its 3-D expert
tensors, so a truncated self-draft and the HF model share them), and its forward over the rows of
one pass. The families, each checked against its own `transformers` modeling file
(tests/unit/test_families.py):
  mixtral     softmax over the experts in fp32, top-k, always renormalised; the weights stay fp32
              and scale each expert's output before it is cast back to the model's dtype
  qwen2_moe   the same softmax and top-k, renormalised where `norm_topk_prob` says, the weights cast
              to the model's dtype; plus a shared expert (a dense MLP) scaled by sigmoid(its gate)
  qwen3_moe   as qwen2_moe, without the shared expert
Dense layers among sparse ones (`mlp_only_layers`, `decoder_sparse_step`) are plain MLPs.

Grouped compute: a pass's B×T rows are routed, the (row, expert) pairs sorted by expert, and each
expert that any row chose runs once over all its rows (two matmuls, gate/up and down), not a loop
per token. Each expert's scaled output is added into its rows in expert order, so a row's sum is
taken in the same order whatever else the pass holds (with the runner's exact linears, a row's
bits do not depend on the width of the pass: the issue's row invariance, for MoE too).

Does not know: attention, caches, requests or speculation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MOE_TYPES = {"mixtral", "qwen2_moe", "qwen3_moe"}


@dataclass
class MoE:
    router: torch.Tensor  # [N, E]: one logit per expert
    gate_up: list[torch.Tensor]  # N × [2I, E]: [gate; up], views of HF's experts.gate_up_proj
    down: list[torch.Tensor]  # N × [E, I]
    top_k: int
    renormalise: bool  # divide the top-k probabilities by their sum
    weights_fp32: bool  # Mixtral scales by the fp32 weights; Qwen casts them to the model's dtype first
    # [2Is + 1, E]: Qwen2-MoE's shared expert [gate; up] and its sigmoid gate's row, in one matmul (a
    # one-row weight alone gets no row-invariant plan from MKL's fp32 kernels)
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None  # [E, Is]
    active: int = 0  # experts the last call ran (what the MoE bench reports)

    @classmethod
    def from_hf(cls, mlp, model_type: str, fuse) -> "MoE":
        """The sparse block `mlp` of a `model_type` layer; fuse(owner, attr, linears): the runner's
        `_fused` (the shared expert's gate, up and gate row as one weight, shared with the HF module)."""
        experts, gate = mlp.experts, mlp.gate
        if getattr(experts, "has_bias", False) or getattr(gate, "bias", None) is not None:
            raise ValueError(f"{model_type}: expert or router biases are not served by the fast runner")
        n = experts.gate_up_proj.shape[0]
        shared = getattr(mlp, "shared_expert", None)
        return cls(
            router=gate.weight.detach(),
            gate_up=[experts.gate_up_proj.detach()[e] for e in range(n)],
            down=[experts.down_proj.detach()[e] for e in range(n)],
            top_k=int(gate.top_k),
            renormalise=model_type == "mixtral" or bool(gate.norm_topk_prob),
            weights_fp32=model_type == "mixtral",
            shared_gate_up=None if shared is None else fuse(mlp, "weight", [shared.gate_proj, shared.up_proj,
                                                                           mlp.shared_expert_gate]),
            shared_down=None if shared is None else shared.down_proj.weight.detach(),
        )

    def weights(self) -> list[tuple]:
        """Every (weight, bias) this block multiplies by."""
        out = [(self.router, None), *((w, None) for w in self.gate_up), *((w, None) for w in self.down)]
        if self.shared_gate_up is not None:
            out += [(self.shared_gate_up, None), (self.shared_down, None)]
        return out

    def route(self, x: torch.Tensor, linear) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, E] -> (weights [M, k], experts int64 [M, k]) as HF's router computes them."""
        probs = F.softmax(linear(x, self.router), dim=-1, dtype=torch.float32)  # [M, N]
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return (top_w if self.weights_fp32 else top_w.to(x.dtype)), top_i

    def __call__(self, h: torch.Tensor, linear, act) -> torch.Tensor:
        """h [..., E] (after the MLP norm) -> the block's output [..., E]. linear(x, w): the runner's
        (its row plans where it is exact); act: the experts' activation."""
        shape, x = h.shape, h.reshape(-1, h.shape[-1])
        top_w, top_i = self.route(x, linear)
        k = self.top_k
        flat = top_i.reshape(-1)  # [M k]: pair j is row j // k's choice j % k
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, rows ascending in each
        counts = torch.bincount(flat, minlength=len(self.gate_up)).tolist()
        self.active = len(counts) - counts.count(0)
        rows, weights = order // k, top_w.reshape(-1)[order]
        out = torch.zeros_like(x)
        lo = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            idx = rows[lo:lo + n]
            gate, up = linear(x[idx], self.gate_up[e]).chunk(2, dim=-1)
            y = linear(act(gate) * up, self.down[e]) * weights[lo:lo + n, None]
            out.index_add_(0, idx, y.to(out.dtype))
            lo += n
        if self.shared_gate_up is not None:
            i = self.shared_down.shape[1]
            gate, up, g = linear(x, self.shared_gate_up).split([i, i, 1], dim=-1)
            out = out + torch.sigmoid(g) * linear(act(gate) * up, self.shared_down)
        return out.view(shape)
