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

Owns: the head module (training forward with training-time test, checkpoint
save/load) and `EagleDrafter`. Does not know: how the head is trained
(`actors/distill.py`) or acceptance.

Shapes: B rows, L positions, E hidden size, R head vocabulary, k drafting steps.
"""
from __future__ import annotations

import json
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
        rope_parameters=getattr(c, "rope_parameters", None) or {"rope_type": "default",
                                                                 "rope_theta": getattr(c, "rope_theta", 10000.0)},
        tie_word_embeddings=True, hidden_act="silu", attention_bias=False, mlp_bias=False)


class EagleHead(nn.Module):
    """fc + one decoder layer + norm; the LM head rows and the embedding come from the target.

    The decoder layer lives in a one-layer Hugging Face llama ("shell") so the fast runner
    can serve it unchanged; training runs its own forward over the same weights.
    """

    def __init__(self, target_hf, vocab_map: torch.Tensor, init: str = "last", features: tuple[int, ...] = (-1,)):
        super().__init__()
        from transformers import LlamaForCausalLM

        cfg = target_hf.config
        self.shell = LlamaForCausalLM(_shell_config(cfg, len(vocab_map)))
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
        with torch.no_grad():
            if init == "random":  # the HF initialisation of the layer; fc: a small mix of both inputs
                E = cfg.hidden_size
                self.fc.weight.normal_(0.0, 1.0 / math.sqrt(2 * E))
            # Start from the target's last layer and final norm: a head that begins as "one
            # more target layer" learns far faster than a random one.
            self.shell.model.norm.weight.copy_(tgt.norm.weight)
            if init == "last":
                self.shell.model.layers[0].load_state_dict(tgt.layers[-1].state_dict())
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
        head = cls(target_hf, t.pop("vocab_map"), features=features or saved)
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


class EagleDrafter(ModelDrafter):
    """Serves an `EagleHead`: fed with target hidden states, rolls back to the last position
    whose input was a real feature, catches up, then drafts from its own features."""

    def __init__(self, head: EagleHead, name: str, max_batch: int = 8, max_len: int = 2048):
        head = head.eval()
        runner = LlamaRunner(head.shell)
        super().__init__(runner, name, max_batch=max_batch, max_len=max_len,
                         vocab_map=head.vocab_map, vocab_size=head.embed.shape[0])
        self.feature_layers = head.features
        self.fuse = None if head.fuse is None else head.fuse.weight.detach().to(runner.dtype)  # [E, F E]
        self.eps = head.eps
        self.fc = head.fc.weight.detach().to(runner.dtype)  # [E, 2E]
        self.embed = head.embed  # the target's embedding [V, E]
        E = runner.hidden_size
        # Target features of committed tokens, per slot; real[seq]: head KV positions that were
        # computed from real features (the rest were fed drafted features and are recomputed).
        self.feat = torch.zeros(max_batch, max_len + KV_HEADROOM, E, dtype=runner.dtype, device=runner.device)
        self.feat_len: dict[int, int] = {}
        self.real: dict[int, int] = {}

    def _inputs(self, tok: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """fc([embed(tok), prev]): tok [...], prev [..., E] -> [..., E]."""
        return linear(torch.cat([F.embedding(tok, self.embed).to(self.fc.dtype), prev.to(self.fc.dtype)], -1),
                      self.fc)

    def _sync(self, seqs: list[DraftSeq], slots: list[int]) -> torch.Tensor:
        B = len(seqs)
        dev = self.runner.device
        last = torch.empty(B, self.runner.hidden_size, dtype=self.runner.dtype, device=dev)
        jobs = []  # (row, slot, first position to feed, view)
        for b, (s, slot) in enumerate(zip(seqs, slots)):
            view = apply_view(self.views[s.seq_id], s.keep, s.new_tokens)
            n = len(view) - 1  # the last committed token: its feature is not known yet
            have = self.feat_len.get(s.seq_id, 0)
            if s.hidden is not None:
                if s.hidden_start > have:
                    raise ValueError(f"sequence {s.seq_id}: hidden states start at {s.hidden_start}, "
                                     f"the draft holds only {have}")
                h = fuse_features(s.hidden.to(self.feat.device, self.feat.dtype), self.feature_layers, self.fuse,
                                  self.eps)
                self.feat[slot, s.hidden_start:s.hidden_start + len(s.hidden)] = h
                have = self.feat_len[s.seq_id] = s.hidden_start + len(s.hidden)
            if have < n:
                raise ValueError(f"draft {self.name!r} needs the target's hidden states for the first {n} "
                                 f"tokens of sequence {s.seq_id}, has {have} (the verifier must pass "
                                 "DraftSeq.hidden)")
            real = min(self.real.get(s.seq_id, 0), s.keep, n + 1, self.cache.lengths[slot])
            self.cache.truncate(slot, real)
            jobs.append((b, slot, real, view))
        # Feed positions real..n of each row: inputs fc([embed(x_p), h_{p-1}]).
        short = [j for j in jobs if len(j[3]) - j[2] <= KV_HEADROOM]
        groups = ([sorted(short, key=lambda j: j[1])] if short else []) + \
            [[j] for j in jobs if len(j[3]) - j[2] > KV_HEADROOM]
        for grp in groups:
            num = [len(view) - real for _, _, real, view in grp]
            W = max(num)
            emb_in = torch.zeros(len(grp), W, self.runner.hidden_size, dtype=self.runner.dtype, device=dev)
            for i, (b, slot, real, view) in enumerate(grp):
                toks = torch.tensor(view[real:], dtype=torch.long, device=dev)
                prev = torch.zeros(len(toks), self.runner.hidden_size, dtype=self.feat.dtype, device=dev)
                lo = max(real - 1, 0)
                prev[lo - (real - 1):] = self.feat[slot, lo:len(view) - 1]  # h_{p-1}; zeros for p = 0
                emb_in[i, :num[i]] = self._inputs(toks, prev)
            hidden = self.runner.forward(self.cache, [g[1] for g in grp], None, num, embeds=emb_in)
            for i, (b, slot, real, view) in enumerate(grp):
                last[b] = hidden[i, num[i] - 1]
                self.real[seqs[b].seq_id] = len(view)
        return last

    def _tree_inputs(self, tok: torch.Tensor, parent_feat: torch.Tensor) -> dict:
        """A feature head reads fc([embed(token), its parent's feature]) for each tree node."""
        return {"tokens": None, "embeds": self._inputs(tok, parent_feat)}

    def _advance(self, slots: list[int], tok: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return self.runner.forward(self.cache, slots, None, embeds=self._inputs(tok, last)[:, None])[:, 0]

    def warm(self) -> int:
        own = [(self.fc, None)] + ([(self.fuse, None)] if self.fuse is not None else [])
        return super().warm() + warm_linears(own)

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.feat_len.pop(seq_id, None)
        self.real.pop(seq_id, None)

