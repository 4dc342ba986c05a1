"""Int8 quantization through torchao (actors/quant.py), on tiny random llamas (seconds).

What a user relies on: an int8 draft under the lossless rule never changes greedy output (the
target, left unquantized, decides every token, even when the draft shares its weights); an int8
target really runs quantized and stays close to the unquantized one; QAT trains a head through
the int8 rounding and the checkpoint serves in the mode it was trained for; the cluster config
offers exactly the engine's modes.
"""
from __future__ import annotations

import typing

import pytest
import torch
import torch.nn.functional as F

from actors.build import build_engine, draft_mode
from actors.drafters import ModelDrafter
from actors.drafters.eagle import EagleDrafter, EagleHead
from actors.engine import SpecEngine
from actors.llama import LlamaRunner
from actors.quant import MODES, convert_qat, prepare_qat, quantize_drafter, quantize_runner
from helpers import request, run
from specd.train import distill as D

PROMPTS = [[5, 9, 33, 2 + i, 100 + i] for i in range(4)]


def _is_int8(w) -> bool:
    return type(w).__module__.startswith("torchao")


def _greedy(runner, drafters: dict, draft: str | None, gamma: int = 4) -> list[list[int]]:
    eng = SpecEngine(runner, drafters, max_batch=4, max_len=200)
    res = run(eng, [request(f"r{i}", p, draft, gamma, max_tokens=40, ignore_eos=True) for i, p in enumerate(PROMPTS)])
    return [res[f"r{i}"].token_ids for i in range(len(PROMPTS))]


@pytest.mark.parametrize("mode", ["int8-weight", "int8-dynamic"])
def test_int8_draft_with_lossless_rule_keeps_greedy_output(tiny, mode):
    """A truncated self-draft shares the target's fused weights: quantizing it must give the draft
    its own int8 copies and leave the target's tensors alone (were they quantized in place, the
    target's output would change and the comparison with the plain target below would fail)."""
    plain = _greedy(LlamaRunner(tiny.model), {}, None)
    draft = quantize_drafter(ModelDrafter.truncated(tiny.model, 2, max_batch=4, max_len=200), mode)
    assert draft.runner.quant == mode and all(_is_int8(l.wqkv) and _is_int8(l.w_down) for l in draft.runner.layers)
    target = LlamaRunner(tiny.model)
    assert not any(_is_int8(l.wqkv) for l in target.layers)
    eng = SpecEngine(target, {"q": draft}, max_batch=4, max_len=200)
    res = run(eng, [request(f"r{i}", p, "q", 4, max_tokens=40, ignore_eos=True) for i, p in enumerate(PROMPTS)])
    assert [res[f"r{i}"].token_ids for i in range(len(PROMPTS))] == plain
    assert sum(r.stats.accepted_tokens for r in res.values()) > 0  # the int8 draft still gets accepted


def test_int8_eagle_head_quantizes_its_input_projection_and_stays_lossless(tiny):
    head = EagleHead(tiny.model, torch.arange(512)).eval()
    d = quantize_drafter(EagleDrafter(head, "e", max_batch=4, max_len=200), "int8-weight")
    assert _is_int8(d.fc) and _is_int8(d.runner.lm_head)
    assert _greedy(LlamaRunner(tiny.model), {"e": d}, "e") == _greedy(LlamaRunner(tiny.model), {}, None)


@pytest.mark.parametrize("mode", ["int8-weight", "int8-dynamic", "mixed"])
def test_int8_target_runs_quantized_and_stays_close(tiny, mode):
    ref = LlamaRunner(tiny.model)
    q = quantize_runner(LlamaRunner(tiny.model), mode)
    assert q.quant == mode
    attn_int8 = _is_int8(q.layers[0].wqkv)
    assert _is_int8(q.layers[0].w_gate_up) and attn_int8 == (mode != "mixed") and _is_int8(q.lm_head) == attn_int8
    ids = torch.tensor([PROMPTS[0] + list(range(40, 60))])
    a = ref.logits(ref.forward(ref.new_cache(1, 64), [0], ids))
    b = q.logits(q.forward(q.new_cache(1, 64), [0], ids))
    rel = ((a - b).norm() / a.norm()).item()
    assert 0 < rel < 0.05, rel  # quantized (not bit-equal), and int8-close
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


def test_quant_reaches_the_engine_and_bad_modes_are_refused():
    built = build_engine("tiny", {"t": "truncated:2"}, "fp32", max_batch=2, max_len=128, device="cpu",
                         quant="mixed", draft_quant={"t": "int8-weight"})
    assert built.engine.info["quant"] == "mixed" and built.engine.info["draft_quant"] == {"t": "int8-weight"}
    assert built.engine.target.quant == "mixed"
    with pytest.raises(ValueError, match="quant must be one of"):
        build_engine("tiny", [], "fp32", max_batch=1, max_len=64, device="cpu", quant="int4")
    with pytest.raises(ValueError, match="draft quant must be one of"):
        draft_mode("ngram", "fp8")


def test_config_offers_the_engine_modes():
    from actors.schema import PREPACK_CHOICES
    from cluster.config import ClusterConfig, PrepackChoice, QuantMode

    assert typing.get_args(QuantMode) == MODES and typing.get_args(PrepackChoice) == PREPACK_CHOICES
    cfg = ClusterConfig.model_validate({"model": "tiny", "verifier": {"quant": "int8-weight"},
                                        "drafts": [{"name": "d", "spec": "truncated:1", "quant": "int8-dynamic"}]})
    assert cfg.verifier.quant == "int8-weight" and cfg.drafts[0].quant == "int8-dynamic"
    with pytest.raises(Exception, match="quant"):
        ClusterConfig.model_validate({"model": "tiny", "verifier": {"quant": "int4"}})


def test_qat_trains_through_the_int8_rounding_and_the_checkpoint_serves_int8(tiny, tmp_path):
    """prepare_qat swaps the head's trainable linears for fake-quantized ones (the frozen LM head
    stays), gradients reach the weights, convert_qat leaves plain linears with the trained
    weights, and a checkpoint saved with qat in its meta loads quantized by default."""
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    student = D.Student("eagle", tiny, torch.arange(512))
    prepare_qat(student, "int8-weight")
    fq = [n for n, m in student.named_modules() if isinstance(m, FakeQuantizedLinear)]
    assert len(fq) == 8 and not any("lm_head" in n for n in fq)  # fc + q, k, v, o, gate, up, down
    tokens = torch.randint(3, 512, (2, 12))
    hidden = LlamaRunner(tiny.model).forward(LlamaRunner(tiny.model).new_cache(2, 16), [0, 1], tokens)
    logits, _ = student.predict(tokens, hidden, 2)
    before = student.head.fc.weight.detach().clone()
    F.cross_entropy(logits[0].flatten(0, 1), tokens.flatten()).backward()
    torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=0.1).step()
    assert not torch.equal(before, student.head.fc.weight)
    convert_qat(student)
    assert not any(isinstance(m, FakeQuantizedLinear) for m in student.modules())
    out = tmp_path / "qat"
    student.save(out, {"name": "qat", "vocab_fingerprint": "size:512", "qat": "int8-weight"})
    assert draft_mode(str(out)) == "int8-weight" and draft_mode(str(out), "int8-dynamic") == "int8-dynamic"
    built = build_engine("tiny:0", {"h": str(out)}, "fp32", max_batch=2, max_len=128, device="cpu")
    assert built.engine.info["draft_quant"] == {"h": "int8-weight"} and _is_int8(built.drafters["h"].fc)


def test_quant_study_fills_the_table_and_quantized_drafts_keep_the_output(tmp_path):
    """`specd quant` on the tiny model: every target format × draft kind gets a row; rows with the
    unquantized target reproduce its output exactly whatever the draft (agreement 1, same NLL),
    and the report renders with its pass-cost table, verdict and plot."""
    from actors import cpu
    from specd.quant import plot, render, study

    rep = study("tiny", "fp32", "truncated:1", None, 3, ("int8-weight",), None, 2, 12, reps=1, progress=False)
    rows = {(r["target"], r["draft"]): r for r in rep["table"]}
    targets = ("fp32", "fp32+int8-weight") + (("fp32+prepacked",) if cpu.available("prepack-fp32") else ())
    assert set(rows) == {(t, d) for t in targets for d in ("none", "fp32", "int8")}
    ref = rows["fp32", "none"]
    for d in ("fp32", "int8"):
        assert rows["fp32", d]["identical_share"] == 1.0 and rows["fp32", d]["nll"] == pytest.approx(ref["nll"])
        assert rows["fp32", d]["drafted"] > 0
    assert set(rep["pass_cost"]) == set(targets) and set(rep["draft_step_s"]) == {"fp32", "int8"}
    text = render(rep)
    assert "Verdict" in text and "fp32+int8-weight" in text
    plot(rep, tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 0
