"""Fast decoder forward for decoding, over a slotted static KV cache.

Owns: the decoder math of the families in `SUPPORTED_MODEL_TYPES`, over weights taken from the
Hugging Face model, and the KV cache whose rollback is O(1): every slot has a length, and
truncating a sequence to its accepted prefix only lowers that length. Each family's math is
checked against its own `transformers` modeling file (tests/unit/test_families.py):
  llama, mistral   RMSNorm, rotary embeddings, grouped-query attention, SwiGLU (Llama's optional
                   attention bias); Mistral's sliding window on every layer
  qwen2, qwen3     Qwen2's q/k/v bias, Qwen3's per-head q/k RMSNorm; sliding layers where
                   `layer_types` has them
  phi3             fused qkv_proj and gate_up_proj, partial rotary, a sliding window on every layer
  mixtral,         mixture-of-experts MLPs (`actors.moe`: routing, experts grouped per pass) on
  qwen2_moe,       Mistral's, Qwen2's and Qwen3's attention; Qwen2-MoE's shared expert; dense
  qwen3_moe        layers among the sparse ones where the config has them
  deepseek_v3      multi-head latent attention over a compressed cache (`actors.mla`), DeepSeek's
                   grouped sigmoid routing with shared experts, dense first layers
  glm4_moe         partial rotary, q/k/v bias, optional q/k norms, DeepSeek's routing
  gpt_oss          attention sinks, alternating sliding and full layers, q/k/v/o bias, top-k-then-softmax
                   routing with a router bias, clamped SwiGLU experts with biases (`actors.moe`)
  gemma2,          embeddings scaled by sqrt(E), RMSNorm scaling by (1 + weight) (folded into an fp32
  gemma3_text      copy at load), sandwich norms around attention and MLP, query_pre_attn_scalar,
                   GELU (tanh) MLP, alternating sliding and global layers, final logit soft-capping;
                   Gemma2's attention logit soft-capping; Gemma3's q/k norms and local RoPE base
RoPE, as HF computes it, becomes one table per distinct rotary (Gemma3: local and global): exact
for the static rope types (default, linear, llama3, yarn). "dynamic" NTK changes HF's frequencies
only past max_position_embeddings, where no cache reaches, so below it is the plain table;
"longrope" switches HF to its long factors (recomputing the cache) past
original_max_position_embeddings, so the runner serves positions up to there only. Any other
rope type, a non-causal config, or an unchecked activation is refused at load.

Does not know: tokenizers, sampling, requests or speculation.

Why not the Hugging Face forward: at batch 1 on a CPU the eager HF forward
spends most of its time in per-op Python overhead (~1.1 ms per decoder layer
for SmolLM2). Here Q/K/V and gate/up are fused into one matmul each, RoPE is a
table lookup, the masks are built once per forward and shared by all layers,
and the cache is preallocated, so a decode step is a short, fixed list of ops.

Shapes: B rows (sequences in this forward), T new tokens per row, S slots,
L layers, H query heads, Hkv key/value heads, D head dim, E hidden size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu, kernels
from .kv import KVCache
from .mla import MLA, per_head_linear
from .moe import MOE_TYPES, MoE
from .native import NativeWeight


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor | None  # [E]; None: no input norm (an EAGLE-1 head's layer)
    wqkv: torch.Tensor  # [(H + 2*Hkv) * D, E]
    bqkv: torch.Tensor | None  # [(H + 2*Hkv) * D]
    wo: torch.Tensor  # [E, H * D]
    mlp_norm: torch.Tensor  # [E]
    w_gate_up: torch.Tensor | None  # [2 * I, E]; None in a sparse layer
    w_down: torch.Tensor | None  # [E, I]
    q_norm: torch.Tensor | None = None  # [D]: Qwen3's (Gemma3's) RMSNorm of each query head before RoPE
    k_norm: torch.Tensor | None = None  # [D]: and of each key head
    # [E]: an EAGLE-3 head's layer, fed x = [token embedding | feature] ([B, T, 2E]): attention reads
    # [attn_norm(embedding) | hidden_norm(feature)] (wqkv is [.., 2E]); the residual stream is the feature
    hidden_norm: torch.Tensor | None = None
    bo: torch.Tensor | None = None  # [E]: the output projection's bias (Llama/Gemma attention_bias)
    # [E]: Gemma's sandwich norms, on the attention output and on the MLP output before each residual add
    # (mlp_norm is then its pre_feedforward_layernorm)
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    window: int | None = None  # sliding-window attention: the query at position p sees keys p-window+1 .. p
    rope: int = 0  # which of the runner's RoPE tables (`LlamaRunner.ropes`) this layer rotates with
    moe: MoE | None = None  # a sparse layer's experts (`actors.moe`), in place of w_gate_up and w_down
    # multi-head latent attention (`actors.mla`): wqkv is then [q_a (or q_proj); kv_a_proj_with_mqa], the
    # cache one latent vector per position
    mla: MLA | None = None
    sinks: torch.Tensor | None = None  # [H]: gpt-oss's attention sink logit per query head


@dataclass
class TreeMask:
    """The shape of B token trees whose new tokens are fed as [B, T]: the RoPE position of token
    t is the row's cache length + depth[b, t], and anc[b, t, u] says whether it attends to key u
    of the last `past` cached positions followed by the T new ones (the tree's earlier nodes, fed
    by earlier calls, are the `past` ones; everything before them is the visible context, a chain
    whose RoPE positions are its cache positions, and no node sits before the first `past` one:
    depth >= -past). For the target's verify pass (`from_parents`), index 0 is the root (the last
    committed token), past is 0 and depth is the tree depth. A sliding window counts distance along
    the node's path: each ancestor is one position before its child."""
    depth: torch.Tensor  # int64 [B, T]: RoPE offset from the row's cache length
    anc: torch.Tensor  # bool [B, T, past + T]
    past: int = 0

    @classmethod
    def from_parents(cls, parents: list[list[int]], T: int, device) -> "TreeMask":
        """parents[b][i] = feed index of node i+1's parent (< i+1; 0 = the root). Rows shorter
        than T are padded with nodes hanging off the root (their outputs are never read)."""
        B = len(parents)
        depth = [[0] * T for _ in range(B)]
        anc = [[[False] * T for _ in range(T)] for _ in range(B)]
        for b, par in enumerate(parents):
            for t in range(T):
                p = par[t - 1] if 1 <= t <= len(par) else 0
                if t:
                    assert 0 <= p < t, f"row {b}: node {t} has parent {p}"
                    depth[b][t] = depth[b][p] + 1
                    anc[b][t] = list(anc[b][p])
                anc[b][t][t] = True
        return cls(torch.tensor(depth, device=device), torch.tensor(anc, device=device))


class LlamaRunner:
    """A decoder of a supported family (optionally only its first `num_layers` layers).

    A truncated runner built with `num_layers=K` shares the full model's weight
    tensors, fused ones included (see `_fused`): that is the self-draft, and it
    costs only its KV cache (and, for Gemma, fp32 copies of its norm weights).
    """

    def __init__(self, hf_model, num_layers: int | None = None):
        cfg = hf_model.config
        model_type = getattr(cfg, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported by the fast runner "
                f"(supported: {sorted(SUPPORTED_MODEL_TYPES)})")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError(f"{model_type}: use_bidirectional_attention is not a causal decoder; the fast runner "
                             f"serves causal attention only")
        gemma = model_type in GEMMA_TYPES
        field = "hidden_activation" if gemma and getattr(cfg, "hidden_activation", None) else "hidden_act"
        act = getattr(cfg, field, None) or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"{field} {act!r} is not supported (only {sorted(ACTIVATIONS)})")
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.rope_dim = self.head_dim  # the dims a head rotates (all but Phi3's partial rotary and MLA)
        self.mla = hasattr(hf_model.model.layers[0].self_attn, "kv_a_proj_with_mqa")  # DeepSeek-V3
        if self.mla:  # the cache: one [latent | rotated key] vector per position, read by every head
            self.n_kv, self.head_dim, self.rope_dim = 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.qk_rope_head_dim
        self.eps = cfg.rms_norm_eps
        total = cfg.num_hidden_layers
        self.num_layers = total if num_layers is None else num_layers
        self.quant = "none"  # or an int8 mode set by `actors.quant.quantize_runner`
        self.prepacked = False  # see `prepack`
        self.native = False  # GGUF blocks, run by the block kernel (or ATen's int4): `actors.native.apply`
        # Row-invariant passes (`make_exact`): attention by `kernels.attention`, each linear called as
        # its probed `kernels.RowPlan` says (by `_kind`), so every width computes a row's bits alike.
        self.exact = False
        self.exact_why = "exact: off"  # set by `actors.build.with_exact`
        self.compiled = False  # see `compile`
        # Layers in the block kernel's fused calls (`fuse_blocks`): None, else each layer's fp32 norm weights
        self.fused: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.plans: dict[tuple, kernels.RowPlan] = {}
        self.tp = None  # this rank's `actors.tp.Group` where the runner is one shard of a tensor-parallel target
        if not 1 <= self.num_layers <= total:
            raise ValueError(f"num_layers must be in [1, {total}], got {num_layers}")

        # What sets one family's math apart, fixed here so that forward only reads attributes.
        self.act = ACTIVATIONS[act]
        self.rms = _rms_norm_fp32_scale if gemma else _rms_norm  # Gemma: (1 + w), folded, scales in fp32
        self.scaling = float(cfg.query_pre_attn_scalar if gemma else self.head_dim) ** -0.5
        if self.mla:  # HF's: 1/sqrt(qk_nope + qk_rope dims), times yarn's mscale where it applies
            self.scaling = float(hf_model.model.layers[0].self_attn.scaling)
        # Gemma2 soft-caps attention logits (cap * tanh(s / cap)); Gemma3's config has the field but
        # its attention never applies it, so neither does this runner.
        self.attn_softcap = getattr(cfg, "attn_logit_softcapping", None) if model_type == "gemma2" else None
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None) if gemma else None

        base = hf_model.model
        p = next(hf_model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.embed = base.embed_tokens.weight.detach()  # [V, E]
        scale = getattr(base.embed_tokens, "embed_scale", None)  # Gemma: sqrt(E), cast to the dtype as HF does
        self.embed_scale = None if scale is None else scale.detach().to(self.dtype)
        self._norm_weight = _fold_one if gemma else _as_is
        self.norm = self._norm_weight(base.norm.weight)  # [E]; None: forward returns the pre-norm residual stream
        self.lm_head = hf_model.lm_head.weight.detach()  # [V, E] (may be tied to embed)

        # RoPE as tables: cos/sin[pos] = cos/sin(pos * inv_freq) * attention_scaling, computed exactly
        # as HF's rotary embedding does (fp32), duplicated to the rotated dims; one table per rotary.
        max_pos = int(getattr(cfg, "max_position_embeddings", 8192))
        self.max_position, self.positions_why = max_pos, "max_position_embeddings"
        rotaries = _rotaries(cfg, base.rotary_emb)  # {layer type or None: (inv_freq, scaling, rope params)}
        for params in rotaries.values():
            if params[2].get("rope_type", "default") == "longrope":
                limit = int(params[2]["original_max_position_embeddings"])
                if limit < self.max_position:
                    self.max_position = limit
                    self.positions_why = ("longrope's original_max_position_embeddings: past it HF switches "
                                          "to the long factors and recomputes the whole cache")
        rope_index = {key: i for i, key in enumerate(rotaries)}
        self.ropes = [self._rope_table(inv, scale) for inv, scale, _ in rotaries.values()]  # [(cos, sin) [P, R]]
        self.cos, self.sin = self.ropes[0]

        types = _layer_types(cfg)
        windows = _layer_windows(cfg, types)
        self.layers = []
        for i in range(self.num_layers):
            w = windows[i] if windows[i] is not None and windows[i] < self.max_position else None
            rope = rope_index[types[i] if None not in rope_index else None]
            self.layers.append(self._fuse(base.layers[i], w, rope))
        self.windows = sorted({w.window for w in self.layers if w.window is not None})

    def _rope_table(self, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = inv_freq.detach().float().to(self.device)  # [R/2]
        if 2 * len(inv_freq) != self.rope_dim and self.config.model_type not in PARTIAL_ROTARY_TYPES:
            raise ValueError(f"{self.config.model_type}: a partial rotary ({2 * len(inv_freq)} of {self.rope_dim} "
                             f"head dims) is not what its HF attention computes")
        pos = torch.arange(self.max_position, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [P, R/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, R]
        return (emb.cos() * scale).to(self.dtype), (emb.sin() * scale).to(self.dtype)

    def _fuse(self, layer, window: int | None, rope: int) -> LayerWeights:
        at, mlp = layer.self_attn, layer.mlp
        norm = self._norm_weight
        if not hasattr(mlp, "experts") and any(getattr(m, "bias", None) is not None for m in mlp.children()):
            raise ValueError(f"{self.config.model_type}: MLP biases (mlp_bias) are not supported by the fast runner")
        mla = MLA.from_hf(at, self.config) if self.mla else None
        if mla is not None:
            if at.kv_a_proj_with_mqa.bias is not None:
                raise ValueError(f"{self.config.model_type}: attention_bias is not served with MLA by the fast runner")
            wqkv, bqkv = _fused(at, "weight", [at.q_a_proj if mla.q_rank else at.q_proj, at.kv_a_proj_with_mqa]), None
        elif hasattr(at, "qkv_proj"):  # Phi3: already fused, in the q, k, v order used here
            wqkv, bqkv = at.qkv_proj.weight.detach(), at.qkv_proj.bias
            bqkv = None if bqkv is None else bqkv.detach()
        else:
            wqkv = _fused(at, "weight", [at.q_proj, at.k_proj, at.v_proj])
            bqkv = _fused(at, "bias", [at.q_proj, at.k_proj, at.v_proj]) if at.q_proj.bias is not None else None
        moe = MoE.from_hf(mlp, self.config.model_type, _fused) if hasattr(mlp, "experts") else None
        if moe is not None:
            w_gate_up = w_down = None
        elif hasattr(mlp, "gate_up_proj"):  # Phi3: [gate; up], as here
            w_gate_up, w_down = mlp.gate_up_proj.weight.detach(), mlp.down_proj.weight.detach()
        else:
            w_gate_up, w_down = _fused(mlp, "weight", [mlp.gate_proj, mlp.up_proj]), mlp.down_proj.weight.detach()
        sandwich = hasattr(layer, "pre_feedforward_layernorm")  # Gemma
        qk_norm = getattr(at, "q_norm", None) is not None
        return LayerWeights(
            attn_norm=norm(layer.input_layernorm.weight),
            wqkv=wqkv,
            bqkv=bqkv,
            wo=at.o_proj.weight.detach(),
            mlp_norm=norm((layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm).weight),
            w_gate_up=w_gate_up,
            w_down=w_down,
            q_norm=norm(at.q_norm.weight) if qk_norm else None,
            k_norm=norm(at.k_norm.weight) if qk_norm else None,
            bo=None if at.o_proj.bias is None else at.o_proj.bias.detach(),
            post_attn_norm=norm(layer.post_attention_layernorm.weight) if sandwich else None,
            post_mlp_norm=norm(layer.post_feedforward_layernorm.weight) if sandwich else None,
            window=window,
            rope=rope,
            moe=moe,
            mla=mla,
            sinks=None if getattr(at, "sinks", None) is None else at.sinks.detach(),
        )

    def new_cache(self, slots: int, max_len: int, dtype: torch.dtype | None = None, block_size: int | None = None,
                  num_blocks: int | None = None) -> KVCache:
        """A cache of `slots` sequences of at most `max_len` positions (`actors.kv`: blocks of `block_size`
        positions, a pool of `num_blocks`; by default one block per slot, the slotted cache).
        The cache dtype defaults to fp32 on a CPU even for bf16 weights (fp32 attention over a
        small cache is ~3x faster there, with no native bf16 softmax, and rounds less), and to the
        model's dtype on a GPU (bf16 KV halves the bytes every attention reads)."""
        if max_len > self.max_position:
            raise ValueError(f"max_len {max_len} exceeds the {self.max_position} positions this runner serves "
                             f"(the model's {self.positions_why})")
        if dtype is None:
            dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        cache = KVCache(self.num_layers, slots, max_len, self.n_kv, self.head_dim, dtype, self.device,
                        shared_kv=self.mla, block_size=block_size, num_blocks=num_blocks)
        if self.tp is not None:
            from . import tp

            return tp.new_cache(self, cache, dict(slots=slots, max_len=max_len, dtype=dtype,
                                                  block_size=cache.block_size, num_blocks=cache.num_blocks))
        return cache

    def bytes_per_position(self, dtype: torch.dtype | None = None) -> int:
        """KV bytes one position costs in a cache of this runner (every layer, keys and values)."""
        dtype = dtype or (torch.float32 if self.device.type == "cpu" else self.dtype)
        return self.num_layers * self.n_kv * self.head_dim * dtype.itemsize * (1 if self.mla else 2)

    @torch.inference_mode()
    def forward(self, cache: KVCache, slots: list[int], tokens: torch.Tensor | None,
                num_new: list[int] | None = None, embeds: torch.Tensor | None = None,
                tree: "TreeMask | None" = None, features: tuple[int, ...] = ()):
        """Run `tokens` for each row's slot, append their K/V, return final hidden states.

        slots: B distinct slot indices. tokens: int64 [B, T]; row b's first
        num_new[b] tokens are real, the rest padding (default: all T real).
        Row b's tokens take positions lengths[slot] .. lengths[slot] + T - 1;
        afterwards lengths[slot] grows by num_new[b].
        Returns the post-norm hidden states [B, T, E]; padded positions hold garbage.
        embeds [B, T, E], when given, replaces the token embedding lookup (a feature-level
        draft head feeds its own input vectors; [B, T, 2E] for a head whose layer has a hidden_norm,
        see `LayerWeights`); `tokens` may then be None.
        Blocks for the new positions are reserved first (`KVCache.reserve`: OutOfBlocks when the pool is
        short), and blocks past each slot's new length given back after.
        tree, when given, makes the T new tokens of a row a token tree rather than a chain:
        token t sits at RoPE position lengths + depth[t] and attends to the cached context and
        to the new tokens its ancestor mask allows (its KV still goes to slot position
        lengths + t, in feed order; `KVCache.compact` moves an accepted path together).
        features, when given, also returns the features a feature-level draft reads, as
        (hidden, feats): feats [B, T, len(features) * E] concatenates, in order, the output of
        decoder layer i (the residual stream) for each i >= 0 and the final hidden state for -1.
        """
        B, T = tokens.shape if embeds is None else embeds.shape[:2]
        assert len(slots) == B, f"{len(slots)} slots for {B} rows"
        num_new = [T] * B if num_new is None else num_new
        assert len(num_new) == B and all(0 <= n <= T for n in num_new), f"bad num_new {num_new} for T={T}"
        starts = [cache.lengths[s] for s in slots]
        end = max(starts) + T  # keys to attend: [0, end)
        if end > cache.max_len:
            raise ValueError(f"sequence would reach {end} positions, cache holds {cache.max_len}")
        for s, n in zip(slots, starts):
            cache.reserve(s, n + T)
        if self.tp is not None and self.tp.leader:  # the other ranks run the same pass on their heads
            from . import tp

            tp.announce(self, cache, slots, dict(tokens=tokens, num_new=num_new, embeds=embeds, tree=tree,
                                                 features=features))

        dev = self.device
        start_t = torch.tensor(starts, device=dev)  # [B]
        positions = start_t[:, None] + torch.arange(T, device=dev)[None, :]  # [B, T]: where the KV goes
        table = cache.table(slots, dev)  # [B, P]: each row's blocks
        bs = cache.block_size
        rope_pos = positions if tree is None else start_t[:, None] + tree.depth  # [B, T]
        masks = self._masks(starts, start_t, positions, rope_pos, end, tree)  # window -> (mask, first key)

        ropes = [(c[rope_pos][:, :, None, :], s[rope_pos][:, :, None, :]) for c, s in self.ropes]  # [B, T, 1, R]
        H, Hkv = self.n_heads, self.n_kv
        x = F.embedding(tokens, self.embed) if embeds is None else embeds.to(self.dtype)  # [B, T, E]
        if self.embed_scale is not None and embeds is None:
            x = x * self.embed_scale
        taps = {}
        attn_kernel = self.exact and cpu.available("attn-kernel")
        fused = self.fused  # the block kernel's fused calls (`fuse_blocks`): the residual stream in fp32
        if fused:
            x = x.float()
        # every layer in one call, exact or not (the attention kernel is the faster path there too)
        stacked = fused and cpu.available("attn-kernel") and cache.k.dtype == torch.float32
        one_block = end <= bs  # every row's keys in its first block (always so in the slotted cache)
        if not stacked:  # the per-layer path writes the KV itself (the stacked call writes it in the kernel)
            written = table.gather(1, positions // bs) * bs + positions % bs  # [B, T]: flat index of each new position
        if not self.exact and not stacked:  # where the per-op attention reads each row's keys
            if one_block:
                firsts = [cache.tables[s][0] for s in slots]
                rows = slice(firsts[0], firsts[0] + B) if firsts == list(range(firsts[0], firsts[0] + B)) \
                    else table[:, 0]
            else:
                at = torch.arange(end, device=dev)
                keys_at = table[:, at // bs] * bs + at % bs  # [B, end]: flat index of each row's key positions
        if stacked:
            cos, sin = (t[:, :, 0].float().contiguous() for t in ropes[0])
            taps = self._run_layers(x, cos, sin, cache, table, positions, masks[None], end, features)
            x = taps.pop("out")
        for li, w in enumerate([] if stacked else self.layers):
            cos, sin = ropes[w.rope]
            mask, lo = masks[w.window]
            kc, vc = cache.k[li], cache.v[li]  # [N, bs, Hkv, D] (MLA: the same tensor)
            if fused:  # RMSNorm + qkv in one call
                qk, v = w.wqkv(x, norm=fused[li][0], eps=self.eps).view(B, T, H + 2 * Hkv, -1).split([H + Hkv, Hkv], 2)
                q, k = _rope(qk, cos, sin).split([H, Hkv], dim=2)
            elif w.mla is not None:  # the values are the keys: one cache vector per position
                q, k = w.mla.pre(self.linear(self.rms(x, w.attn_norm, self.eps), w.wqkv), self.rms, self.eps,
                                 self.linear, _rope, cos, sin)
                v = k
            else:
                q, k, v = self._pre_attn(x, w.attn_norm, w.wqkv, w.bqkv, cos, sin, w.q_norm, w.k_norm,
                                         w.hidden_norm)  # [B, T, *, D]
            if w.hidden_norm is not None:
                x = x[..., x.shape[-1] // 2:]
            kf, vf = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])  # one row per (block, offset)
            kf[written] = k.to(kc.dtype)
            if vc is not kc:
                vf[written] = v.to(vc.dtype)
            if self.exact:  # [B, T, H * D]: each query row in one order at every width
                a = kernels.attention(q, kc, vc, table, None if mask is None else mask[:, 0], lo, end,
                                      self.scaling, self.attn_softcap, attn_kernel, w.sinks)
            else:
                if one_block:  # [B, end - lo, Hkv, D]: views where the rows' blocks are consecutive
                    keys, vals = (kc[rows, lo:end], vc[rows, lo:end]) if isinstance(rows, slice) else \
                        (kc[:, lo:end][rows], vc[:, lo:end][rows])
                else:  # gathered from the rows' blocks
                    keys, vals = kf[keys_at[:, lo:]], vf[keys_at[:, lo:]]
                q = q.transpose(1, 2).to(kc.dtype)  # [B, H, T, D]
                if self.attn_softcap is None and w.sinks is None:
                    a = F.scaled_dot_product_attention(q, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask,
                                                       scale=self.scaling, enable_gqa=Hkv != H)  # [B, H, T, D]
                else:
                    a = _eager_attention(q, keys.transpose(1, 2), vals.transpose(1, 2), mask, self.scaling,
                                         self.attn_softcap, w.sinks)
                a = a.transpose(1, 2).reshape(B, T, -1)
            if w.mla is not None:
                a = w.mla.post(a.to(x.dtype), self.linear)
            if fused:  # output projection + residual, RMSNorm + gate/up, down + residual
                x = w.wo(a, residual=x)
                gate, up = w.w_gate_up(x, norm=fused[li][1], eps=self.eps).chunk(2, dim=-1)
                x = w.w_down(F.silu(gate) * up, residual=x)
            else:
                x = self._post_attn(x, a, w.wo, w.mlp_norm, w.w_gate_up, w.w_down, w.bo, w.post_attn_norm,
                                    w.post_mlp_norm, w.moe)
            if li in features:
                taps[li] = x.to(self.dtype)
        for s, n in zip(slots, num_new):
            cache.lengths[s] += n
            cache.trim(s)
        if self.norm is None:
            out = x.to(self.dtype)
        elif fused:  # in the runner's dtype, as every consumer of hidden states takes them
            out = kernels.blocks_extension().rms_norm(x, self.norm, self.eps).to(self.dtype)
        else:
            out = self.rms(x, self.norm, self.eps)
        if not features:
            return out
        taps[-1] = out
        missing = [i for i in features if i not in taps]
        if missing:
            raise ValueError(f"features {missing}: this runner has layers 0..{self.num_layers - 1} (-1: final)")
        return out, torch.cat([taps[i] for i in features], -1)

    def _masks(self, starts: list[int], start_t: torch.Tensor, positions: torch.Tensor, rope_pos: torch.Tensor,
               end: int, tree: "TreeMask | None") -> dict:
        """The attention masks of one forward, for every window its layers use (None: full causal):
        window -> (mask bool [B, 1, T, end - lo] or None where every row attends to every key, lo: the
        first cache position any query of this forward may see through that window; keys before it
        are not read at all)."""
        B, T = positions.shape
        dev = self.device
        keys = torch.arange(end, device=dev)  # [end]
        if tree is None:
            # Causal mask over cache positions: key j is visible to the query at position p iff j <= p.
            # Not needed when every row attends to all of [0, end), i.e. one token per row, same length.
            uniform = T == 1 and min(starts) == max(starts)
            full = None if uniform else (keys[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, end]
        else:
            U = tree.past + T
            offs = keys[None, :] - (start_t[:, None] - tree.past)  # [B, end]: key's index in the tree block
            in_block = (offs >= 0) & (offs < U)  # [B, end]
            idx = offs.clamp(0, U - 1)[:, None, :].expand(B, T, end)
            anc = tree.anc.gather(2, idx)  # [B, T, end]
            full = ((offs < 0)[:, None, :] | (in_block[:, None, :] & anc))[:, None]  # [B, 1, T, end]
        masks = {None: (full, 0)}
        dist = None  # tree rows: each query's distance to each key, for every window alike
        for W in self.windows:
            if end <= W:  # no query is W positions past any key
                masks[W] = (full, 0)
                continue
            if tree is None:  # key j visible to the query at position p iff p - W < j <= p
                lo = max(0, min(starts) - W + 1)
                k, p = keys[lo:][None, None, :], positions[:, :, None]
                masks[W] = (None if uniform else ((k <= p) & (k > p - W))[:, None], lo)  # [B, 1, T, end - lo]
                continue
            if dist is None:
                # A tree node's distance to a key: along its path inside the block (the path nodes after
                # the key, up to the node itself), to the context before it by RoPE positions.
                anc_l = tree.anc.long()
                after = anc_l.flip(-1).cumsum(-1).flip(-1) - anc_l  # [B, T, U]
                dist = torch.where(in_block[:, None, :], after.gather(2, idx),
                                   rope_pos[:, :, None] - keys[None, None, :])  # [B, T, end]
            lo = max(0, min(starts) - tree.past - W + 1)
            masks[W] = ((full[:, 0] & (dist < W))[:, None, :, lo:], lo)
        return masks

    def _pre_attn(self, x, attn_norm, wqkv, bqkv, cos, sin, q_norm=None, k_norm=None, hidden_norm=None):
        """x [B, T, E] -> q [B, T, H, D], k and v [B, T, Hkv, D], rotated (after Qwen3's per-head
        q/k RMSNorm, where the layer has one). See `LayerWeights` for the layers without attn_norm
        or with hidden_norm (then x is [B, T, 2E])."""
        B, T = x.shape[:2]
        rms = self.rms
        if hidden_norm is not None:
            e, f = x.chunk(2, dim=-1)
            h = torch.cat([rms(e, attn_norm, self.eps), rms(f, hidden_norm, self.eps)], -1)
        else:
            h = x if attn_norm is None else rms(x, attn_norm, self.eps)
        qkv = self.linear(h, wqkv, bqkv)  # [B, T, (H + 2Hkv) D]
        H, Hkv = self.n_heads, self.n_kv
        heads = qkv.view(B, T, H + 2 * Hkv, self.head_dim)
        if q_norm is not None:
            q, k, v = heads.split([H, Hkv, Hkv], dim=2)
            return _rope(rms(q, q_norm, self.eps), cos, sin), _rope(rms(k, k_norm, self.eps), cos, sin), v
        qk, v = heads.split([H + Hkv, Hkv], dim=2)
        q, k = _rope(qk, cos, sin).split([H, Hkv], dim=2)  # one rotation for both: the same ops per element
        return q, k, v

    def _post_attn(self, x, a, wo, mlp_norm, w_gate_up, w_down, bo=None, post_attn_norm=None, post_mlp_norm=None,
                   moe=None):
        """x [B, T, E], attention output a [B, T, H * D] -> the layer's output [B, T, E]. With Gemma's
        sandwich norms: x + post_attn_norm(o), then + post_mlp_norm(mlp(mlp_norm(x))); a sparse layer's
        MLP is its experts (`moe`)."""
        o = self.linear(a.to(x.dtype), wo, bo)
        if self.tp is not None:  # the heads' partial sums
            o = self.tp.reduce(o)
        if post_attn_norm is not None:
            o = self.rms(o, post_attn_norm, self.eps)
        x = x + o
        h = self.rms(x, mlp_norm, self.eps)
        if moe is not None:
            m = moe(h, self.linear, self.act)
            return x + (m if self.tp is None else self.tp.reduce(m))  # (each rank's experts' share)
        gate, up = self.linear(h, w_gate_up).chunk(2, dim=-1)  # [B, T, I] each
        m = self.linear(self.act(gate) * up, w_down)
        if self.tp is not None:  # the MLP columns' partial sums
            m = self.tp.reduce(m)
        if post_mlp_norm is not None:
            m = self.rms(m, post_mlp_norm, self.eps)
        return x + m

    def linear(self, x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
        """`linear`, called as the weight's row plan says where the runner is exact."""
        if not self.exact:
            return linear(x, w, b)
        plan = self.plans[_kind(w, b)]
        if not plan.pad and x.numel() <= plan.chunk * x.shape[-1]:  # one call, as the plan allows
            return linear(x, w, b)
        return kernels.apply_plan(lambda c: linear(c, w, b), x, plan)

    def _run_layers(self, x, cos, sin, cache, table, positions, mask_lo, end, features) -> dict:
        """Every layer in one call of the block kernel (`fuse_blocks`), attention by the attention kernel's
        `attend_rope` (RoPE at cos, sin [B, T, R] fp32, the KV write, attention) from inside it: {"out": the
        last layer's output (fp32), layer index: its output (the runner's dtype) for each layer in `features`}."""
        w, codes, ns, norms, path = self._stack
        mask, lo = mask_lo
        taps = [i for i in features if i >= 0]
        outs = kernels.blocks_extension().run_layers(
            x, w, codes, ns, norms, path, self.eps, cos, sin, cache.k, cache.v, table, positions,
            torch.empty(0, dtype=torch.bool) if mask is None else mask[:, 0].contiguous(), lo, end, self.n_heads,
            self.scaling, kernels.attend_rope_address(), taps)
        return {"out": outs[0], **{i: t.to(self.dtype) for i, t in zip(taps, outs[1:])}}

    def fuse_blocks(self) -> "LlamaRunner":
        """Run the decoder layers in the block kernel's fused calls (`native.BlockWeight`: RMSNorm
        folded into the quantization of the next matmul's input, residual adds into the matmul's
        output; the residual stream in fp32) where every projection is a BlockWeight and the layers
        have nothing else (no biases, q/k norms, sandwich norms, EAGLE-3 input norm, sliding windows;
        one rotary; SiLU; Llama's RMSNorm). With the attention kernel and an fp32 cache the whole stack
        is one call (`_run_layers`, row-invariant whatever `exact` says); without them, four block-kernel
        calls per layer around the per-op attention. Otherwise the per-op path stays."""
        from .native import BlockWeight

        plain = all(isinstance(getattr(w, name), BlockWeight) for w in self.layers
                    for name in ("wqkv", "wo", "w_gate_up", "w_down")) and all(
            w.attn_norm is not None and w.bqkv is None and w.bo is None and w.q_norm is None
            and w.hidden_norm is None and w.post_attn_norm is None for w in self.layers)
        if plain and self.act is F.silu and self.rms is _rms_norm and self.attn_softcap is None \
                and not self.windows and len(self.ropes) == 1:
            self.fused = [(w.attn_norm.float(), w.mlp_norm.float()) for w in self.layers]
            projs = [getattr(w, name) for w in self.layers for name in ("wqkv", "wo", "w_gate_up", "w_down")]
            # the whole stack in one call of the block kernel (`_run_layers`): its weights as flat lists, once
            self._stack = ([t for p in projs for t in (p.w, p.s)], [p.code for p in projs], [p.shape[0] for p in projs],
                           [t for pair in self.fused for t in pair], projs[0].path)
        return self

    def weights(self) -> list[tuple]:
        """Every (weight, bias) this runner's passes multiply by: the layers' projections, the LM head."""
        mlp = [w.moe.weights() if w.moe is not None else [(w.w_gate_up, None), (w.w_down, None)] for w in self.layers]
        attn = [w.mla.weights() if w.mla is not None else [] for w in self.layers]
        return [wb for w, a, m in zip(self.layers, attn, mlp) for wb in ((w.wqkv, w.bqkv), *a, (w.wo, w.bo), *m)] + \
            [(self.lm_head, None)]

    def make_exact(self) -> "LlamaRunner":
        """Make every pass row-invariant (`kernels`): attention in one order per query row, and each
        kind of linear (`_kind`) probed for the calls whose rows agree with the row alone, once per
        process and kernel choice (on the first weight of that kind met). `self.plans` says what each
        probe found; a plan that is not `cheap` is what `exact` settings weigh (build.py). Not with
        `compile` (Inductor's kernels)."""
        if self.compiled:
            raise ValueError("exact passes and torch.compile do not mix: compiled kernels choose their own order")
        for w, b in self.weights():
            key = _kind(w, b)
            probed = key + (torch.backends.mkldnn.enabled, torch.get_num_threads())  # which kernel runs it
            if probed not in _PLANS:
                inputs = w.shape[0] * w.shape[2] if len(w.shape) == 3 else w.shape[1]  # a per-head weight: H x K
                _PLANS[probed] = kernels.probe_plan(lambda c, w=w, b=b: linear(c, w, b), inputs, w.dtype, self.device)
            self.plans[key] = _PLANS[probed]
        self.exact = True
        return self

    def compile(self) -> "LlamaRunner":
        """Opt-in: compile the dense math of a decoder layer (norms, fused projections, RoPE,
        SwiGLU) with torch.compile, shapes dynamic in batch and tokens; the KV cache indexing and
        attention stay eager. Inductor caches compiled code on disk (under the specd cache), so
        a later run on the same machine starts warm. Off by default and in tests."""
        import os

        from .models import cache_dir

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
        if self.exact:
            raise ValueError("torch.compile and exact passes do not mix: compiled kernels choose their own order")
        self._pre_attn = torch.compile(self._pre_attn, dynamic=True)
        self._post_attn = torch.compile(self._post_attn, dynamic=True)
        self.compiled = True
        return self

    def prepack(self) -> "LlamaRunner":
        """CPU only: hold every dense projection and the LM head in oneDNN's blocked layout, reordered
        once here instead of inside every matmul (`torch.ops.mkldnn`, the layout Inductor's CPU
        freezing uses). Measured on a 2-core AVX-512-BF16 EPYC, SmolLM2 shapes: each linear 1.3-3x
        faster in bf16 at 1-9 tokens, bit-identical to F.linear; in fp32 (MKL without it) up to 5x at
        2+ tokens, where MKL's small-M path costs twice a GEMV, but rounding differs from MKL's in the
        last bits. Costs a second copy of those weights (the model's own stay for other runners that
        share them: a truncated self-draft, an HF forward); MoE experts and MLA's query projection too
        (not MLA's per-head absorptions, batched matmuls). Int8 (torchao) weights are left as they
        are. A weight whose dtype's layout this CPU cannot run (`cpu.probe`: prepack-bf16,
        prepack-fp32) stays as it is; `build.with_prepack` refuses an explicit "on" there. No-op on a GPU."""
        if self.device.type != "cpu":
            return self

        def pack(w):
            if type(w) is not torch.Tensor or w.is_mkldnn or w.dtype not in PACKABLE \
                    or not cpu.available(PACKABLE[w.dtype]):
                return w
            return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        for layer in self.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                setattr(layer, name, pack(getattr(layer, name)))
            if layer.moe is not None:
                layer.moe.repack(pack)
            if layer.mla is not None:
                layer.mla.q_b = pack(layer.mla.q_b)
        self.lm_head = pack(self.lm_head)
        self.prepacked = self.lm_head.is_mkldnn or any(w.wqkv.is_mkldnn for w in self.layers)
        return self

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., E] -> logits [..., V] (in the model dtype); Gemma's final soft-capping,
        cap * tanh(logits / cap), where the config sets one."""
        if self.tp is None:
            out = self.linear(hidden, self.lm_head)
        else:  # each rank's vocabulary rows, gathered
            if self.tp.leader:
                self.tp.send(("logits", hidden))
            out = self.tp.gather_last(self.linear(hidden, self.lm_head))[..., :self.tp_vocab]
        if self.final_softcap is not None:
            out = torch.tanh(out / self.final_softcap) * self.final_softcap
        return out

    def warm(self) -> int:
        """Compile the kernels of the shapes this runner's linears will meet (`warm_linears`): the
        layers' at every bucket, the LM head's up to 256 rows (each warmed row costs a full LM
        head, 57 MFLOP with SmolLM2's; a wider pass, e.g. verifying a full batch of token trees,
        compiles its bucket on first use)."""
        *layers, head = self.weights()
        return warm_linears(layers) + warm_linears([head], max_rows=256)


SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", *MOE_TYPES}
GEMMA_TYPES = {"gemma2", "gemma3_text"}
PARTIAL_ROTARY_TYPES = {"phi3", "glm4_moe"}  # families whose HF attention rotates only the first dims of a head
# Rope types whose HF frequencies the runner's tables reproduce (see the module docstring for
# dynamic and longrope); any other is refused at load.
ROPE_TYPES = {"default", "linear", "llama3", "yarn", "dynamic", "longrope"}


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The MLP activations checked against HF's (ACT2FN): SiLU, and Gemma's "gelu_pytorch_tanh".
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu_pytorch_tanh": _gelu_tanh}


def _layer_types(cfg) -> list[str]:
    """Each layer's attention type ("full_attention" or "sliding_attention")."""
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types is None or cfg.model_type in ("llama", "mistral", "phi3", "mixtral", "qwen3_moe"):  # HF ignores it
        return ["full_attention"] * n
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"{cfg.model_type}: layer types {unknown} are not supported by the fast runner")
    return list(types)


def _layer_windows(cfg, types: list[str]) -> list[int | None]:
    """Each layer's attention window (None: it attends to all): Mistral's, Phi3's, Mixtral's and
    Qwen3-MoE's `sliding_window` on every layer; Qwen2/3's, Qwen2-MoE's and Gemma's on the layers
    `layer_types` marks sliding; never Llama's."""
    window = getattr(cfg, "sliding_window", None)
    if not window or cfg.model_type == "llama":
        return [None] * len(types)
    if cfg.model_type in ("mistral", "phi3", "mixtral", "qwen3_moe"):  # their attention reads it on every layer
        return [int(window)] * len(types)
    return [int(window) if t == "sliding_attention" else None for t in types]


def _rotaries(cfg, rot) -> dict:
    """HF's rotary embedding(s) of a model: {layer type (None: one for all layers): (inv_freq [R/2],
    attention_scaling, rope parameters)}. The frequencies are the ones HF rotates with below
    max_position_embeddings: its `original_inv_freq` (a dynamic or longrope rotary rewrites its
    `inv_freq` after a long call)."""
    def one(prefix: str, rope_type: str, params: dict):
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{cfg.model_type}: rope_type {rope_type!r} is not supported by the fast runner "
                             f"(supported: {sorted(ROPE_TYPES)})")
        inv = getattr(rot, f"{prefix}original_inv_freq", None)
        inv = getattr(rot, f"{prefix}inv_freq") if inv is None else inv
        return inv, float(getattr(rot, f"{prefix}attention_scaling", 1.0)), params

    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(getattr(rot, "rope_type", None), dict):  # Gemma3: one rotary per layer type
        return {lt: one(f"{lt}_", rt, params.get(lt) or {}) for lt, rt in rot.rope_type.items()}
    return {None: one("", getattr(rot, "rope_type", "default"), params)}


def context_features(runner: LlamaRunner, context: list[int], features: tuple[int, ...]) -> torch.Tensor:
    """The features `features` (see `LlamaRunner.forward`) of context[:-1], from one prefill in a
    scratch cache: what a feature-level draft has been handed when it drafts after `context`."""
    with torch.inference_mode():
        ids = torch.tensor([context], device=runner.device)
        return runner.forward(runner.new_cache(1, len(context) + 1), [0], ids, features=features)[1][0, :-1]


PACKABLE = {torch.bfloat16: "prepack-bf16", torch.float32: "prepack-fp32"}  # dtype -> its `cpu` probe


# oneDNN (the CPU path of a prepacked or a bf16 linear) JIT-compiles a kernel for every input shape
# it meets and caches it, ~0.5 MB each with AMX: a server meeting every row count (rows x tokens
# per pass, every prefill length) grows for as long as it meets new ones (issue 16's soak: 298
# shapes in 60 requests). There a linear pads its rows to a bucket (`row_bucket`) and splits more
# than ROW_CHUNK rows into chunks, so a process meets a fixed set of shapes, which `warm_linears`
# compiles at start. Padding costs most where it is cheapest: a matmul of a few rows is bound by
# reading its weight, not by its rows; from 256 rows on, buckets are 8 per octave (at most
# 12.5% padding) and only the last chunk of a long prefill is padded.
ROW_CHUNK = 1024


def row_bucket(m: int) -> int:
    """The rows a chunk of m <= ROW_CHUNK rows is padded to: m up to 8, then 4 buckets per octave
    up to 256 (10, 12, 14, 16, 20, 24, ..., 224, 256), then 8 (288, 320, ..., 960, 1024)."""
    if m <= 8:
        return m
    step = 1 << (m.bit_length() - (3 if m < 256 else 4))
    return -(-m // step) * step


def row_buckets(max_rows: int = ROW_CHUNK) -> list[int]:
    return sorted({row_bucket(m) for m in range(1, max_rows + 1)})


def shape_cached(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x @ w.T runs a per-shape cached oneDNN kernel: a CPU matmul with a prepacked
    weight, or in a reduced precision where ATen sends those to oneDNN (`cpu.onednn_bf16`; fp32
    goes to MKL; an int8 weight is a torchao tensor)."""
    return x.device.type == "cpu" and (w.is_mkldnn or (type(w) is torch.Tensor and w.dtype != torch.float32
                                                       and cpu.onednn_bf16()))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or oneDNN's linear for a weight `LlamaRunner.prepack` reordered; where the kernel
    is cached per shape, over bucketed row chunks (see ROW_CHUNK). Padded rows are zeros and
    are dropped: every real row's result is what the unpadded call gives. Not under
    torch.compile (`LlamaRunner.compile`), whose own kernels take dynamic shapes."""
    if isinstance(w, NativeWeight):  # native weights: the block kernel or ATen's int4, not cached per shape
        return w(x, b)
    if w.dim() == 3:  # a linear per head (MLA's absorbed projections)
        return per_head_linear(x, w)
    if not shape_cached(x, w) or torch.compiler.is_compiling():
        return _linear(x, w, b)
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if m <= ROW_CHUNK and row_bucket(m) == m:  # the common decode case: nothing to pad
        return _linear(x, w, b)
    x2 = x.reshape(m, k)
    outs = []
    for i in range(0, m, ROW_CHUNK):
        c = x2[i:i + ROW_CHUNK]
        n = c.shape[0]
        pad = row_bucket(n) - n
        outs.append(_linear(F.pad(c, (0, 0, 0, pad)) if pad else c, w, b)[:n])
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
    return y.view(*x.shape[:-1], y.shape[-1])


_PLANS: dict = {}  # (`_kind`, oneDNN on, threads) -> the kernels.RowPlan its probe found, once per process


def _kind(w, b) -> tuple:
    """What decides a linear's kernel: the weight's type, layout, dtype and shape, and a bias or not."""
    return type(w), w.is_mkldnn, w.dtype, tuple(w.shape), b is None


_WARMED: set = set()  # (kind of weight, rows) whose kernel this process has compiled


def warm_linears(weights, max_rows: int = ROW_CHUNK) -> int:
    """Run each (weight, bias) once at every row bucket up to max_rows, so that the kernels a
    server will use are compiled before its first request rather than during its first minutes
    of traffic. oneDNN's caches are per process, and so is this record of what was warmed: a
    kind of weight warmed once (another layer, a truncated self-draft sharing the target's
    shapes, a second engine) is not run again. A no-op where kernels are not cached per shape.
    Returns the shapes warmed now."""
    n = 0
    with torch.inference_mode():
        for w, b in weights:
            kind = (type(w), w.is_mkldnn, w.dtype, w.device, tuple(w.shape), b is None)
            rows = [m for m in row_buckets(max_rows) if (kind, m) not in _WARMED]
            if not rows or len(w.shape) != 2:  # (a per-head weight runs batched matmuls, not a linear)
                continue
            x = torch.zeros(rows[-1], w.shape[-1], dtype=w.dtype, device=w.device)
            if not shape_cached(x, w):
                continue
            for m in rows:
                _linear(x[:m], w, b)
                _WARMED.add((kind, m))
                n += 1
    return n


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel call `linear` buckets: F.linear, or oneDNN's for a prepacked weight."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


FUSED_PREFIX = "_specd_fused_"  # `_fused`'s cache on a module; stale once the model's dtype changes


def _fused(owner: torch.nn.Module, attr: str, linears: list[torch.nn.Linear]) -> torch.Tensor:
    """One contiguous tensor holding the linears' `attr` (weight or bias) stacked on dim 0.

    The HF parameters are re-pointed at views of it, so the HF model keeps working and no
    weight exists twice; the result is cached on `owner`, so a truncated runner built on
    the same model (the self-draft) shares it too. (Saving such a model with safetensors
    needs a clone first: its parameters now share storage.)
    """
    key = f"{FUSED_PREFIX}{attr}"
    fused = owner.__dict__.get(key)
    if fused is None:
        fused = torch.cat([getattr(m, attr).detach() for m in linears], 0).contiguous()
        off = 0
        for m in linears:
            n = getattr(m, attr).shape[0]
            getattr(m, attr).data = fused[off:off + n]
            off += n
        owner.__dict__[key] = fused  # a plain attribute: not a parameter or buffer
    return fused


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as HF LlamaRMSNorm: normalise in fp32, cast back, then scale.
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _rms_norm_fp32_scale(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, weight = the fp32 (1 + w) of `_fold_one`: normalise and scale in fp32, then
    cast back (HF Gemma2RMSNorm: (x * w).to(dtype), where Llama's is x.to(dtype) * w)."""
    return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)


def _as_is(w: torch.Tensor) -> torch.Tensor:
    return w.detach()


def _fold_one(w: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm scales by (1 + w), computed in fp32: that sum, once, as an fp32 copy."""
    return 1.0 + w.detach().float()


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, cap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The attention SDPA cannot do: Gemma2's softmax(cap * tanh(q k^T * scale / cap)) v, and gpt-oss's
    attention sinks (a learned logit per head joins each query's softmax, and its share is dropped:
    softmax([scores, sink])[:-1] v, as HF's eager attention computes it). q [B, H, T, D]; k, v
    [B, Hkv, S, D] (query head h reads key head h // (H / Hkv), grouped here rather than by copying
    K and V per query head); mask bool [B, 1, T, S] or None; sinks [H]. Returns [B, H, T, D]."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    s = torch.matmul(q.reshape(B, Hkv, H // Hkv * T, D), k.transpose(2, 3)) * scale  # [B, Hkv, rep * T, S]
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    s = s.view(B, Hkv, H // Hkv, T, S)
    if mask is not None:
        s = s.masked_fill(~mask[:, :, None], float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        s = torch.cat([s, sinks.to(s.dtype).view(1, Hkv, H // Hkv, 1, 1).expand(B, -1, -1, T, 1)], dim=-1)
        s = s - s.max(dim=-1, keepdim=True).values
        p = torch.softmax(s, dim=-1, dtype=s.dtype)[..., :-1].to(q.dtype)
    return torch.matmul(p.reshape(B, Hkv, H // Hkv * T, S), v).view(B, H, T, D)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D]; cos/sin [B, T, 1, R]. x*cos + rotate_half(x)*sin over the first R dims
    (R < D: Phi3's partial rotary); the rest pass through."""
    r = cos.shape[-1]
    if r != x.shape[-1]:
        return torch.cat([_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
