"""Multi-token-prediction drafts from the target's own checkpoint (`--draft mtp`).

DeepSeek-V3 and GLM-4.5 ship MTP layers after their decoder layers, as `model.layers.{L}.*` for a
target of L layers (`num_nextn_predict_layers` of them; Hugging Face's model drops them at load).
The first is served as a draft head, with the published math (DeepSeek-V3 report §2.2; vLLM's
deepseek_mtp.py and glm4_moe_mtp.py; SGLang's deepseek_nextn.py):

    h' = eh_proj([enorm(embed(x_p)) | hnorm(h_{p-1})])       h_{p-1}: the target's final (post-norm)
    o  = the MTP decoder layer over h' (MLA or the family's     hidden state at position p-1
         attention, its MoE, its input and post-attention norms)
    logits = shared_head.head(shared_head.norm(o))

The pair (x_p, h_{p-1}) sits at KV and RoPE position p - 1, as the published EAGLE heads do
(`eagle_formats.PublishedEagleDrafter`, offset 1). Drafting k > 1 tokens chains the same layer,
feeding back its own pre-norm output o as the next h, as vLLM does: the layer was trained to predict
one token ahead from the target's states, so acceptance falls with each chained position.

Tensors are read from the checkpoint's safetensors (its index where there is one), in either
layout: the published one (`mlp.experts.{e}.gate_proj/up_proj/down_proj`) or Hugging Face's fused
one (`mlp.experts.gate_up_proj`, `down_proj`). The embedding and the head default to the target's
where the layer ships none.

Owns: reading the MTP layer and serving it. Does not know: training (the layers come trained).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from .eagle_formats import PublishedEagleDrafter, PublishedHead

SPEC = "mtp"
MTP_TYPES = {"deepseek_v3", "glm4_moe"}
_OWN = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
        "shared_head.head.weight")
_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # kept in fp32, as Hugging Face keeps the target's


def checkpoint_dir(target_hf) -> Path:
    path = Path(getattr(target_hf.config, "_name_or_path", "") or "")
    if not (path / "config.json").is_file():
        raise ValueError("draft 'mtp': the target was not loaded from a checkpoint directory, so its MTP layers "
                         "cannot be read")
    return path


def _read_prefixed(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor whose name starts with `prefix`, from the checkpoint's safetensors, keyed without it."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({f for k, f in json.loads(index.read_text())["weight_map"].items() if k.startswith(prefix)})
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    out = {}
    for name in files:
        with safe_open(str(path / name), "pt") as f:
            out.update({k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})
    return out


def _fuse_experts(block: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The published per-expert tensors as Hugging Face's fused ones (other keys unchanged)."""
    per = {k for k in block if k.startswith("mlp.experts.") and k.split(".")[2].isdigit()}
    if not per:
        return block
    n = 1 + max(int(k.split(".")[2]) for k in per)
    out = {k: v for k, v in block.items() if k not in per}

    def w(e, name):
        return block[f"mlp.experts.{e}.{name}.weight"]
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w(e, "gate_proj"), w(e, "up_proj")]) for e in range(n)])
    out["mlp.experts.down_proj"] = torch.stack([w(e, "down_proj") for e in range(n)])
    return out


def read_mtp(target_hf) -> PublishedHead:
    """The target's first MTP layer as a head (`PublishedHead`, format "mtp")."""
    cfg = target_hf.config
    what = f"draft 'mtp' for {cfg.model_type}"
    if cfg.model_type not in MTP_TYPES:
        raise ValueError(f"{what}: MTP layers are read for {sorted(MTP_TYPES)} targets only")
    L = cfg.num_hidden_layers
    tensors = _read_prefixed(checkpoint_dir(target_hf), f"model.layers.{L}.")
    missing = [k for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
               if k not in tensors]
    if missing:
        raise ValueError(f"{what}: the checkpoint holds no MTP layer model.layers.{L}.* (missing {missing}; "
                         f"num_nextn_predict_layers is {getattr(cfg, 'num_nextn_predict_layers', None)})")
    dt = next(target_hf.parameters()).dtype
    block = _fuse_experts({k: v for k, v in tensors.items() if k not in _OWN})
    sparse = any(k.startswith("mlp.experts.") for k in block)
    shell_cfg = copy.deepcopy(cfg)
    shell_cfg.num_hidden_layers = 1
    shell_cfg.first_k_dense_replace = 0 if sparse else 1
    with torch.device("meta"):
        shell = type(target_hf)(shell_cfg)
    state = {f"model.layers.0.{k}": v for k, v in block.items()}
    embed = tensors.get("embed_tokens.weight", target_hf.model.embed_tokens.weight.detach())
    state.update({"model.embed_tokens.weight": embed, "model.norm.weight": tensors["shared_head.norm.weight"],
                  "lm_head.weight": tensors.get("shared_head.head.weight", target_hf.lm_head.weight.detach())})
    try:
        shell.load_state_dict({k: v if k.endswith(_FP32) else v.to(dt) for k, v in state.items()},
                              strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{what}: its layer does not match the target's config: {e}") from None
    shell.model.rotary_emb = type(target_hf.model.rotary_emb)(config=shell_cfg)
    shell.eval()
    head = PublishedHead("mtp", shell, embed.to(dt), (-1,), None, final_norm=tensors["shared_head.norm.weight"].to(dt))
    head.enorm, head.hnorm = tensors["enorm.weight"].to(dt), tensors["hnorm.weight"].to(dt)
    head.eh_proj = tensors["eh_proj.weight"].to(dt)
    return head


def load_mtp(target, max_batch: int = 8, max_len: int = 2048) -> PublishedEagleDrafter:
    """The drafter of `--draft mtp` for `target` (a `models.LoadedModel`)."""
    return PublishedEagleDrafter(read_mtp(target.model), SPEC, max_batch=max_batch, max_len=max_len)


META = {"kind": "eagle", "format": "mtp", "name": SPEC, "qat": "none", "feature_layers": [-1]}
