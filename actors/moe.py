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
  deepseek_v3, sigmoid scores; experts chosen by score + a bias correction, within the top
              `topk_group` of `n_group` groups (each group ranked by its two best); weighted by the
  glm4_moe    chosen scores without the bias, renormalised, times `routed_scaling_factor`; the
              router in fp32; shared experts (one dense MLP, no gate) added to the routed output
  gpt_oss     a router with a bias; top-k of its logits, then softmax over those k (in the model's
              dtype); experts with biases, stored transposed with gate and up interleaved (copied
              here as [gate; up] rows: twice the experts' memory while the HF model lives), and a
              clamped SwiGLU: (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g), g = min(gate, limit)
Dense layers among sparse ones (`mlp_only_layers`, `decoder_sparse_step`) are plain MLPs.

Grouped compute: a pass's B×T rows are routed, the (row, expert) pairs sorted by expert, and each
expert that any row chose runs once over all its rows (two matmuls, gate/up and down), not a loop
per token. Each expert's scaled output is added into its rows in expert order, so a row's sum is
taken in the same order whatever else the pass holds: with the runner's exact linears, a row's
bits do not depend on the width of the pass, for MoE layers too.

Does not know: attention, caches, requests or speculation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MOE_TYPES = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"}
GROUPED_SIGMOID_TYPES = {"deepseek_v3", "glm4_moe"}  # DeepSeek-V3's router


@dataclass
class MoE:
    router: torch.Tensor  # [N, E]: one logit per expert
    gate_up: list[torch.Tensor]  # N × [2I, E]: [gate; up], views of HF's experts.gate_up_proj
    down: list[torch.Tensor]  # N × [E, I]
    top_k: int
    renormalise: bool  # divide the top-k probabilities by their sum
    weights_fp32: bool  # Mixtral scales by the fp32 weights; Qwen casts them to the model's dtype first
    # [2Is (+ 1), E]: the shared expert's [gate; up], and Qwen2-MoE's sigmoid gate row, in one matmul (a
    # one-row weight alone gets no row-invariant plan from MKL's fp32 kernels)
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None  # [E, Is]
    shared_gated: bool = False  # the last row of shared_gate_up is a sigmoid gate on the shared expert
    # DeepSeek-V3's routing (scoring "sigmoid"): the bias added to the scores to choose experts, the
    # expert groups and how many of them rows choose from, and the factor on the weights
    scoring: str = "softmax"
    correction: torch.Tensor | None = None  # [N] fp32
    groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0
    # gpt-oss: biases (router [N], experts N × [2I] and N × [E]) and the clamped SwiGLU's alpha and limit
    router_bias: torch.Tensor | None = None
    gate_up_bias: list[torch.Tensor] | None = None
    down_bias: list[torch.Tensor] | None = None
    clamp: tuple[float, float] | None = None
    active: int = 0  # experts the last call ran (what the MoE bench reports)

    @classmethod
    def from_hf(cls, mlp, model_type: str, fuse) -> "MoE":
        """The sparse block `mlp` of a `model_type` layer; fuse(owner, attr, linears): the runner's
        `_fused` (the shared expert's gate, up and gate row as one weight, shared with the HF module)."""
        if model_type == "gpt_oss":
            return cls._from_gpt_oss(mlp)
        experts, gate = mlp.experts, mlp.gate
        if getattr(experts, "has_bias", False) or getattr(gate, "bias", None) is not None:
            raise ValueError(f"{model_type}: expert or router biases are not served by the fast runner")
        n = experts.gate_up_proj.shape[0]
        shared = getattr(mlp, "shared_expert", None) or getattr(mlp, "shared_experts", None)
        shared_gate = getattr(mlp, "shared_expert_gate", None)
        sigmoid = model_type in GROUPED_SIGMOID_TYPES
        if sigmoid and n % gate.num_group:
            raise ValueError(f"{model_type}: {n} experts do not split into n_group {gate.num_group} groups")
        return cls(
            router=gate.weight.detach().float() if sigmoid else gate.weight.detach(),  # HF: an fp32 router
            gate_up=[experts.gate_up_proj.detach()[e] for e in range(n)],
            down=[experts.down_proj.detach()[e] for e in range(n)],
            top_k=int(gate.top_k),
            renormalise=model_type == "mixtral" or bool(gate.norm_topk_prob),
            weights_fp32=model_type == "mixtral" or sigmoid,
            shared_gate_up=None if shared is None else fuse(
                mlp, "weight", [shared.gate_proj, shared.up_proj] + ([shared_gate] if shared_gate is not None else [])),
            shared_down=None if shared is None else shared.down_proj.weight.detach(),
            shared_gated=shared_gate is not None,
            scoring="sigmoid" if sigmoid else "softmax",
            correction=gate.e_score_correction_bias.detach().float() if sigmoid else None,
            groups=int(gate.num_group) if sigmoid else 1,
            topk_groups=int(gate.topk_group) if sigmoid else 1,
            scale=float(gate.routed_scaling_factor) if sigmoid else 1.0,
        )

    @classmethod
    def _from_gpt_oss(cls, mlp) -> "MoE":
        ex, router = mlp.experts, mlp.router
        n = ex.gate_up_proj.shape[0]

        def gate_then_up(t: torch.Tensor) -> torch.Tensor:  # interleaved [g0, u0, g1, u1, ...] -> [g; u]
            return torch.cat([t[0::2], t[1::2]]).contiguous()
        return cls(
            router=router.weight.detach(), router_bias=router.bias.detach(),
            gate_up=[gate_then_up(ex.gate_up_proj.detach()[e].T) for e in range(n)],
            gate_up_bias=[gate_then_up(ex.gate_up_proj_bias.detach()[e]) for e in range(n)],
            down=[ex.down_proj.detach()[e].T.contiguous() for e in range(n)],
            down_bias=[ex.down_proj_bias.detach()[e] for e in range(n)],
            top_k=int(router.top_k), renormalise=False, weights_fp32=False, scoring="topk-softmax",
            clamp=(float(ex.alpha), float(ex.limit)))

    def weights(self) -> list[tuple]:
        """Every (weight, bias) this block multiplies by."""
        out = [(self.router, self.router_bias), *zip(self.gate_up, self.gate_up_bias or [None] * len(self.gate_up)),
               *zip(self.down, self.down_bias or [None] * len(self.down))]
        out = [(w, b) for w, b in out if w is not None]  # (a tensor-parallel rank holds some experts: `keep`)
        if self.shared_gate_up is not None:
            out += [(self.shared_gate_up, None), (self.shared_down, None)]
        return out

    def keep(self, lo: int, hi: int, shared: bool) -> None:
        """Hold experts [lo, hi) only (and the shared expert where `shared`): one rank's part of a
        tensor-parallel target (`actors.tp`), whose outputs the ranks' all-reduce adds up."""
        drop = lambda ts: None if ts is None else [t if lo <= e < hi else None for e, t in enumerate(ts)]  # noqa: E731
        self.gate_up, self.down = drop(self.gate_up), drop(self.down)
        self.gate_up_bias, self.down_bias = drop(self.gate_up_bias), drop(self.down_bias)
        if not shared:
            self.shared_gate_up = self.shared_down = None

    def _glu(self, gate: torch.Tensor, up: torch.Tensor, act) -> torch.Tensor:
        if self.clamp is None:
            return act(gate) * up
        alpha, limit = self.clamp
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))

    def repack(self, pack) -> None:
        """Every weight through pack(w) -> w' (`LlamaRunner.prepack`'s oneDNN layout)."""
        self.router = pack(self.router)
        self.gate_up, self.down = [w if w is None else pack(w) for w in self.gate_up], \
            [w if w is None else pack(w) for w in self.down]
        self.shared_gate_up, self.shared_down = pack(self.shared_gate_up), pack(self.shared_down)

    def route(self, x: torch.Tensor, linear) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, E] -> (weights [M, k], experts int64 [M, k]) as HF's router computes them."""
        if self.scoring == "sigmoid":
            return self._route_grouped(x, linear)
        if self.scoring == "topk-softmax":  # gpt-oss: the k best logits, then their softmax
            top_v, top_i = torch.topk(linear(x, self.router, self.router_bias), self.top_k, dim=-1)
            return F.softmax(top_v, dim=-1, dtype=top_v.dtype), top_i
        probs = F.softmax(linear(x, self.router), dim=-1, dtype=torch.float32)  # [M, N]
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return (top_w if self.weights_fp32 else top_w.to(x.dtype)), top_i

    def _route_grouped(self, x: torch.Tensor, linear) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's router (see the module docstring)."""
        # [M, N] fp32. In fp64, rounded once: ATen's vectorised and scalar sigmoid round differently in
        # fp32, and which one a row meets depends on where it falls in the pass (N experts per row
        # need not fill whole vectors), so fp32 would make a row's routing depend on the pass's width
        scores = linear(x.float(), self.router).double().sigmoid().float()
        choice = scores + self.correction
        if self.groups > 1:
            M, N = choice.shape
            ranked = choice.view(M, self.groups, N // self.groups).topk(2, dim=-1)[0].sum(dim=-1)  # [M, groups]
            keep = torch.zeros_like(ranked, dtype=torch.bool).scatter_(1, ranked.topk(self.topk_groups, dim=-1)[1],
                                                                        True)
            choice = choice.masked_fill(~keep.repeat_interleave(N // self.groups, dim=1), float("-inf"))
        top_i = choice.topk(self.top_k, dim=-1)[1]
        top_w = scores.gather(1, top_i)
        if self.renormalise:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        return top_w * self.scale, top_i

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
            if not n or self.gate_up[e] is None:  # (an expert another tensor-parallel rank holds)
                lo += n
                continue
            idx = rows[lo:lo + n]
            gate, up = linear(x[idx], self.gate_up[e], self.gate_up_bias and self.gate_up_bias[e]).chunk(2, dim=-1)
            y = linear(self._glu(gate, up, act), self.down[e], self.down_bias and self.down_bias[e])
            y = y * weights[lo:lo + n, None]
            out.index_add_(0, idx, y.to(out.dtype))
            lo += n
        if self.shared_gate_up is not None:
            i = self.shared_down.shape[1]
            gate, up, g = linear(x, self.shared_gate_up).split([i, i, int(self.shared_gated)], dim=-1)
            shared = linear(self._glu(gate, up, act), self.shared_down)
            out = out + (torch.sigmoid(g) * shared if self.shared_gated else shared)
        return out.view(shape)
