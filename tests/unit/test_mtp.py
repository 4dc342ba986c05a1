"""`--draft mtp`: the MTP layer a DeepSeek-V3 or GLM-4.5 checkpoint ships, against the published math.

Each test saves a tiny target of the family (test_families' configs) as a checkpoint directory and
writes a random MTP layer beside its weights, as `model.layers.{L}.*` in the published layout (one
tensor per expert, in a safetensors file of its own, as the real checkpoints' shards hold them).
The reference is written from the published modeling code (DeepSeek-V3 report §2.2; vLLM
deepseek_mtp.py: enorm, hnorm, eh_proj over [embedding | hidden], the decoder layer, then
shared_head's norm and head), over whole sequences without a KV cache, with Hugging Face's own
decoder layer of the family as the layer (loaded with the MTP weights) and the target's final
post-norm hidden states from Hugging Face: token x_p paired with h_{p-1} at position p - 1, the
layer's pre-norm output fed back for the next token. specd's drafter must propose its tokens, after
a rollback too, and inside the engine greedy output must stay the target's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_eagle_formats import _propose
from test_families import DEEPSEEK, GLM4_MOE, family

from actors.build import draft_kind, make_drafter, spec_feature_layers
from actors.drafters.base import DraftSeq
from actors.drafters.eagle_formats import PublishedEagleDrafter
from actors.llama import LlamaRunner, context_features
from actors.models import load_model
from helpers import rand_tokens, request, run

CASES = {"deepseek_v3": DEEPSEEK, "glm4_moe": GLM4_MOE}
EPS = 1e-6


def _mtp_tensors(model, seed: int) -> dict[str, torch.Tensor]:
    """A random MTP layer for `model` in the published layout, named model.layers.{L}.*."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    src = model.model.layers[-1].state_dict()  # a sparse layer of the family: the names and shapes of one
    E, L = cfg.hidden_size, cfg.num_hidden_layers
    out = {}
    for k, t in src.items():
        if k == "mlp.experts.gate_up_proj":
            for e in range(t.shape[0]):
                gate, up = torch.randn(t.shape[1:], generator=g).mul(0.08).chunk(2)
                out[f"mlp.experts.{e}.gate_proj.weight"], out[f"mlp.experts.{e}.up_proj.weight"] = gate, up
        elif k == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"mlp.experts.{e}.down_proj.weight"] = torch.randn(t.shape[1:], generator=g).mul(0.08)
        elif t.dim() >= 2:
            out[k] = torch.randn(t.shape, generator=g).mul(0.08)
        else:  # norms (and the routing bias) off their init
            out[k] = (t.float() + torch.randn(t.shape, generator=g) * 0.1).to(t.dtype)
    out.update({"enorm.weight": 1 + 0.1 * torch.randn(E, generator=g), "hnorm.weight": 1 + 0.1 * torch.randn(E, generator=g),
                "eh_proj.weight": torch.randn(E, 2 * E, generator=g).mul(0.08),
                "shared_head.norm.weight": 1 + 0.1 * torch.randn(E, generator=g)})
    return {f"model.layers.{L}.{k}": v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    """(family, the target loaded from its directory, the MTP tensors as written)."""
    from safetensors.torch import save_file

    name = request.param
    path = tmp_path_factory.mktemp(name)
    family(name, **CASES[name]).save_pretrained(path)
    model = load_model(str(path))
    tensors = _mtp_tensors(model.model, seed=7)
    save_file(tensors, str(path / "model-mtp.safetensors"))
    return name, model, tensors


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


@torch.no_grad()
def reference_drafts(target, tensors, context: list[int], gamma: int) -> list[int]:
    """The chain the MTP layer drafts after `context`, greedy (vLLM's proposer with deepseek_mtp)."""
    tm, cfg = target.model, target.model.config
    p = f"model.layers.{cfg.num_hidden_layers}."
    mtp = {k[len(p):]: v for k, v in tensors.items()}
    layer = type(tm.model.layers[-1])(cfg, layer_idx=cfg.num_hidden_layers - 1).eval()  # HF's sparse layer
    sd = {k: v for k, v in mtp.items() if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "mlp.experts."))}
    n = cfg.n_routed_experts
    sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([mtp[f"mlp.experts.{e}.gate_proj.weight"],
                                                             mtp[f"mlp.experts.{e}.up_proj.weight"]]) for e in range(n)])
    sd["mlp.experts.down_proj"] = torch.stack([mtp[f"mlp.experts.{e}.down_proj.weight"] for e in range(n)])
    layer.load_state_dict(sd, strict=True)
    h = tm.model(torch.tensor([context])).last_hidden_state[0][:-1]  # h_{p-1}, p = 1..n
    toks, out = list(context[1:]), []
    for _ in range(gamma):
        T = len(toks)
        x = F.linear(torch.cat([_rms(tm.model.embed_tokens.weight[torch.tensor(toks)], mtp["enorm.weight"]),
                                _rms(h, mtp["hnorm.weight"])], -1), mtp["eh_proj.weight"])[None]
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        o = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=tm.model.rotary_emb(x, pos))[0]
        tok = int(F.linear(_rms(o[-1], mtp["shared_head.norm.weight"]), tm.lm_head.weight).argmax())
        out.append(tok)
        toks, h = toks + [tok], torch.cat([h, o[-1:]])
    return out


def test_mtp_drafts_what_the_published_math_drafts(checkpoint):
    """From a fresh context, two sequences in one call, and after rollbacks (kept drafts plus a bonus
    token; a lost suffix), the drafter proposes the reference's chain."""
    _, target, tensors = checkpoint
    assert draft_kind("mtp") == "eagle" and spec_feature_layers("mtp") == (-1,)
    drafter = make_drafter("mtp", target, 4, 128)
    assert isinstance(drafter, PublishedEagleDrafter) and drafter.format == "mtp"
    runner = LlamaRunner(target.model)

    def feats(ctx):
        return context_features(runner, ctx, (-1,))

    a, b = rand_tokens(13, 1, 256), rand_tokens(7, 2, 256)
    prop = drafter.propose([DraftSeq(seq_id=1, keep=0, new_tokens=a, gamma=4, hidden=feats(a)),
                            DraftSeq(seq_id=2, keep=0, new_tokens=b, gamma=3, hidden=feats(b))])
    drafts = prop.tokens[0].tolist()
    assert drafts == reference_drafts(target, tensors, a, 4)
    assert prop.tokens[1, :3].tolist() == reference_drafts(target, tensors, b, 3)
    committed = a + drafts[:2] + [7]
    h = feats(committed)
    assert _propose(drafter, 1, len(a) + 2, [7], h[len(a) - 1:], len(a) - 1) == \
        reference_drafts(target, tensors, committed, 4)
    assert _propose(drafter, 1, 6, committed[6:], None, 0) == reference_drafts(target, tensors, committed, 4)


def test_mtp_keeps_greedy_output_in_the_engine(checkpoint, hf_greedy):
    from actors.calibrate import PassCost, grid
    from actors.engine import SpecEngine

    _, target, _ = checkpoint
    prompts = [rand_tokens(9, 3, 256) * 2, rand_tokens(5, 4, 256)]
    eng = SpecEngine(LlamaRunner(target.model), {"mtp": make_drafter("mtp", target, 2, 96)}, max_batch=2, max_len=96,
                     pass_cost=PassCost({(b, t): 0.01 * b * t for b, t in grid(2)}))
    out = run(eng, [request(f"r{i}", p, "mtp", 3, max_tokens=16, ignore_eos=True) for i, p in enumerate(prompts)])
    assert [out[f"r{i}"].token_ids for i in range(2)] == [hf_greedy(target.model, p, 16, eos=None) for p in prompts]
    assert sum(c.stats.draft_tokens for c in out.values()) > 0


def test_a_checkpoint_without_mtp_layers_or_another_family_is_refused(tmp_path):
    family("deepseek_v3", **DEEPSEEK).save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"holds no MTP layer model.layers.4"):
        make_drafter("mtp", load_model(str(tmp_path / "plain")), 2, 64)
    with pytest.raises(ValueError, match=r"MTP layers are read for \['deepseek_v3', 'glm4_moe'\] targets only"):
        make_drafter("mtp", load_model("tiny:0"), 2, 64)


def test_mtp_with_its_input_halves_swapped_drafts_otherwise(checkpoint, monkeypatch):
    """The check can fail: eh_proj over [hnorm(hidden) | enorm(embedding)] (the halves swapped)."""
    _, target, tensors = checkpoint
    drafter = make_drafter("mtp", target, 2, 128)

    def swapped(tok, prev):
        e = F.embedding(tok, drafter.embed)
        return F.linear(torch.cat([_rms(prev.to(e.dtype), drafter.hnorm), _rms(e, drafter.enorm)], -1), drafter.eh_proj)

    monkeypatch.setattr(drafter, "_inputs", swapped)
    a = rand_tokens(13, 1, 256)
    got = _propose(drafter, 1, 0, a, context_features(LlamaRunner(target.model), a, (-1,)), 0)
    assert got != reference_drafts(target, tensors, a, 4)
