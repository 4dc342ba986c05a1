"""A feature-level draft head (EAGLE-style) and the drafter that runs it.

The head reads what the target already computed. For the token x_p at position
p its input is fc([embed(x_p), h_{p-1}]), where h_{p-1} is the target's final
(post-norm) hidden state of the token before; one llama decoder layer and a
norm turn that into a predicted feature f_p ~ h_p, and the target's own LM head
(optionally cut to the R most frequent tokens) turns f_p into a guess for
x_{p+1}. Drafting further feeds the head its own prediction: the input at p+1
is fc([embed(draft), f_p]).

An EAGLE-3-style head (`features` naming several target layers, e.g. a low, a middle
and the final one) reads, for real positions, fuse([norm(h^low), norm(h^mid), h^final])
instead of h alone: one linear map over the concatenated layers, learnt with the rest.
Drafted positions still read the head's own feature f, so training unrolls several
drafting steps on the head's own predictions (training-time test).

The target hands over hidden states only for committed tokens (the verifier
passes them with the rollback information, `DraftSeq.hidden`), so the head's
KV for a position fed with a predicted feature is always recomputed from the
real one on the next call, even when the draft was accepted.

The head's decoder layer is a one-layer model of the target's own family where its last
layer maps onto it exactly (llama and mistral: a llama layer; qwen2: q/k/v bias; qwen3:
per-head q/k RMSNorm), so `init="last"` starts it as that layer. For any other family the
fast runner serves, the head is a llama layer started at random (one logged line).

Owns: the head module (training forward with training-time test, checkpoint
save/load), `FeatureDrafter` (serving any head fed target features: the rollback and
catch-up bookkeeping) and `EagleDrafter` (serving this head). Does not know: how the head
is trained (`specd/train/distill.py`), published heads' formats (`eagle_formats.py`) or acceptance.

Shapes: B rows, L positions, E hidden size, R head vocabulary, k drafting steps.
"""
from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..llama import LlamaRunner, _rms_norm, linear, warm_linears
from .base import KV_HEADROOM, DraftSeq, apply_view
from .model import ModelDrafter

HEAD_FILE = "head.safetensors"
META_FILE = "specd_draft.json"
log = logging.getLogger("specd")

# Target families whose last decoder layer the head's layer can start as, exactly: llama's own
# layer serves llama and mistral; qwen2 (q/k/v bias) and qwen3 (per-head q/k RMSNorm) get a
# one-layer model of their own family, whose math `EagleHead.unroll` covers too.
LLAMA_LAYER_FAMILIES = {"llama", "mistral"}
OWN_SHELL_FAMILIES = {"qwen2", "qwen3"}


def _shell_config(target_config, head_vocab: int):
    """The config of a one-layer llama with the target's layer shape and an R-row LM head."""
    from transformers import LlamaConfig

    c = target_config
    return LlamaConfig(
        vocab_size=head_vocab, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
        rope_parameters=_plain_rope(c), tie_word_embeddings=True, hidden_act="silu", attention_bias=False,
        mlp_bias=False)


def _plain_rope(c) -> dict:
    """The target's RoPE parameters for a llama layer: a family with RoPE per layer type gives its
    full-attention layers' parameters, and the head rotates whole heads (no partial_rotary_factor)."""
    rope = getattr(c, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_type" not in rope and isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    rope = rope or {"rope_type": "default", "rope_theta": getattr(c, "rope_theta", 10000.0)}
    return {k: v for k, v in rope.items() if k != "partial_rotary_factor"}


def _shell(target_hf, head_vocab: int) -> tuple[nn.Module, bool]:
    """The head's one-layer Hugging Face model, and whether the target's last layer maps onto its
    layer exactly (see LLAMA_LAYER_FAMILIES, OWN_SHELL_FAMILIES)."""
    from transformers import LlamaForCausalLM

    c = target_hf.config
    family = getattr(c, "model_type", None)
    if family not in OWN_SHELL_FAMILIES:
        return LlamaForCausalLM(_shell_config(c, head_vocab)), family in LLAMA_LAYER_FAMILIES
    cfg = copy.deepcopy(c)
    cfg.num_hidden_layers, cfg.vocab_size, cfg.tie_word_embeddings = 1, head_vocab, True
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[-1:]
    return type(target_hf)(cfg), True


class EagleHead(nn.Module):
    """fc + one decoder layer + norm; the LM head rows and the embedding come from the target.

    The decoder layer lives in a one-layer Hugging Face model ("shell", see `_shell`) so the fast
    runner can serve it unchanged; training runs its own forward over the same weights.
    """

    def __init__(self, target_hf, vocab_map: torch.Tensor, init: str = "last", features: tuple[int, ...] = (-1,)):
        super().__init__()
        cfg = target_hf.config
        self.shell, maps = _shell(target_hf, len(vocab_map))
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.features = tuple(int(i) for i in features)
        if not self.features or any(i < -1 or i >= cfg.num_hidden_layers for i in self.features):
            raise ValueError(f"feature layers {features}: each must be -1 (final) or in [0, "
                             f"{cfg.num_hidden_layers - 1}]")
        # EAGLE-3: fuse several target layers into the one feature the head reads. Starts as
        # "read the final hidden state" when that is among them (the single-layer head's input).
        self.fuse = None
        if self.features != (-1,):
            E = cfg.hidden_size
            self.fuse = nn.Linear(len(self.features) * E, E, bias=False)
            with torch.no_grad():
                if -1 in self.features:
                    self.fuse.weight.zero_()
                    i = self.features.index(-1)
                    self.fuse.weight[:, i * E:(i + 1) * E].copy_(torch.eye(E))
        self.register_buffer("vocab_map", vocab_map.clone().long(), persistent=False)
        tgt = target_hf.model
        if init not in ("last", "random"):
            raise ValueError(f"init must be 'last' or 'random', got {init!r}")
        src, dst = tgt.layers[-1].state_dict(), self.shell.model.layers[0].state_dict()
        # e.g. a llama with attention bias maps onto no shell here: never a partial copy
        maps = maps and src.keys() == dst.keys() and all(src[k].shape == dst[k].shape for k in src)
        if init == "last" and not maps:
            log.warning("eagle head: the last layer of a %r target does not map onto the head's layer; "
                        "starting it at random (as --eagle-init random)", getattr(cfg, "model_type", "?"))
            init = "random"
        with torch.no_grad():
            if init == "random":  # the HF initialisation of the layer; fc: a small mix of both inputs
                E = cfg.hidden_size
                self.fc.weight.normal_(0.0, 1.0 / math.sqrt(2 * E))
            # Start from the target's last layer and final norm: a head that begins as "one
            # more target layer" learns far faster than a random one. (A family whose layer does
            # not map may scale its norm otherwise, e.g. Gemma's 1 + w: the norm then starts at 1.)
            if maps:
                self.shell.model.norm.weight.copy_(tgt.norm.weight)
            if init == "last":
                self.shell.model.layers[0].load_state_dict(src)
                # fc starts as "take the token embedding" + a little of the feature.
                E = cfg.hidden_size
                self.fc.weight.zero_()
                self.fc.weight[:, :E].copy_(torch.eye(E))
                self.fc.weight[:, E:].copy_(0.1 * torch.eye(E))
        # Frozen target parts (not saved: rebuilt from the target at load time).
        self.embed = tgt.embed_tokens.weight.detach()  # [V, E]
        self.head_w = target_hf.lm_head.weight.detach()[self.vocab_map]  # [R, E]
        self.shell.lm_head.weight = nn.Parameter(self.head_w.clone(), requires_grad=False)
        self.shell.model.embed_tokens.weight.requires_grad_(False)
        rot = self.shell.model.rotary_emb
        self._inv_freq = rot.inv_freq.detach().float()
        self._rope_scale = float(getattr(rot, "attention_scaling", 1.0))
        c = self.shell.config
        self.H, self.Hkv, self.D, self.eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps

    # ---- weights ----------------------------------------------------------------------------
    def fused(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target features [..., F * E] (layers `features`) as the one feature [..., E] the
        head reads: each decoder layer's residual stream RMS-normalised (their scales differ by
        orders of magnitude), the final hidden state as it is, then mixed by `fuse`."""
        return fuse_features(hidden, self.features, None if self.fuse is None else self.fuse.weight, self.eps)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        sd = {"fc.weight": self.fc.weight}
        if self.fuse is not None:
            sd["fuse.weight"] = self.fuse.weight
        for k, v in self.shell.model.layers[0].state_dict().items():
            sd[f"layer.{k}"] = v
        sd["norm.weight"] = self.shell.model.norm.weight
        return sd

    def save(self, path: str | Path, meta: dict, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to(dtype).contiguous().clone() for k, v in self.trainable_state().items()}
        tensors["vocab_map"] = self.vocab_map.clone()
        save_file(tensors, str(path / HEAD_FILE))
        (path / META_FILE).write_text(json.dumps({**meta, "kind": "eagle", "feature_layers": list(self.features)},
                                                 indent=2))

    @classmethod
    def load(cls, path: str | Path, target_hf, features: tuple[int, ...] | None = None) -> "EagleHead":
        """A saved head; `features` overrides the checkpoint's own layers (a single-layer head
        loaded as the start of a fused one: its `fuse` then begins as "read the final state")."""
        from safetensors.torch import load_file

        t = load_file(str(Path(path) / HEAD_FILE))
        saved = tuple(json.loads((Path(path) / META_FILE).read_text()).get("feature_layers", [-1]))
        head = cls(target_hf, t.pop("vocab_map"), init="random", features=features or saved)  # all overwritten
        dt = next(target_hf.parameters()).dtype
        with torch.no_grad():
            if "fuse.weight" in t:
                w = t.pop("fuse.weight")
                if head.fuse is None or head.fuse.weight.shape != w.shape:
                    raise ValueError(f"draft {path!r} fuses target layers {saved}, not {head.features}")
                head.fuse.weight.copy_(w)
            head.fc.weight.copy_(t.pop("fc.weight"))
            head.shell.model.norm.weight.copy_(t.pop("norm.weight"))
            head.shell.model.layers[0].load_state_dict({k[len("layer."):]: v for k, v in t.items()})
        return head.to(dt)

    # ---- training forward --------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self._inv_freq  # [..., D/2]
        emb = torch.cat([freqs, freqs], -1)
        return (emb.cos() * self._rope_scale).to(dtype), (emb.sin() * self._rope_scale).to(dtype)

    @staticmethod
    def _rot(x, cos, sin):  # x [B, L, h, D], cos/sin [B or 1, L, 1, D]
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def unroll(self, tokens: torch.Tensor, hidden: torch.Tensor, steps: int,
               noise: float = 0.0) -> list[torch.Tensor]:
        """Training-time test: draft `steps` tokens ahead from every position at once.

        tokens [B, L] (the sequence), hidden [B, L, F * E] (the target's features for it).
        Step 1 at position p reads the real h_{p-1}, as at inference; step j reads the
        head's own feature from step j-1 and the (teacher-forced) token x_{p+j-1}, and
        attends to the real keys at positions <= p plus its own chain of j-1 drafted keys.
        Returns the predicted features per step, [B, L, E] each: step j at p predicts
        the target feature at position p+j-1, i.e. the distribution of x_{p+j}.
        """
        B, L = tokens.shape
        layer = self.shell.model.layers[0]
        at, mlp = layer.self_attn, layer.mlp
        H, Hkv, D = self.H, self.Hkv, self.D
        rep = H // Hkv
        dt = self.fc.weight.dtype
        g = self.fused(hidden.to(dt))
        prev = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], 1)  # h_{p-1}
        if noise > 0:
            prev = prev + (torch.rand_like(prev) - 0.5) * 2 * noise
        pos = torch.arange(L, device=tokens.device)
        causal = pos[None, :] <= pos[:, None]  # [L(query p), L(key)]
        feats, chain_k, chain_v = [], [], []
        real_k = real_v = None
        for j in range(1, steps + 1):
            # Step j's input token at start p is x_{p+j-1} (past the end: padding, never scored).
            tok = torch.cat([tokens[:, j - 1:], tokens.new_zeros(B, j - 1)], 1)
            x = self.fc(torch.cat([F.embedding(tok, self.embed).to(dt), prev], -1))  # [B, L, E]
            h = _rms_norm(x, layer.input_layernorm.weight, self.eps)
            q = at.q_proj(h).view(B, L, H, D)
            k = at.k_proj(h).view(B, L, Hkv, D)
            v = at.v_proj(h).view(B, L, Hkv, D)
            if getattr(at, "q_norm", None) is not None:  # Qwen3: each head RMS-normalised before RoPE
                q, k = at.q_norm(q), at.k_norm(k)
            cos, sin = self._rope(pos + (j - 1), dt)
            cos, sin = cos[None, :, None], sin[None, :, None]
            q, k = self._rot(q, cos, sin), self._rot(k, cos, sin)
            q = q.transpose(1, 2)  # [B, H, L, D]
            kx = k.repeat_interleave(rep, 2).transpose(1, 2)  # [B, H, L, D]
            vx = v.repeat_interleave(rep, 2).transpose(1, 2)
            if j == 1:
                real_k, real_v = kx, vx
                o = F.scaled_dot_product_attention(q, kx, vx, attn_mask=causal)
            else:
                chain_k.append(kx)
                chain_v.append(vx)
                s_real = (q @ real_k.transpose(-1, -2)) / math.sqrt(D)  # [B, H, L, L]
                s_real = s_real.masked_fill(~causal, float("-inf"))
                s_chain = torch.stack([(q * ck).sum(-1) for ck in chain_k], -1) / math.sqrt(D)  # [B,H,L,j-1]
                w = torch.softmax(torch.cat([s_real, s_chain], -1).float(), -1).to(dt)
                o = w[..., :L] @ real_v + sum(w[..., L + i, None] * cv for i, cv in enumerate(chain_v))
            x = x + at.o_proj(o.transpose(1, 2).reshape(B, L, H * D))
            h = _rms_norm(x, layer.post_attention_layernorm.weight, self.eps)
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
            f = _rms_norm(x, self.shell.model.norm.weight, self.eps)
            feats.append(f)
            prev = f  # the next step reads this step's prediction (gradients flow through it)
        return feats

    def logits(self, feat: torch.Tensor) -> torch.Tensor:
        return F.linear(feat, self.head_w.to(feat.dtype))


def fuse_features(hidden: torch.Tensor, layers: tuple[int, ...], weight: torch.Tensor | None,
                  eps: float) -> torch.Tensor:
    """See `EagleHead.fused`; weight None: a single-layer head (the features pass unchanged)."""
    if weight is None:
        return hidden
    parts = hidden.split(hidden.shape[-1] // len(layers), -1)
    parts = [p if i == -1 else p * torch.rsqrt(p.float().pow(2).mean(-1, keepdim=True) + eps).to(p.dtype)
             for i, p in zip(layers, parts)]
    return linear(torch.cat(parts, -1), weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype))


class FeatureDrafter(ModelDrafter):
    """A draft head fed target features: keeps each sequence's features of committed tokens, rolls
    its KV back to the last position whose input was a real feature, catches up, then drafts from
    its own outputs. A subclass says what the head reads:

      fused(hidden)       the target features [n, F * E_t] (layers `feature_layers`) as the feature
                          [n, E] the head pairs with a token
      _inputs(tok, prev)  the runner's input vectors for tokens paired with features (the target's
                          h_{p-1} for a committed token x_p, the head's own output for a draft)
      offset              where the pair (x_p, h_{p-1}) sits in the head's KV cache: at position p
                          (0: specd's head, which feeds x_0 with a zero feature) or at p - 1 (1:
                          the published EAGLE heads: x_0 is never fed, as in vLLM and SGLang)

    The runner's forward output is what is fed back as the next draft's feature, and
    `runner.logits` turns it into the draft distribution. Weights the head runs outside its
    runner are attributes `fc` and `fuse` (or None), which `quant.quantize_drafter` quantizes.
    """

    offset = 0
    fc: torch.Tensor | None = None
    fuse: torch.Tensor | None = None

    def __init__(self, runner: LlamaRunner, name: str, max_batch: int, max_len: int,
                 vocab_map: torch.Tensor | None, vocab_size: int, feature_layers: tuple[int, ...]):
        super().__init__(runner, name, max_batch=max_batch, max_len=max_len, vocab_map=vocab_map,
                         vocab_size=vocab_size)
        self.feature_layers = tuple(feature_layers)
        # Features of committed tokens, per slot; real[seq]: head KV positions that were computed
        # from real features (the rest were fed drafted features and are recomputed).
        self.feat = torch.zeros(max_batch, max_len + KV_HEADROOM, runner.hidden_size, dtype=runner.dtype,
                                device=runner.device)
        self.feat_len: dict[int, int] = {}
        self.real: dict[int, int] = {}

    def fused(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _inputs(self, tok: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _own_linears(self) -> list:
        """(weight, bias) pairs the head runs outside its runner (for `warm`)."""
        return []

    def _sync(self, seqs: list[DraftSeq], slots: list[int]) -> torch.Tensor:
        B, o = len(seqs), self.offset
        dev = self.runner.device
        # A row with no pair to feed (offset 1, a one-token view) drafts from a zero feature.
        last = torch.zeros(B, self.runner.hidden_size, dtype=self.runner.dtype, device=dev)
        jobs = []  # (row, slot, first KV position to feed, view)
        for b, (s, slot) in enumerate(zip(seqs, slots)):
            view = apply_view(self.views[s.seq_id], s.keep, s.new_tokens)
            n = len(view) - 1  # the last committed token: its feature is not known yet
            have = self.feat_len.get(s.seq_id, 0)
            if s.hidden is not None:
                if s.hidden_start > have:
                    raise ValueError(f"sequence {s.seq_id}: hidden states start at {s.hidden_start}, "
                                     f"the draft holds only {have}")
                self.feat[slot, s.hidden_start:s.hidden_start + len(s.hidden)] = \
                    self.fused(s.hidden.to(self.feat.device, self.feat.dtype))
                have = self.feat_len[s.seq_id] = s.hidden_start + len(s.hidden)
            if have < n:
                raise ValueError(f"draft {self.name!r} needs the target's hidden states for the first {n} "
                                 f"tokens of sequence {s.seq_id}, has {have} (the verifier must pass "
                                 "DraftSeq.hidden)")
            # KV position q holds the pair (view[q + o], h_{q + o - 1}): still valid while that token
            # is (q + o < keep) and its feature was a real one (q < real).
            real = max(0, min(self.real.get(s.seq_id, 0), s.keep - o, n + 1 - o, self.cache.lengths[slot]))
            self.cache.truncate(slot, real)
            self.real[s.seq_id] = max(real, n + 1 - o)
            if n + 1 - o > real:
                jobs.append((b, slot, real, view))
        # Feed KV positions real..n-o of each row: the pairs (x_p, h_{p-1}), p = q + o.
        short = [j for j in jobs if len(j[3]) - o - j[2] <= KV_HEADROOM]
        groups = ([sorted(short, key=lambda j: j[1])] if short else []) + \
            [[j] for j in jobs if len(j[3]) - o - j[2] > KV_HEADROOM]
        for grp in groups:
            num = [len(view) - o - real for _, _, real, view in grp]
            emb_in = None
            for i, (b, slot, real, view) in enumerate(grp):
                p0 = real + o  # the first token fed
                toks = torch.tensor(view[p0:], dtype=torch.long, device=dev)
                prev = torch.zeros(len(toks), self.runner.hidden_size, dtype=self.feat.dtype, device=dev)
                lo = max(p0 - 1, 0)
                prev[lo - (p0 - 1):] = self.feat[slot, lo:len(view) - 1]  # h_{p-1}; zeros for p = 0
                x = self._inputs(toks, prev)  # [num, E_in]
                if emb_in is None:
                    emb_in = torch.zeros(len(grp), max(num), x.shape[-1], dtype=self.runner.dtype, device=dev)
                emb_in[i, :num[i]] = x
            hidden = self.runner.forward(self.cache, [g[1] for g in grp], None, num, embeds=emb_in)
            for i, (b, slot, real, view) in enumerate(grp):
                last[b] = hidden[i, num[i] - 1]
        return last

    def _tree_inputs(self, tok: torch.Tensor, parent_feat: torch.Tensor) -> dict:
        """A feature head reads each tree node paired with its parent's feature."""
        return {"tokens": None, "embeds": self._inputs(tok, parent_feat)}

    def _advance(self, slots: list[int], tok: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return self.runner.forward(self.cache, slots, None, embeds=self._inputs(tok, last)[:, None])[:, 0]

    def warm(self) -> int:
        return super().warm() + warm_linears(self._own_linears())

    def set_view(self, seq_id: int, tokens: list[int], kv_valid: int) -> None:
        """As `ModelDrafter.set_view`: the KV that holds tokens[:kv_valid] is its first kv_valid - offset
        positions."""
        super().set_view(seq_id, tokens, max(0, kv_valid - self.offset))

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.feat_len.pop(seq_id, None)
        self.real.pop(seq_id, None)


class EagleDrafter(FeatureDrafter):
    """Serves an `EagleHead`: the pair (x_p, h_{p-1}) is fc([embed(x_p), h_{p-1}]) at KV position p
    (x_0 with a zero feature), and the head's post-norm output is fed back."""

    def __init__(self, head: EagleHead, name: str, max_batch: int = 8, max_len: int = 2048):
        head = head.eval()
        runner = LlamaRunner(head.shell)
        super().__init__(runner, name, max_batch, max_len, head.vocab_map, head.embed.shape[0], head.features)
        self.fuse = None if head.fuse is None else head.fuse.weight.detach().to(runner.dtype)  # [E, F E]
        self.eps = head.eps
        self.fc = head.fc.weight.detach().to(runner.dtype)  # [E, 2E]
        self.embed = head.embed  # the target's embedding [V, E]

    def fused(self, hidden: torch.Tensor) -> torch.Tensor:
        return fuse_features(hidden, self.feature_layers, self.fuse, self.eps)

    def _inputs(self, tok: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """fc([embed(tok), prev]): tok [...], prev [..., E] -> [..., E]."""
        return linear(torch.cat([F.embedding(tok, self.embed).to(self.fc.dtype), prev.to(self.fc.dtype)], -1),
                      self.fc)

    def _own_linears(self) -> list:
        return [(self.fc, None)] + ([(self.fuse, None)] if self.fuse is not None else [])
