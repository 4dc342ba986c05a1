"""Draft distillation and feature-level (EAGLE) drafts, on tiny random targets (seconds).

What a user relies on: training makes a draft better than its untrained start; a trained
draft saved to disk loads with --draft PATH and never changes greedy output; a draft from
another vocabulary is refused; the served head computes exactly what training scored. And for
any family the runner serves: the head starts as the target's last layer where it maps exactly
(Qwen2's biases and Qwen3's q/k norms kept), else at random with a logged line; `specd distill
--model DIR` on a Qwen3 directory serves losslessly; a separate Qwen3 draft model drafts for a
Qwen3 target.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from actors.build import load_distilled, make_drafter
from actors.drafters.base import DraftSeq
from actors.drafters.eagle import EagleDrafter, EagleHead
from actors.engine import SpecEngine
from actors.llama import LlamaRunner, context_features
from actors.models import LoadedModel, build_tiny, load_model
from helpers import request, run
from specd.train import distill as D


@pytest.fixture(scope="module")
def target():
    return load_model("tiny:1")


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    """On-policy teacher data from the tiny target: greedy and sampled continuations."""
    import os
    old = os.environ.get("SPECD_CACHE")
    os.environ["SPECD_CACHE"] = str(tmp_path_factory.mktemp("cache"))  # the teacher cache, not the user's
    try:
        rng = random.Random(0)
        rows = [{"ids": [rng.randrange(3, 512) for _ in range(rng.randrange(4, 9))], "domain": "d"}
                for _ in range(48)]
        seqs = D.teacher_data(target, rows, max_new=40, progress=False, tag="test")
    finally:
        if old is None:
            os.environ.pop("SPECD_CACHE", None)
        else:
            os.environ["SPECD_CACHE"] = old
    return seqs[:80], seqs[80:]  # train / held-out: rows 0-39 and 40-47 (greedy + sampled each)


FUSED = (1, 2, -1)  # D.eagle3_layers of the 4-layer tiny target: an EAGLE-3-style head


def _perturbed_head(target, seed=0, features=(-1,)) -> EagleHead:
    head = EagleHead(target.model, torch.arange(target.model.config.vocab_size), features=features)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad and p.dim() == 2:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return head.eval()


@pytest.mark.parametrize("features", [(-1,), FUSED], ids=["final-layer", "fused-layers"])
def test_served_head_drafts_exactly_what_training_scores(target, features):
    """The drafter (fast runner, KV cache, fed target features with the rollback info)
    and the training unroll (all starts at once, training-time test) are one function: a
    divergence would make the reported α a lie about what serving gets. For a fused head the
    features are several target layers, as the engine hands them over."""
    assert D.eagle3_layers(target.model.config.num_hidden_layers) == FUSED
    head = _perturbed_head(target, features=features)
    runner = LlamaRunner(target.model)
    prefix = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(1))
    hid = runner.forward(runner.new_cache(1, 64), [0], prefix, features=features)[1][0]  # [12, F E]
    drafter = EagleDrafter(head, "eagle", max_batch=2, max_len=64)
    prop = drafter.propose([DraftSeq(seq_id=7, keep=0, new_tokens=prefix[0].tolist(), gamma=4,
                                     hidden=hid[:-1], hidden_start=0)])
    drafts = prop.tokens[0].tolist()
    seq = torch.cat([prefix, torch.tensor([drafts])], 1)  # teacher-forced tokens = the drafts
    hid_seq = torch.cat([hid, torch.zeros(4, hid.shape[1])])  # only positions <= 10 are read at start 11
    with torch.no_grad():
        feats = head.unroll(seq, hid_seq[None], 4)
    n = prefix.shape[1] - 1
    unrolled = [int(head.logits(f[0, n]).argmax()) for f in feats]
    assert unrolled == drafts

    # A rollback that keeps 2 drafts, then the bonus token: the head recomputes the kept
    # positions from the target's real features and drafts the same as a fresh drafter.
    keep = len(prefix[0]) + 2
    committed = seq[0, :keep].tolist() + [5]
    hid_all = runner.forward(runner.new_cache(1, 64), [0], torch.tensor([committed]), features=features)[1][0]
    p2 = drafter.propose([DraftSeq(seq_id=7, keep=keep, new_tokens=[5], gamma=3,
                                   hidden=hid_all[11:-1], hidden_start=11)])
    fresh = EagleDrafter(head, "eagle", max_batch=2, max_len=64)
    p3 = fresh.propose([DraftSeq(seq_id=1, keep=0, new_tokens=committed, gamma=3,
                                 hidden=hid_all[:-1], hidden_start=0)])
    assert p2.tokens.tolist() == p3.tokens.tolist()


def test_eagle_draft_is_lossless_and_accepts_in_the_engine(target):
    """Greedy output with the head equals the target alone; the engine hands the head its
    hidden states, and a head that starts as 'one more target layer' gets drafts accepted.
    One engine serves a single-layer head and a fused (EAGLE-3-style) one side by side: each
    gets its own layers out of the features the engine keeps, and a fused head that starts
    as the single-layer one (its fuse reads only the final state) drafts exactly what it does;
    a fused head given the wrong layers' columns would not."""
    single = EagleHead(target.model, torch.arange(512)).eval()
    fused = EagleHead(target.model, torch.arange(512), features=FUSED)
    fused.load_state_dict({k: v for k, v in single.state_dict().items()}, strict=False)
    prompts = [[5, 9, 33, 2 + i, 100 + i] for i in range(4)]

    def go(drafts):
        eng = SpecEngine(LlamaRunner(target.model),
                         {"eagle": EagleDrafter(single, "eagle", max_batch=8, max_len=200),
                          "eagle3": EagleDrafter(fused.eval(), "eagle3", max_batch=8, max_len=200)},
                         max_batch=8, max_len=200)
        assert eng.features == FUSED
        res = run(eng, [request(f"r{i}", p, d, 4, max_tokens=40, ignore_eos=True)
                        for i, (p, d) in enumerate(zip(prompts * 2, drafts))])
        return ([res[f"r{i}"].token_ids for i in range(len(drafts))],
                [res[f"r{i}"].stats.accepted_tokens for i in range(len(drafts))])

    plain, _ = go([None] * 4)
    spec, accepted = go(["eagle"] * 4 + ["eagle3"] * 4)
    assert spec == plain * 2
    assert sum(accepted) > 0
    assert accepted[:4] == accepted[4:]  # the fused head began as the single-layer one


def test_distill_improves_heldout_acceptance(target, data):
    """A real (small) training run: held-out greedy α must rise well above the untrained start.
    The same run with a zero learning rate must not, which is what makes this assertion able to fail."""
    train, held = data
    results = {}
    for lr in (3e-3, 0.0):
        student = D.Student("truncated:2", target, torch.arange(512))
        before = D.evaluate(student, target, held)
        D.train(student, target, train, held, D.DistillConfig(kind="truncated:2", steps=40, batch=8, lr=lr),
                progress=False)
        after = D.evaluate(student, target, held)
        results[lr] = (before["alpha"], after["alpha"])
    before, after = results[3e-3]
    assert after > before + 0.1, results
    assert abs(results[0.0][1] - results[0.0][0]) < 1e-6, results


def test_objectives_rank_a_perfect_student_best():
    t = torch.randn(6, 10)
    nxt = t.argmax(-1)
    for obj in D.OBJECTIVES:
        good = D.loss_fn(obj, t * (10 if obj == "ntp" else 1), t, nxt, 1.0).mean()
        bad = D.loss_fn(obj, -t, t, nxt, 1.0).mean()
        assert good < bad, obj
        if obj != "ntp":
            assert good.abs() < 1e-5, obj


def test_saved_draft_round_trips_and_keeps_greedy_output(target, data, tmp_path):
    train, held = data
    vmap = D.head_vocab(train, 300, 512, target.eos_token_ids)  # a restricted head, as shipped
    for kind in ("eagle3", "eagle", "truncated:2"):
        student = D.Student(kind, target, vmap)
        D.train(student, target, train, held, D.DistillConfig(kind=kind, steps=5, batch=8), progress=False)
        out = tmp_path / kind.replace(":", "_")
        student.save(out, {"name": out.name, "vocab_fingerprint": "size:512"})
        meta = json.loads((out / "specd_draft.json").read_text())
        assert meta["kind"] == ("model" if kind.startswith("truncated") else "eagle")
        drafter = make_drafter(str(out), target, 4, 200)  # the --draft PATH code path
        assert drafter.feature_layers == {"eagle3": FUSED, "eagle": (-1,)}.get(kind, ())
        # what it trained is what it serves: the loaded head scores the held-out data as the student did
        if kind != "truncated:2":
            assert D.evaluate(student, target, held)["alpha"] == pytest.approx(
                D.evaluate(D._init_from(D.DistillConfig(kind=kind, init_from=str(out)), target), target,
                           held)["alpha"], abs=0.02)
        prompts = [[7, 8, 9, 10 + i] for i in range(3)]
        outs = {}
        for draft in (None, "d"):
            eng = SpecEngine(LlamaRunner(target.model), {"d": drafter}, max_batch=4, max_len=200)
            res = run(eng, [request(f"r{i}", p, draft, 3, max_tokens=30, ignore_eos=True)
                            for i, p in enumerate(prompts)])
            outs[draft] = [res[f"r{i}"].token_ids for i in range(3)]
        assert outs["d"] == outs[None], kind
        # A restricted head only ever proposes its own tokens (mapped back to target ids).
        seq = list(range(20, 40))
        hid = context_features(LlamaRunner(target.model), seq, drafter.feature_layers) \
            if drafter.wants_hidden else None
        prop = drafter.propose([DraftSeq(seq_id=99, keep=0, new_tokens=seq, gamma=6, hidden=hid)])
        assert set(prop.tokens[0].tolist()) <= set(vmap.tolist())
        drafter.release(99)


def test_draft_for_another_vocabulary_is_refused(target, tmp_path):
    head = EagleHead(target.model, torch.arange(512))
    head.save(tmp_path / "h", {"name": "h", "vocab_fingerprint": "size:512"})
    other = LoadedModel(build_tiny(2, vocab_size=640), None, "tiny-640")
    with pytest.raises(ValueError, match="tokenizer"):
        load_distilled(str(tmp_path / "h"), other, 2, 100)


# ---- any family the runner serves ----------------------------------------------------------------------
def _family(model_type: str, **kw):
    """A tiny random model of a family (its own transformers classes), weights scaled so greedy
    choices are not near-ties; Qwen2's q/k/v biases nonzero."""
    import transformers as T

    cfg_cls, model_cls = {"qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM), "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
                          "mistral": (T.MistralConfig, T.MistralForCausalLM),
                          "llama": (T.LlamaConfig, T.LlamaForCausalLM), "phi3": (T.Phi3Config, T.Phi3ForCausalLM),
                          "gemma3_text": (T.Gemma3TextConfig, T.Gemma3ForCausalLM)}[model_type]
    torch.manual_seed(kw.pop("seed", 0))
    cfg = {**dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False), **kw}
    model = model_cls(cfg_cls(**{k: v for k, v in cfg.items() if v is not None}))  # None: the family's default
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn(p.shape) * 0.05)
    return model.float().eval()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_head_of_each_family_starts_as_its_last_layer_and_serves_what_it_trains(family):
    """The head's layer is a one-layer model the target's last layer maps onto exactly (Qwen2's
    q/k/v biases, Qwen3's q/k norms included: nothing dropped), and the served head (fast runner,
    KV cache) drafts what the training unroll scores."""
    model = _family(family, **({"sliding_window": None} if family == "mistral" else {}))
    head = EagleHead(model, torch.arange(256), features=(1, 2, -1))
    src, dst = model.model.layers[-1].state_dict(), head.shell.model.layers[0].state_dict()
    assert src.keys() == dst.keys() and all(torch.equal(src[k], dst[k]) for k in src)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad and p.dim() == 2:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    head.eval()
    prefix = torch.randint(3, 256, (1, 12), generator=g)
    hid = context_features(LlamaRunner(model), prefix[0].tolist() + [0], head.features)  # [12, F E]
    drafts = EagleDrafter(head, "e", max_batch=1, max_len=64).propose(
        [DraftSeq(seq_id=0, keep=0, new_tokens=prefix[0].tolist(), gamma=4, hidden=hid[:-1])]).tokens[0].tolist()
    with torch.no_grad():
        feats = head.unroll(torch.cat([prefix, torch.tensor([drafts])], 1), torch.cat([hid, hid[:4] * 0])[None], 4)
    assert [int(head.logits(f[0, 11]).argmax()) for f in feats] == drafts


def test_a_family_whose_last_layer_does_not_map_starts_the_head_at_random(caplog):
    """Gemma 3's layer (1 + w and sandwich norms, GELU, RoPE per layer type), Phi-3's (fused
    qkv_proj, partial rotary) and a llama with attention bias do not map onto the head's llama
    layer: the head starts at random, with one logged line, trains, and serves what it trains."""
    for model in (_family("gemma3_text", hidden_activation="gelu_pytorch_tanh"),
                  _family("phi3", head_dim=None, partial_rotary_factor=0.5), _family("llama", attention_bias=True)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="specd"):
            head = EagleHead(model, torch.arange(256))
        assert "starting it at random" in caplog.text, model.config.model_type
        assert head.shell.config.model_type == "llama"
        down = head.shell.model.layers[0].mlp.down_proj.weight
        assert not torch.equal(down, model.model.layers[-1].mlp.down_proj.weight)
        tokens, hidden = torch.randint(3, 256, (1, 8)), torch.randn(1, 8, 64)
        feats = head.unroll(tokens, hidden, 2)
        sum(f.sum() for f in feats).backward()  # trainable
        head.eval()
        drafts = EagleDrafter(head, "e", max_batch=1, max_len=32).propose(
            [DraftSeq(seq_id=0, keep=0, new_tokens=tokens[0, :5].tolist(), gamma=2, hidden=hidden[0, :4])]).tokens
        with torch.no_grad():
            feats = head.unroll(torch.cat([tokens[:, :5], drafts], 1), hidden[:, :7], 2)
        assert [int(head.logits(f[0, 4]).argmax()) for f in feats] == drafts[0].tolist()


def _qwen3_dir(path, seed=0, **kw):
    m = _family("qwen3", seed=seed, **kw)
    m.save_pretrained(path)
    return str(path)


def test_specd_distill_on_a_qwen3_target_serves_losslessly(tmp_path, monkeypatch):
    """`specd distill --model DIR` on a Qwen3 directory (q/k norms, no tokenizer: "ids" rows): a
    few steps, then the checkpoint loads with --draft PATH (a Qwen3-shaped head) and greedy output
    with it is the target's own."""
    from specd.cli import main

    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "cache"))
    model_dir = _qwen3_dir(tmp_path / "qwen3")
    rng = random.Random(0)
    for name, n in (("data", 8), ("held", 2)):
        rows = [{"ids": [rng.randrange(3, 256) for _ in range(6)]} for _ in range(n)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "head"
    assert main(["distill", "--model", model_dir, "--dtype", "fp32", "--kind", "eagle3", "--steps", "3",
                 "--batch", "4", "--max-new", "12", "--samples", "0", "--head-vocab", "0", "--data",
                 str(tmp_path / "data.jsonl"), "--heldout", str(tmp_path / "held.jsonl"), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["steps_run"] == 3
    target = load_model(model_dir)
    drafter = make_drafter(str(out), target, 4, 128)
    assert isinstance(drafter, EagleDrafter) and drafter.runner.layers[0].q_norm is not None
    prompts = [[5, 9, 33, 2 + i, 100 + i] for i in range(3)]
    outs = {}
    for draft in (None, "d"):
        eng = SpecEngine(LlamaRunner(target.model), {"d": drafter}, max_batch=4, max_len=128)
        res = run(eng, [request(f"r{i}", p, draft, 3, max_tokens=20, ignore_eos=True) for i, p in enumerate(prompts)])
        outs[draft] = [res[f"r{i}"].token_ids for i in range(3)]
        if draft:
            assert sum(res[f"r{i}"].stats.draft_tokens for i in range(3)) > 0
    assert outs["d"] == outs[None]


def test_a_qwen3_draft_model_drafts_for_a_qwen3_target(tmp_path):
    """A separate Qwen3 causal LM sharing the vocabulary, through --draft PATH: greedy output stays
    the target's own, and drafts are proposed (and some accepted: the draft is the target with
    its last layers perturbed)."""
    target_dir = _qwen3_dir(tmp_path / "target", seed=0)
    draft = _family("qwen3", seed=0)
    with torch.no_grad():
        for p in draft.model.layers[-1].parameters():
            p.add_(0.02 * torch.randn(p.shape))
    draft.save_pretrained(tmp_path / "draft")
    target = load_model(target_dir)
    drafter = make_drafter(str(tmp_path / "draft"), target, 4, 128)
    assert drafter.runner.layers[0].q_norm is not None and drafter.feature_layers == ()
    prompts = [[5, 9, 33, 2 + i, 100 + i] for i in range(3)]
    outs, accepted = {}, 0
    for d in (None, "d"):
        eng = SpecEngine(LlamaRunner(target.model), {"d": drafter}, max_batch=4, max_len=128)
        res = run(eng, [request(f"r{i}", p, d, 4, max_tokens=24, ignore_eos=True) for i, p in enumerate(prompts)])
        outs[d] = [res[f"r{i}"].token_ids for i in range(3)]
        accepted += sum(res[f"r{i}"].stats.accepted_tokens for i in range(3))
    assert outs["d"] == outs[None]
    assert accepted > 0
