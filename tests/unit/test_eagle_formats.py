"""Published EAGLE heads through `--draft PATH` (`make_drafter`), against the published math.

Each test writes a checkpoint in a published layout with random weights: SpecForge's EAGLE-3
(`LlamaForCausalLMEagle3`: fc over three target layers, a midlayer with hidden_norm, norm,
an lm_head over a draft vocabulary mapped to target ids by d2t; safetensors) and the EAGLE repo's
EAGLE-1/2 (fc with bias over [embedding | feature], layer 0 without input norm, no final norm, the
target's LM head; pytorch_model.bin). The reference below is written from the published modeling
code (vLLM llama_eagle3.py, llama_eagle.py and v1/spec_decode/eagle.py; SpecForge llama3_eagle.py;
EAGLE cnets.py and cnets1.py), not from specd's runner: whole sequences without a KV cache, the
target's states from Hugging Face's own `output_hidden_states` indexed with vLLM's layer ids (the
state entering layer j), token x_p paired with the feature of x_{p-1} at position p-1, the pre-norm
output fed back. specd's drafter must propose exactly its tokens, after rollbacks too and inside
the engine, where greedy output must stay the target's own.

specd's own EAGLE-3-style head does not map onto the published architecture in either direction
(its layer input is fc([embedding, fused feature]) under one input norm with that sum as the
residual stream, where the published layer normalises the two halves apart and keeps the feature
alone as the residual; its fused feature RMS-normalises each decoder layer and includes the final
hidden state; it feeds back the post-norm output), so no shipped head is converted here.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from actors.build import draft_kind, draft_meta, make_drafter, spec_feature_layers
from actors.drafters.base import DraftSeq
from actors.drafters.eagle_formats import PublishedEagleDrafter, aux_layers, published_format
from actors.engine import SpecEngine
from actors.llama import LlamaRunner, context_features
from actors.models import load_model
from actors.schema import Request, SamplingParams, SpeculationParams
from helpers import rand_tokens, request, run

V, ET, EPS = 512, 64, 1e-5  # the tiny target: vocabulary, hidden size, norm eps (4 layers)
R = 200  # the EAGLE-3 head's draft vocabulary


@pytest.fixture(scope="module")
def target():
    return load_model("tiny:1")


def _w(g, *shape, std=0.15):
    return torch.randn(*shape, generator=g) * std


def _norm_w(g, n):
    return 1.0 + 0.2 * torch.randn(n, generator=g)


def _layer(g, prefix, E, in_dim, H, Hkv, D, I, input_norm=True, qkv_bias=False):
    a, m = f"{prefix}self_attn.", f"{prefix}mlp."
    sd = {f"{a}q_proj.weight": _w(g, H * D, in_dim), f"{a}k_proj.weight": _w(g, Hkv * D, in_dim),
          f"{a}v_proj.weight": _w(g, Hkv * D, in_dim), f"{a}o_proj.weight": _w(g, E, H * D),
          f"{m}gate_proj.weight": _w(g, I, E), f"{m}up_proj.weight": _w(g, I, E), f"{m}down_proj.weight": _w(g, E, I),
          f"{prefix}post_attention_layernorm.weight": _norm_w(g, E)}
    if input_norm:
        sd[f"{prefix}input_layernorm.weight"] = _norm_w(g, E)
    if qkv_bias:
        for n, rows in (("q", H * D), ("k", Hkv * D), ("v", Hkv * D)):
            sd[f"{prefix}self_attn.{n}_proj.bias"] = _w(g, rows, std=0.1)
    return sd


def write_eagle3(path, seed=0, E=48, ids=("vllm", [1, 2, 3]), own_embed=True, fc_bias=False, V=V, ET=ET):
    """A SpecForge-layout EAGLE-3 head for the tiny target (or another of vocabulary V and hidden size
    ET): E may differ from the target's (then it ships its embedding); ids: ("vllm", top-level ids: the
    state entering layer j) or ("specforge", eagle_config ids: the output of layer j). Returns (config,
    state dict)."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D, I = 4, 2, E // 4, 2 * E
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": E,
           "intermediate_size": I, "num_attention_heads": H, "num_key_value_heads": Hkv, "head_dim": D,
           "num_hidden_layers": 1, "rms_norm_eps": EPS, "rope_theta": 10000.0, "max_position_embeddings": 512,
           "vocab_size": V, "draft_vocab_size": R, "tie_word_embeddings": True, "hidden_act": "silu",
           "target_hidden_size": ET, "torch_dtype": "bfloat16"}
    if ids[0] == "vllm":
        cfg["eagle_aux_hidden_state_layer_ids"] = list(ids[1])
    else:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids[1])}
    if fc_bias:
        cfg["bias"] = True
    keep = torch.randperm(V, generator=g)[:R].sort().values  # the draft vocabulary's target ids
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    sd = {"fc.weight": _w(g, E, 3 * ET, std=0.08), "midlayer.hidden_norm.weight": _norm_w(g, E),
          **_layer(g, "midlayer.", E, 2 * E, H, Hkv, D, I), "norm.weight": _norm_w(g, E),
          "lm_head.weight": _w(g, R, E, std=0.3), "d2t": keep - torch.arange(R), "t2d": t2d}
    if own_embed:
        sd["embed_tokens.weight"] = _w(g, V, E, std=1.0)
    if fc_bias:
        sd["fc.bias"] = _w(g, E, std=0.1)
    _save(path, cfg, sd, "safetensors")
    return cfg, sd


def write_eagle1(path, seed=0, layers=2, qkv_bias=True):
    """An EAGLE-repo EAGLE-1/2 head for the tiny target (hidden size 64), as pytorch_model.bin."""
    g = torch.Generator().manual_seed(seed)
    E, H, Hkv, D, I = ET, 4, 2, 16, 128
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": E, "intermediate_size": I,
           "num_attention_heads": H, "num_key_value_heads": Hkv, "num_hidden_layers": layers, "rms_norm_eps": EPS,
           "rope_theta": 10000.0, "max_position_embeddings": 512, "vocab_size": V, "hidden_act": "silu",
           "bias": True, "qkv_bias": qkv_bias}
    sd = {"fc.weight": _w(g, E, 2 * E, std=0.1), "fc.bias": _w(g, E, std=0.1)}
    for i in range(layers):
        sd.update(_layer(g, f"layers.{i}.", E, E, H, Hkv, D, I, input_norm=i > 0, qkv_bias=qkv_bias))
    _save(path, cfg, sd, "bin")
    return cfg, sd


def _save(path, cfg, sd, fmt):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    sd = {k: v.contiguous() for k, v in sd.items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(sd, str(path / "model.safetensors"))
    else:
        torch.save(sd, path / "pytorch_model.bin")


# ---- the reference: published math, whole sequences, no KV cache ---------------------------------------
def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x, theta=10000.0):  # x [T, h, D] at positions 0..T-1, rotate_half convention
    T, _, D = x.shape
    inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    f = torch.arange(T).float()[:, None] * inv
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _decoder(sd, p, attn_in, resid, H, Hkv):
    """One llama decoder layer over a whole sequence: attention reads attn_in [T, *], the residual
    stream is resid [T, E]."""
    T = attn_in.shape[0]
    q = F.linear(attn_in, sd[f"{p}self_attn.q_proj.weight"], sd.get(f"{p}self_attn.q_proj.bias")).view(T, H, -1)
    k = F.linear(attn_in, sd[f"{p}self_attn.k_proj.weight"], sd.get(f"{p}self_attn.k_proj.bias")).view(T, Hkv, -1)
    v = F.linear(attn_in, sd[f"{p}self_attn.v_proj.weight"], sd.get(f"{p}self_attn.v_proj.bias")).view(T, Hkv, -1)
    q, k = _rope(q), _rope(k)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    s = torch.einsum("thd,uhd->htu", q, k) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    a = torch.einsum("htu,uhd->thd", s.softmax(-1), v).reshape(T, -1)
    x = resid + F.linear(a, sd[f"{p}self_attn.o_proj.weight"])
    m = _rms(x, sd[f"{p}post_attention_layernorm.weight"])
    return x + F.linear(F.silu(F.linear(m, sd[f"{p}mlp.gate_proj.weight"])) * F.linear(m, sd[f"{p}mlp.up_proj.weight"]),
                        sd[f"{p}mlp.down_proj.weight"])


def _capture_ids(cfg) -> list[int]:
    """vLLM's aux layer ids (the state entering layer j); SpecForge's eagle_config ids + 1, as SGLang."""
    if "eagle_aux_hidden_state_layer_ids" in cfg:
        return sorted(cfg["eagle_aux_hidden_state_layer_ids"])
    return sorted(j + 1 for j in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])


@torch.no_grad()
def reference_drafts(fmt, cfg, sd, target, context, gamma) -> list[int]:
    """The chain a published head drafts after `context` (vLLM's EagleProposer.propose, greedy)."""
    tm = target.model
    ids = torch.tensor([context])
    if fmt == "eagle3":
        hs = tm.model(ids, output_hidden_states=True).hidden_states
        feats = F.linear(torch.cat([hs[j][0] for j in _capture_ids(cfg)], -1), sd["fc.weight"], sd.get("fc.bias"))
    else:
        feats = tm.model(ids).last_hidden_state[0]  # the target's final (post-norm) hidden state
    embed = sd.get("embed_tokens.weight", tm.model.embed_tokens.weight)
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    toks, h = list(context[1:]), feats[:-1]  # pairs (x_p, h_{p-1}), p = 1..n, at positions 0..n-1
    out = []
    for _ in range(gamma):
        e = embed[torch.tensor(toks)]
        if fmt == "eagle3":
            x = _decoder(sd, "midlayer.", torch.cat([_rms(e, sd["midlayer.input_layernorm.weight"]),
                                                     _rms(h, sd["midlayer.hidden_norm.weight"])], -1), h, H, Hkv)
            row = int(F.linear(_rms(x[-1], sd["norm.weight"]), sd["lm_head.weight"]).argmax())
            tok = row + int(sd["d2t"][row])
        else:
            x = F.linear(torch.cat([e, h], -1), sd["fc.weight"], sd["fc.bias"])
            for i in range(cfg["num_hidden_layers"]):
                p = f"layers.{i}."
                x = _decoder(sd, p, x if i == 0 else _rms(x, sd[f"{p}input_layernorm.weight"]), x, H, Hkv)
            tok = int(F.linear(x[-1], tm.lm_head.weight).argmax())
        out.append(tok)
        toks, h = toks + [tok], torch.cat([h, x[-1:]])  # the pre-norm output is fed back
    return out


def _propose(drafter, seq_id, keep, new, hidden, start, gamma=4):
    prop = drafter.propose([DraftSeq(seq_id=seq_id, keep=keep, new_tokens=new, gamma=gamma, hidden=hidden,
                                     hidden_start=start)])
    return prop.tokens[0, :prop.num_draft[0]].tolist()


HEADS = {  # name: (writer, kwargs)
    "eagle3-vllm-ids": ("eagle3", dict(ids=("vllm", [1, 2, 3]))),
    "eagle3-specforge-ids-shared-embed": ("eagle3", dict(E=ET, ids=("specforge", [2, 0, 1]), own_embed=False,
                                                         fc_bias=True)),
    "eagle1-two-layers": ("eagle1", dict(layers=2)),
    "eagle1-one-layer": ("eagle1", dict(layers=1, qkv_bias=False)),
}


def _write(name, path):
    fmt, kw = HEADS[name]
    return fmt, *(write_eagle3 if fmt == "eagle3" else write_eagle1)(path, **kw)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_published_head_drafts_what_the_published_math_drafts(target, tmp_path, name):
    """Loaded through --draft PATH, a head proposes the reference's tokens: from a fresh context,
    two sequences in one call, and after a rollback that kept two drafts and added a bonus token
    (the kept positions were fed drafted features and are recomputed from the target's)."""
    fmt, cfg, sd = _write(name, tmp_path / name)
    spec = str(tmp_path / name)
    assert published_format(spec) == fmt and draft_kind(spec) == "eagle"
    drafter = make_drafter(spec, target, 4, 256)
    assert isinstance(drafter, PublishedEagleDrafter)
    want = {"eagle3-vllm-ids": (0, 1, 2), "eagle3-specforge-ids-shared-embed": (0, 1, 2)}.get(name, (-1,))
    assert drafter.feature_layers == want == spec_feature_layers(spec)
    runner = LlamaRunner(target.model)

    def feats(ctx):
        return context_features(runner, ctx, drafter.feature_layers)

    a, b = rand_tokens(13, 1), rand_tokens(7, 2)
    prop = drafter.propose([DraftSeq(seq_id=1, keep=0, new_tokens=a, gamma=4, hidden=feats(a)),
                            DraftSeq(seq_id=2, keep=0, new_tokens=b, gamma=3, hidden=feats(b))])
    drafts = prop.tokens[0].tolist()
    assert drafts == reference_drafts(fmt, cfg, sd, target, a, 4)
    assert prop.tokens[1, :3].tolist() == reference_drafts(fmt, cfg, sd, target, b, 3)
    if fmt == "eagle3":
        assert set(drafts) <= set((torch.arange(R) + sd["d2t"]).tolist())  # only draft-vocabulary tokens

    committed = a + drafts[:2] + [7]
    h = feats(committed)
    got = _propose(drafter, 1, len(a) + 2, [7], h[len(a) - 1:], len(a) - 1)
    assert got == reference_drafts(fmt, cfg, sd, target, committed, 4)
    # ... and a rollback into the committed tokens (a lost suffix), then catching up again
    got = _propose(drafter, 1, 6, committed[6:], None, 0)
    assert got == reference_drafts(fmt, cfg, sd, target, committed, 4)
    drafter.release(1)
    drafter.release(2)


def test_published_heads_keep_greedy_output_in_the_engine(target, tmp_path):
    """An engine serving both formats (and a token tree for one request) decodes exactly the
    target's greedy output; every chain proposed along the way is the reference's for the
    committed context the engine handed over (its features included)."""
    heads = {n: _write(n, tmp_path / n) for n in ("eagle3-vllm-ids", "eagle1-two-layers")}
    drafters = {n: make_drafter(str(tmp_path / n), target, 4, 200) for n in heads}
    calls = {n: [] for n in heads}
    for n, d in drafters.items():
        def recorded(seqs, _orig=d.propose, _n=n, _d=d):
            prop = _orig(seqs)
            for b, s in enumerate(seqs):
                if prop.parents is None or prop.parents[b] is None:
                    k = prop.num_draft[b]
                    view = _d.views[s.seq_id]
                    calls[_n].append((list(view[:len(view) - k]), prop.tokens[b, :k].tolist()))
            return prop
        d.propose = recorded
    prompts = [rand_tokens(5 + i, 10 + i) for i in range(2)]

    def go(draft):
        eng = SpecEngine(LlamaRunner(target.model), drafters, max_batch=4, max_len=200)
        reqs = [request(f"r{i}", p, draft, 3, max_tokens=16, ignore_eos=True) for i, p in enumerate(prompts)]
        if draft:
            reqs.append(Request("tree", list(prompts[0]), SamplingParams(max_tokens=16, ignore_eos=True),
                                SpeculationParams(draft=draft, gamma=3, tree=6)))
        res = run(eng, reqs)
        return [res[r.request_id].token_ids for r in reqs]

    plain = go(None)
    for n in heads:
        out = go(n)
        assert out[:2] == plain and out[2] == plain[0], n
    for n, (fmt, cfg, sd) in heads.items():
        assert len(calls[n]) > 8
        for ctx, drafts in calls[n]:
            assert drafts == reference_drafts(fmt, cfg, sd, target, ctx, len(drafts)), (n, len(ctx))


def test_aux_layer_ids_map_to_the_target_layers_both_conventions_name():
    """vLLM's ids name the state entering layer j (specd's j - 1), SpecForge's eagle_config ids the
    output of layer j; the default is vLLM's and SGLang's (2, L/2, L-3); both capture in layer order."""
    assert aux_layers({"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}, 32) == (1, 15, 28)
    assert aux_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [28, 1, 15]}}, 32) == (1, 15, 28)
    assert aux_layers({}, 32) == (1, 15, 28) and aux_layers({}) is None
    assert aux_layers({"eagle_config": {"use_aux_hidden_state": False}}) == (-1,)
    with pytest.raises(ValueError, match="distinct"):
        aux_layers({}, 4)  # (2, 2, 1): a 4-layer target needs pinned ids
    with pytest.raises(ValueError, match="embeddings"):
        aux_layers({"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}, 4)
    with pytest.raises(ValueError, match="4 layers"):  # the last layer's output: captured by neither runtime
        aux_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}}, 4)


def test_what_cannot_be_served_exactly_is_refused(target, tmp_path):
    cfg, sd = write_eagle3(tmp_path / "ok")
    assert draft_meta(str(tmp_path / "ok"))["format"] == "eagle3"

    def variant(name, cfg_extra=None, drop=(), add=None):
        from actors.drafters.eagle_formats import read_published
        path = tmp_path / name
        _save(path, {**cfg, **(cfg_extra or {})}, {**{k: v for k, v in sd.items() if k not in drop}, **(add or {})},
              "safetensors")
        return lambda: read_published(path, target.model)

    with pytest.raises(ValueError, match="norm_before_residual"):
        variant("nbr", {"norm_before_residual": True})()
    with pytest.raises(ValueError, match="tokenizer"):
        variant("vocab", {"vocab_size": 640})()
    with pytest.raises(ValueError, match="needs d2t"):
        variant("no-d2t", drop=("d2t",))()
    with pytest.raises(ValueError, match="does not know"):
        variant("extra", add={"midlayer.self_attn.o_proj.bias": torch.zeros(48), "layers.1.mlp.x": torch.zeros(1)})()
    with pytest.raises(ValueError, match="embed_tokens"):
        variant("no-embed", drop=("embed_tokens.weight",))()  # 48-wide head, 64-wide target embedding
    # a specd distill checkpoint or a plain Hugging Face model directory is no published head
    target.model.save_pretrained(tmp_path / "plain")
    assert published_format(tmp_path / "plain") is None and draft_meta(str(tmp_path / "plain")) is None


@pytest.mark.parametrize("family_name", ["gpt_oss", "qwen3_moe"])
def test_eagle3_heads_for_moe_targets_draft_what_the_published_math_drafts(tmp_path, family_name):
    """The published EAGLE-3 heads for gpt-oss and Qwen3-MoE targets are SpecForge's layout (a llama
    decoder layer over the MoE target's hidden states: gpt-oss's with eagle_config's layer ids and
    its own embedding, Qwen3-MoE's with vLLM's ids and the target's embedding): written here for tiny
    targets of those families, they draft the reference's chain, and the engine's greedy output with
    them is the target's."""
    from test_families import model_of

    from actors.models import LoadedModel

    target = LoadedModel(model_of(family_name), None, family_name)
    kw = dict(ids=("specforge", [0, 1, 2]), own_embed=True) if family_name == "gpt_oss" else \
        dict(E=64, ids=("vllm", [1, 2, 3]), own_embed=False)
    cfg, sd = write_eagle3(tmp_path / "head", V=256, ET=64, **kw)
    drafter = make_drafter(str(tmp_path / "head"), target, 4, 128)
    runner = LlamaRunner(target.model)
    a = rand_tokens(11, 5, 256)
    got = _propose(drafter, 1, 0, a, context_features(runner, a, drafter.feature_layers), 0)
    assert got == reference_drafts("eagle3", cfg, sd, target, a, 4)
    eng = SpecEngine(runner, {"head": drafter}, max_batch=4, max_len=128)
    prompts = [rand_tokens(8, 6, 256) * 2, rand_tokens(5, 7, 256)]
    out = run(eng, [request(f"r{i}", p, "head", 3, max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)])
    with torch.no_grad():
        want = [target.model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                      eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    assert [out[f"r{i}"].token_ids for i in range(2)] == want
