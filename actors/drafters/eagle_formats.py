"""Published EAGLE draft heads, trained outside specd, served as vLLM and SGLang serve them.

A checkpoint is a directory holding config.json and model.safetensors (or pytorch_model.bin):

  EAGLE-3    SpecForge's `LlamaForCausalLMEagle3` (the EAGLE repo's EAGLE-3 heads are the same).
             config.json: a llama config of the head (hidden_size, heads, intermediate_size,
             rms_norm_eps, rope) with `draft_vocab_size`, optionally `target_hidden_size`, and
             the target layers it reads (see `aux_layers`). Weights: fc.weight [E, 3 E_t] (and
             fc.bias, SGLang's config `bias`); midlayer.* (one decoder layer whose q/k/v read 2E:
             [input_layernorm(embedding) | hidden_norm(feature)], midlayer.hidden_norm.weight;
             "layers.0." is read as "midlayer.", vLLM's name); norm.weight; lm_head.weight
             [draft_vocab_size, E]; optionally embed_tokens.weight, d2t [draft_vocab_size], t2d.
  EAGLE-1/2  the EAGLE repo's heads (SafeAILab/EAGLE eagle/model/cnets1.py). config.json: a
             llama config; fc.weight [E, 2E] over [embedding | feature] and fc.bias (config
             `bias`); layers.{i}.* where layer 0 has no input_layernorm (q/k/v bias: config
             `qkv_bias`); no final norm; the target's LM head; optionally embed_tokens.weight.

What they compute, as read in vLLM (vllm/model_executor/models/llama_eagle3.py, llama_eagle.py,
vllm/v1/spec_decode/eagle.py), SGLang (python/sglang/srt/models/llama_eagle3.py) and the EAGLE
repo (eagle/model/cnets.py, cnets1.py, ea_model.py):
  - Token x_p is paired with the feature of token p-1 and fed at KV and RoPE position p-1: vLLM
    shifts the input ids by one against the target's positions, EAGLE drops input_ids[:, 0].
    x_0 is never fed (specd's own head feeds it with a zero feature at position 0).
  - The feature of a committed token: EAGLE-3, fc over the target's auxiliary states,
    concatenated in layer order (each the residual stream entering a target layer, i.e. the
    output of the layer before it); EAGLE-1, the target's final post-norm hidden state.
  - Drafting feeds back the head's own output before any final norm: EAGLE-3's layer returns the
    residual stream, `norm` is applied only for the logits (vLLM: `last_hidden_states,
    hidden_states = model(...)`, the second fed back; SGLang: "we capture the hidden state
    before norm"; EAGLE: `input_hidden = out_hidden`, `lm_head(norm(out_hidden))`). EAGLE-1 has
    no final norm: its output is fed back and read by the target's LM head.
  - Draft row r is target token r + d2t[r]; t2d (the same map as a mask over target ids) is
    not needed.
  - embed_tokens, and for EAGLE-3 lm_head, default to the target's when the checkpoint has none
    (vLLM shares them). An EAGLE-3 lm_head.weight is read whatever tie_word_embeddings says
    (SpecForge's configs say true and ship one; vLLM reads it). An EAGLE-1 head's fc.bias is used,
    as the EAGLE repo trains and runs it (vLLM's EAGLE-1 fc has no bias and skips it).
  - Target layer ids: `aux_layers` (vLLM's and SpecForge's conventions differ by one).

Refused with a message (never served approximately): speculators' layout and its
`norm_before_residual`, HASS `add_para_norm`, an EAGLE-3 head of more than one layer, o_proj or
MLP biases, a vocabulary or hidden size that does not match the target, unknown weights.

Owns: recognising these checkpoints (`published_format`, `published_meta`), loading them
(`load_published`) and `PublishedEagleDrafter`. Does not know: how they were trained, or specd's
own head (`eagle.py`, `specd distill`).

Shapes: E the head's hidden size, E_t the target's, V the vocabulary, R the head's rows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..llama import LlamaRunner, _rms_norm, linear
from .eagle import META_FILE, FeatureDrafter

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
FORMATS = {"eagle3": "EAGLE-3", "eagle1": "EAGLE-1/2", "mtp": "MTP"}  # mtp: the target's own layer (`mtp.py`)
_NAMED = {"eagle3": ("fc.weight", "fc.bias", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d"),
          "eagle1": ("fc.weight", "fc.bias", "embed_tokens.weight")}


def _weights_file(path: Path) -> Path | None:
    return next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)


def _read(file: Path, keys_only: bool = False):
    if file.suffix == ".safetensors":
        if keys_only:
            from safetensors import safe_open

            with safe_open(str(file), "pt") as f:
                return set(f.keys())
        from safetensors.torch import load_file

        return load_file(str(file))
    try:
        sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (non-zip) serialization cannot be memory-mapped
        sd = torch.load(file, map_location="cpu", weights_only=True)
    return set(sd) if keys_only else dict(sd)


def published_format(path: str | Path) -> str | None:
    """"eagle3", "eagle1", or None: not a published EAGLE head (a `specd distill` checkpoint, a
    plain Hugging Face model, a spec that is no directory). Reads config.json's presence and the
    weight names only."""
    path = Path(path)
    if not (path / "config.json").is_file() or (path / META_FILE).exists():
        return None
    file = _weights_file(path)
    if file is None:
        return None
    keys = _read(file, keys_only=True)
    if any(k.startswith(("midlayer.", "layers.0.hidden_norm.")) for k in keys):
        return "eagle3"
    if "fc.weight" in keys and "layers.0.self_attn.q_proj.weight" in keys:
        return "eagle1"
    return None


def aux_layers(cfg: dict, target_layers: int | None = None) -> tuple[int, ...] | None:
    """The target features (specd's numbering: i = the output of decoder layer i, -1 the final
    hidden state) an EAGLE-3 head's fc reads, in the order it reads them. None where they depend
    on a target that is not given.

    The config names them one of two ways, and a third is the default:
      eagle_aux_hidden_state_layer_ids                vLLM's (speculators'): j = the state entering
                                                      layer j, i.e. specd's j - 1
      eagle_config.eagle_aux_hidden_state_layer_ids   SpecForge's, which SGLang captures at j + 1:
                                                      the output of layer j, specd's j
      neither                                         vLLM's and SGLang's default: the states
                                                      entering layers 2, L/2 and L-3
    Both runtimes capture the states in layer order, each once, and only states entering a layer:
    the ids are sorted, and a repeated one (the fc would read fewer states than it was trained
    on) or the last layer's output (Hugging Face's last hidden state is post-norm) is refused.
    eagle_config.use_aux_hidden_state false: no fc, the final hidden state (vLLM)."""
    eagle = cfg.get("eagle_config") or {}
    if not eagle.get("use_aux_hidden_state", True):
        return (-1,)
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        named = cfg["eagle_aux_hidden_state_layer_ids"]
        if min(named) < 1:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids {named}: id 0 (the embeddings) is no target "
                             "feature specd keeps")
        ids = [int(j) - 1 for j in named]
    elif eagle.get("eagle_aux_hidden_state_layer_ids"):
        named = eagle["eagle_aux_hidden_state_layer_ids"]
        ids = [int(j) for j in named]
    elif target_layers is None:
        return None
    else:
        named = f"the default (2, {target_layers} // 2, {target_layers} - 3) for a {target_layers}-layer target"
        ids = [1, target_layers // 2 - 1, target_layers - 4]
    if len(set(ids)) != len(ids) or min(ids) < 0:
        raise ValueError(f"EAGLE-3 aux layers {named}: they must be distinct target layers (pin "
                         "eagle_aux_hidden_state_layer_ids in config.json)")
    if target_layers is not None and max(ids) >= target_layers - 1:  # both capture a state entering a layer
        raise ValueError(f"EAGLE-3 aux layers {named}: the target has {target_layers} layers, and the state "
                         f"after its last one is captured by neither vLLM nor SGLang")
    return tuple(sorted(ids))


def published_meta(path: str | Path) -> dict | None:
    """What `build.draft_meta` says of a published head (kind "eagle", its format and the target
    features it reads: None where they depend on the target), or None for anything else."""
    fmt = published_format(path)
    if fmt is None:
        return None
    layers = (-1,) if fmt == "eagle1" else aux_layers(json.loads((Path(path) / "config.json").read_text()))
    return {"kind": "eagle", "format": fmt, "name": Path(path).name, "qat": "none",
            "feature_layers": None if layers is None else list(layers)}


@dataclass
class PublishedHead:
    """A published head's weights in the target's dtype, laid out for the fast runner."""
    format: str  # "eagle3" | "eagle1" | "mtp"
    shell: nn.Module  # a llama of its decoder layer(s) (layer 0's q/k/v read 2E for EAGLE-3) and R-row LM head
    embed: torch.Tensor  # [V, E]
    features: tuple[int, ...]  # the target features it reads (`aux_layers`)
    vocab_map: torch.Tensor | None  # [R] target id of each LM head row (r + d2t[r]); None: R = V
    fc: torch.Tensor | None = None  # EAGLE-1's input projection [E, 2E] over [embedding | feature]
    fc_bias: torch.Tensor | None = None
    fuse: torch.Tensor | None = None  # EAGLE-3's fc [E, F E_t] over the concatenated target features
    fuse_bias: torch.Tensor | None = None
    hidden_norm: torch.Tensor | None = None  # EAGLE-3: [E], the feature half's norm in layer 0
    final_norm: torch.Tensor | None = None  # EAGLE-3 (MTP's shared_head.norm): [E], applied for the logits only
    # MTP (`mtp.py`): eh_proj [E, 2E] over [enorm(embedding) | hnorm(feature)]
    enorm: torch.Tensor | None = None
    hnorm: torch.Tensor | None = None
    eh_proj: torch.Tensor | None = None


def read_published(path: str | Path, target_hf) -> PublishedHead:
    """Load a published head for `target_hf` (a Hugging Face causal LM), refusing what cannot be
    served exactly (see the module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    path = Path(path)
    fmt = published_format(path)
    if fmt is None:
        raise ValueError(f"{str(path)!r} is not a published EAGLE head (config.json with {' or '.join(WEIGHT_FILES)} "
                         "holding EAGLE-3 midlayer.* or EAGLE-1 fc + layers.* weights)")
    what = f"{FORMATS[fmt]} draft {str(path)!r}"
    raw = json.loads((path / "config.json").read_text())
    if "speculators_model_type" in raw or "hidden_size" not in raw:
        raise ValueError(f"{what}: only SpecForge's and the EAGLE repo's layout (a llama config.json) is read, "
                         "not speculators' (transformer_layer_config)")
    for key, name in (("norm_before_residual", "speculators' norm_before_residual"),
                      ("add_para_norm", "HASS's add_para_norm")):
        if raw.get(key):
            raise ValueError(f"{what}: {name} is not supported")
    tc = target_hf.config
    dt = next(target_hf.parameters()).dtype
    V, Et, L = tc.vocab_size, tc.hidden_size, tc.num_hidden_layers
    E = int(raw["hidden_size"])
    if int(raw.get("vocab_size", V)) != V:
        raise ValueError(f"{what} has vocab_size {raw.get('vocab_size')}, the target {V}: a draft must share "
                         "the target's tokenizer")
    if int(raw.get("target_hidden_size", E if fmt == "eagle1" else Et)) != Et or (fmt == "eagle1" and E != Et):
        raise ValueError(f"{what} reads target features of size {raw.get('target_hidden_size', E)}, the target's "
                         f"hidden size is {Et}")
    n_layers = int(raw.get("num_hidden_layers", 1))
    if fmt == "eagle3" and n_layers != 1:
        raise ValueError(f"{what}: num_hidden_layers {n_layers}; an EAGLE-3 head has one decoder layer")
    features = (-1,) if fmt == "eagle1" else aux_layers(raw, L)

    # Sort the weights: decoder layer(s), the named tensors, and anything else (refused).
    w = _read(_weights_file(path))
    layer, named, unknown, hidden_norm = {}, {}, [], None
    for k, t in w.items():
        if fmt == "eagle3" and k.startswith(("midlayer.", "layers.0.")):
            sub = k.split(".", 1)[1] if k.startswith("midlayer.") else k[len("layers.0."):]
            if sub == "hidden_norm.weight":
                hidden_norm = t
            else:
                layer[f"model.layers.0.{sub}"] = t
        elif fmt == "eagle1" and k.startswith("layers.") and k.split(".")[1].isdigit() \
                and int(k.split(".")[1]) < n_layers:
            i, sub = k.split(".", 2)[1:]
            if not (i == "0" and sub == "input_layernorm.weight"):  # layer 0 has none (both loaders drop it)
                layer[f"model.layers.{i}.{sub}"] = t
        elif k in _NAMED[fmt]:
            named[k] = t
        else:
            unknown.append(k)
    if unknown:
        raise ValueError(f"{what}: weights it does not know how to serve: {sorted(unknown)[:8]}")
    if fmt == "eagle3" and hidden_norm is None:
        raise ValueError(f"{what}: midlayer.hidden_norm.weight is missing")

    embed = named.get("embed_tokens.weight", target_hf.model.embed_tokens.weight.detach())
    if tuple(embed.shape) != (V, E):
        raise ValueError(f"{what}: its embedding would be {tuple(embed.shape)}, it needs [{V}, {E}] (a head whose "
                         "hidden size differs from the target's ships its own embed_tokens)")
    # The LM head rows and the target token each of them means.
    d2t = named.get("d2t")
    R = int(raw.get("draft_vocab_size") or V) if fmt == "eagle3" else V
    vmap = None
    if d2t is not None:
        if len(d2t) != R:
            raise ValueError(f"{what}: d2t has {len(d2t)} entries for {R} draft tokens")
        vmap = torch.arange(R) + d2t.long()
        if int(vmap.min()) < 0 or int(vmap.max()) >= V or len(vmap.unique()) != R:
            raise ValueError(f"{what}: d2t maps draft tokens outside the target's {V} or onto the same one")
    elif R != V:
        raise ValueError(f"{what}: draft_vocab_size {R} < vocab_size {V} needs d2t")
    head = named.get("lm_head.weight") if fmt == "eagle3" else None
    if head is None:  # the target's LM head (EAGLE-1's always), its rows for this head's tokens
        if E != Et:
            raise ValueError(f"{what}: no lm_head.weight, and the target's does not fit its hidden size {E}")
        head = target_hf.lm_head.weight.detach()
        head = head if vmap is None else head[vmap]
    if tuple(head.shape) != (R, E):
        raise ValueError(f"{what}: lm_head.weight is {tuple(head.shape)}, expected [{R}, {E}]")

    # The shell: a llama with the head's layer(s), built on the meta device, then given the
    # checkpoint's tensors (no random initialisation of a large vocabulary).
    rope = dict(LlamaConfig.from_dict(dict(raw)).rope_parameters or {})
    max_pos = int(raw.get("max_position_embeddings", 2048))
    if rope.get("rope_type", "default") in ("default", "linear", "llama3"):  # frequencies independent of it:
        max_pos = max(max_pos, int(getattr(tc, "max_position_embeddings", max_pos)))  # serve the target's length
    cfg = LlamaConfig.from_dict({**raw, "vocab_size": R, "num_hidden_layers": n_layers, "tie_word_embeddings": False,
                                 "attention_bias": False, "mlp_bias": False, "max_position_embeddings": max_pos,
                                 "architectures": ["LlamaForCausalLM"]})
    with torch.device("meta"):
        shell = LlamaForCausalLM(cfg)
        shell.model.embed_tokens = nn.Embedding(V, E)  # the full vocabulary's (the LM head has R rows)
        for i, lyr in enumerate(shell.model.layers):
            for name in ("q_proj", "k_proj", "v_proj"):
                out = getattr(lyr.self_attn, name).out_features
                bias = f"model.layers.{i}.self_attn.{name}.bias" in layer
                setattr(lyr.self_attn, name, nn.Linear(2 * E if fmt == "eagle3" and i == 0 else E, out, bias=bias))
    ones = torch.ones(E)
    if fmt == "eagle3" and "norm.weight" not in named:
        raise ValueError(f"{what}: norm.weight is missing")
    state = {**layer, "model.embed_tokens.weight": embed, "lm_head.weight": head,
             "model.norm.weight": named.get("norm.weight", ones)}  # EAGLE-1: none (HeadRunner applies none)
    if fmt == "eagle1":
        state["model.layers.0.input_layernorm.weight"] = ones  # not applied (LayerWeights.attn_norm None)
    try:
        shell.load_state_dict({k: v.to(dt) for k, v in state.items()}, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{what}: its decoder layer does not match its config, or holds weights the runner "
                         f"cannot serve (o_proj or MLP bias): {e}") from None
    shell.model.rotary_emb = LlamaRotaryEmbedding(config=cfg)
    shell.eval()

    out = PublishedHead(fmt, shell, embed.to(dt), features, vmap)
    fc, fc_b = named.get("fc.weight"), named.get("fc.bias")
    if fmt == "eagle1":
        if fc is None or tuple(fc.shape) != (E, 2 * E):
            raise ValueError(f"{what}: fc.weight must be [{E}, {2 * E}]")
        out.fc, out.fc_bias = fc.to(dt), None if fc_b is None else fc_b.to(dt)
    else:
        out.hidden_norm, out.final_norm = hidden_norm.to(dt), named["norm.weight"].to(dt)
        if features != (-1,):
            if fc is None or tuple(fc.shape) != (E, len(features) * Et):
                raise ValueError(f"{what}: fc.weight must be [{E}, {len(features) * Et}] (target layers {features})")
            out.fuse, out.fuse_bias = fc.to(dt), None if fc_b is None else fc_b.to(dt)
        elif E != Et:
            raise ValueError(f"{what}: reads the final hidden state (no fc) but its hidden size differs")
    return out


class HeadRunner(LlamaRunner):
    """A published head's decoder: `forward` returns the residual stream before any final norm
    (what the head feeds back), `logits` apply the final norm (EAGLE-3's `norm`; EAGLE-1 has
    none) and the LM head."""

    def __init__(self, head: PublishedHead):
        super().__init__(head.shell)
        self.norm = None
        self.final_norm = head.final_norm
        if head.format == "eagle3":
            self.layers[0].hidden_norm = head.hidden_norm  # attention reads [norm(embedding) | norm(feature)]
        elif head.format == "eagle1":
            self.layers[0].attn_norm = None  # EAGLE-1's layer 0 has no input norm

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., E] (pre-norm) -> logits [..., R]."""
        if self.final_norm is not None:
            hidden = _rms_norm(hidden, self.final_norm, self.eps)
        return linear(hidden, self.lm_head)


class PublishedEagleDrafter(FeatureDrafter):
    """Serves a `PublishedHead` with vLLM's semantics (module docstring): the pair (x_p, h_{p-1})
    at KV position p - 1, the head's pre-norm output fed back, draft rows mapped through d2t."""

    offset = 1

    def __init__(self, head: PublishedHead, name: str, max_batch: int = 8, max_len: int = 2048):
        runner = HeadRunner(head)
        super().__init__(runner, name, max_batch, max_len, head.vocab_map, head.embed.shape[0], head.features)
        self.format = head.format
        self.embed = head.embed  # [V, E]
        self.fc, self.fc_bias = head.fc, head.fc_bias
        self.fuse, self.fuse_bias = head.fuse, head.fuse_bias
        self.enorm, self.hnorm, self.eh_proj = head.enorm, head.hnorm, head.eh_proj

    def fused(self, hidden: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: fc over the concatenated target layers [n, F E_t] -> [n, E]; EAGLE-1: as is."""
        return hidden if self.fuse is None else linear(hidden, self.fuse, self.fuse_bias)

    def _inputs(self, tok: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: [embed(tok) | prev] ([..., 2E], normalised halves inside layer 0); EAGLE-1:
        fc([embed(tok) | prev]) ([..., E]); MTP: eh_proj([enorm(embed(tok)) | hnorm(prev)])."""
        e = F.embedding(tok, self.embed)
        if self.eh_proj is not None:
            eps = self.runner.eps
            x = torch.cat([_rms_norm(e, self.enorm, eps), _rms_norm(prev.to(e.dtype), self.hnorm, eps)], -1)
            return linear(x, self.eh_proj)
        x = torch.cat([e, prev.to(e.dtype)], -1)
        return x if self.fc is None else linear(x, self.fc, self.fc_bias)

    def _own_linears(self) -> list:
        return [(w, b) for w, b in ((self.fc, self.fc_bias), (self.fuse, self.fuse_bias), (self.eh_proj, None))
                if w is not None]


def load_published(path: str | Path, target, max_batch: int = 8, max_len: int = 2048) -> PublishedEagleDrafter:
    """A drafter for a published EAGLE head directory and `target` (a `models.LoadedModel`)."""
    return PublishedEagleDrafter(read_published(path, target.model), Path(path).name, max_batch=max_batch,
                                 max_len=max_len)
