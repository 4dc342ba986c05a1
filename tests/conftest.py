"""Shared fixtures for the engine, runner and drafter tests.

Models are session-scoped: the tiny random llamas build in milliseconds, but the
embedded SmolLM2 costs ~25 s the very first time (GGUF dequantisation into
~/.cache/specd) and ~1 s afterwards, so every test shares one instance. Tests
must treat these models as read-only.

`hf_greedy` memoises Hugging Face `generate` references (the oracle of the
greedy-equivalence tests), so several tests can compare against the same
SmolLM2 continuation without paying for it twice.

`cpu_paths_off` forces optional CPU fast paths off for one test (`actors/cpu.py`,
SPECD_DISABLE), so the fallbacks of an AVX2-only machine run on any machine. CI also runs
the unit tests a second time with SPECD_DISABLE=all for the whole process.
"""
from __future__ import annotations

import os

import pytest
import torch

from actors import cpu
from actors.models import load_model


@pytest.fixture(scope="session")
def tiny():
    """Random tiny llama (vocab 512, 4 layers, fp32), the default target."""
    return load_model("tiny:0")


@pytest.fixture(scope="session")
def tiny_draft():
    """A different random tiny llama with the same vocabulary: a separate draft model."""
    return load_model("tiny:1")


@pytest.fixture(scope="session")
def small_tiny():
    """A tiny random llama with a vocabulary of 8: output laws small enough to compare exactly."""
    from actors.models import LoadedModel, build_tiny

    return LoadedModel(build_tiny(0, vocab_size=8), None, "tiny8")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct in fp32, with its tokenizer."""
    return load_model("smollm2", "fp32")


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(model, prompt_ids, n, eos="config") -> the new tokens of HF greedy `generate`.

    Batch 1, no padding. eos="config" keeps the model's generation config (SmolLM2:
    <|im_end|>); eos=None disables EOS (transformers 5: an explicit
    `eos_token_id=None` overrides the generation config); an int stops there.
    Generation stops after the first eos token, which is included, as in the engine.
    """
    memo: dict = {}

    def run(model, prompt_ids, n, eos="config"):
        key = (model, tuple(prompt_ids), n, eos)  # the model itself: a freed model's id may be reused
        if key not in memo:
            ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
            pad = model.config.pad_token_id
            kw = {} if eos == "config" else {"eos_token_id": eos}
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                     do_sample=False, pad_token_id=pad if pad is not None else 0, **kw)
            memo[key] = out[0, ids.shape[1]:].tolist()
        return list(memo[key])

    return run


@pytest.fixture
def cpu_paths_off():
    """cpu_paths_off("prepack-bf16") -> forces those paths' probes to fail for this test, as on a CPU
    without them ("all": every optional fast path); the variable and the probes are restored after."""
    before = os.environ.get(cpu.DISABLE_ENV)

    def force(names: str = "all") -> None:
        os.environ[cpu.DISABLE_ENV] = ",".join(filter(None, [before, names]))
        cpu.reset()

    yield force
    if before is None:
        os.environ.pop(cpu.DISABLE_ENV, None)
    else:
        os.environ[cpu.DISABLE_ENV] = before
    cpu.reset()
