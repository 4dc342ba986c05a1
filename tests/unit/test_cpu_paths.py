"""Optional CPU fast paths are chosen by trial (`actors/cpu.py`), and every fallback runs.

What an AVX2-only EPYC meets (torch refuses oneDNN's prepacked bf16 layout there) is run on any
machine in two ways: SPECD_DISABLE forces a probe off (the `cpu_paths_off` fixture), and a trial
that raises torch's own error stands for the CPU that lacks the instructions. Either way `auto`
never picks the path, an explicit setting that needs it fails at load naming what is missing and
what to set instead, and the engine, the replicas and the CLI start, report their choice and
keep their output."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from actors import cpu
from actors.build import build_engine, load_target
from actors.schema import Completion, Request, SamplingParams, SpeculationParams
from helpers import chat_ids

AVX2_ERROR = ("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, "
              "avx512vl and avx512dq")  # what torch 2.13 raises on an AVX2-only EPYC


def _generate(eng, draft: str, gamma, prompts: list[list[int]], n: int = 16) -> list[list[int]]:
    reqs = [Request(f"{draft}-{i}", p, SamplingParams(max_tokens=n, ignore_eos=True),
                    SpeculationParams(draft=draft if gamma else "none", gamma=gamma))
            for i, p in enumerate(prompts)]
    return [c.token_ids for c in eng.generate(reqs)]


def test_probes_pass_here_and_the_variable_forces_them_off(cpu_paths_off):
    """Every path runs on the machines this suite runs on (unless CI's second run forced it off); a
    forced path reports the variable as its reason, prepack-bf16 off also takes bf16 matmuls off
    oneDNN (as that CPU check would), and a misspelt name is refused rather than testing nothing."""
    forced = cpu.forced_off()
    assert all(p.ok or name in forced for name, p in cpu.probes().items())
    cpu_paths_off("prepack-bf16")
    p = cpu.probe("prepack-bf16")
    assert not p.ok and "SPECD_DISABLE" in p.reason and not cpu.onednn_bf16()
    assert not torch.backends.mkldnn.enabled and cpu.available("bf16")
    assert "prepack-bf16 (forced off by SPECD_DISABLE" in cpu.unavailable_line()
    with pytest.raises(ValueError, match=r"SPECD_DISABLE: unknown path\(s\) \['prepack-bf61'\]"):
        cpu_paths_off("prepack-bf61")


def test_a_trial_that_raises_is_never_chosen_and_on_is_refused_naming_it(monkeypatch):
    """The AVX2 EPYC without any variable: the bf16 prepack trial raises torch's error. `auto`
    then loads bf16 plain and the engine works; `prepack: on` fails at load with that error, the
    CPU's flags and what to set instead; the reason reaches engine.info."""
    def avx2_only():
        raise RuntimeError(AVX2_ERROR)

    monkeypatch.setitem(cpu._TRIALS, "prepack-bf16", avx2_only)
    monkeypatch.delenv(cpu.DISABLE_ENV, raising=False)  # the trial's own failure, whatever forced paths off
    cpu.reset()
    try:
        built = build_engine("tiny", ["truncated:2"], "bf16", max_batch=2, max_len=64, device="cpu")
        assert not built.engine.info["prepacked"] and not built.drafters["truncated:2"].runner.prepacked
        assert built.engine.info["cpu_paths"]["prepack-bf16"] == AVX2_ERROR
        assert AVX2_ERROR in built.dtype_reason
        assert len(_generate(built.engine, "truncated:2", 3, [[5, 9, 33]])[0]) == 16
        with pytest.raises(ValueError) as e:
            build_engine("tiny", [], "bf16", max_batch=2, max_len=64, device="cpu", prepack="on")
        msg = str(e.value)
        assert msg.startswith("prepack: on (dtype bf16) needs oneDNN's prepacked bf16 layout")
        assert AVX2_ERROR in msg and "This CPU: " in msg and "Set prepack: auto or off, or dtype: fp32 instead" in msg
    finally:
        monkeypatch.undo()
        cpu.reset()


def test_explicit_settings_the_cpu_cannot_run_fail_at_load(cpu_paths_off):
    cpu_paths_off("all,bf16")
    for kw, msg in [({"dtype": "bf16"}, "dtype: bf16 needs bf16 matmuls, which this CPU cannot run"),
                    ({"dtype": "fp32", "prepack": "on"}, r"prepack: on \(dtype fp32\) needs oneDNN's prepacked "
                                                         r"fp32 layout.*Set prepack: auto or off instead")]:
        with pytest.raises(ValueError, match=msg):
            load_target("tiny", max_batch=2, device="cpu", **kw)
    t = load_target("tiny", "auto", max_batch=2, device="cpu")  # and auto still loads: fp32, plain
    assert (t.dtype, t.layout) == ("fp32", "off")


@pytest.mark.parametrize("off", ["", "prepack-bf16", "all"])
def test_auto_weighs_exactly_the_paths_that_run_and_reports_them(cpu_paths_off, off):
    """With exact passes off, dtype and prepack 'auto' measure every (dtype, layout) this CPU runs
    (bf16 prepacked where it runs, fp32 both ways where prepacked fp32 runs) and none it does not;
    the choice, the figures and the missing paths are in the reason, and engine.info carries every
    probe. (Exact passes choose by rule: tests/unit/test_exact.py.)"""
    if off:
        cpu_paths_off(off)
    built = build_engine("tiny", ["ngram"], "auto", max_batch=2, max_len=64, device="cpu", exact="off")
    want = {"bf16+prepacked" if cpu.available("prepack-bf16") else "bf16", "fp32"}
    if cpu.available("prepack-fp32"):
        want.add("fp32+prepacked")
    why = built.dtype_reason
    figures = why.split(" — ")[1].split("; unavailable here")[0]
    assert {part.rsplit(" ", 2)[0] for part in figures.split(", ")} == want, why
    assert built.engine.info["cpu_paths"] == {n: p.reason or "ok" for n, p in cpu.probes().items()}
    assert ("unavailable here: " in why) == bool(cpu.unavailable_line())
    assert built.engine.info["prepacked"] == why.split(":")[0].endswith("+prepacked")


@pytest.mark.parametrize("off", ["prepack-bf16", "all"])
def test_greedy_equals_hf_fp32_with_every_drafter_and_the_fast_paths_off(cpu_paths_off, tiny, tiny_draft,
                                                                         hf_greedy, off):
    cpu_paths_off(off)
    from actors.drafters.eagle import EagleDrafter, EagleHead

    head = EagleHead(tiny.model, torch.arange(256)).eval()
    built = build_engine("tiny:0", {"ngram": "ngram", "truncated:2": "truncated:2"}, "fp32", max_batch=3,
                         max_len=128, device="cpu",
                         extra_drafters={"eagle": EagleDrafter(head, "eagle", max_batch=3, max_len=128)})
    assert built.engine.info["prepacked"] <= cpu.available("prepack-fp32")  # measured where it runs, else never
    prompts = [[5, 9, 33, 7, 5, 9, 33], [40, 41, 42], [7, 7, 7, 7, 8]]
    ref = [hf_greedy(tiny.model, p, 16, eos=None) for p in prompts]
    for draft, gamma in [("none", 0), ("ngram", 3), ("truncated:2", 4), ("eagle", "auto"), ("auto", "auto")]:
        out = _generate(built.engine, draft, gamma, prompts)
        if built.engine.info["prepacked"]:  # prepacked fp32 rounds apart from MKL: the engine against itself
            assert out == _generate(built.engine, "none", 0, prompts), draft
        else:  # MKL's kernel, as HF runs it
            assert out == ref, draft


def test_the_demo_replicas_start_and_keep_their_output_with_the_fast_paths_off(cpu_paths_off, smollm2, hf_greedy):
    """`make demo`'s code path (cluster/configs/local.yaml) on a CPU without the fast paths: the
    verifier replica builds its engine (dtype auto, its reason in GetStats' fields), the remote
    draft replica starts, and the verifier's greedy output through its drafts is HF's. bf16 is
    forced off too, so that auto lands on fp32 as on an AVX2 EPYC (where bf16 measures slower) and
    the comparison is exact: in bf16 a greedy near-tie can fall either way with the pass's shape."""
    from cluster.app import DraftDeployment
    from cluster.config import LOCAL_CONFIG, ClusterConfig
    from cluster.verifier import VerifierServer

    cpu_paths_off("all,bf16")
    cfg = ClusterConfig.load(LOCAL_CONFIG)
    assert cfg.dtype == "auto" and cfg.prepack == "auto"
    raw = cfg.model_dump(mode="json")
    raw["device"] = "cpu"
    raw["verifier"]["max_batch"] = 4  # fewer grid points to calibrate; the rest as configured
    for d in raw["drafts"]:
        d["placement"] = "colocated"  # no Ray here: the self-draft runs beside the target
    draft_raw = {**cfg.model_dump(mode="json"), "device": "cpu"}
    for d in draft_raw["drafts"]:
        if d["name"] == "truncated:4":
            d["max_batch"] = 2
    replica = DraftDeployment(draft_raw, "truncated:4")  # as the config's remote draft deploys
    assert not replica.core.drafter.runner.prepacked
    server = VerifierServer(raw)
    eng = server.engine
    info = eng.info
    assert not info["prepacked"] and info["dtype"] == "fp32" and info["dtype_reason"].startswith("fp32: the only option")
    assert info["cpu_paths"]["prepack-bf16"].startswith("forced off")
    ids = chat_ids(smollm2.tokenizer, "Name three primary colours.")

    async def served(draft: str, gamma) -> list[int]:
        req = Request(draft, ids, SamplingParams(max_tokens=24, ignore_eos=True),
                      SpeculationParams(draft=draft, gamma=gamma))
        return Completion.join([d async for d in server.generate(req)]).token_ids

    async def all_drafts():
        return {d: await asyncio.wait_for(served(d, g), 120)
                for d, g in [("none", 0), ("ngram", "auto"), ("eagle", "auto"), ("truncated:4", 4)]}
    outs = asyncio.run(all_drafts())
    base = outs.pop("none")
    assert len(base) == 24 and all(o == base for o in outs.values()), outs
    assert base == hf_greedy(smollm2.model, ids, 24, eos=None)
    json.dumps(info)  # what GetStats serialises


def test_yaml_on_and_off_are_the_prepack_switch():
    """YAML 1.1 reads a plain `prepack: off` as False: the config takes it as the switch it spelled."""
    import yaml

    from cluster.config import ClusterConfig

    for text, want in [("prepack: off", "off"), ("prepack: on", "on"), ("prepack: auto", "auto"),
                       ("prepack: 'off'", "off")]:
        assert ClusterConfig.model_validate(yaml.safe_load(text)).prepack == want
    with pytest.raises(ValueError, match="Input should be 'auto', 'on' or 'off'"):
        ClusterConfig.model_validate({"prepack": "maybe"})
