"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over a compressed KV cache, for the fast runner.

Owns: an MLA layer's weights, taken from the Hugging Face module, and the two halves of its
attention around the runner's ordinary attention call. The cache holds, per position, one
vector shared by every head: the normalised KV latent c (kv_lora_rank) followed by the rotated
key part k_rot (qk_rope_head_dim), as HF's cache does; nothing per head is stored. Attention runs
in the absorbed form: each head's query no-RoPE part is multiplied into the latent space by that
head's slice of kv_b_proj (W_UK), so that

    score(h, j) = [q_nope(h) W_UK(h) | q_rot(h)] . [c(j) | k_rot(j)]

is the score HF computes from the expanded keys, and the head's output is the attention-weighted
latent multiplied by its value slice (W_UV). The runner's attention call sees one KV head of
width kv_lora_rank + qk_rope_head_dim, with the values the same vectors as the keys (the output's
trailing RoPE part is dropped): multi-query attention, exact and row-invariant where the runner's
attention is. Both absorptions are per-head linears (a 3-D weight, `llama.linear`), under the
runner's row plans where it is exact.

RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (`rope_interleave`, HF's default
for the family); HF computes that as the usual rotate-half over the de-interleaved dims, and so
does this: the rotated parts are de-interleaved, then rotated with the runner's table.

Does not know: caches, masks, MoE or requests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MLA:
    heads: int
    nope: int  # qk_nope_head_dim
    rot: int  # qk_rope_head_dim
    rank: int  # kv_lora_rank: the latent's width
    v_dim: int  # v_head_dim
    q_rank: int | None  # q_lora_rank (None: one q_proj)
    q_norm: torch.Tensor | None  # [q_rank]: q_a_layernorm
    q_b: torch.Tensor | None  # [H (nope + rot), q_rank]
    kv_norm: torch.Tensor  # [rank]: kv_a_layernorm
    w_uk: torch.Tensor  # [H, rank, nope]: each head's no-RoPE query into the latent space (a per-head linear)
    w_uv: torch.Tensor  # [H, v_dim, rank]: each head's latent output into its values
    interleaved: bool

    @classmethod
    def from_hf(cls, at, cfg) -> "MLA":
        H, nope, rot, rank, v = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                 cfg.kv_lora_rank, cfg.v_head_dim)
        kv_b = at.kv_b_proj.weight.detach().view(H, nope + v, rank)
        lora = at.q_a_proj is not None
        return cls(H, nope, rot, rank, v, cfg.q_lora_rank if lora else None,
                   at.q_a_layernorm.weight.detach() if lora else None, at.q_b_proj.weight.detach() if lora else None,
                   at.kv_a_layernorm.weight.detach(), kv_b[:, :nope].transpose(1, 2).contiguous(),
                   kv_b[:, nope:].contiguous(), bool(getattr(cfg, "rope_interleave", False)))

    @property
    def width(self) -> int:
        """The cache's vector per position: [latent | rotated key]."""
        return self.rank + self.rot

    def weights(self) -> list[tuple]:
        return ([(self.q_b, None)] if self.q_b is not None else []) + [(self.w_uk, None), (self.w_uv, None)]

    def _deinterleave(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1) if self.interleaved else x

    def pre(self, qkv: torch.Tensor, rms, eps: float, linear, rope, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv [B, T, (q_rank or H (nope + rot)) + rank + rot]: the layer's fused first projection of
        the normed input -> (query [B, T, H, width], cache vector [B, T, 1, width])."""
        B, T = qkv.shape[:2]
        H = self.heads
        q, kv = qkv.split([qkv.shape[-1] - self.width, self.width], dim=-1)
        if self.q_b is not None:
            q = linear(rms(q, self.q_norm, eps), self.q_b)
        q_nope, q_rot = q.view(B, T, H, self.nope + self.rot).split([self.nope, self.rot], dim=-1)
        c, k_rot = kv.split([self.rank, self.rot], dim=-1)
        c = rms(c, self.kv_norm, eps)
        q_rot = rope(self._deinterleave(q_rot), cos, sin)
        k_rot = rope(self._deinterleave(k_rot)[:, :, None], cos, sin)
        q_lat = linear(q_nope.reshape(B, T, H * self.nope), self.w_uk).view(B, T, H, self.rank)
        return torch.cat([q_lat, q_rot.to(q_lat.dtype)], dim=-1), torch.cat([c[:, :, None], k_rot.to(c.dtype)], -1)

    def post(self, a: torch.Tensor, linear) -> torch.Tensor:
        """The attention output over the cache vectors [B, T, H * width] -> each head's values
        [B, T, H * v_dim] (o_proj's input)."""
        B, T = a.shape[:2]
        lat = a.view(B, T, self.heads, self.width)[..., :self.rank]
        return linear(lat.reshape(B, T, self.heads * self.rank), self.w_uv)


def per_head_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., H K] and w [H, N, K] (a linear weight per head) -> [..., H N]: head h's K inputs
    through w[h]."""
    H, N, K = w.shape
    lead = x.shape[:-1]
    y = torch.bmm(x.reshape(-1, H, K).transpose(0, 1), w.transpose(1, 2))  # [H, M, N]
    return y.transpose(0, 1).reshape(*lead, H * N)
